"""`make bench-concurrency`: many clients at once through the gRPC system.

    python -m bench.concurrency [--levels 1,2,4,8,16] [--prompts 16] [--new-tokens 128]

For each concurrency level C, C client streams (GenerateStream) share the held-out
prompts (at least max(prompts, 2C) requests per level, each 128 new tokens) and we
measure aggregate tokens/s and, per request, time to first token and inter-token
latency (p50 / p99), for:
  spec          the system with speculation (the coordinator's K policy: adaptive by default)
  no spec       the same services decoding with the target alone (K = 0 per request)
  spec predraft the same with pre-drafting (--predraft: the draft drafts the next round while
                the target verifies this one)
  spec 1-at-a-time   speculation with --max-batch 1 on both model services: every session
                     gets its own forward pass (what batching buys)
  spec lockstep the coordinator's --lockstep (all drafts, then all verifications, never at
                once; K = --lockstep-k), both services on 2 threads
  spec defaults the spec row's services started with no thread flags, as by hand (each takes its
                role's defaults: model_service.threads.default_threads)
  HF sequential transformers `generate` on the target, one request after another
Each stack runs one stream again after its last level (row "1*"); "x C=1" divides by the mean
of the two single-stream runs, so a slow or fast spell of a shared machine does not land on
one side of the ratio only. With --repeat N every level of a stack runs N times, turn about
(1, 8, 1, 8, ...), and each row is its median run (no 1* row): a level of 16 requests lasts
seconds, and this kind of machine moves by 10-20% between such runs.
With greedy decoding (the default) every request's tokens are checked against the first run of
its prompt, across systems and levels: greedy output is the target's own at any concurrency
and batch, so the bench prints how many requests matched and names any that did not.
Writes a table to stdout, bench/results/concurrency.json and bench/results/concurrency.png (with
--draft-method eagle: concurrency-eagle.json and .png; with --quantize int4, -int4 after the name).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.pair import RESULTS, add_pair_flags, heldout_prompts, pair_of  # noqa: E402
from bench.systems import hf_generate  # noqa: E402
from assets.models import EAGLE  # noqa: E402
from coordinator.launch import LocalStack  # noqa: E402


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q / 100 * (len(values) - 1))))]


async def drive(addr: str, prompts: list[list[int]], concurrency: int, requests: int, new_tokens: int,
                temperature: float, k: int | None, p_min: float | None = None) -> dict:
    """`requests` generations over `concurrency` concurrent streams (request i: prompt i mod
    len(prompts), seed i). -> figures of the level, and "outputs": request i's token ids"""
    import grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    queue: asyncio.Queue[int] = asyncio.Queue()
    for i in range(requests):
        queue.put_nowait(i)
    ttft, itl, tokens, batches = [], [], 0, []
    outputs: list[list[int]] = [[] for _ in range(requests)]

    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        await stub.Generate(pb.GenerateRequest(prompt_token_ids=prompts[0], max_new_tokens=4))  # warm up

        async def worker() -> None:
            nonlocal tokens
            while not queue.empty():
                i = queue.get_nowait()
                request = pb.GenerateRequest(prompt_token_ids=prompts[i % len(prompts)], max_new_tokens=new_tokens,
                                             temperature=temperature, seed=i)
                if k is not None:
                    request.num_speculative_tokens = k
                if p_min is not None:
                    request.draft_p_min = p_min
                start = last = time.perf_counter()
                first = True
                async for chunk in stub.GenerateStream(request, timeout=600):
                    now, n = time.perf_counter(), len(chunk.token_ids)
                    if n:
                        if first:
                            ttft.append(now - start)
                            first = False
                        else:
                            itl.extend([(now - last) / n] * n)
                        last = now
                        tokens += n
                        outputs[i].extend(chunk.token_ids)
                    if chunk.HasField("stats"):
                        batches.append(chunk.stats.mean_verify_batch)
                        ks.append(chunk.stats.draft_tokens / max(1, chunk.stats.rounds))

        ks: list[float] = []
        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        seconds = time.perf_counter() - start
    return {
        "requests": requests, "tokens": tokens, "seconds": seconds, "tokens_per_s": tokens / seconds,
        "ttft_p50_ms": 1e3 * percentile(ttft, 50), "ttft_p99_ms": 1e3 * percentile(ttft, 99),
        "itl_p50_ms": 1e3 * percentile(itl, 50), "itl_p99_ms": 1e3 * percentile(itl, 99),
        "mean_verify_batch": statistics.fmean(batches) if batches else 0.0,
        "mean_k": statistics.fmean(ks) if ks else 0.0, "outputs": outputs,
    }


