"""Run the target service.

    python -m target_service --model DIR --port 50051      # or: specdec target ...

Every flag can also be set from the environment (SPECDEC_TARGET_<FLAG>); see --help.
"""

from __future__ import annotations

import logging

import model_service.openmp  # noqa: F401  (before torch loads)
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from model_service.batcher import PREFILL_PART_MS
from model_service.service import add_model_flags, run_model_service
from runtime.cli import EnvArgumentParser, add_common_flags, exit_process

from .servicer import SERVICE_NAME, TargetServicer

DEFAULT_PORT = 50051


def parse_args(argv=None, prog: str = "python -m target_service"):
    parser = EnvArgumentParser("SPECDEC_TARGET", prog=prog, description=__doc__)
    add_common_flags(parser, DEFAULT_PORT)
    add_model_flags(parser, "target")
    parser.add_argument("--prefill-chunk", default="auto",
                        help="most tokens of a long prompt one pass feeds while other sessions' calls wait: theirs"
                             " run between its parts instead of waiting for its whole prefill. auto: a part's pass"
                             f" ~{PREFILL_PART_MS:g} ms at the calibrated cost of a token (int4 SmolLM2 on 2 CPU cores:"
                             " 112-128); 0: a prompt in one pass")
    args = parser.parse_args(argv)
    if args.prefill_chunk != "auto":
        chunk = args.prefill_chunk
        args.prefill_chunk = int(chunk) if chunk.isdigit() else -1
        if args.prefill_chunk < 0:
            parser.error(f"--prefill-chunk must be auto or a count of tokens >= 0, not {chunk!r}")
    return args


def main(argv=None, prog: str = "python -m target_service") -> None:
    args = parse_args(argv, prog)
    run_model_service(
        "target", args, TargetServicer, pb_grpc.add_TargetServicer_to_server, SERVICE_NAME,
        lambda load_model: make_engine(load_model, args.max_tokens_per_call,
                                       None if args.prefill_chunk == "auto" else args.prefill_chunk),
    )


def make_engine(load_model, max_tokens: int, prefill_chunk: int | None = None):
    """The TargetEngine of --model (load_model() -> its ModelRunner), on the model thread: its modules
    (torch) load once run_model_service has checked the flags."""
    from model_service.engines import TargetEngine

    engine = TargetEngine(load_model(), max_tokens, prefill_chunk)
    logging.getLogger("specdec").info("target: a long prompt's pass feeds at most %s tokens while others wait",
                                      engine.prefill_chunk or "all its")
    return engine


if __name__ == "__main__":
    exit_process(main())
