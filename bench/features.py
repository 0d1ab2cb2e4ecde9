"""What the target's features cost: a verify pass with and without them, and their bytes.

    python -m bench.features [--target-model models/target] [--layers 2,15,27] [--quantize none,int4]

A session that drafts with an EAGLE head asks the target for its hidden states at a few layers
(speculative/protocol.py's Features); each answer then carries the rows of the positions it
committed, float16. This times the target's verify pass (TargetEngine, the code the service
runs) over 1 and K + 1 new tokens on a cached context, each shape with the layers captured and
without, interleaved (median of --reps), and the packing of a round's rows into the protobuf
message and back; and prints the bytes a round adds for 1 and K + 1 committed tokens. Writes
bench/results/features.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from assets.models import TARGET  # noqa: E402
from bench.pair import RESULTS  # noqa: E402
from bench.systems import machine  # noqa: E402
from model_service import features as wire  # noqa: E402
from model_service.engines import TargetEngine  # noqa: E402
from model_service.model_runner import ModelRunner  # noqa: E402
from speculative.protocol import (Proposal, SamplingParams, VerifyCall, features_from_proto,  # noqa: E402
                                  features_to_proto)
from speculative.sampling import one_hot_supports  # noqa: E402

GREEDY = SamplingParams(0.0)


def time_pass(engine: TargetEngine, session: str, tokens: int, layers: tuple[int, ...], context: int) -> float:
    """ms of one verify over `tokens` new tokens (tokens - 1 drafted, all accepted or not) on a fresh
    session of `context` cached tokens."""
    prompt = [(7 * i) % 1000 + 10 for i in range(context)]
    engine.verify(VerifyCall(session, True, prompt, Proposal(), GREEDY, 1, layers))
    drafted = [(13 * i) % 1000 + 10 for i in range(tokens - 1)]
    proposal = Proposal(drafted, *one_hot_supports(drafted))
    start = time.perf_counter()
    engine.verify(VerifyCall(session, False, [], proposal, GREEDY))
    ms = (time.perf_counter() - start) * 1e3
    engine.release(session)
    return ms


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.features", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-model", default=str(TARGET))
    parser.add_argument("--layers", default="2,15,27", help="the feature layers (EAGLE-3's defaults for SmolLM2)")
    parser.add_argument("--quantize", default="none,int4")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=RESULTS / "features.json")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    layers = tuple(int(i) for i in args.layers.split(","))
    rows = []
    for quantize in args.quantize.split(","):
        runner = ModelRunner(args.target_model, "cpu", "float32", quantize=quantize)
        engine = TargetEngine(runner)
        width = len(layers) * runner.hidden_size
        for tokens in (1, args.k + 1):
            times = {(): [], layers: []}
            for rep in range(args.reps + 2):  # the first two warm up, each shape with and without
                for asked in times:
                    ms = time_pass(engine, f"s{rep}", tokens, asked, args.context)
                    if rep >= 2:
                        times[asked].append(ms)
            plain, with_features = statistics.median(times[()]), statistics.median(times[layers])
            f = wire.pack(0, torch.randn(tokens, width))
            start = time.perf_counter()
            for _ in range(100):
                msg = features_to_proto(f).SerializeToString()
                wire.unpack(features_from_proto(type(features_to_proto(f)).FromString(msg)))
            codec_ms = (time.perf_counter() - start) * 10
            rows.append({"quantize": quantize, "tokens": tokens, "pass_ms": plain,
                         "pass_ms_with_features": with_features, "added_ms": with_features - plain,
                         "bytes": len(f.data), "message_bytes": len(msg), "codec_ms": codec_ms})
            print(f"{quantize:>5} {tokens:>2} tokens: pass {plain:6.2f} ms, with layers {list(layers)}"
                  f" {with_features:6.2f} ms (+{with_features - plain:5.2f}), rows {len(f.data):,} B"
                  f" ({len(msg):,} B as a message),"
                  f" pack + message + unpack {codec_ms:.3f} ms", flush=True)
        runner.close()
    args.out.write_text(json.dumps({"meta": {"machine": machine(), "threads": args.threads, "layers": list(layers),
                                             "context": args.context, "reps": args.reps,
                                             "date": time.strftime("%Y-%m-%d %H:%M")}, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
