"""A bench row's figures, and the report: the table, the plot, the issues' bars and each a' row's
memory-bandwidth floor.

A row is a dict: name (its letter first: "a target alone (HF)", "d specdec gRPC", ...), mode,
K, tokens, tokens_per_s; for the speculative rows also the round's figures (row_from_stats):
acceptance, alpha, c (a draft token's cost over a target call's), overhead, wire bytes, and the
speedup Leviathan et al.'s formula predicts from alpha and c (ideal_speedup); once the baseline
is known, speedup (over row a) and efficiency (speedup / ideal).
"""

from __future__ import annotations

import statistics
from pathlib import Path

from speculative.round import Stats

MODES = {"greedy": 0.0, "sampling": 0.7}  # mode: temperature


def ideal_speedup(alpha: float, c: float, k: int) -> float:
    """Leviathan et al.: expected speedup S = (1 - a^(K+1)) / ((1 - a)(K c + 1))."""
    if alpha >= 1.0:
        return (k + 1) / (k * c + 1)
    return (1 - alpha ** (k + 1)) / ((1 - alpha) * (k * c + 1))


def row_from_stats(name, mode, k, stats: Stats, seconds):
    """A row's measurements; `speedup` and `efficiency` are set by with_speedups once the baseline is known."""
    tps = stats.generated_tokens / seconds
    rounds = max(stats.rounds, 1)
    draft_per_token = stats.draft_ms / stats.draft_tokens if stats.draft_tokens else 0.0
    target_per_call = stats.target_ms / rounds
    c = draft_per_token / target_per_call if target_per_call else 0.0
    alpha = stats.alpha
    ideal = ideal_speedup(alpha, c, k)
    round_ms = seconds * 1e3 / rounds
    overhead_ms = round_ms - (stats.draft_ms + stats.target_ms) / rounds
    return {
        "name": name, "mode": mode, "k": k, "tokens": stats.generated_tokens, "tokens_per_s": tps,
        "acceptance_rate": stats.acceptance_rate, "alpha": alpha,
        "mean_accepted": stats.mean_accepted,
        "acceptance_per_position": [n / rounds for n in stats.accepted_per_position],
        "draft_ms_per_call": stats.draft_ms / max(stats.draft_calls, 1), "target_ms_per_call": target_per_call,
        "c": c, "round_ms": round_ms, "overhead_ms_per_round": overhead_ms,
        "overhead_fraction": overhead_ms / round_ms if round_ms else 0.0,
        "wire_bytes_per_round": stats.wire_bytes / rounds, "ideal_speedup": ideal,
        "feature_bytes_per_round": stats.feature_bytes / rounds,
        # of the tokens, those the target copied from the context and kept (prompt lookup in the target)
        "copied_share": stats.copied_tokens / stats.generated_tokens if stats.generated_tokens else 0.0,
    }


def with_speedups(rows: list[dict], baselines: dict[str, list[float]]) -> None:
    """speedup = tokens/s over the median of the mode's baseline runs (row a, measured again after
    every K so that a slow or busy spell of a shared machine does not bias one side); efficiency =
    speedup / ideal."""
    base = {mode: statistics.median(runs) for mode, runs in baselines.items()}
    for row in rows:
        if row["name"].startswith("a "):
            row["tokens_per_s"] = base[row["mode"]]
            row["tokens_per_s_runs"] = baselines[row["mode"]]
        row["speedup"] = row["tokens_per_s"] / base[row["mode"]]
        if "ideal_speedup" in row:
            row["efficiency"] = row["speedup"] / row["ideal_speedup"] if row["ideal_speedup"] else 0.0


