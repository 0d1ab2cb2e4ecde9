"""`make bench-sampling`: what sampling's maths costs a token, beside what it replaced.

    python -m bench.sampling                          # SmolLM2's 49,152 ids and the head's 11,264
    python -m bench.sampling --vocab 49152 --rows 1,5 --reps 50

A sampled token is drawn from p over the vocabulary (temperature, top-k, top-p:
speculative/sampling.py), a sampled verify builds p for its K + 1 rows, a sampled draft token its
q (the top 64 of its own p). On a small int4 target (~4 ms a pass on 2 CPU cores) this maths had
cost as much as a pass. For each vocabulary size, rows per call and top_p this times (median of
--reps, after warm-up) each step three ways, in turn: in one call of specdec's kernel (where it is
built: the services' way on the CPU), with torch's ops (its way elsewhere), and the whole-row way
they replaced, on rows shaped like a chat model's at T = 0.7 (a peaked head of 20 tokens over a long
random tail):

  draw         sample: one uniform, inverse CDF             against torch.multinomial
               (kernel: q4_kernel.draw)
  p            logits_to_probs: top-p among the top tokens   against a sort of the whole row
               (kernel: q4_kernel.target_probs)
  draft token  draft_token: the top 64 logits and a mass     against p over the whole row, its top 64
               (kernel: q4_kernel.draft_support)             (draft_support), torch.multinomial

The draw and the draft token take one row (their callers' shape); p takes --rows rows. Writes a
table to stdout and bench/results/sampling.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from bench.systems import machine
from model_service import q4_kernel
from speculative.protocol import SamplingParams
from speculative.sampling import draft_support, draft_token, logits_to_probs, sample

RESULTS = Path(__file__).resolve().parent / "results"
TEMPERATURE = 0.7
SUPPORT = 64  # a draft's q: its top 64 tokens (the draft services' --max-support default)


def chat_like_rows(rows: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """Logits [rows, vocab]: a long random tail (N(0, 2.5)) and 20 tokens 8 above it."""
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab, generator=g) * 2.5
    logits[:, :20] += 8.0
    return logits


def probs_by_sorting(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits_to_probs as it was: top-p by a sort of the whole row."""
    probs = torch.softmax((logits - logits.max(-1, keepdim=True).values) / params.temperature, dim=-1)
    if params.top_p < 1.0:
        ordered, order = torch.sort(probs, dim=-1, descending=True)
        ordered = ordered.masked_fill(ordered.cumsum(-1) - ordered >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter_(-1, order, ordered)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def draft_as_it_was(row: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """draft_token as it was: p over the whole row (sorted for top-p), its top 64, torch.multinomial."""
    ids, q = draft_support(probs_by_sorting(row, params), SUPPORT)
    return int(ids[torch.multinomial(q, 1, generator=generator)])


def timed_us(fn) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e6


def measure(vocab: int, rows: int, top_p: float, reps: int, one_row: bool = True) -> list[dict]:
    """The steps' rows for one vocabulary, row count and top_p (one_row: also the draw and the draft
    token, which take one row): the kernel's way (where it is built), torch's and the way before, µs."""
    params = SamplingParams(TEMPERATURE, top_p=top_p)
    logits = chat_like_rows(rows, vocab)
    row = logits[0]
    p = logits_to_probs(row, params)
    g = torch.Generator().manual_seed(1)
    kernel = q4_kernel.available()
    steps = {
        "draw": {"kernel": lambda: sample(p, g, q4_kernel.draw), "torch": lambda: sample(p, g),
                 "before": lambda: int(torch.multinomial(p, 1, generator=g))},
        "p": {"kernel": lambda: q4_kernel.target_probs(logits, params),
              "torch": lambda: logits_to_probs(logits, params), "before": lambda: probs_by_sorting(logits, params)},
        "draft token": {"kernel": lambda: draft_token(row, params, 0.0, SUPPORT, g, q4_kernel.draft_support),
                        "torch": lambda: draft_token(row, params, 0.0, SUPPORT, g),
                        "before": lambda: draft_as_it_was(row, params, g)},
    }
    if not one_row:
        steps = {"p": steps["p"]}
    out = []
    for step, ways in steps.items():
        if not kernel:
            del ways["kernel"]
        for _ in range(3):  # warm-up
            for fn in ways.values():
                fn()
        # each rep one of each, in turn, so that a drift in the machine's speed moves them alike
        times = {way: [] for way in ways}
        for _ in range(reps):
            for way, fn in ways.items():
                times[way].append(timed_us(fn))
        us = {way: statistics.median(t) for way, t in times.items()}
        out.append({"step": step, "vocab": vocab, "rows": rows if step == "p" else 1, "top_p": top_p,
                    "kernel_us": us.get("kernel"), "torch_us": us["torch"], "before_us": us["before"]})
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.sampling", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", default="49152,11264", help="row widths (the target's, the EAGLE head's)")
    parser.add_argument("--rows", default="1,5", help="rows of a p call (a decode step, a K = 4 verify)")
    parser.add_argument("--top-p", default="1.0,0.9")
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--out", default=str(RESULTS / "sampling.json"))
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    report = {"machine": machine(), "threads": torch.get_num_threads(), "temperature": TEMPERATURE, "rows": []}
    print(f"{report['machine']}; {report['threads']} threads; T = {TEMPERATURE}; µs, medians of {args.reps}\n")
    print("| step | vocab | rows | top_p | kernel | torch | before | torch / kernel | before / kernel |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for top_p in (float(t) for t in args.top_p.split(",")):
            for i, rows in enumerate(int(r) for r in args.rows.split(",")):
                for r in measure(vocab, rows, top_p, args.reps, one_row=i == 0):
                    report["rows"].append(r)
                    k = r["kernel_us"]
                    kernel = (f"{k:.0f}", f"{r['torch_us'] / k:.1f}x", f"{r['before_us'] / k:.1f}x") if k \
                        else ("-",) * 3
                    print(f"| {r['step']} | {vocab:,} | {r['rows']} | {top_p} | {kernel[0]} | {r['torch_us']:.0f} | "
                          f"{r['before_us']:.0f} | {kernel[1]} | {kernel[2]} |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1))
    print(f"\nwrote {args.out}")


if __name__ == "__main__":
    main()
