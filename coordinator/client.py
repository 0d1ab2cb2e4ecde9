"""Command-line client for the coordinator.

    python -m coordinator.client --addr 127.0.0.1:50050 --stream "def fibonacci(n):"
    python -m coordinator.client --chat --stream "What is the capital of France?"   # one user message
    python -m coordinator.client --chat --system "Answer in French." "Where is Paris?"
    python -m coordinator.client --tls-ca ca.pem --tls-cert me.pem --tls-key me.key "def f():"  # mutual TLS
    python -m coordinator.client --api-key KEY "def f():"   # a coordinator started with --api-key

Prints the text (as it arrives with --stream), or with --json one JSON object
with text, token_ids, finish_reason and stats. --stats adds the acceptance
statistics on stderr. Exits 1 with the gRPC status on an error; 2 on a flag refused (a value past
its field's range included).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
from google.protobuf.json_format import MessageToDict

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from runtime.auth import bearer
from runtime.transport import add_dial_flags, channel_credentials, open_channel


MAX_TIMEOUT = 1e8  # s (about 3 years)


def build_request(args: argparse.Namespace) -> pb.GenerateRequest:
    if args.chat or args.system is not None:
        messages = [pb.ChatMessage(role="system", content=args.system)] if args.system is not None else []
        messages.append(pb.ChatMessage(role="user", content=args.prompt))
        request = pb.GenerateRequest(messages=messages, stop=args.stop or [])
    else:
        request = pb.GenerateRequest(prompt=args.prompt, stop=args.stop or [])
    for field in ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "num_speculative_tokens",
                  "draft_p_min"):
        value = getattr(args, field)
        if value is not None:
            try:
                setattr(request, field, value)
            except ValueError as e:  # (past the field's range: the server would never see it)
                raise ValueError(f"--{field.replace('_', '-')} {value}: {e}") from None
    return request


def seconds(text: str) -> float:
    """A deadline in seconds: above 0, at most MAX_TIMEOUT (grpc fails one past ~1e10 s at once, as exceeded)."""
    value = float(text)
    if not 0 < value <= MAX_TIMEOUT:
        raise argparse.ArgumentTypeError(f"a deadline is more than 0 s and at most {MAX_TIMEOUT:g} s, not {text}")
    return value


def format_stats(stats: pb.GenerationStats) -> str:
    tok_s = stats.generated_tokens / (stats.wall_ms / 1e3) if stats.wall_ms else 0.0
    k = f"K={stats.num_speculative_tokens}"
    if stats.adaptive:
        k = f"adaptive K (at most {stats.num_speculative_tokens}, mean {stats.draft_tokens / max(1, stats.rounds):.1f})"
    return (
        f"[{stats.generated_tokens} tokens in {stats.wall_ms:.0f} ms ({tok_s:.1f} tok/s); {k}, "
        f"{stats.rounds} rounds, acceptance {stats.acceptance_rate:.2f} ({stats.accepted_tokens}/{stats.draft_tokens}), "
        f"alpha {stats.alpha:.2f}, "
        f"{stats.mean_accepted:.2f} accepted per round, per position {list(stats.accepted_per_position)}; "
        f"draft {stats.draft_ms:.0f} ms, target {stats.target_ms:.0f} ms; seed {stats.seed}]"
    )


def finish_name(reason: int) -> str:
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def main(argv=None, prog: str = "python -m coordinator.client") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("prompt", help="prompt text (with --chat: the user's message)")
    parser.add_argument("--chat", action="store_true",
                        help="send the prompt as one user message through the model's chat template")
    parser.add_argument("--system", help="a system message before the user's (implies --chat)")
    parser.add_argument("--addr", default="127.0.0.1:50050", help="coordinator address HOST:PORT")
    parser.add_argument("--stream", action="store_true", help="print the text as it is generated")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the text")
    parser.add_argument("--stats", action="store_true", help="print acceptance statistics to stderr")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--temperature", type=float, help="0 = greedy (server default 1.0)")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--min-p", type=float, help="cut tokens under this share of the top's probability (0: off)")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--stop", action="append", help="stop string (repeatable)")
    parser.add_argument("--num-speculative-tokens", "-k", type=int,
                        help="a fixed K, draft tokens per round (default: the server's, adaptive unless set)")
    parser.add_argument("--draft-p-min", type=float, help="the draft stops at a token it is less sure of than this")
    parser.add_argument("--timeout", type=seconds, default=300.0, help="deadline in seconds")
    add_dial_flags(parser, "tls", "the coordinator")
    parser.add_argument("--tls", action="store_true",
                        help="TLS, verifying the coordinator against the system's root certificates (for a"
                             " publicly issued certificate; implied by --tls-ca / --tls-cert)")
    parser.add_argument("--api-key", default=os.environ.get("SPECDEC_API_KEY"),
                        help="the coordinator's --api-key, sent as `authorization: Bearer KEY`"
                             " (default: $SPECDEC_API_KEY)")
    args = parser.parse_args(argv)

    try:
        request = build_request(args)
    except ValueError as e:
        parser.error(str(e))  # (exits 2, as argparse's own refusals)
    metadata = bearer(args.api_key)
    credentials = channel_credentials(args.tls_ca, args.tls_cert, args.tls_key)
    if credentials is None and args.tls:
        credentials = grpc.ssl_channel_credentials()
    with open_channel(args.addr, credentials) as channel:
        stub = pb_grpc.GenerationStub(channel)
        try:
            if args.stream and not args.json:
                stats = None
                for chunk in stub.GenerateStream(request, timeout=args.timeout, metadata=metadata):
                    sys.stdout.write(chunk.text)
                    sys.stdout.flush()
                    if chunk.HasField("stats"):
                        stats, finish = chunk.stats, chunk.finish_reason
                sys.stdout.write("\n")
                if args.stats and stats is not None:
                    print(f"[finish: {finish_name(finish)}] {format_stats(stats)}", file=sys.stderr)
                return 0
            response = stub.Generate(request, timeout=args.timeout, metadata=metadata)
        except grpc.RpcError as e:
            print(f"error: {e.code().name}: {e.details()}", file=sys.stderr)
            return 1
    if args.json:
        print(json.dumps({
            "text": response.text,
            "token_ids": list(response.token_ids),
            "finish_reason": finish_name(response.finish_reason),
            "stats": MessageToDict(response.stats, preserving_proto_field_name=True,
                                   always_print_fields_with_no_presence=True),
        }))
    else:
        print(response.text)
        if args.stats:
            print(f"[finish: {finish_name(response.finish_reason)}] {format_stats(response.stats)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
