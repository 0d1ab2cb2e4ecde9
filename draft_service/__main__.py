"""Run the draft service.

    python -m draft_service --model DIR --port 50052      # or: specdec draft ...

Every flag can also be set from the environment (SPECDEC_DRAFT_<FLAG>); see --help.
"""

from __future__ import annotations

import model_service.openmp  # noqa: F401  (before torch loads)
import json
from pathlib import Path

from specdec.v1 import specdec_pb2_grpc as pb_grpc
from model_service.drafting import DraftMethod
from model_service.engines import DraftEngine
from model_service.oracle import OracleDraftEngine
from model_service.service import add_model_flags, run_model_service
from runtime.cli import EnvArgumentParser, add_common_flags

from .servicer import SERVICE_NAME, DraftServicer

DEFAULT_PORT = 50052


def parse_args(argv=None, prog: str = "python -m draft_service"):
    parser = EnvArgumentParser("SPECDEC_DRAFT", prog=prog, description=__doc__)
    add_common_flags(parser, DEFAULT_PORT)
    add_model_flags(parser, "draft")
    parser.add_argument("--max-support", type=int, default=64,
                        help="tokens in each shipped draft distribution q (the draft samples from exactly these)")
    parser.add_argument("--draft-vocab", default="auto",
                        help="score only the N most frequent tokens (FR-Spec: the rest get q = 0, which keeps the"
                             " output exact) from the model's draft_vocab.json; auto: its recommended size where the"
                             " file exists, else the full vocabulary; full (or 0): every token")
    parser.add_argument("--oracle", default=None,
                        help="benchmark only: JSON list of token sequences to replay instead of drafting")
    args = parser.parse_args(argv)
    args.vocab_subset = vocab_subset(args.draft_vocab, args.model)
    return args


def vocab_subset(flag: str, model_dir: str | None) -> int:
    """--draft-vocab -> how many ids the output layer scores (0: all)."""
    if flag in ("full", "0"):
        return 0
    if flag == "auto":
        listing = Path(model_dir or "") / "draft_vocab.json"
        return int(json.loads(listing.read_text()).get("recommended", 0)) if listing.is_file() else 0
    try:
        size = int(flag)
    except ValueError:
        raise SystemExit(f"--draft-vocab must be auto, full or a number, not {flag!r}") from None
    if size < 0:
        raise SystemExit(f"--draft-vocab must be >= 0, not {size}")
    return size


def main(argv=None, prog: str = "python -m draft_service") -> None:
    args = parse_args(argv, prog)
    run_model_service(
        "draft", args, DraftServicer, pb_grpc.add_DraftServicer_to_server, SERVICE_NAME,
        lambda runner: make_engine(runner, args),
    )


def make_engine(runner, args) -> DraftMethod:
    """The drafting method the flags pick: the oracle (--oracle), else the model's own draft."""
    if args.oracle:
        references = json.loads(Path(args.oracle).read_text())
        return OracleDraftEngine(runner, references, args.max_tokens_per_call)
    return DraftEngine(runner, args.max_support, args.max_tokens_per_call)


if __name__ == "__main__":
    main()
