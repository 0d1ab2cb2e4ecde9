"""Run the draft service.

    python -m draft_service --model DIR --port 50052      # or: specdec draft ...
    python -m draft_service --method ngram --port 50052   # no model: copies n-grams of the context
    python -m draft_service --method eagle --model HEAD_DIR --target-model TARGET_DIR

--method picks the drafting method (model_service/drafting.py): model (a small model drafts,
the default), ngram (prompt lookup, model_service/ngram.py: no --model; --tokenizer, the
target's, answers GetModelInfo's pairing check) or eagle (an EAGLE-3 head, model_service/eagle.py:
--model is the head's directory, --target-model the target's, whose tokenizer and, where the head
has none, token embeddings it reads; the target sends it its hidden states each round).

Every flag can also be set from the environment (SPECDEC_DRAFT_<FLAG>); see --help.
"""

from __future__ import annotations

import model_service.openmp  # noqa: F401  (before torch loads)
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from specdec.v1 import specdec_pb2_grpc as pb_grpc
from model_service.service import add_model_flags, run_model_service, shipped_model
from runtime.cli import EnvArgumentParser, add_common_flags, exit_process

from .servicer import SERVICE_NAME, DraftServicer

if TYPE_CHECKING:
    from model_service.drafting import DraftMethod

DEFAULT_PORT = 50052
log = logging.getLogger("specdec")


def parse_args(argv=None, prog: str = "python -m draft_service"):
    parser = EnvArgumentParser("SPECDEC_DRAFT", prog=prog, description=__doc__)
    add_common_flags(parser, DEFAULT_PORT)
    add_model_flags(parser, "draft", model_required=False)
    parser.add_argument("--method", default="model", choices=["model", "ngram", "eagle"],
                        help="drafting method: model (--model drafts), ngram (copies what followed the context's"
                             " last n-gram earlier in it; no model) or eagle (--model is an EAGLE-3 head that drafts"
                             " from the target's hidden states)")
    parser.add_argument("--head-quantize", default="auto", choices=["auto", "none", "int8", "int4"],
                        help="eagle on CPU: the head's linears through specdec's int4 kernel (int4: 4-bit groups, int8"
                             " activation blocks; a step ~2x faster than int8's), in int8 with dynamic activation scales"
                             " (int8) or as loaded (none; on a GPU always). auto: int4 where the kernel is built here,"
                             " else int8. A slightly different head, the same exact output")
    parser.add_argument("--target-model", default=shipped_model("target"),
                        help="eagle: the target's model directory (its tokenizer, and its token embeddings where the"
                             " head has none; only that tensor is read); default: the shipped models/target")
    parser.add_argument("--ngram-max", type=int, default=4,
                        help="ngram, and eagle's --lookup-min: the longest suffix matched (tried first)")
    parser.add_argument("--ngram-min", type=int, default=2, help="ngram: the shortest suffix matched")
    parser.add_argument("--lookup-min", type=int, default=3,
                        help="eagle: where the context's last N or more tokens (up to --ngram-max) occurred earlier in"
                             " it, propose what followed them there (prompt lookup; the head drafts elsewhere). Pays"
                             " on input-grounded work (editing code, answering from a document); 0: the head always"
                             " drafts")
    parser.add_argument("--tokenizer", default=shipped_model("target"),
                        help="ngram: the target's tokenizer or model directory (the pairing check compares its"
                             " vocabulary and fingerprint); default: the shipped models/target")
    parser.add_argument("--max-support", type=int, default=64,
                        help="tokens in each shipped draft distribution q (the draft samples from exactly these)")
    parser.add_argument("--draft-vocab", default="auto",
                        help="score only the N most frequent tokens (FR-Spec: the rest get q = 0, which keeps the"
                             " output exact) from the model's draft_vocab.json; auto: its recommended size where the"
                             " file exists, else the full vocabulary; full (or 0): every token")
    parser.add_argument("--acceptance-prior", default="auto",
                        help="the draft's acceptance (alpha, 0..1) the coordinator's adaptive K assumes until it has"
                             " seen rounds; auto: the one its card (distill.json) measured against its target, if any;"
                             " 0: not known (the coordinator then assumes 0.6)")
    parser.add_argument("--oracle", default=None,
                        help="benchmark only: JSON list of token sequences to replay instead of drafting")
    parser.add_argument("--oracle-acceptance", type=float, default=1.0,
                        help="benchmark only: --oracle corrupts each proposed token with probability 1 - this")
    parser.add_argument("--oracle-cost", default="none", choices=["none", "model"],
                        help="benchmark only: model: --oracle drafts with --model first (its cost), then replays")
    args = parser.parse_args(argv)
    if args.method == "model" and not args.model:
        parser.error("--method model needs --model DIR (the checkout has no models/draft), or use --method ngram")
    if args.method == "ngram" and not args.tokenizer:
        parser.error("--method ngram needs --tokenizer (the checkout has no models/target)")
    if args.method == "eagle" and not args.model:
        parser.error("--method eagle needs --model HEAD_DIR (an EAGLE-3 head)")
    if not 0.0 <= args.oracle_acceptance <= 1.0:
        parser.error(f"--oracle-acceptance must lie in [0, 1], not {args.oracle_acceptance}")
    if args.method != "model" and args.oracle:
        parser.error(f"--oracle replaces the model method's drafting, not {args.method}'s")
    if args.max_support < 1:
        parser.error(f"--max-support must be at least 1, not {args.max_support}")
    if not 1 <= args.ngram_min <= args.ngram_max:
        parser.error(f"need 1 <= --ngram-min <= --ngram-max, not {args.ngram_min} and {args.ngram_max}")
    if args.lookup_min and not 1 <= args.lookup_min <= args.ngram_max:
        parser.error(f"need 1 <= --lookup-min <= --ngram-max (or --lookup-min 0), not {args.lookup_min} and"
                     f" {args.ngram_max}")
    args.vocab_subset = vocab_subset(args.draft_vocab, args.model) if args.method == "model" else 0
    if args.method == "eagle":  # None: auto, from the head's card (eagle.json), read where the head loads
        args.acceptance_prior = None if args.acceptance_prior == "auto" else acceptance_prior(args.acceptance_prior, None)
    else:
        args.acceptance_prior = acceptance_prior(args.acceptance_prior, args.model) if args.method == "model" else 0.0
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


