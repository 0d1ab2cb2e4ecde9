"""`make bench-tracing`: what OpenTelemetry tracing (runtime/tracing.py) adds to a round.

    python -m bench.tracing [--prompts 8] [--new-tokens 64] [--k 4] [--repeats 2]

One stack (coordinator + the shipped draft + the default target over gRPC) per setting, the same
greedy requests (the held-out chat prompts) one after another, in rotation over the settings
(`--repeats` times) so that a machine's drift falls on all of them:

  off   no OTEL_* variables: the API's no-op tracer
  0.0   tracing on, OTEL_TRACES_SAMPLER=traceidratio with ratio 0.0: spans made, none recorded
  1.0   tracing on, every request traced and exported over OTLP to a receiver in this process

Per setting: the median over requests of wall ms per round (GenerationStats), its difference from
`off`, and the spans received. Writes a table to stdout and bench/results/tracing.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402

from assets.models import DRAFT, TARGET  # noqa: E402
from assets.prompts import CHAT  # noqa: E402
from bench.systems import machine  # noqa: E402
from coordinator.launch import LocalStack  # noqa: E402
from runtime import trace_receiver  # noqa: E402
from specdec.v1 import specdec_pb2 as pb  # noqa: E402
from specdec.v1 import specdec_pb2_grpc as pb_grpc  # noqa: E402

RESULTS = Path(__file__).parent / "results"
OTEL = ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_INSECURE", "OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG",
        "OTEL_TRACES_EXPORTER", "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")


def settings(endpoint: str) -> dict[str, dict[str, str]]:
    on = {"OTEL_EXPORTER_OTLP_ENDPOINT": endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    return {"off": {},
            "0.0": {**on, "OTEL_TRACES_SAMPLER": "traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.0"},
            "1.0": {**on, "OTEL_TRACES_SAMPLER": "always_on"}}


def run(env: dict[str, str], draft: Path, target: Path, prompts: list[str], new_tokens: int, k: int) -> list[float]:
    """One stack with `env`; -> wall ms per round of each request."""
    saved = {name: os.environ.pop(name) for name in OTEL if name in os.environ}
    os.environ.update(env)
    try:
        with LocalStack(draft, target) as stack, grpc.insecure_channel(stack.addr) as channel:
            stub = pb_grpc.GenerationStub(channel)
            def ask(prompt: str, n: int) -> pb.GenerateResponse:
                return stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=prompt)],
                                                        max_new_tokens=n, temperature=0, num_speculative_tokens=k))

            ask(prompts[0], 8)  # (warm)
            per_round = []
            for prompt in prompts:
                reply = ask(prompt, new_tokens)
                per_round.append(reply.stats.wall_ms / reply.stats.rounds)
            return per_round
    finally:
        for name in env:
            os.environ.pop(name, None)
        os.environ.update(saved)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.tracing", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", type=Path, default=DRAFT)
    parser.add_argument("--target", type=Path, default=TARGET)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args(argv)
    server, receiver, port = trace_receiver.serve()
    prompts = CHAT[: args.prompts]
    per_round: dict[str, list[float]] = {}
    spans: dict[str, int] = {}
    try:
        for _ in range(args.repeats):
            for name, env in settings(f"http://127.0.0.1:{port}").items():
                receiver.take()
                per_round.setdefault(name, []).extend(run(env, args.draft, args.target, prompts, args.new_tokens,
                                                          args.k))
                spans[name] = spans.get(name, 0) + len(receiver.take())  # (a stack sends the rest as it stops)
    finally:
        server.stop(0)
    base = statistics.median(per_round["off"])
    rows = [{"setting": name, "requests": len(values), "ms_per_round_median": round(statistics.median(values), 3),
             "added_ms_per_round": round(statistics.median(values) - base, 3), "spans": spans[name]}
            for name, values in per_round.items()]
    print(f"{'setting':>8} {'requests':>9} {'ms/round':>9} {'added ms':>9} {'spans':>7}")
    for r in rows:
        print(f"{r['setting']:>8} {r['requests']:>9} {r['ms_per_round_median']:>9.2f} {r['added_ms_per_round']:>+9.2f}"
              f" {r['spans']:>7}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tracing.json").write_text(json.dumps({"machine": machine(), "draft": os.path.relpath(args.draft),
                                                      "target": os.path.relpath(args.target), "k": args.k,
                                                      "new_tokens": args.new_tokens, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
