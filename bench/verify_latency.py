"""Verify latency of the target's model runner on a random-weight Llama of any size.

    python -m bench.verify_latency                                   # a 7B-shaped model on cuda, bf16
    python -m bench.verify_latency --device cpu --dtype float32 --hidden 512 --layers 8 \\
        --tensor-parallel-size 1,2                                   # TP = 1 against TP = 2 here

A verify step is one forward pass over K + 1 new tokens per session on top of a cached
context; with continuous batching, B sessions share the pass. For each tensor-parallel size,
batch B and K this times that pass (median of --reps, after warm-up) through `ModelRunner`,
the code the target service runs, and prints ms per pass and scored tokens per second.
Weights are random: latency depends on shapes, not values.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from model_service.model_runner import DTYPES, ModelRunner, synchronize  # noqa: E402
from speculative.tiny import make_model, make_tokenizer  # noqa: E402


def build(args, out: Path) -> Path:
    tokenizer = make_tokenizer(out / "tokenizer")
    init = args.device if args.device.startswith("cuda") else "cpu"
    return make_model(out / "model", tokenizer, hidden=args.hidden, layers=args.layers, heads=args.heads,
                      kv_heads=args.kv_heads, intermediate=args.intermediate, vocab_size=args.vocab,
                      max_context=args.context + 64, dtype=DTYPES[args.dtype], device=init)


def time_passes(runner: ModelRunner, batch: int, k: int, context: int, reps: int) -> float:
    """Median ms of one pass over `batch` sessions of k + 1 new tokens each, on `context` cached tokens."""
    return time_passes_side_by_side(runner, batch, [k], context, reps)[k]


def time_passes_side_by_side(runner: ModelRunner, batch: int, ks: list[int], context: int, reps: int) -> dict[int, float]:
    """time_passes for each k of `ks`, their passes taken in turn (one of each k a rep, after two
    warm-up rounds): a machine whose speed drifts (a shared VM's can move 10-40% within a minute)
    slows every k's passes alike, so their ratios hold where medians taken one k after another do not."""
    return time_runners_side_by_side([runner], batch, ks, context, reps)[0]


def prefilled(runner: ModelRunner, batch: int, k: int, context: int, tag: str) -> list:
    """`batch` new sessions of `context` cached tokens each, for passes of k + 1 tokens."""
    group = [runner.start_session(f"{tag}{batch}-k{k}-{i}", i) for i in range(batch)]
    for i, session in enumerate(group):
        session.tokens = [(31 * i + j) % runner.vocab_size for j in range(context)]
    runner.forward_many([(s, 1) for s in group])  # prefill
    return group


def timed_pass(runner: ModelRunner, group: list, k: int, seed: int, context: int) -> float:
    """One pass of k + 1 new tokens for each session of `group`, then back to `context`. -> ms"""
    for session in group:
        session.tokens.extend([(seed + j) % runner.vocab_size for j in range(k + 1)])
    synchronize(runner.device)
    start = time.perf_counter()
    runner.forward_many([(s, k + 1) for s in group])
    synchronize(runner.device)
    ms = (time.perf_counter() - start) * 1e3
    for session in group:
        session.truncate(context)
    return ms


def release(runner: ModelRunner, group: list) -> None:
    for session in group:
        runner.sessions.release(session.id)


def time_runners_side_by_side(runners: list[ModelRunner], batch: int, ks: list[int], context: int,
                              reps: int) -> list[dict[int, float]]:
    """time_passes_side_by_side for several runners (weight formats, cache dtypes) at once: each rep
    one pass of every runner and k in turn, so a drift moves them all alike. -> per runner, k -> ms"""
    sessions = {(r, k): prefilled(runner, batch, k, context, "b") for r, runner in enumerate(runners) for k in ks}
    samples = {key: [] for key in sessions}
    for rep in range(reps + 2):
        for (r, k), group in sessions.items():
            ms = timed_pass(runners[r], group, k, rep, context)
            if rep >= 2:  # warm-up passes dropped
                samples[r, k].append(ms)
    for (r, _), group in sessions.items():
        release(runners[r], group)
    return [{k: statistics.median(samples[r, k]) for k in ks} for r in range(len(runners))]


def time_runner_back_to_back(runner: ModelRunner, batch: int, ks: list[int], context: int, reps: int,
                             burst: int = 3) -> dict[int, float]:
    """time_runners_side_by_side's passes for one runner with nothing of another runner's between them:
    each rep a burst of `burst` passes of each k in turn, the burst's first dropped (the one after
    another k's), so that what is timed follows a pass over the same weights, as a decode or verify
    loop's pass does, whose weights the last pass left in the caches (on a CPU whose L3 holds them
    that decides much of a small pass's time). -> k -> median ms"""
    sessions = {k: prefilled(runner, batch, k, context, "w") for k in ks}
    samples = {k: [] for k in ks}
    for rep in range(reps + 1):
        for k, group in sessions.items():
            for b in range(burst):
                ms = timed_pass(runner, group, k, rep + b, context)
                if rep >= 1 and b >= 1:  # a warm-up rep; each burst's first pass
                    samples[k].append(ms)
    for group in sessions.values():
        release(runner, group)
    return {k: statistics.median(samples[k]) for k in ks}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.verify_latency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--intermediate", type=int, default=14336)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--context", type=int, default=512, help="cached tokens per session")
    parser.add_argument("--batches", default="1,4,16")
    parser.add_argument("--ks", default="0,1,4,8")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="torch threads per rank (0: torch's default)")
    parser.add_argument("--tensor-parallel-size", default="1", help="sizes to compare, e.g. 1,2")
    parser.add_argument("--model", type=Path, help="an existing model directory instead of a random one")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    with tempfile.TemporaryDirectory(prefix="specdec-verify-") as tmp:
        start = time.perf_counter()
        model_dir = args.model or build(args, Path(tmp))
        print(f"model ready in {time.perf_counter() - start:.0f} s: {model_dir}", flush=True)
        rows = []
        for size in (int(n) for n in args.tensor_parallel_size.split(",")):
            runner = ModelRunner(model_dir, args.device, args.dtype, max_context=args.context + 64,
                                 tensor_parallel=size)
            try:
                n = runner.num_parameters
                params = f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"
                name = f"{params} params, {runner.dtype}, {runner.device}, TP={size}"
                if runner.device.type == "cuda":
                    name += f" ({torch.cuda.get_device_name(runner.device)})"
                print(f"\n{name}\n{'batch':>6}{'K':>4}{'ms/pass':>10}{'tokens/s':>11}", flush=True)
                for batch in (int(b) for b in args.batches.split(",")):
                    for k in (int(k) for k in args.ks.split(",")):
                        ms = time_passes(runner, batch, k, args.context, args.reps)
                        tokens = batch * (k + 1)
                        rows.append({"tp": size, "batch": batch, "k": k, "ms": ms, "tokens_per_s": tokens / ms * 1e3,
                                     "model": name})
                        print(f"{batch:>6}{k:>4}{ms:>10.2f}{tokens / ms * 1e3:>11.0f}", flush=True)
            finally:
                runner.close()
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
