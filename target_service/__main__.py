"""Run the target service.

    python -m target_service --model DIR --port 50051      # or: specdec target ...

Every flag can also be set from the environment (SPECDEC_TARGET_<FLAG>); see --help.
"""

from __future__ import annotations

import model_service.openmp  # noqa: F401  (before torch loads)
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from model_service.service import add_model_flags, run_model_service
from runtime.cli import EnvArgumentParser, add_common_flags, exit_process

from .servicer import SERVICE_NAME, TargetServicer

DEFAULT_PORT = 50051


def parse_args(argv=None, prog: str = "python -m target_service"):
    parser = EnvArgumentParser("SPECDEC_TARGET", prog=prog, description=__doc__)
    add_common_flags(parser, DEFAULT_PORT)
    add_model_flags(parser, "target")
    return parser.parse_args(argv)


def main(argv=None, prog: str = "python -m target_service") -> None:
    args = parse_args(argv, prog)
    run_model_service(
        "target", args, TargetServicer, pb_grpc.add_TargetServicer_to_server, SERVICE_NAME,
        lambda load_model: make_engine(load_model, args.max_tokens_per_call),
    )


def make_engine(load_model, max_tokens: int):
    """The TargetEngine of --model (load_model() -> its ModelRunner), on the model thread: its modules
    (torch) load once run_model_service has checked the flags."""
    from model_service.engines import TargetEngine

    return TargetEngine(load_model(), max_tokens)


if __name__ == "__main__":
    exit_process(main())
