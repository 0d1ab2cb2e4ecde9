"""Run the target service.

    python -m target_service --model DIR --port 50051

Every flag can also be set from the environment (SPECDEC_TARGET_<FLAG>); see --help.
"""

from __future__ import annotations

import speculative.openmp  # noqa: F401  (before torch loads)
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.engines import TargetEngine
from speculative.serving import EnvArgumentParser, ModelThread, add_common_flags, add_model_flags, run_model_service

from .servicer import SERVICE_NAME, TargetServicer

DEFAULT_PORT = 50051


def parse_args(argv=None):
    parser = EnvArgumentParser("SPECDEC_TARGET", prog="python -m target_service", description=__doc__)
    add_common_flags(parser, DEFAULT_PORT)
    add_model_flags(parser, "target")
    return parser.parse_args(argv)


def main(argv=None) -> None:
    args = parse_args(argv)
    servicer = TargetServicer(ModelThread())
    run_model_service(
        "target", args, servicer, pb_grpc.add_TargetServicer_to_server, SERVICE_NAME,
        lambda runner: TargetEngine(runner, args.max_tokens_per_call),
    )


if __name__ == "__main__":
    main()