def median_run(system: str, concurrency: int, again: bool, runs: list[dict]) -> dict:
    """A level's row: of its runs, the one of median tokens/s (the lower middle one of an even
    count), every run's tokens/s beside it."""
    ranked = sorted(runs, key=lambda r: r["tokens_per_s"])
    return {"system": system, "concurrency": concurrency, "again": again, **ranked[(len(ranked) - 1) // 2],
            "tokens_per_s_runs": [r["tokens_per_s"] for r in runs]}


def print_table(rows: list[dict]) -> None:
    print(f"{'system':<20}{'C':>4}{'tok/s':>8}{'x C=1':>7}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
          f"{'batch':>7}{'K':>6}")
    for r in rows:
        level = "1*" if r.get("again") else r["concurrency"]
        print(f"{r['system']:<20}{level:>4}{r['tokens_per_s']:>8.1f}{r.get('vs_single', float('nan')):>7.2f}"
              f"{r['ttft_p50_ms']:>10.1f}{r['ttft_p99_ms']:>8.1f}{r['itl_p50_ms']:>9.2f}{r['itl_p99_ms']:>8.2f}"
              f"{r['mean_verify_batch']:>7.2f}{r['mean_k']:>6.2f}"
              + (f"  runs {', '.join(f'{x:.1f}' for x in r['tokens_per_s_runs'])}"
                 if len(r.get("tokens_per_s_runs", ())) > 1 else ""))


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 4.5))
    for system in dict.fromkeys(r["system"] for r in rows):
        pts = sorted((r["concurrency"], r["tokens_per_s"], r["itl_p50_ms"]) for r in rows
                     if r["system"] == system and not r.get("again"))
        xs = [p[0] for p in pts]
        left.plot(xs, [p[1] for p in pts], marker="o", label=system)
        right.plot(xs, [p[2] for p in pts], marker="o", label=system)
    for ax, label in ((left, "aggregate tokens/s"), (right, "inter-token latency p50 (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.concurrency", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_flags(parser)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--levels", default="1,2,4,8,16", help="concurrency levels")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--k", type=int, default=None,
                        help="fixed K for the speculative rows (default: the coordinator's adaptive K)")
    parser.add_argument("--draft-p-min", type=float, default=None,
                        help="the requests' draft_p_min (default: the coordinator's)")
    parser.add_argument("--systems",
                        default="spec,no spec,spec defaults,spec predraft,spec 1-at-a-time,spec lockstep,HF sequential")
    parser.add_argument("--lockstep-k", type=int, default=4, help="K of the spec lockstep row")
    parser.add_argument("--repeat", type=int, default=1,
                        help="runs of each level of each system, turn about over the levels and systems of a stack;"
                             " a row is the run of median tokens/s (all kept in tokens_per_s_runs)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch threads of the target service (and of HF generate)")
    parser.add_argument("--draft-threads", type=int, default=1)
    parser.add_argument("--draft-method", default="model", choices=["model", "eagle"],
                        help="the drafts' method: model (--draft-model) or eagle (--draft-model: an EAGLE-3 head,"
                             " default models/eagle; the target sends it its hidden states)")
    parser.add_argument("--quantize", default="none", choices=["none", "int4"],
                        help="the target's weights (and a model draft's): int4 as the services' --quantize (HF"
                             " sequential stays float32)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    draft_dir, target_dir = pair_of(args)
    if args.draft_method == "eagle":
        draft_dir = args.draft_model or EAGLE
    levels = [int(c) for c in args.levels.split(",")]
    systems = [s.strip() for s in args.systems.split(",")]
    prompts = heldout_prompts(AutoTokenizer.from_pretrained(target_dir), args.prompts)
    rows: list[dict] = []
    # each stack runs one stream again at the end: this machine's speed drifts over minutes, and a
    # ratio to a single-stream figure taken in a slow or fast spell would say more about the spell
    # (with --repeat, every level runs again in turn: its median is the figure, and no 1* row)
    again = [1] if 1 in levels and len(levels) > 1 and args.repeat == 1 else []
    runs = len(levels + again) * args.repeat * len([s for s in systems if s != "HF sequential"])
    bar = tqdm(total=runs + ("HF sequential" in systems),
               desc="bench-concurrency", unit="run")
    stacks = {"batched": [s for s in systems if s in ("spec", "no spec")],
              "predraft": [s for s in systems if s == "spec predraft"],
              "one at a time": [s for s in systems if s == "spec 1-at-a-time"],
              "lockstep": [s for s in systems if s == "spec lockstep"],
              "defaults": [s for s in systems if s == "spec defaults"]}
    decoded: dict[int, list[int]] = {}  # prompt index -> the tokens its first greedy run decoded
    differ: list[str] = []  # the runs whose tokens were not those
    checked = 0

    def check(label: str, outputs: list[list[int]]) -> None:
        """Greedy output is the target's own whatever the system, level and batch: request j (prompt
        j mod len(prompts)) must decode what that prompt's first run decoded."""
        nonlocal checked
        if args.temperature != 0:
            return
        for j, ids in enumerate(outputs):
            if decoded.setdefault(j % len(prompts), ids) != ids:
                differ.append(f"{label} prompt {j % len(prompts)}")
        checked += len(outputs)

    for kind, names in stacks.items():
        if not names:
            continue
        extra = {"one at a time": ["--max-batch", "1"]}.get(kind, [])
        extra = [*extra, *(["--quantize", args.quantize] if args.quantize != "none" else [])]
        coordinator_args = {"predraft": ["--predraft"],
                            "lockstep": ["--lockstep", "--num-speculative-tokens", str(args.lockstep_k)]}.get(kind, [])
        lockstep = kind == "lockstep"  # each model has the cores to itself in its turn
        with LocalStack(draft_dir, target_dir, threads=None if kind == "defaults" else args.threads,
                        draft_threads=args.threads if lockstep else args.draft_threads,
                        batched_threads=args.threads,
                        draft_args=extra, target_args=extra, coordinator_args=coordinator_args,
                        draft_method=args.draft_method) as stack:
            runs_of: dict[tuple[str, int, bool], list[dict]] = {}
            for _ in range(args.repeat):
                for i, c in enumerate(levels + again):
                    for name in names:
                        bar.set_postfix_str(f"{name} C={c}")
                        k = 0 if name == "no spec" else args.k
                        figures = asyncio.run(drive(stack.addr, prompts, c, max(len(prompts), 2 * c),
                                                    args.new_tokens, args.temperature, k, args.draft_p_min))
                        check(f"{name} C={c}", figures.pop("outputs"))
                        runs_of.setdefault((name, c, i >= len(levels)), []).append(figures)
                        bar.update()
            rows += [median_run(name, c, is_again, runs) for (name, c, is_again), runs in runs_of.items()]
    if "HF sequential" in systems:
        bar.set_postfix_str("HF sequential")
        torch.set_num_threads(args.threads)
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        outputs, seconds = hf_generate(target, prompts, args.temperature, args.new_tokens)
        check("HF sequential", outputs)
        tokens = sum(map(len, outputs))
        rows.append({"system": "HF sequential", "concurrency": 1, "requests": len(prompts), "tokens": tokens,
                     "seconds": seconds, "tokens_per_s": tokens / seconds, "ttft_p50_ms": float("nan"),
                     "ttft_p99_ms": float("nan"), "itl_p50_ms": 1e3 * seconds / tokens,
                     "itl_p99_ms": float("nan"), "mean_verify_batch": 0.0, "mean_k": 0.0})
        bar.update()
    bar.close()
    for r in rows:  # against the mean of the system's single-stream runs (first and last)
        singles = [x["tokens_per_s"] for x in rows if x["system"] == r["system"] and x["concurrency"] == 1]
        if singles:
            r["vs_single"] = r["tokens_per_s"] / statistics.fmean(singles)

    meta = {"machine": f"{os.cpu_count()} cores, {torch.__version__}", "threads": args.threads,
            "draft_threads": args.draft_threads, "draft": str(draft_dir), "draft_method": args.draft_method,
            "target": str(target_dir), "quantize": args.quantize,
            "prompts": len(prompts), "new_tokens": args.new_tokens, "temperature": args.temperature,
            "k": args.k if args.k is not None else "adaptive", "draft_p_min": args.draft_p_min, "repeat": args.repeat,
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "greedy_requests_checked": checked, "greedy_requests_differing": differ}
    args.out.mkdir(parents=True, exist_ok=True)
    name = "concurrency" if args.draft_method == "model" else f"concurrency-{args.draft_method}"
    name += "-int4" if args.quantize == "int4" else ""
    (args.out / f"{name}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    plot(rows, args.out / f"{name}.png")
    print(f"\n{meta}\n")
    print_table(rows)
    by = {(r["system"], r["concurrency"]): r for r in rows if not r.get("again")}
    if ("spec", 8) in by and ("spec", 1) in by:
        print(f"\nspec at 8 streams: {by[('spec', 8)]['vs_single']:.2f}x its single-stream tokens/s (bar 3x)")
    if ("spec defaults", 8) in by and ("spec defaults", 1) in by:
        print(f"spec defaults (no thread flags) at 8 streams: {by[('spec defaults', 8)]['tokens_per_s']:.1f} tok/s,"
              f" {by[('spec defaults', 8)]['vs_single']:.2f}x its single stream")
    if ("spec lockstep", 8) in by and ("spec lockstep", 1) in by:
        print(f"spec lockstep at 8 streams: {by[('spec lockstep', 8)]['vs_single']:.2f}x its single-stream tokens/s")
    if any(s == "no spec" for s, _ in by):
        worse = [c for c in levels if ("spec", c) in by and ("no spec", c) in by
                 and by[("spec", c)]["tokens_per_s"] < by[("no spec", c)]["tokens_per_s"]]
        print("spec >= no spec at every level" if not worse else f"spec < no spec at C = {worse}")
    if checked:
        print(f"greedy: {checked - len(differ)} of {checked} requests decoded their prompt's first run's tokens"
              + (f"; differing: {', '.join(differ[:8])}" if differ else " (every system, every level)"))
    print(f"\nwrote {args.out / (name + '.json')} and {args.out / (name + '.png')}")
    return {"meta": meta, "rows": rows}


if __name__ == "__main__":
    main()
