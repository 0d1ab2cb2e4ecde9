"""`make bench`'s n-gram rows: specdec with the n-gram draft (no draft model) beside HF generate's
prompt lookup, on input-grounded and on ordinary prompts.

    python -m bench --only ngram [--prompts 8] [--new-tokens 128] [--ngram-ks 8,16]

One run, same machine, same threads, same target; for each mode and prompt set (its first
--prompts; g: assets/prompts.py GROUNDED, 8 requests that hold what their answer copies; o: the
held-out CHAT prompts):
  a   target alone: transformers `generate`
  a'  target alone on specdec's model runner, measured before and after the set's other rows
      (its tokens/s: their mean)
  p   transformers `generate` with `prompt_lookup_num_tokens=K` (the peer: model-free drafting)
  n   specdec over gRPC (coordinator + n-gram draft + target, `--method ngram`) at each K, and
      with adaptive K (its K column: the mean K it chose)
  a' int4, n int4   with --quantize (default int4; '' skips): a' and n again on the quantized
      target (each set, each K, adaptive K), its greedy outputs compared with a' int4's own
Bars: on g, n (best) >= 1.5x p (best); on o, n with adaptive K (the coordinator's default) no
slower than a' by more than 5%; the quantized rows' ratios to a' on that target are printed beside.
The best n and the best p on g then run --repeat - 1 more times each, turn about, and their tok/s
is the median of their runs (tokens_per_s_runs): the ratio sat at 1.47-1.57 over four single runs,
as much run-to-run drift as margin. Writes bench/results/ngram.json.
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from assets.prompts import CHAT, GROUNDED
from bench.pair import chat_prompts
from bench.rows import print_table, row_from_stats
from bench.systems import grpc_run, hf_generate, interleaved, machine, runner_alone
from coordinator.launch import LocalStack

SETS = {"g": ("input-grounded prompts (assets/prompts.py GROUNDED)", GROUNDED),
        "o": ("ordinary held-out prompts (assets/prompts.py CHAT)", CHAT)}


def run(target, tokenizer, target_dir, *, modes: dict[str, float], n_prompts: int, new_tokens: int, ks: list[int],
        threads: int, out: Path, progress=None, repeat: int = 1, quantize: tuple[str, ...] = ()) -> list[dict]:
    """Every n-gram row (module docstring); `target` is the HF model of target_dir. -> rows, each
    with its prompt set ("prompts": g or o), its target's "quantize" and its speedup over a of its set
    and mode. repeat > 1: the best n and the best p on g run that many times in all, turn about
    (bench.systems.interleaved). quantize: the rows a' and n again on each such target."""
    eos_ids = target.generation_config.eos_token_id
    eos = set(eos_ids) if isinstance(eos_ids, list) else {eos_ids}
    rows: list[dict] = []
    identical: dict[str, int] = {}

    def step(label: str) -> None:
        if progress is not None:
            progress.set_postfix_str(label)
            progress.update()

    stack = LocalStack(None, target_dir, threads=threads, draft_threads=1, draft_method="ngram").start()
    try:
        warm = chat_prompts(tokenizer, GROUNDED[:1])
        hf_generate(target, warm, 0.0, 4)  # the process's first generate pays one-time costs: not row a's
        hf_generate(target, warm, 0.0, 4, prompt_lookup=2)
        for mode, temperature in modes.items():
            for name, (_, texts) in SETS.items():
                prompts = chat_prompts(tokenizer, texts[:n_prompts])
                tag = {"mode": mode, "prompts": name}
                outputs, seconds = hf_generate(target, prompts, temperature, new_tokens)
                hf = outputs
                rows.append({"name": "a target alone (HF)", **tag, "k": 0, "tokens": sum(map(len, outputs)),
                             "tokens_per_s": sum(map(len, outputs)) / seconds})
                step(f"{mode} {name}: a")
                row_at = len(rows)  # where row a' goes, once its second run is in
                alone = [runner_alone(target_dir, prompts, temperature, new_tokens, eos)[:2]]
                step(f"{mode} {name}: a'")
                for k in ks:
                    outputs, seconds = hf_generate(target, prompts, temperature, new_tokens, prompt_lookup=k)
                    rows.append({"name": "p HF prompt lookup", **tag, "k": k, "tokens": sum(map(len, outputs)),
                                 "tokens_per_s": sum(map(len, outputs)) / seconds})
                    if temperature == 0:
                        identical[f"{name}: p K={k}"] = sum(a == b for a, b in zip(outputs, hf))
                    step(f"{mode} {name}: p K={k}")
                    served = []
                    rows.append(n_row(stack, prompts, mode, temperature, new_tokens, k, tag, served))
                    if temperature == 0:
                        identical[f"{name}: n K={k}"] = sum(a == b for a, b in zip(served, hf))
                    step(f"{mode} {name}: n K={k}")
                rows.append(n_row(stack, prompts, mode, temperature, new_tokens, None, tag))
                step(f"{mode} {name}: n adaptive")
                alone.append(runner_alone(target_dir, prompts, temperature, new_tokens, eos)[:2])
                step(f"{mode} {name}: a' again")
                rows.insert(row_at, alone_row(alone, tag))
            if repeat > 1:
                best_p, best_n = (max((r for r in rows if r["mode"] == mode and r["prompts"] == "g"
                                       and r["name"].startswith(prefix)), key=lambda r: r["tokens_per_s"])
                                  for prefix in ("p ", "n "))
                prompts = chat_prompts(tokenizer, GROUNDED[:n_prompts])

                def again_p(k=best_p["k"], temperature=temperature) -> float:
                    outputs, seconds = hf_generate(target, prompts, temperature, new_tokens, prompt_lookup=k)
                    return sum(map(len, outputs)) / seconds

                def again_n(k=None if best_n.get("adaptive") else best_n["k"], temperature=temperature) -> float:
                    stats, seconds = grpc_run(stack, prompts, temperature, new_tokens, k)
                    return stats.generated_tokens / seconds

                interleaved(best_p, best_n, again_p, again_n, repeat)
                step(f"{mode} g: best p and n, {repeat - 1} more times each")
    finally:
        stack.stop()
    for q in quantize:
        rows += quantized_rows(q, tokenizer, target_dir, modes, n_prompts, new_tokens, ks, threads, eos, identical,
                               step)
    for row in rows:
        row.setdefault("quantize", "none")
        base = next(r for r in rows if r["name"].startswith("a ") and r["mode"] == row["mode"]
                    and r["prompts"] == row["prompts"])
        row["speedup"] = row["tokens_per_s"] / base["tokens_per_s"]
        if "ideal_speedup" in row:
            row["efficiency"] = row["speedup"] / row["ideal_speedup"] if row["ideal_speedup"] else 0.0
    out.mkdir(parents=True, exist_ok=True)
    meta = {"machine": machine(), "threads": threads, "target": str(target_dir), "prompts": n_prompts,
            "new_tokens": new_tokens, "greedy_identical_to_a": identical, "date": time.strftime("%Y-%m-%d %H:%M")}
    (out / "ngram.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    report(rows, identical, n_prompts, out)
    return rows


def quantized_rows(quantize: str, tokenizer, target_dir, modes: dict[str, float], n_prompts: int, new_tokens: int,
                   ks: list[int], threads: int, eos: set[int], identical: dict[str, int], step) -> list[dict]:
    """Rows a' and n (each K, adaptive K) on the `quantize` target, each set and mode; a' before and
    after the set's n rows (its tokens/s: their mean). Greedy n outputs are counted against a'
    `quantize`'s own (a quantized model's output is its own, not a's) into `identical`."""
    rows: list[dict] = []
    stack = LocalStack(None, target_dir, threads=threads, draft_threads=1, draft_method="ngram",
                       target_args=["--quantize", quantize]).start()
    try:
        for mode, temperature in modes.items():
            for name, (_, texts) in SETS.items():
                prompts = chat_prompts(tokenizer, texts[:n_prompts])
                tag = {"mode": mode, "prompts": name, "quantize": quantize}
                own: list[list[int]] = []
                alone = [runner_alone(target_dir, prompts, temperature, new_tokens, eos, quantize, own)[:2]]
                step(f"{mode} {name}: a' {quantize}")
                row_at = len(rows)
                for k in (*ks, None):
                    served: list[list[int]] = []
                    rows.append(n_row(stack, prompts, mode, temperature, new_tokens, k, tag, served, f", {quantize}"))
                    label = "adaptive" if k is None else k
                    if temperature == 0:
                        identical[f"{name}: n {quantize} K={label} (of a' {quantize}'s)"] = sum(
                            a == b for a, b in zip(served, own))
                    step(f"{mode} {name}: n {quantize} K={label}")
                alone.append(runner_alone(target_dir, prompts, temperature, new_tokens, eos, quantize)[:2])
                step(f"{mode} {name}: a' {quantize} again")
                rows.insert(row_at, alone_row(alone, tag, f", {quantize}"))
    finally:
        stack.stop()
    return rows


def n_row(stack: LocalStack, prompts, mode: str, temperature: float, new_tokens: int, k: int | None, tag: dict,
          served: list | None = None, suffix: str = "") -> dict:
    """Row n: the n-gram draft over gRPC at K = k (None: adaptive K, its K column the mean K it chose);
    each prompt's ids appended to `served` when given."""
    stats, seconds = grpc_run(stack, prompts, temperature, new_tokens, k, served)
    if k is None:
        mean_k = stats.draft_tokens / max(1, stats.rounds)
        return {**row_from_stats(f"n n-gram gRPC, adaptive K{suffix}", mode, round(mean_k), stats, seconds), **tag,
                "adaptive": True, "mean_k": mean_k}
    return {**row_from_stats(f"n specdec n-gram gRPC{suffix}", mode, k, stats, seconds), **tag}


def alone_row(alone: list[tuple[int, float]], tag: dict, suffix: str = "") -> dict:
    """Row a' from its runs (tokens, seconds) before and after its set's rows: tok/s their mean."""
    runs = [tokens / seconds for tokens, seconds in alone]
    return {"name": f"a' target alone (runner){suffix}", **tag, "k": 0, "tokens": alone[0][0],
            "tokens_per_s": statistics.mean(runs), "tokens_per_s_runs": runs}


def report(rows: list[dict], identical: dict[str, int], n_prompts: int, out: Path) -> None:
    for name, (title, _) in SETS.items():
        print(f"\nn-gram rows, {title}; speedup over a of the set")
        print_table([r for r in rows if r["prompts"] == name])
    if identical:
        print(f"greedy outputs identical to a's (of {n_prompts}): "
              + ", ".join(f"{name} {n}" for name, n in identical.items()))
    for line in bars(rows):
        print(line)
    print(f"wrote {out / 'ngram.json'}")


def bars(rows: list[dict]) -> list[str]:
    """Issue 26's bars, per mode: on g, best n >= 1.5x best p; on o, n with adaptive K >= 0.95x a'.
    The quantized rows against a' on their target, each set (no bar: issue 42 names the row)."""
    def pick(prefix: str, mode: str, prompts: str, adaptive: bool | None = None, quantize: str = "none") -> dict | None:
        found = [r for r in rows if r["mode"] == mode and r["prompts"] == prompts and r["name"].startswith(prefix)
                 and (adaptive is None or bool(r.get("adaptive")) == adaptive)
                 and r.get("quantize", "none") == quantize]
        return max(found, key=lambda r: r["tokens_per_s"]) if found else None

    lines = []
    for mode in dict.fromkeys(r["mode"] for r in rows):
        n, p, n_adaptive = pick("n ", mode, "g"), pick("p ", mode, "g"), pick("n ", mode, "g", True)
        if n and p:
            lines.append(f"bar n >= 1.5x p on input-grounded prompts ({mode}, best of each: n K={n['k']}"
                         f"{' adaptive' if n.get('adaptive') else ''}, p K={p['k']}): "
                         f"{n['tokens_per_s'] / p['tokens_per_s']:.2f}x"
                         + (f" (adaptive K: {n_adaptive['tokens_per_s'] / p['tokens_per_s']:.2f}x)" if n_adaptive else ""))
        n_o, alone = pick("n ", mode, "o", True), pick("a' ", mode, "o")
        if n_o and alone:
            lines.append(f"bar n (adaptive K) >= 0.95x a' on ordinary prompts ({mode}): "
                         f"{n_o['tokens_per_s'] / alone['tokens_per_s']:.2f}x")
        for q in sorted({r["quantize"] for r in rows if r.get("quantize", "none") != "none"}):
            for prompts in SETS:
                n_q, n_qa, a_q = (pick(prefix, mode, prompts, adaptive, q) for prefix, adaptive
                                  in (("n ", None), ("n ", True), ("a' ", None)))
                if n_q and n_qa and a_q:
                    lines.append(f"(no bar) n {q} / a' {q} on {prompts} ({mode}): best n K={n_q['k']}"
                                 f"{' adaptive' if n_q.get('adaptive') else ''} "
                                 f"{n_q['tokens_per_s'] / a_q['tokens_per_s']:.2f}x, adaptive K "
                                 f"{n_qa['tokens_per_s'] / a_q['tokens_per_s']:.2f}x")
    return lines
