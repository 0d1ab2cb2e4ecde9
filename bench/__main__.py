"""`make bench`: specdec against the target alone and HF assisted generation, side by side.

    python -m bench [--draft-model D --target-model T] [--prompts 16] [--new-tokens 128]

One run, same machine, same threads, same held-out chat prompts (assets/prompts.py, through the
target's chat template; never trained on), for greedy and for sampling (temperature 0.7),
sweeping K:
  a  target alone: transformers `generate` — the baseline, measured at the start of each mode
     and again after every K; speedups are over the median of those runs
  a' target alone on specdec's model runner (its lean forward, no draft): how much of c/d's
     speedup is the forward rather than speculation
  b  transformers assisted generation (`assistant_model=` the draft)
  c  specdec's speculative round in one process (no gRPC)
  d  specdec as three processes over gRPC on loopback (coordinator + draft + target), for each
     K and with adaptive K (its K column: the mean K it chose)
  a' int4, d int4  a' and d again with --quantize int4 (weight-only int4: specdec's CPU kernel
     where make setup built it, else torch's; ModelInfo's quantization says which) on
     the target and the draft (--quantize; d at --quant-k and adaptive K): the model those
     services then run is the int4 one, so their greedy text is its own
  g  d with the EAGLE-3 head (--eagle, default models/eagle) drafting from the target's hidden
     states, at --quant-k and adaptive K, float32 and each --quantize; its feature bytes a round
     (`--only eagle`: rows a, a', g and l, and d at --quant-k and adaptive K beside g; a' is
     measured again right after the g rows and quoted as the mean of its two runs)
  e  d with an oracle draft replaying the target's own greedy continuation (acceptance 1.0):
     the ceiling of the machinery (greedy only)
  f  d at K = --tp-k with the target tensor-parallel over 1 and 2 ranks (--tp), one torch
     thread per rank: what sharding costs or gains on this machine (on a 2-core CPU it costs)
  l  llama.cpp (llama-cpp-python, the `bench` extra) on the GGUF the target was converted from,
     same threads: what a CPU user would run instead (its weights stay 4-bit, so its greedy
     text is its own, not the target's)
  n  the n-gram draft (no draft model) beside HF prompt lookup, on input-grounded and on the
     held-out prompts, and on each --quantize target beside a' on it: bench/ngram.py, its own
     table and bench/results/ngram.json (`--only ngram` runs these rows alone)
Also: each service's peak RSS, how many of d's greedy outputs equal a's (and of the quantized rows'
the quantized runner's own, a' int4's), each a' row's distance
from its memory-bandwidth floor (the weight bytes one pass reads / the bandwidth this process
measures), and the issues' bars. Where a bar sets two systems within a few percent of each other
(d int4 with adaptive K against l), they run --repeat times (default 3) turn about, and their
tok/s is the median of their runs (all kept in latest.json's tokens_per_s_runs): this machine's
speed drifts by 5-10% over minutes, more than such a bar's margin.
Writes a table to stdout, bench/results/latest.json and bench/results/speedup.png (`--only eagle`:
bench/results/eagle.json and eagle.png).

Here: the flags and the order the rows run in (PairRun); each row's system is in bench/systems.py,
its figures and the report in bench/rows.py, the n rows in bench/ngram.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import time
from pathlib import Path

import torch
from tqdm import tqdm

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench import llama_row  # noqa: E402
from bench.pair import RESULTS, add_pair_flags, heldout_prompts, pair_of  # noqa: E402
from bench.rows import MODES, bars, floors, plot, print_table, row_from_stats, with_speedups  # noqa: E402
from bench.systems import (engine_run, grpc_run, hf_generate, interleaved, machine, memory_bandwidth_gbs,  # noqa: E402
                           rss_mb, runner_alone, source_gguf)
from assets.models import EAGLE  # noqa: E402
from coordinator.launch import LocalStack  # noqa: E402
from model_service import q4_kernel  # noqa: E402


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_flags(parser)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--ks", default="2,4,6", help="K values to sweep")
    parser.add_argument("--modes", default="greedy,sampling")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1),
                        help="torch threads of the bench process (rows a, b, c) and of d's target service")
    parser.add_argument("--draft-threads", type=int, default=1,
                        help="torch threads of d's draft service: it runs while the target waits, and with more"
                             " than one its idle OpenMP workers spin on the cores the target needs next")
    parser.add_argument("--tp", default="", help="row f: target tensor-parallel sizes, e.g. 1,2 ('' skips the row)")
    parser.add_argument("--gguf", type=Path, help="row l: the GGUF llama.cpp runs (default: the one the target was"
                                                  " converted from, where installed; none: no row l)")
    parser.add_argument("--tp-k", type=int, default=4, help="row f: K")
    parser.add_argument("--quantize", default="int4",
                        help="rows a' and d again with the target's and the draft's --quantize (e.g. int4; '' skips)")
    parser.add_argument("--quant-k", type=int, default=4, help="the fixed K of the quantized d row (adaptive K too)")
    parser.add_argument("--repeat", type=int, default=3,
                        help="rows one bar sets against another system's (l and d int4 with adaptive K; best n and"
                             " best p on grounded prompts) run this many times, interleaved; their tok/s: the median")
    parser.add_argument("--ngram-ks", default="8,16", help="rows n and p (bench/ngram.py): K values")
    parser.add_argument("--eagle", default=None,
                        help="row g: the EAGLE-3 head's directory (default: models/eagle where it exists and the target"
                             " is the default one; '' skips)")
    parser.add_argument("--only", choices=["ngram", "pair", "eagle"],
                        help="run only these rows: ngram (the n rows, bench/ngram.py), pair (all but those) or eagle"
                             " (a, a', g, l)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    return parser.parse_args(argv)


class PairRun:
    """The pair's rows (a, a', b, c, d, e, f, l and their int4 ones) in the order they run, over one
    set of prompts: what the rows share, the rows so far, and the services the gRPC rows go
    through (`stack`), started again with each phase's flags."""

    def __init__(self, args: argparse.Namespace, draft_dir, target_dir, tokenizer, target, modes: dict[str, float],
                 ks: list[int], tp_sizes: list[int]):
        from transformers import AutoModelForCausalLM

        self.args, self.draft_dir, self.target_dir, self.target = args, draft_dir, target_dir, target
        self.modes, self.ks, self.tp_sizes = modes, ks, tp_sizes
        self.prompts = heldout_prompts(tokenizer, args.prompts)
        self.assistant = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()
        eos_ids = target.generation_config.eos_token_id
        self.eos = set(eos_ids) if isinstance(eos_ids, list) else {eos_ids}
        self.gguf = args.gguf or source_gguf(target_dir)
        if self.gguf is not None and importlib.util.find_spec("llama_cpp") is None:
            print("row l skipped: llama-cpp-python is not installed (make bench-deps builds it)", flush=True)
            self.gguf = None
        self.quantized = [q for q in args.quantize.split(",") if q and q != "none"]
        if args.eagle is None:  # the shipped head is the default target's
            args.eagle = str(EAGLE) if args.target_model is None and (EAGLE / "config.json").is_file() else ""
        self.eagle = Path(args.eagle) if args.eagle else None
        self.eagle_only = args.only == "eagle"
        if self.eagle_only:
            runs = len(modes) * (2 + 2 * (1 + len(self.quantized)) + (self.gguf is not None)
                                 + 4 * (1 + len(self.quantized)))
        else:
            runs = (len(modes) * (3 + 4 * len(ks) + len(tp_sizes) + (self.gguf is not None)
                                  + 3 * len(self.quantized) + (2 + 2 * len(self.quantized)) * (self.eagle is not None))
                    + len(ks) * ("greedy" in modes))
        self.bar = tqdm(total=runs, desc="bench", unit="run")
        self.rows: list[dict] = []
        self.baselines: dict[str, list[float]] = {}  # row a's tokens/s, per mode: at the start and after every K
        self.references = None  # greedy: each prompt with row a's continuation (the oracle's, row e)
        self.hf_greedy, self.identical = None, {}  # d's greedy outputs equal to a's: (row, K) -> count
        # greedy: the quantized runner's own outputs (a' int4), per --quantize, and the rows on that target
        # whose outputs equal them: (row, K) -> count (a quantized model's output is its own, not a's)
        self.quant_greedy: dict[str, list[list[int]]] = {}
        self.identical_quant: dict[str, int] = {}
        self.alone: dict[tuple[str, str], dict] = {}  # (mode, quantize) -> row a' (--only eagle measures it again)
        self.rss: dict[str, float] = {}
        self.stack: LocalStack | None = None

    def run(self) -> None:
        """Every row, then the report."""
        args = self.args
        args.out.mkdir(parents=True, exist_ok=True)
        self.stack = LocalStack(self.draft_dir, self.target_dir, threads=args.threads,
                                draft_threads=args.draft_threads).start()
        try:
            if self.eagle_only:
                self.eagle_only_rows()
            else:
                self.all_rows()
        finally:
            self.stack.stop()
            self.bar.close()
        self.report()

    def eagle_only_rows(self) -> None:
        """`--only eagle`: the baselines (a, a', l), then rows g and, beside them, d (the distilled draft)."""
        for mode, temperature in self.modes.items():
            self.alone_rows(mode, temperature)
        for quantize in ("none", *self.quantized):
            self.eagle_rows(quantize)
            self.eagle_rows(quantize, head=False)

    def all_rows(self) -> None:
        """a, a', b, c, d, l; the quantized ones; e, f, g."""
        for mode, temperature in self.modes.items():
            self.float_rows(mode, temperature)
        self.rss = {name: rss_mb(proc.pid) for name, proc in self.stack.procs.items()}
        self.rss["bench process (a, a', b, c)"] = rss_mb(os.getpid())
        for quantize in self.quantized:
            self.quantized_rows(quantize)
        if self.references is not None:
            self.oracle_rows()
        for size in self.tp_sizes:
            self.tp_rows(size)
        if self.eagle is not None:
            for quantize in ("none", *self.quantized):
                self.eagle_rows(quantize)

    def restart(self, **flags) -> None:
        """The services again, with these LocalStack arguments (threads and draft threads: the bench's
        unless given)."""
        self.stack.stop()
        draft = flags.pop("draft_model", self.draft_dir)
        self.stack = LocalStack(draft, self.target_dir, **{
            "threads": self.args.threads, "draft_threads": self.args.draft_threads, **flags}).start()

    def progress(self, label: str) -> None:
        self.bar.set_postfix_str(label)

    def baseline(self, mode: str, temperature: float) -> list[list[int]]:
        """Row a once more: its tokens/s joins the mode's baselines. -> its outputs"""
        self.progress(f"{mode}: a target alone")
        outputs, seconds = hf_generate(self.target, self.prompts, temperature, self.args.new_tokens)
        self.baselines[mode].append(sum(map(len, outputs)) / seconds)
        self.bar.update()
        return outputs

    def runner_row(self, mode: str, temperature: float, quantize: str) -> None:
        """Row a': the target alone on specdec's runner (`quantize`: its --quantize); greedy on a
        quantized target, its outputs are the ones that target's rows are compared with."""
        self.progress(f"{mode}: a' target alone, specdec runner ({quantize})")
        own = [] if mode == "greedy" and quantize != "none" else None
        tokens, seconds, weight_bytes = runner_alone(self.target_dir, self.prompts, temperature, self.args.new_tokens,
                                                     self.eos, quantize, own)
        if own is not None:
            self.quant_greedy[quantize] = own
        self.rows.append({"name": "a' target alone (runner)" + ("" if quantize == "none" else f", {quantize}"),
                          "mode": mode, "k": 0, "tokens": tokens, "tokens_per_s": tokens / seconds,
                          "quantize": quantize, "ms_per_pass": seconds * 1e3 / tokens,
                          "weight_mb": weight_bytes / 1e6})
        self.bar.update()

    def alone_rows(self, mode: str, temperature: float) -> None:
        """`--only eagle`'s baselines: rows a, a' (float and each --quantize) and l."""
        args, prompts, rows = self.args, self.prompts, self.rows
        self.baselines[mode] = []
        outputs = self.baseline(mode, temperature)
        rows.append({"name": "a target alone (HF)", "mode": mode, "k": 0, "tokens": sum(map(len, outputs)),
                     "tokens_per_s": self.baselines[mode][0]})
        if mode == "greedy":
            self.hf_greedy = outputs
        for quantize in ("none", *self.quantized):
            self.runner_row(mode, temperature, quantize)
            rows[-1]["tokens_per_s_runs"] = [rows[-1]["tokens_per_s"]]
            self.alone[mode, quantize] = rows[-1]
        ran = (llama_row.run(self.gguf, prompts, temperature, args.new_tokens, args.threads, args.out)
               if self.gguf else None)
        if ran is not None:
            outputs, seconds = ran
            rows.append({"name": "l llama.cpp (GGUF)", "mode": mode, "k": 0, "tokens": sum(map(len, outputs)),
                         "tokens_per_s": sum(map(len, outputs)) / seconds})
            self.bar.update()

    def eagle_rows(self, quantize: str, head: bool = True) -> None:
        """Row g: d with the EAGLE-3 head drafting (the target's features over gRPC), the target on
        `quantize`, at --quant-k and adaptive K, each mode; greedy outputs compared with row a's.
        head=False: the same rows with the distilled draft (row d), for `--only eagle`'s comparison."""
        args, rows = self.args, self.rows
        flags = [] if quantize == "none" else ["--quantize", quantize]
        if head:
            self.restart(draft_model=self.eagle, draft_method="eagle", target_args=flags)
        else:  # (the draft on `quantize` too, as the whole bench's d rows)
            self.restart(draft_args=flags, target_args=flags)
        suffix = "" if quantize == "none" else f", {quantize}"
        row, label = ("g", f", eagle{suffix}") if head else ("d", suffix)
        for mode, temperature in self.modes.items():
            for k in (args.quant_k, None):
                self.progress(f"{mode}: {row}{label} K={k or 'adaptive'}")
                served = []
                stats, seconds = grpc_run(self.stack, self.prompts, temperature, args.new_tokens, k, served)
                name = f"{row} specdec gRPC{label}" + (", adaptive K" if k is None else "")
                mean_k = stats.draft_tokens / max(1, stats.rounds)
                rows.append({**row_from_stats(name, mode, k or round(mean_k), stats, seconds), "quantize": quantize,
                             **({"adaptive": True, "mean_k": mean_k} if k is None else {})})
                if mode == "greedy" and self.hf_greedy is not None and quantize == "none":
                    self.identical[f"{row}{label} K={k or 'adaptive'}"] = sum(
                        a == b for a, b in zip(served, self.hf_greedy))
                self.same_as_quantized(mode, quantize, f"{row}{label} K={k or 'adaptive'}", served)
                self.bar.update()
        if head:
            self.rss.update({f"{name} (eagle{suffix})": rss_mb(proc.pid) for name, proc in self.stack.procs.items()})
            for mode, temperature in self.modes.items():
                self.alone_again(mode, temperature, quantize)

    def same_as_quantized(self, mode: str, quantize: str, name: str, served: list[list[int]]) -> None:
        """A row on the `quantize` target: how many of its greedy outputs are the quantized runner's own."""
        own = self.quant_greedy.get(quantize)
        if mode == "greedy" and quantize != "none" and own is not None:
            self.identical_quant[name] = sum(a == b for a, b in zip(served, own))

    def alone_again(self, mode: str, temperature: float, quantize: str) -> None:
        """Row a' once more, right after the g rows it is compared with: its tokens/s becomes the mean of
        its runs, so that a slow or fast spell of a shared machine does not decide g / a'."""
        row = self.alone.get((mode, quantize))
        if row is None:
            return
        self.progress(f"{mode}: a' target alone again ({quantize})")
        tokens, seconds, _ = runner_alone(self.target_dir, self.prompts, temperature, self.args.new_tokens,
                                          self.eos, quantize)
        row["tokens_per_s_runs"].append(tokens / seconds)
        row["tokens_per_s"] = statistics.mean(row["tokens_per_s_runs"])
        row["ms_per_pass"] = 1e3 / row["tokens_per_s"]
        self.bar.update()

    def float_rows(self, mode: str, temperature: float) -> None:
        """Rows a, a' (and a' quantized), b, c, d at each K (a again after each), d with adaptive K, l."""
        args, prompts, new_tokens, rows = self.args, self.prompts, self.args.new_tokens, self.rows
        self.baselines[mode] = []
        outputs = self.baseline(mode, temperature)
        rows.append({"name": "a target alone (HF)", "mode": mode, "k": 0, "tokens": sum(map(len, outputs)),
                     "tokens_per_s": self.baselines[mode][0]})
        if mode == "greedy":
            self.references = [p + o for p, o in zip(prompts, outputs)]
            self.hf_greedy = outputs
        for quantize in ("none", *self.quantized):
            self.runner_row(mode, temperature, quantize)
        for k in self.ks:
            self.progress(f"{mode}: b HF assisted K={k}")
            outputs, seconds = hf_generate(self.target, prompts, temperature, new_tokens, self.assistant, k)
            rows.append({"name": "b HF assisted", "mode": mode, "k": k, "tokens": sum(map(len, outputs)),
                         "tokens_per_s": sum(map(len, outputs)) / seconds})
            self.bar.update()
            self.progress(f"{mode}: c in-process K={k}")
            stats, seconds = engine_run(self.draft_dir, self.target_dir, prompts, temperature, new_tokens, k, self.eos)
            rows.append(row_from_stats("c specdec in-process", mode, k, stats, seconds))
            self.bar.update()
            self.progress(f"{mode}: d gRPC K={k}")
            served = []
            stats, seconds = grpc_run(self.stack, prompts, temperature, new_tokens, k, served)
            rows.append(row_from_stats("d specdec gRPC", mode, k, stats, seconds))
            if mode == "greedy":
                self.identical[f"d K={k}"] = sum(a == b for a, b in zip(served, self.hf_greedy))
            self.bar.update()
            self.baseline(mode, temperature)
        self.progress(f"{mode}: d gRPC adaptive K")
        stats, seconds = grpc_run(self.stack, prompts, temperature, new_tokens, None)
        mean_k = stats.draft_tokens / max(1, stats.rounds)
        rows.append({**row_from_stats("d specdec gRPC, adaptive K", mode, round(mean_k), stats, seconds),
                     "adaptive": True, "mean_k": mean_k})
        self.bar.update()
        ran = llama_row.run(self.gguf, prompts, temperature, new_tokens, args.threads, args.out) if self.gguf else None
        if ran is not None:
            self.progress(f"{mode}: l llama.cpp")
            outputs, seconds = ran
            rows.append({"name": "l llama.cpp (GGUF)", "mode": mode, "k": 0, "tokens": sum(map(len, outputs)),
                         "tokens_per_s": sum(map(len, outputs)) / seconds})
            if mode == "greedy":
                self.identical["l llama.cpp"] = sum(a == b for a, b in zip(outputs, self.hf_greedy))
        if self.gguf is not None:
            self.bar.update()

    def quantized_rows(self, quantize: str) -> None:
        """Row d with the draft and the target on --quantize `quantize`, at --quant-k and adaptive K; where
        row l ran, l and d adaptive again, turn about (--repeat)."""
        args, prompts, new_tokens, rows = self.args, self.prompts, self.args.new_tokens, self.rows
        flags = ["--quantize", quantize]
        self.restart(draft_args=flags, target_args=flags)
        for mode, temperature in self.modes.items():
            for k in (args.quant_k, None):
                self.progress(f"{mode}: d {quantize} K={k or 'adaptive'}")
                served = []
                stats, seconds = grpc_run(self.stack, prompts, temperature, new_tokens, k, served)
                name = f"d specdec gRPC, {quantize}" + (", adaptive K" if k is None else "")
                mean_k = stats.draft_tokens / max(1, stats.rounds)
                rows.append({**row_from_stats(name, mode, k or round(mean_k), stats, seconds), "quantize": quantize,
                             **({"adaptive": True, "mean_k": mean_k} if k is None else {})})
                self.same_as_quantized(mode, quantize, f"d, {quantize} K={k or 'adaptive'}", served)
                self.bar.update()
            llama = next((r for r in rows if r["name"].startswith("l ") and r["mode"] == mode), None)
            if llama is not None and args.repeat > 1:
                # the bar d int4 >= l sets two systems within a few % of each other, while this
                # machine's speed drifts by ~5-10% over minutes: each runs again, turn about
                self.progress(f"{mode}: l and d {quantize} adaptive K, {args.repeat - 1} more times each")
                adaptive_row = rows[-1]

                def again_l(temperature=temperature) -> float:
                    ran = llama_row.run(self.gguf, prompts, temperature, new_tokens, args.threads, args.out)
                    return sum(map(len, ran[0])) / ran[1] if ran else float("nan")

                def again_d(temperature=temperature) -> float:
                    stats, seconds = grpc_run(self.stack, prompts, temperature, new_tokens, None)
                    return stats.generated_tokens / seconds

                interleaved(llama, adaptive_row, again_l, again_d, args.repeat)
        self.rss.update({f"{name} ({quantize})": rss_mb(proc.pid) for name, proc in self.stack.procs.items()})

    def oracle_rows(self) -> None:
        """Row e: the draft replays row a's greedy continuations (acceptance 1), at each K."""
        oracle = self.args.out / "oracle.json"
        oracle.write_text(json.dumps(self.references))
        self.restart(draft_args=["--oracle", str(oracle)])
        for k in self.ks:
            self.progress(f"greedy: e oracle K={k}")
            stats, seconds = grpc_run(self.stack, self.prompts, 0.0, self.args.new_tokens, k)
            self.rows.append(row_from_stats("e specdec gRPC, oracle", "greedy", k, stats, seconds))
            self.bar.update()
        oracle.unlink()

    def tp_rows(self, size: int) -> None:
        """Row f: d at --tp-k with the target over `size` tensor-parallel ranks, one thread each."""
        self.restart(threads=1, target_args=["--tensor-parallel-size", str(size)])
        for mode, temperature in self.modes.items():
            self.progress(f"{mode}: f target TP={size} K={self.args.tp_k}")
            stats, seconds = grpc_run(self.stack, self.prompts, temperature, self.args.new_tokens, self.args.tp_k)
            self.rows.append({**row_from_stats(f"f gRPC, target TP={size}", mode, self.args.tp_k, stats, seconds),
                              "tensor_parallel": size})
            self.bar.update()

    def report(self) -> None:
        """Speedups, floors and bars; latest.json and speedup.png (--only eagle: eagle.json, eagle.png); the table."""
        args, rows, rss, identical = self.args, self.rows, self.rss, self.identical
        with_speedups(rows, self.baselines)
        bandwidth = memory_bandwidth_gbs(args.threads)
        floor_lines = floors(rows, bandwidth)
        meta = {"machine": machine(), "threads": args.threads, "rss_mb_peak_and_now": rss,
                "greedy_identical_to_a": identical, "greedy_identical_to_a_prime_quantized": self.identical_quant,
                "memory_bandwidth_gbs": bandwidth,
                "int4_kernel": f"specdec {q4_kernel.path()}" if q4_kernel.available()
                else f"torch (specdec's: {q4_kernel.path()})",
                "draft_threads": args.draft_threads,
                "draft": str(self.draft_dir), "target": str(self.target_dir), "prompts": len(self.prompts),
                "new_tokens": args.new_tokens, "date": time.strftime("%Y-%m-%d %H:%M")}
        # --only eagle: a file of its own, so the whole bench's latest.json (the README's table) stays
        results, figure = (args.out / "eagle.json", args.out / "eagle.png") if self.eagle_only else (
            args.out / "latest.json", args.out / "speedup.png")
        results.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        plot(rows, figure)
        print(f"\n{meta}\n")
        print_table(rows)
        best = {m: max((r for r in rows if r["mode"] == m and r["name"].startswith("d ")
                        and r.get("quantize", "none") == "none"),
                       key=lambda r: r["speedup"],
                       default=None) for m in self.modes}
        for mode, r in best.items():
            peers = [x for x in rows if x["mode"] == mode and x["name"].startswith("b ")]
            if r and peers:
                peer = min(peers, key=lambda x: abs(x["k"] - r["k"]))  # adaptive K's mean may fall between
                print(f"best d ({mode}): {r['name']} K={r['k']} {r['speedup']:.2f}x target alone, "
                      f"{r['tokens_per_s'] / peer['tokens_per_s']:.2f}x HF assisted at that K, "
                      f"gRPC overhead {100 * r['overhead_fraction']:.1f}% of a round")
        if rss:
            print("RSS, MB (peak / now): " + ", ".join(f"{name} {peak:.0f} / {now:.0f}"
                                                       for name, (peak, now) in rss.items()))
        if identical:
            print(f"greedy outputs identical to a's (of {len(self.prompts)}): "
                  + ", ".join(f"{name} {n}" for name, n in identical.items()))
        if self.identical_quant:
            print(f"greedy outputs identical to the quantized runner's own, a' int4 (of {len(self.prompts)}): "
                  + ", ".join(f"{name} {n}" for name, n in self.identical_quant.items()))
        for line in floor_lines + bars(rows):
            print(line)
        print(f"\nwrote {results} and {figure}")


def main(argv=None) -> None:
    args = parse_args(argv)
    tp_sizes = [int(n) for n in args.tp.split(",") if n]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(args.threads)
    draft_dir, target_dir = pair_of(args)
    ks = [int(k) for k in args.ks.split(",")]
    modes = {m: MODES[m] for m in args.modes.split(",")}
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def ngram_rows(progress=None) -> list[dict]:
        from bench import ngram

        return ngram.run(target, tokenizer, target_dir, modes=modes, n_prompts=args.prompts,
                         new_tokens=args.new_tokens, ks=[int(k) for k in args.ngram_ks.split(",")],
                         threads=args.threads, out=args.out, progress=progress, repeat=args.repeat,
                         quantize=tuple(q for q in args.quantize.split(",") if q and q != "none"))

    if args.only == "ngram":
        with tqdm(desc="bench n-gram rows", unit="run") as progress:
            ngram_rows(progress)
        return
    PairRun(args, draft_dir, target_dir, tokenizer, target, modes, ks, tp_sizes).run()
    if args.only is None:
        ngram_rows()


if __name__ == "__main__":
    main()