def print_table(rows: list[dict]) -> None:
    head = (f"{'row':<34}{'mode':<9}{'K':>3}{'tok/s':>8}{'speedup':>8}{'accept':>7}{'alpha':>6}{'acc/rnd':>8}{'draft ms':>9}"
            f"{'target ms':>10}{'ovh ms':>7}{'ovh %':>6}{'B/rnd':>7}{'ideal':>6}{'eff':>6}{'copied':>7}")
    print(head)
    print("-" * len(head))
    for r in rows:
        def f(key, fmt):
            return format(r[key], fmt) if key in r else "-"
        print(f"{r['name']:<34}{r['mode']:<9}{r['k']:>3}{r['tokens_per_s']:>8.1f}{r['speedup']:>7.2f}x"
              f"{f('acceptance_rate', '.2f'):>7}{f('alpha', '.2f'):>6}{f('mean_accepted', '.2f'):>8}{f('draft_ms_per_call', '.2f'):>9}"
              f"{f('target_ms_per_call', '.2f'):>10}{f('overhead_ms_per_round', '.2f'):>7}"
              f"{(format(100 * r['overhead_fraction'], '.1f') if 'overhead_fraction' in r else '-'):>6}"
              f"{f('wire_bytes_per_round', '.0f'):>7}{f('ideal_speedup', '.2f'):>6}{f('efficiency', '.2f'):>6}"
              f"{f('copied_share', '.2f'):>7}")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(MODES), figsize=(6 * len(MODES), 4.5), sharey=True)
    for ax, mode in zip(axes, MODES):
        for name in dict.fromkeys(r["name"] for r in rows if r["mode"] == mode and r["k"] > 0):
            pts = sorted((r["k"], r["speedup"]) for r in rows if r["mode"] == mode and r["name"] == name)
            ax.plot(*zip(*pts), marker="o", label=name)
        ideal = sorted((r["k"], r["ideal_speedup"]) for r in rows if r["mode"] == mode and r["name"] == "d specdec gRPC")
        if ideal:
            ax.plot(*zip(*ideal), "k--", label="ideal (Leviathan, α and c of d)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{mode}")
        ax.set_xlabel("K (draft tokens per round)")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # a mode not run (--modes) leaves its axes empty
            ax.legend(fontsize=8)
    axes[0].set_ylabel("speedup vs target alone")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def bars(rows: list[dict]) -> list[str]:
    """The issues' bars, greedy unless said. Real pair (float rows: the model as converted): best d
    >= 2.5x a, >= 1.7x a', >= 1.3x b (best of each); sampled best d >= 1.8x a; d's acceptance at K = 4
    >= 0.6. CPU speed: a' int4 >= 2x a' float; best d int4 >= l (llama.cpp plain)."""
    def best(prefix: str, mode: str, quantize: str = "none") -> dict | None:
        found = [r for r in rows if r["mode"] == mode and r["name"].startswith(prefix)
                 and r.get("quantize", "none") == quantize]
        return max(found, key=lambda r: r["tokens_per_s"]) if found else None

    lines = []
    d, a, a2, b = (best(p, "greedy") for p in ("d ", "a ", "a' ", "b "))
    if d and a:
        lines.append(f"bar d >= 2.5x a (greedy): {d['tokens_per_s'] / a['tokens_per_s']:.2f}x")
    if d and a2:
        lines.append(f"bar d >= 1.7x a' (greedy): {d['tokens_per_s'] / a2['tokens_per_s']:.2f}x")
    if d and b:
        lines.append(f"bar d >= 1.3x b (greedy, best of each): {d['tokens_per_s'] / b['tokens_per_s']:.2f}x")
    ds, as_ = best("d ", "sampling"), best("a ", "sampling")
    if ds and as_:
        lines.append(f"bar d >= 1.8x a (sampled): {ds['tokens_per_s'] / as_['tokens_per_s']:.2f}x")
    k4 = [r for r in rows if r["name"] == "d specdec gRPC" and r["k"] == 4]
    for r in k4:
        lines.append(f"bar acceptance at K = 4 >= 0.6 ({r['mode']}): {r['acceptance_rate']:.3f}")
    lo = best("l ", "greedy")
    if d and lo:
        lines.append(f"(no bar) d / l llama.cpp (greedy): {d['tokens_per_s'] / lo['tokens_per_s']:.2f}x")
    for quantize in sorted({r["quantize"] for r in rows if r.get("quantize", "none") != "none"}):
        aq, dq = best("a' ", "greedy", quantize), best("d ", "greedy", quantize)
        if aq and a2:
            lines.append(f"bar a' {quantize} >= 2x a' float (greedy): {aq['tokens_per_s'] / a2['tokens_per_s']:.2f}x")
        if dq and lo:
            lines.append(f"bar d {quantize} >= l llama.cpp (greedy): {dq['tokens_per_s'] / lo['tokens_per_s']:.2f}x"
                         f" ({dq['tokens_per_s']:.1f} vs {lo['tokens_per_s']:.1f} tok/s)")
    return lines + eagle_bars(rows, best)