def acceptance_prior(flag: str, model_dir: str | None) -> float:
    """--acceptance-prior -> alpha (0: not known). auto: what `python -m training distill` measured
    and wrote into the model's distill.json: alpha in specdec's own rounds on held-out chat prompts
    where it ran them (--acceptance), else greedy agreement on held-out answers."""
    if flag == "auto":
        card = Path(model_dir or "") / "distill.json"
        if not card.is_file():
            return 0.0
        info = json.loads(card.read_text())
        in_rounds = (info.get("acceptance") or {}).get("alpha_pooled")
        return float(in_rounds or (info.get("final") or {}).get("heldout_agreement") or 0.0)
    try:
        alpha = float(flag)
    except ValueError:
        raise SystemExit(f"--acceptance-prior must be auto or a number, not {flag!r}") from None
    if not 0.0 <= alpha <= 1.0:
        raise SystemExit(f"--acceptance-prior must be within 0..1, not {alpha}")
    return alpha


def main(argv=None, prog: str = "python -m draft_service") -> None:
    args = parse_args(argv, prog)
    run_model_service(
        "draft", args, DraftServicer, pb_grpc.add_DraftServicer_to_server, SERVICE_NAME,
        lambda load_model: make_engine(args, load_model),
    )


def make_engine(args, load_model) -> DraftMethod:
    """The drafting method the flags pick: ngram (no model loaded), the oracle (--oracle), else
    the model's own draft. load_model() -> the ModelRunner of --model."""
    if args.method == "eagle":
        import torch

        from model_service.eagle import EagleDraft
        from model_service.fast_forward import DTYPES

        prior = {} if args.acceptance_prior is None else {"acceptance_prior": args.acceptance_prior}
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        quantize = args.head_quantize if torch.device(device).type == "cpu" and args.dtype == "float32" else "none"
        if quantize == "auto":
            from model_service import q4_kernel

            quantize = "int4" if q4_kernel.available() else "int8"
            if quantize == "int8":
                log.warning("--head-quantize auto: specdec's int4 kernel is not built here (%s): the head runs in int8",
                            q4_kernel.path())
        eagle = EagleDraft.load(args.model, args.target_model, device, DTYPES[args.dtype], quantize,
                                max_support=args.max_support, max_tokens=args.max_tokens_per_call,
                                max_sessions=args.max_sessions, idle_timeout=args.session_idle_timeout,
                                max_context=args.max_context or None, threads=args.threads,
                                batched_threads=args.batched_threads,
                                lookup=range(args.lookup_min, args.ngram_max + 1) if args.lookup_min else range(0),
                                max_kv_tokens=args.max_kv_tokens, prefix_cache_mb=args.prefix_cache_mb, **prior)
        eagle.calibrate()
        return eagle
    if args.method == "ngram":
        from model_service.ngram import NgramDraft

        return NgramDraft.load(args.tokenizer, ngram_max=args.ngram_max, ngram_min=args.ngram_min,
                               max_tokens=args.max_tokens_per_call, max_sessions=args.max_sessions,
                               idle_timeout=args.session_idle_timeout, max_context=args.max_context or None,
                               max_kv_tokens=args.max_kv_tokens)
    if args.oracle:
        from model_service.oracle import OracleDraftEngine

        references = json.loads(Path(args.oracle).read_text())
        return OracleDraftEngine(load_model(), references, args.max_tokens_per_call, args.oracle_acceptance,
                                 args.oracle_cost == "model")
    from model_service.engines import DraftEngine

    return DraftEngine(load_model(), args.max_support, args.max_tokens_per_call, args.acceptance_prior)


if __name__ == "__main__":
    exit_process(main())
