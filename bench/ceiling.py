"""`make bench-ceiling`: how far batching alone can take throughput on this machine.

    python -m bench.ceiling [--sessions 1,8,16] [--ks 0,2,3,4,6] [--repeats 2]

The gRPC system overlaps the draft's work with the target's and pays for its calls on the
wire. This bench measures the schedule with none of that: S sessions in one process run
specdec's own round (`speculative.round.generate`) over in-process peers behind the coordinator's
--lockstep gate (coordinator.lockstep), which holds every call until all S sessions wait for a
model; the turn it lets through then runs as one batched pass (`DraftEngine.propose_many` over
those waiting for the draft, else `TargetEngine.verify_many`), so all S sessions draft in
lockstep, then all S are verified, and whichever model is running has every thread (`--threads`, `--draft-threads`). No call
crosses a socket and nothing else runs beside a pass: on a machine whose cores the draft and
the target share, that is the most a batching schedule can do. S sessions go through the
held-out prompts (`--prompts` × `--new-tokens`, greedy; max(prompts, 2S) requests, each session
taking the next as soon as its last one ends, as bench-concurrency's clients do), at each fixed K (K = 0:
the target decoding alone, batched the same way), `--repeats` times in alternating order;
tokens/s are medians over the repeats. "x S=1" divides each S's best K by the best K at one
session: the ceiling of `make bench-concurrency`'s "x C=1" column on this machine and pair.
"prompt" is the share of a run's time that its prompts cost: for each pass that carried a
request's first call, what it took beyond the median pass that carried none. A prompt is
computed at full width whatever the batch (it is already compute-bound alone), so that share
grows with S; the last lines divide the runs' tokens/s with that time taken out as well.

Every run's tokens must equal those of the first run, prompt by prompt (greedy output is the
target's own at any batch and K); a difference stops the bench with an error.
Writes a table to stdout and bench/results/ceiling.json.
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

from bench.__main__ import RESULTS, add_pair_flags, heldout_prompts, pair_of  # noqa: E402
from coordinator.lockstep import DRAFT, TARGET, GatedDraft, GatedTarget, PhaseGate  # noqa: E402
from model_service.engines import DraftEngine, TargetEngine  # noqa: E402
from model_service.local import LocalDraft, LocalTarget  # noqa: E402
from model_service.model_runner import ModelRunner  # noqa: E402
from speculative.protocol import Cost, Proposal, ProposeCall, SamplingParams, Verdict, VerifyCall  # noqa: E402
from speculative.round import Stats, generate  # noqa: E402

# The gate's hold: how long calls wait for a live session that is not waiting. A session here does
# nothing else for long (between two requests, only its releases): a turn waits for all of them.
NO_HOLD_S = 3600.0


class TurnPasses:
    """One model's passes: the calls of each turn the gate lets through (`turn`: its id and number
    of calls) wait here until the turn's last one comes, then run as one batched pass (`run_many`:
    DraftEngine.propose_many or TargetEngine.verify_many) with `threads` torch threads.

    `timeline`: per pass, (seconds inside it, calls it served, whether one was a request's first: its prompt).
    """

    def __init__(self, run_many, threads: int):
        self.run_many, self.threads = run_many, threads
        self.waiting: list[tuple[ProposeCall | VerifyCall, asyncio.Future]] = []
        self.timeline: list[tuple[float, int, bool]] = []

    async def call(self, call: ProposeCall | VerifyCall, turn: tuple[int, int]):
        future = asyncio.get_running_loop().create_future()
        self.waiting.append((call, future))
        _, turn_size = turn
        if len(self.waiting) >= turn_size:
            self._run()
        return await future

    def _run(self) -> None:
        batch, self.waiting = self.waiting, []
        torch.set_num_threads(self.threads)
        start = time.perf_counter()
        try:
            results = self.run_many([call for call, _ in batch])
        except Exception as exc:  # not one call's: every call of the pass gets it
            results = [exc] * len(batch)
        self.timeline.append((time.perf_counter() - start, len(batch), any(call.start for call, _ in batch)))
        for (_, future), result in zip(batch, results):
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)


class TurnDraft(LocalDraft):
    """An in-process DraftPeer whose calls wait for the rest of their turn, then draft in one pass."""

    def __init__(self, engine: DraftEngine, passes: TurnPasses):
        super().__init__(engine)
        self.passes = passes

    async def propose(self, call: ProposeCall, *, turn: tuple[int, int] = (0, 0)) -> tuple[Proposal, Cost]:
        return await self.passes.call(call, turn)


class TurnTarget(LocalTarget):
    """An in-process TargetPeer whose calls wait for the rest of their turn, then verify in one pass."""

    def __init__(self, engine: TargetEngine, passes: TurnPasses):
        super().__init__(engine)
        self.passes = passes

    async def verify(self, call: VerifyCall, *, turn: tuple[int, int] = (0, 0)) -> tuple[Verdict, Cost]:
        return await self.passes.call(call, turn)


class Lockstep:
    """S sessions' peers in one process, in lockstep: the coordinator's PhaseGate lets the calls
    through in turns, a turn only when every live session waits for a model (`gate.joined` /
    `gate.left` count them), the draft's turn first; each turn is one pass (TurnPasses). So a
    session that starts a new request while the others are mid-round waits for them, and they all
    verify together: the groups a pipelined system forms never split a batch here."""

    def __init__(self, draft: DraftEngine, target: TargetEngine, draft_threads: int, target_threads: int):
        self.gate = PhaseGate(NO_HOLD_S)
        self.passes = {DRAFT: TurnPasses(draft.propose_many, draft_threads),
                       TARGET: TurnPasses(target.verify_many, target_threads)}
        self.draft = GatedDraft(TurnDraft(draft, self.passes[DRAFT]), self.gate)
        self.target = GatedTarget(TurnTarget(target, self.passes[TARGET]), self.gate)
        self.max_context = target.runner.max_context

    def set_threads(self, draft_threads: int, target_threads: int) -> None:
        self.passes[DRAFT].threads, self.passes[TARGET].threads = draft_threads, target_threads


def prompt_seconds(passes: list[tuple[float, int, bool]]) -> float:
    """What the passes (seconds, calls, prompt) that carried a prompt cost beyond a pass without
    one: each such pass's seconds less the median of the others' (the decoding they did beside
    the prompt), summed."""
    plain = [seconds for seconds, _, prompt in passes if not prompt]
    typical = statistics.median(plain) if plain else 0.0
    return sum(max(0.0, seconds - typical) for seconds, _, prompt in passes if prompt)


def lockstep_run(lockstep: Lockstep, prompts: list[list[int]], sessions: int, k: int, new_tokens: int,
                 eos: set[int], tag: str) -> dict:
    """max(len(prompts), 2 * sessions) requests over the prompts in turn, `sessions` at a time: each
    session takes the next request as soon as its last one ends, as `make bench-concurrency`'s
    clients do. -> figures of the run, with each request's tokens"""
    params = SamplingParams(0.0, 0, 1.0, 0)
    requests = max(len(prompts), 2 * sessions)
    outputs: list[list[int]] = [[] for _ in range(requests)]
    stats = Stats()
    marks = {model: len(passes.timeline) for model, passes in lockstep.passes.items()}
    queue = iter(range(requests))

    async def session() -> None:
        try:
            for i in queue:
                run = Stats()  # generate() counts toward max_new_tokens in the Stats it is given
                async for new in generate(lockstep.draft, lockstep.target, prompts[i % len(prompts)],
                                          max_new_tokens=new_tokens, k=k, params=params, eos_token_ids=eos,
                                          max_context=lockstep.max_context, stats=run, session_id=f"{tag}-{i}"):
                    outputs[i].extend(new)
                stats.merge(run)
        finally:
            lockstep.gate.left()

    async def run() -> float:
        start = time.perf_counter()
        for _ in range(sessions):  # all live before the first call: the first turn waits for every session
            lockstep.gate.joined()
        await asyncio.gather(*(session() for _ in range(sessions)))
        return time.perf_counter() - start

    seconds = asyncio.run(run())
    tokens = sum(map(len, outputs))
    run_passes = {model: lockstep.passes[model].timeline[mark:] for model, mark in marks.items()}  # this run's
    verify = run_passes[TARGET]
    prompts_s = sum(map(prompt_seconds, run_passes.values()))
    return {"outputs": outputs, "requests": requests, "tokens": tokens, "seconds": seconds,
            "tokens_per_s": tokens / seconds,
            "mean_verify_batch": sum(calls for _, calls, _ in verify) / len(verify) if verify else 0.0,
            "acceptance_rate": stats.acceptance_rate, "rounds": stats.rounds,
            "prompt_share": prompts_s / seconds, "tokens_per_s_no_prompts": tokens / (seconds - prompts_s),
            **{f"{model}_ms_per_token": 1e3 * sum(busy for busy, _, _ in passes) / tokens
               for model, passes in run_passes.items()}}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(prog="python -m bench.ceiling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_flags(parser)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--sessions", default="1,8,16", help="sessions in lockstep (1 must be among them)")
    parser.add_argument("--ks", default="0,2,3,4", help="fixed K values (0: the target alone)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch threads of the target's passes")
    parser.add_argument("--draft-threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch threads of the draft's passes")
    parser.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the bound counts")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    levels = [int(s) for s in args.sessions.split(",")]
    ks = [int(k) for k in args.ks.split(",")]
    if 1 not in levels:
        parser.error("--sessions must include 1: every level is divided by it")

    from transformers import AutoTokenizer

    draft_dir, target_dir = pair_of(args)
    prompts = heldout_prompts(AutoTokenizer.from_pretrained(target_dir), args.prompts)
    draft_runner, target_runner = ModelRunner(draft_dir), ModelRunner(target_dir)
    eos = set(target_runner.eos_token_ids)
    draft_engine, target_engine = DraftEngine(draft_runner), TargetEngine(target_runner)
    lockstep = Lockstep(draft_engine, target_engine, args.draft_threads, args.threads)

    # warm both models (first passes allocate and pack) on two prompts
    lockstep_run(lockstep, prompts[:2], 2, max(ks), 8, eos, "warm")
    # one thread per model: each pass's time is its CPU time, whose sum bounds any schedule
    threads = sorted({(1, 1), (args.threads, args.draft_threads)})
    runs = [(t, s, k) for t in threads for s in levels for k in ks]
    reference: list[list[int]] | None = None  # per prompt, from the first run
    figures: dict[tuple, list[dict]] = {run: [] for run in runs}
    with tqdm(total=len(runs) * args.repeats, desc="bench-ceiling", unit="run") as bar:
        for repeat in range(args.repeats):
            for (tt, td), s, k in runs if repeat % 2 == 0 else runs[::-1]:
                bar.set_postfix_str(f"threads {tt}/{td} S={s} K={k}")
                lockstep.set_threads(td, tt)
                result = lockstep_run(lockstep, prompts, s, k, args.new_tokens, eos, f"r{repeat}t{tt}s{s}k{k}")
                outputs = result.pop("outputs")
                if reference is None:
                    reference = outputs[: len(prompts)]
                bad = [i for i, out in enumerate(outputs) if out != reference[i % len(prompts)]]
                if bad:
                    raise SystemExit(f"S={s} K={k}: request {bad[0]} (prompt {bad[0] % len(prompts)}) decoded "
                                     f"differently from the first run")
                figures[(tt, td), s, k].append(result)
                bar.update()

    cores = args.cores
    rows = []
    for (tt, td), s, k in runs:
        done = figures[(tt, td), s, k]
        row = {"threads": tt, "draft_threads": td, "sessions": s, "k": k,
               "tokens_per_s": statistics.median(r["tokens_per_s"] for r in done),
               "tokens_per_s_runs": [r["tokens_per_s"] for r in done], "tokens": done[0]["tokens"],
               "mean_verify_batch": statistics.mean(r["mean_verify_batch"] for r in done),
               "acceptance_rate": done[0]["acceptance_rate"],
               "draft_ms_per_token": statistics.median(r["draft_ms_per_token"] for r in done),
               "target_ms_per_token": statistics.median(r["target_ms_per_token"] for r in done),
               "prompt_share": statistics.median(r["prompt_share"] for r in done),
               "tokens_per_s_no_prompts": statistics.median(r["tokens_per_s_no_prompts"] for r in done)}
        if (tt, td) == (1, 1):  # every core busy with these passes and nothing else
            row["bound_tokens_per_s"] = 1e3 * cores / (row["draft_ms_per_token"] + row["target_ms_per_token"])
        rows.append(row)
    chosen = (args.threads, args.draft_threads)
    best = {s: max((r for r in rows if r["sessions"] == s and (r["threads"], r["draft_threads"]) == chosen),
                   key=lambda r: r["tokens_per_s"]) for s in levels}
    bound = {s: max((r for r in rows if r["sessions"] == s and "bound_tokens_per_s" in r),
                    key=lambda r: r["bound_tokens_per_s"]) for s in levels}
    single = best[1]["tokens_per_s"]
    for r in rows:
        r["best"] = r is best[r["sessions"]] or r is bound[r["sessions"]]
        r["vs_1"] = r["tokens_per_s"] / single
    print(f"\n{'thr':>3} {'S':>3} {'K':>3} {'tok/s':>8} {'x S=1':>6} {'batch':>6} {'accept':>7} "
          f"{'draft':>6} {'target':>6} {'prompt':>6} {'bound':>7}  runs")
    for r in rows:
        runs_text = " ".join(f"{t:.1f}" for t in r["tokens_per_s_runs"])
        bound_text = f"{r['bound_tokens_per_s']:>7.1f}" if "bound_tokens_per_s" in r else f"{'':>7}"
        print(f"{r['threads']:>1}/{r['draft_threads']:<1} {r['sessions']:>3} {r['k']:>3} {r['tokens_per_s']:>8.1f} "
              f"{r['vs_1']:>5.2f}x {r['mean_verify_batch']:>6.2f} {r['acceptance_rate']:>7.3f} "
              f"{r['draft_ms_per_token']:>6.2f} {r['target_ms_per_token']:>6.2f} {r['prompt_share']:>6.1%} {bound_text}  "
              f"{runs_text}{'  best' if r['best'] else ''}")
    print(f"(thr: target/draft torch threads; draft, target: ms inside each model's passes per token; prompt: the "
          f"run's time the passes carrying a prompt took beyond a pass without one; bound: "
          f"{cores} cores x tokens per ms of one-thread passes, i.e. no core ever idle and nothing but the passes)")
    print(f"one session, lockstep at {chosen[0]}/{chosen[1]} threads: {single:.1f} tok/s (K {best[1]['k']})")
    ceiling = {}
    for s in levels:
        if s != 1:
            no_prompts = best[s]["tokens_per_s_no_prompts"] / best[1]["tokens_per_s_no_prompts"]
            ceiling[str(s)] = {"lockstep": best[s]["vs_1"], "bound": bound[s]["bound_tokens_per_s"] / single,
                               "lockstep_no_prompts": no_prompts}
            print(f"{s} sessions: lockstep {best[s]['tokens_per_s']:.1f} tok/s = {best[s]['vs_1']:.2f}x one session "
                  f"(K {best[s]['k']}); bound {bound[s]['bound_tokens_per_s']:.1f} tok/s = "
                  f"{ceiling[str(s)]['bound']:.2f}x (K {bound[s]['k']})")
            print(f"  prompts: {best[s]['prompt_share']:.1%} of the run against {best[1]['prompt_share']:.1%} at one "
                  f"session; without that time {best[s]['tokens_per_s_no_prompts']:.1f} against "
                  f"{best[1]['tokens_per_s_no_prompts']:.1f} tok/s = {no_prompts:.2f}x")
    result = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": f"{os.cpu_count()} cores, torch "
              f"{torch.__version__}", "threads": args.threads, "draft_threads": args.draft_threads, "cores": cores,
              "prompts": args.prompts, "new_tokens": args.new_tokens, "rows": rows, "ceiling": ceiling}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ceiling.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