def eagle_bars(rows: list[dict], best) -> list[str]:
    """[eagle]'s bars, on row g (the EAGLE-3 head): acceptance at K = 4 >= 0.5; g float32 >= 2.5x a
    and >= 1.6x a' (floor: 1.3x a', and g beats d, the distilled draft); sampled g >= 1.8x a; g int4
    >= 1.3x a' int4 and >= 1.5x l."""
    lines = []
    for r in rows:
        if r["name"].startswith("g ") and r["k"] == 4 and not r.get("adaptive"):
            lines.append(f"bar eagle acceptance at K = 4 >= 0.5 ({r['mode']}, {r.get('quantize', 'none')}):"
                         f" {r['acceptance_rate']:.3f} (alpha {r['alpha']:.3f}; features"
                         f" {r.get('feature_bytes_per_round', 0) / 1e3:.1f} kB a round)")
    g, a, a2, lo = best("g ", "greedy"), best("a ", "greedy"), best("a' ", "greedy"), best("l ", "greedy")
    if g and a:
        lines.append(f"bar g eagle >= 2.5x a (greedy): {g['tokens_per_s'] / a['tokens_per_s']:.2f}x")
    if g and a2:
        runs = a2.get("tokens_per_s_runs", [])
        lines.append(f"bar g eagle >= 1.6x a' (greedy; floor 1.3x): {g['tokens_per_s'] / a2['tokens_per_s']:.2f}x"
                     + (f" (a' {a2['tokens_per_s']:.1f} tok/s: the mean of its runs before and after g,"
                        f" {' / '.join(f'{x:.1f}' for x in runs)}; against the faster,"
                        f" {g['tokens_per_s'] / max(runs):.2f}x)" if len(runs) > 1 else ""))
    gs, as_ = best("g ", "sampling"), best("a ", "sampling")
    if gs and as_:
        lines.append(f"bar g eagle >= 1.8x a (sampled): {gs['tokens_per_s'] / as_['tokens_per_s']:.2f}x")
    for quantize in ("none", *sorted({r["quantize"] for r in rows if r.get("quantize", "none") != "none"})):
        gq, dq = best("g ", "greedy", quantize), best("d ", "greedy", quantize)
        if gq and dq:
            lines.append(f"(floor) g eagle beats d, the distilled draft ({quantize}, greedy, best of each):"
                         f" {gq['tokens_per_s'] / dq['tokens_per_s']:.2f}x ({gq['tokens_per_s']:.1f} vs"
                         f" {dq['tokens_per_s']:.1f} tok/s)")
    for quantize in sorted({r["quantize"] for r in rows if r.get("quantize", "none") != "none"}):
        gq, aq = best("g ", "greedy", quantize), best("a' ", "greedy", quantize)
        if gq and aq:
            lines.append(f"bar g eagle {quantize} >= 1.3x a' {quantize} (greedy):"
                         f" {gq['tokens_per_s'] / aq['tokens_per_s']:.2f}x")
        if gq and lo:
            lines.append(f"bar g eagle {quantize} >= 1.5x l llama.cpp (greedy):"
                         f" {gq['tokens_per_s'] / lo['tokens_per_s']:.2f}x")
    return lines


def floors(rows: list[dict], bandwidth_gbs: float) -> list[str]:
    """How far each a' row's pass is from its memory-bandwidth floor (weight bytes it reads / bandwidth)."""
    lines = []
    for r in rows:
        if r.get("weight_mb"):
            floor_ms = r["weight_mb"] / 1e3 / bandwidth_gbs * 1e3
            r["floor_ms"] = floor_ms
            lines.append(f"{r['name']} ({r['mode']}): {r['ms_per_pass']:.1f} ms per token, reads {r['weight_mb']:.0f} MB"
                         f" of weights -> floor {floor_ms:.1f} ms at {bandwidth_gbs:.1f} GB/s: {r['ms_per_pass'] / floor_ms:.1f}x"
                         " the floor")
    return lines
