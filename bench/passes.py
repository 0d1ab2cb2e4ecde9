"""`make bench-passes`: what one target pass costs by the tokens it scores, beside the memory floor.

    python -m bench.passes                               # models/target: float32 and int4, each kernel
    python -m bench.passes --tokens 1,5,9 --sessions 1 --weights "float32 specdec"

Speculation pays only where verifying K + 1 tokens costs little more than decoding one. For each
weight format of the real target (float32 through specdec's panels and through oneDNN's packed
weights; int4 through specdec's kernel, with its float16 keys and values and with float32 ones, and
through torch's) this times one pass of `tokens` new tokens per session over `sessions` sessions,
each on --context cached tokens (median of --reps after two warm-up passes, the target service's own
code: ModelRunner.forward_many; every weight format's and token count's passes taken in turn, so
that a drift in the machine's speed moves them alike), and prints beside it:

  x 1 token   the pass against the same sessions' one-token pass (the bars of cheap verification:
              int4 five tokens <= 1.3x, nine <= 1.6x; float32 five <= 1.2x)
  warm ms     the same pass right after another of the same weights (bursts of each token count,
              no other format's pass between them: what a decode or verify loop's pass meets), and
  warm x 1    its ratio to the warm one-token pass. In turn, a format's pass follows the others'
              (float32's 540 MB among them), which leave little of its weights in the caches: on a
              CPU whose L3 holds the int4 model (84 MB) the warm one-token pass is the faster by
              ~20%, and a pass of more rows, which computes more, by less
  floor       the bytes of weights one pass reads over this process's memory bandwidth (a sum over
              256 MB), the least a memory-bound pass can take

Writes a table to stdout and bench/results/passes.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.systems import machine, memory_bandwidth_gbs  # noqa: E402
from bench.verify_latency import time_runner_back_to_back, time_runners_side_by_side  # noqa: E402
from model_service import q4_kernel  # noqa: E402
from model_service.model_runner import ModelRunner  # noqa: E402

RESULTS = Path(__file__).parent / "results"
WEIGHTS = {"float32 specdec": {"float_kernel": "specdec"}, "float32 onednn": {"float_kernel": "onednn"},
           "int4 specdec": {"quantize": "int4", "int4_kernel": "specdec"},  # float16 keys and values (auto)
           "int4 specdec (float32 KV)": {"quantize": "int4", "int4_kernel": "specdec", "kv_dtype": "float32"},
           "int4 torch": {"quantize": "int4", "int4_kernel": "torch"}}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.passes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", default="models/target")
    parser.add_argument("--weights", default=",".join(WEIGHTS), help=f"any of {', '.join(WEIGHTS)}")
    parser.add_argument("--tokens", default="1,2,5,9,17", help="new tokens per session in a pass")
    parser.add_argument("--sessions", default="1,4")
    parser.add_argument("--context", type=int, default=128, help="cached tokens per session")
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=str(RESULTS / "passes.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    unknown = [w for w in weights if w not in WEIGHTS]
    if unknown:
        parser.error(f"--weights: unknown {unknown}; choose among {list(WEIGHTS)}")
    if not q4_kernel.load():
        print(f"specdec's kernel: {q4_kernel.path()} (make kernel): its rows are skipped", flush=True)
        weights = [w for w in weights if "specdec" not in w]
    tokens = [int(t) for t in args.tokens.split(",")]
    sessions = [int(s) for s in args.sessions.split(",")]
    bandwidth = memory_bandwidth_gbs(torch.get_num_threads())
    report = {"machine": machine(), "threads": torch.get_num_threads(), "bandwidth_gbs": bandwidth,
              "context": args.context, "rows": []}
    print(f"{report['machine']}; {report['threads']} threads; memory {bandwidth:.1f} GB/s (a sum over 256 MB)\n")
    print("| weights | sessions | tokens each | ms | x 1 token | warm ms | warm x 1 | floor ms |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    runners = []
    for name in weights:  # all of them held, so that their passes are taken in turn (a drift moves them alike)
        start = time.perf_counter()
        runners.append(ModelRunner(args.target, "cpu", max_context=args.context + max(tokens) + 8, **WEIGHTS[name]))
        report.setdefault("load_s", {})[name] = time.perf_counter() - start
    for s in sessions:
        results = time_runners_side_by_side(runners, s, [t - 1 for t in tokens], args.context, args.reps)
        warm = [time_runner_back_to_back(runner, s, [t - 1 for t in tokens], args.context, args.reps)
                for runner in runners]
        for name, runner, times, warm_times in zip(weights, runners, results, warm):
            floor = runner.fast.weight_bytes() / (bandwidth * 1e9) * 1e3
            one = warm_one = None
            for t in tokens:
                ms, warm_ms = times[t - 1], warm_times[t - 1]
                if t == 1:
                    one, warm_one = ms, warm_ms
                ratio = ms / one if one else None
                warm_ratio = warm_ms / warm_one if warm_one else None
                report["rows"].append({"weights": name, "sessions": s, "tokens": t, "ms": ms, "x_one_token": ratio,
                                       "warm_ms": warm_ms, "warm_x_one_token": warm_ratio,
                                       "floor_ms": floor, "weight_bytes": runner.fast.weight_bytes(),
                                       "kv_dtype": str(runner.kv_dtype).removeprefix("torch.")})
                shown = [f"{r:.2f}" if r is not None else "-" for r in (ratio, warm_ratio)]
                print(f"| {name} | {s} | {t} | {ms:.2f} | {shown[0]} | {warm_ms:.2f} | {shown[1]} | {floor:.2f} |",
                      flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
