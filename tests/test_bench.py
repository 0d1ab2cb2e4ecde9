"""A tiny `make bench` (two prompts, a few tokens, every row) so the bench cannot rot."""

from __future__ import annotations

import json
import math
import statistics

import pytest
import torch

from bench.__main__ import main as bench_main
from bench.systems import interleaved
from model_service import q4_kernel
from speculative.tiny import make_model, make_tokenizer
from tests.model_service.test_eagle import make_head

KEYS = {"name", "mode", "k", "tokens_per_s", "speedup", "acceptance_rate", "mean_accepted", "ideal_speedup",
        "efficiency", "alpha", "draft_ms_per_call", "target_ms_per_call", "overhead_ms_per_round",
        "wire_bytes_per_round", "acceptance_per_position"}


@pytest.mark.slow  # 90 s, the default suite's longest: `make bench` end to end (the n-gram and concurrency rows stay)
def test_tiny_bench_writes_every_row(pair, tmp_path, capsys):
    draft, target = pair
    head = make_head(target, tmp_path / "head")
    bench_main(["--draft-model", str(draft), "--target-model", str(target), "--prompts", "2", "--new-tokens", "12",
                "--ks", "1,3", "--tp", "2", "--tp-k", "3", "--modes", "greedy,sampling", "--threads", "1",
                "--eagle", str(head), "--out", str(tmp_path)])
    results = json.loads((tmp_path / "latest.json").read_text())
    rows = results["rows"]
    assert (tmp_path / "speedup.png").stat().st_size > 1000
    out = capsys.readouterr().out
    assert "best d (greedy)" in out

    names = {r["name"][:2].strip() for r in rows}
    assert names == {"a", "a'", "b", "c", "d", "e", "f", "g"}
    # row g: the EAGLE head at --quant-k and adaptive K, float and int4, each mode; features each round
    eagle = {(r["name"], r["mode"]) for r in rows if r["name"].startswith("g ")}
    assert eagle == {(f"g specdec gRPC, eagle{q}{a}", m) for q in ("", ", int4") for a in ("", ", adaptive K")
                     for m in ("greedy", "sampling")}
    assert all(r["feature_bytes_per_round"] > 0 for r in rows if r["name"].startswith("g ") and r["k"])
    assert "bar eagle acceptance at K = 4 >= 0.5" in out and "bar g eagle >= 2.5x a (greedy)" in out
    assert "(floor) g eagle beats d, the distilled draft (none, greedy" in out
    tp_rows = {(r["mode"], r["tensor_parallel"]): r for r in rows if r["name"].startswith("f ")}
    assert set(tp_rows) == {(m, 2) for m in ("greedy", "sampling")}  # (TP = 1 would be row d on one thread)
    a_rows = [r for r in rows if r["name"].startswith("a ")]
    assert all(len(r["tokens_per_s_runs"]) == 3 and r["speedup"] == 1.0 for r in a_rows)  # start + after each K
    for row in rows:
        assert row["tokens_per_s"] > 0 and math.isfinite(row["speedup"])
        if row["name"][0] in "cdefg":
            assert KEYS <= row.keys(), row["name"]
            assert 0.0 <= row["acceptance_rate"] <= row["alpha"] <= 1.0
            assert row["ideal_speedup"] > 0
            assert (row["wire_bytes_per_round"] > 0) == (row["name"][0] in "defg")  # c makes no calls
            if row.get("adaptive"):  # k: the mean K it chose (0 where drafting never paid); positions: as
                # many as its largest K
                assert row["mean_k"] >= 0 and len(row["acceptance_per_position"]) >= row["k"]
            else:
                assert len(row["acceptance_per_position"]) == row["k"]

    # the int4 rows (--quantize int4 on the target and the draft): a', d and g, each mode
    int4 = {(r["name"], r["mode"]) for r in rows if r.get("quantize") == "int4"}
    assert int4 == {(name, mode) for mode in ("greedy", "sampling") for name in (
        "a' target alone (runner), int4", "d specdec gRPC, int4", "d specdec gRPC, int4, adaptive K",
        "g specdec gRPC, eagle, int4", "g specdec gRPC, eagle, int4, adaptive K")}
    floors = [r for r in rows if "floor_ms" in r]  # each a' row against its memory-bandwidth floor
    assert len(floors) == 4 and all(0 < r["floor_ms"] < r["ms_per_pass"] for r in floors)
    assert all(r["weight_mb"] < f["weight_mb"] / 3 for r in floors if r["quantize"] == "int4"
               for f in floors if f["quantize"] == "none")
    assert "bar a' int4 >= 2x a' float (greedy)" in out and "memory_bandwidth_gbs" in results["meta"]

    greedy = [r for r in rows if r["mode"] == "greedy" and r.get("quantize", "none") == "none"]
    # greedy output is the target's own whatever the row: same token counts everywhere (the int4
    # rows run another model, the int4 one)
    assert len({r["tokens"] for r in greedy}) == 1, [(r["name"], r["k"], r["tokens"]) for r in greedy]
    for k in (1, 3):
        c, d = (next(r for r in greedy if r["name"].startswith(x) and r["k"] == k) for x in ("c", "d"))
        assert c["acceptance_rate"] == d["acceptance_rate"]  # same rounds in one process and over gRPC
        e = next(r for r in greedy if r["name"].startswith("e") and r["k"] == k)
        assert e["acceptance_rate"] == 1.0  # the oracle replays the target's own continuation
    # a sharded target makes the same rounds
    assert tp_rows["greedy", 2]["acceptance_rate"] == next(
        r for r in greedy if r["name"] == "d specdec gRPC" and r["k"] == 3)["acceptance_rate"]
    assert {r["k"] for r in rows if r["mode"] == "sampling" and r["name"] == "d specdec gRPC"} == {1, 3}
    assert {r["mode"] for r in rows if r.get("adaptive")} == {"greedy", "sampling"}


def test_tiny_ceiling_bench(pair, tmp_path, capsys):
    from bench.ceiling import main as ceiling_main

    draft, target = pair
    result = ceiling_main(["--draft-model", str(draft), "--target-model", str(target), "--prompts", "2",
                           "--new-tokens", "8", "--sessions", "1,3", "--ks", "0,2", "--repeats", "2",
                           "--threads", "1", "--draft-threads", "1", "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "ceiling.json").read_text())
    assert saved["ceiling"] == result["ceiling"] and set(saved["ceiling"]) == {"3"}
    rows = saved["rows"]
    assert {(r["sessions"], r["k"]) for r in rows} == {(1, 0), (1, 2), (3, 0), (3, 2)}  # one thread setting
    # every run decoded the same tokens (the bench stops otherwise): max(2, 2 S) requests of <= 8 tokens
    single = {r["tokens"] for r in rows if r["sessions"] == 1}
    assert len(single) == 1 and 0 < single.pop() <= 2 * 8
    for r in rows:
        assert len(r["tokens_per_s_runs"]) == 2 and r["tokens_per_s"] > 0 and r["bound_tokens_per_s"] > 0
        assert r["target_ms_per_token"] > 0 and (r["draft_ms_per_token"] > 0) == (r["k"] > 0)
        if r["sessions"] == 1:
            assert r["mean_verify_batch"] == 1.0
        # every request's first call carries its prompt: some of the run is theirs, never all of it
        assert 0 < r["prompt_share"] < 1 and r["tokens_per_s_no_prompts"] > r["tokens_per_s"]
    assert max(r["mean_verify_batch"] for r in rows if r["sessions"] == 3) > 1.5  # sessions shared passes
    assert saved["ceiling"]["3"]["lockstep_no_prompts"] > 0
    out = capsys.readouterr().out
    assert "3 sessions: lockstep" in out and "prompts:" in out


def test_prompt_seconds_counts_what_prompts_add_to_their_passes():
    from bench.ceiling import prompt_seconds

    # passes of 10, 12 and 11 ms without a prompt (median 11), two with one, of 30 and 9 ms
    passes = [(0.010, 8, False), (0.030, 8, True), (0.012, 7, False), (0.009, 8, True), (0.011, 8, False)]
    assert prompt_seconds(passes) == pytest.approx(0.030 - 0.011)  # a prompt pass no longer than usual adds 0
    assert prompt_seconds([(0.02, 1, True)]) == pytest.approx(0.02)  # no plain pass to compare: all of it
    assert prompt_seconds([(0.02, 1, False)]) == 0.0


def test_tiny_concurrency_bench(pair, tmp_path, capsys):
    from bench.concurrency import main as concurrency_main

    draft, target = pair
    # one stack (the other rows' stacks differ by flags, tested over gRPC in tests/coordinator)
    systems = ["spec", "no spec", "HF sequential"]
    result = concurrency_main(["--draft-model", str(draft), "--target-model", str(target), "--prompts", "2",
                               "--new-tokens", "8", "--levels", "1,3", "--threads", "1",
                               "--systems", ",".join(systems), "--out", str(tmp_path)])
    saved = json.loads((tmp_path / "concurrency.json").read_text())
    rows = saved["rows"]
    figures = [(r["system"], r["concurrency"], r["tokens_per_s"]) for r in rows]
    assert figures == [(r["system"], r["concurrency"], r["tokens_per_s"]) for r in result["rows"]]
    assert (tmp_path / "concurrency.png").stat().st_size > 1000
    # every gRPC system at C = 1, 3 and 1 again (max(2, 2C) requests of 8 tokens), HF once
    assert [(r["system"], r["concurrency"]) for r in rows if r["system"] == "spec"] == [("spec", 1), ("spec", 3),
                                                                                      ("spec", 1)]
    assert {r["system"] for r in rows} == set(systems)
    for r in rows:
        assert r["tokens_per_s"] > 0 and r["tokens"] == r["requests"] * 8, r
        if r["system"] != "HF sequential":
            assert r["vs_single"] > 0 and r["ttft_p50_ms"] > 0
    by = {(r["system"], r["concurrency"]): r for r in rows if not r.get("again")}
    assert by["no spec", 3]["mean_k"] == 0 and by["no spec", 3]["mean_verify_batch"] > 1.0  # streams shared passes
    # greedy: every request decoded its prompt's tokens, in every system at every level
    assert saved["meta"]["greedy_requests_checked"] == sum(r["requests"] for r in rows)
    assert saved["meta"]["greedy_requests_differing"] == []
    out = capsys.readouterr().out
    assert "spec at 8 streams" not in out and "(every system, every level)" in out


def test_a_repeated_concurrency_level_is_its_median_run():
    from bench.concurrency import median_run

    runs = [{"tokens_per_s": t, "itl_p50_ms": 1000 / t} for t in (80.0, 95.0, 70.0)]
    row = median_run("spec", 8, False, runs)
    assert row["tokens_per_s"] == 80.0 and row["itl_p50_ms"] == 12.5  # the whole run's figures, not a mix
    assert row["tokens_per_s_runs"] == [80.0, 95.0, 70.0] and (row["system"], row["concurrency"]) == ("spec", 8)
    assert median_run("spec", 8, False, runs[:2])["tokens_per_s"] == 80.0  # an even count: the lower middle


def test_tiny_ngram_rows(pair, tmp_path, capsys):
    """`--only ngram`: rows a, a', p, n (fixed and adaptive K) for both prompt sets, a' and n again
    on the int4 target (--quantize's default), and the bars."""
    _, target = pair
    bench_main(["--target-model", str(target), "--only", "ngram", "--prompts", "2", "--new-tokens", "8",
                "--ngram-ks", "3", "--modes", "greedy", "--threads", "1", "--out", str(tmp_path)])
    result = json.loads((tmp_path / "ngram.json").read_text())
    rows = result["rows"]
    assert [(r["prompts"], r["name"][:2].strip(), r["quantize"]) for r in rows] == [
        (s, n, "none") for s in "go" for n in ("a", "a'", "p", "n", "n")] + [
        (s, n, "int4") for s in "go" for n in ("a'", "n", "n")]
    floats = [r for r in rows if r["quantize"] == "none"]
    assert len({r["tokens"] for r in floats}) == 1  # greedy: the target's own tokens whatever the row (2 x 8)
    assert all(r["tokens_per_s"] > 0 and math.isfinite(r["speedup"]) for r in rows)
    # the int4 n rows' greedy outputs are the int4 runner's own, every prompt
    own = {name: n for name, n in result["meta"]["greedy_identical_to_a"].items() if "int4" in name}
    assert len(own) == 4 and set(own.values()) == {2}
    out = capsys.readouterr().out
    assert "bar n >= 1.5x p on input-grounded prompts (greedy" in out and "bar n (adaptive K) >= 0.95x a'" in out
    assert "n int4 / a' int4 on g (greedy)" in out and "n int4 / a' int4 on o (greedy)" in out
    # the bar's two rows ran 3 times each (--repeat's default), and read the median of their runs
    repeated = [r for r in rows if "tokens_per_s_runs" in r and not r["name"].startswith("a'")]
    assert sorted(r["name"][0] for r in repeated) == ["n", "p"] and {r["prompts"] for r in repeated} == {"g"}
    for r in repeated:
        assert len(r["tokens_per_s_runs"]) == 3 and r["tokens_per_s"] == statistics.median(r["tokens_per_s_runs"])


def test_tiny_prediction_bench(pair, tmp_path, capsys):
    """`make bench-prediction`: a' and the stack without a prediction, with the prompts' material and
    with a''s own answer, greedy outputs a''s own in every row; the own answer is kept whole."""
    from bench.prediction import EDITS, main as prediction_main, material

    assert all(material(text) == text.split(":\n\n", 1)[1].strip() for text in EDITS)  # the text after the ask
    _, target = pair
    out = tmp_path / "prediction.json"
    prediction_main(["--target-model", str(target), "--drafts", "ngram", "--quantize", "none", "--sets", "g",
                     "--new-tokens", "8", "--threads", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert [r["name"] for r in rows] == ["s ngram", "s ngram + pred", "s ngram + own"]
    assert all(r["identical"] == 8 and r["tokens"] == rows[0]["tokens"] for r in rows)
    plain, pred, own = rows
    assert plain["prediction_tokens"] == 0 and pred["prediction_tokens"] > 0  # the material was offered
    assert own["prediction_tokens"] == own["accepted_prediction_tokens"] > 0
    assert len(result["alone_tokens_per_s_runs"]["g"]) == 2
    assert "| g | s ngram + own |" in capsys.readouterr().out


def test_tiny_prefix_bench(pair, tmp_path, capsys):
    """`make bench-prefix`: a chat's later turns come largely cached with the prefix cache kept, none
    without, and both stacks answer alike."""
    from bench.prefix import main as prefix_main

    draft, target = pair
    out = tmp_path / "prefix.json"
    prefix_main(["--target-model", str(target), "--draft", "model", "--draft-model", str(draft), "--quantize", "none",
                 "--chats", "2", "--turns", "3", "--max-tokens", "8", "--threads", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["meta"]["identical"] == result["meta"]["answers"] == 6
    first, *later = result["rows"]
    assert first["cached_share"] == 0 and all(r["cached_share"] > 0.3 for r in later)
    assert all(t["hit_tokens"] == 0 for t in result["turns"]["off"])
    assert "| 3 |" in capsys.readouterr().out


def test_interleaved_runs_two_systems_turn_about_and_keeps_the_median():
    calls = []
    first, second = {"tokens_per_s": 10.0}, {"tokens_per_s": 50.0}
    speeds = iter([30.0, 20.0, 12.0, 60.0])
    interleaved(first, second, lambda: calls.append("first") or next(speeds),
                lambda: calls.append("second") or next(speeds), 3)
    assert calls == ["first", "second", "first", "second"]
    assert first == {"tokens_per_s": 12.0, "tokens_per_s_runs": [10.0, 30.0, 12.0]}
    assert second == {"tokens_per_s": 50.0, "tokens_per_s_runs": [50.0, 20.0, 60.0]}
    interleaved(first, second, lambda: 1 / 0, lambda: 1 / 0, 1)  # one run: nothing again, nothing changes
    assert first["tokens_per_s"] == 12.0 and len(first["tokens_per_s_runs"]) == 3


def test_tiny_structured_bench(tmp_path, capsys):
    """`make bench-structured`'s rows (u, c at adaptive K and K = 4 over gRPC; t, t0 tool calls over HTTP; m, x
    in one process) and its bars. (The tiny pair with a context of 2,048 tokens: the tools' description takes
    ~400 of its tokens.)"""
    from bench import structured

    tokenizer = make_tokenizer(tmp_path / "tokenizer")
    target = make_model(tmp_path / "target", tokenizer, seed=1, max_context=2048)
    draft = make_model(tmp_path / "draft", tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, seed=2,
                       max_context=2048)
    out = tmp_path / "structured.json"
    structured.main(["--draft", str(draft), "--target", str(target), "--prompts", "2", "--new-tokens", "24",
                     "--tool-tokens", "24", "--threads", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [(r["row"], r["k"]) for r in result["rows"]] == [("u", "adaptive"), ("c", "adaptive"), ("u", 4), ("c", 4),
                                                           ("t", "adaptive"), ("t0", "adaptive"), ("m", 4), ("x", 4)]
    assert all(r["tokens"] > 0 and r["tokens_per_s"] > 0 for r in result["rows"])
    t, t0 = result["rows"][4:6]
    assert t["copied_tokens"] > 0 and t0["copied_tokens"] == 0  # the forced tokens, copied with lookup on only
    assert t["same_calls_as_t0"] and result["bars"]["t_same_calls_as_t0"]  # greedy: the same calls either way
    constrained = [r for r in result["rows"] if r["row"] == "c"]
    assert all(r["mask_ms_per_round"] > 0 for r in constrained)  # scraped from both services' metrics
    assert result["rows"][-1]["same_output_as_m"]  # greedy: masking q changes acceptance, not the output
    assert set(result["bars"]) >= {"all_valid", "c_vs_u_tokens_per_s_k_4", "masked_vs_unmasked_acceptance"}
    assert "mask ms/rnd" in capsys.readouterr().out


@pytest.mark.slow  # ~30 s: services started three times
def test_tiny_eagle_rows_measure_a_prime_again_after_g(pair, tmp_path, capsys):
    """`--only eagle`: rows a, a', g and d (the distilled draft beside it); a' runs again right after
    the g rows, and the g / a' bar reads the mean of its two runs (a slow or fast spell of a shared
    machine moves both sides)."""
    draft, target = pair
    head = make_head(target, tmp_path / "head")
    bench_main(["--draft-model", str(draft), "--target-model", str(target), "--only", "eagle", "--prompts", "2",
                "--new-tokens", "8", "--modes", "greedy", "--quantize", "", "--threads", "1", "--eagle", str(head),
                "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "eagle.json").read_text())["rows"]
    assert sorted(r["name"][:2].strip() for r in rows) == ["a", "a'", "d", "d", "g", "g"]
    alone = next(r for r in rows if r["name"].startswith("a' "))
    assert len(alone["tokens_per_s_runs"]) == 2
    assert alone["tokens_per_s"] == pytest.approx(statistics.mean(alone["tokens_per_s_runs"]))
    g = max((r for r in rows if r["name"].startswith("g ")), key=lambda r: r["tokens_per_s"])
    out = capsys.readouterr().out
    bar = next(line for line in out.splitlines() if line.startswith("bar g eagle >= 1.6x a'"))
    assert f"{g['tokens_per_s'] / alone['tokens_per_s']:.2f}x" in bar and "the mean of its runs" in bar


def test_tiny_passes_bench_times_each_pass_in_turn_and_back_to_back(pair, tmp_path, capsys, monkeypatch):
    """`make bench-passes` on the tiny target: a row per weight format, sessions and tokens, each with its
    in-turn and back-to-back (warm) medians and both against the one-token pass; the one-token rows' own
    ratios are 1, and a back-to-back pass is timed only after a pass of the same tokens (none of another
    runner or token count between them)."""
    from bench import passes, verify_latency

    _, target = pair
    order = []  # (runner, tokens) of every pass, in the order taken
    real = verify_latency.ModelRunner.forward_many

    def spy(runner, feeds, *args, **kwargs):
        order.append((id(runner), feeds[0][1]))
        return real(runner, feeds, *args, **kwargs)

    monkeypatch.setattr(verify_latency.ModelRunner, "forward_many", spy)
    out = tmp_path / "passes.json"
    passes.main(["--target", str(target), "--weights", "float32 onednn,int4 torch", "--tokens", "1,3",
                 "--sessions", "1", "--context", "8", "--reps", "3", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["weights"], r["tokens"]) for r in rows] == [("float32 onednn", 1), ("float32 onednn", 3),
                                                          ("int4 torch", 1), ("int4 torch", 3)]
    for r in rows:
        assert r["ms"] > 0 and r["warm_ms"] > 0 and r["floor_ms"] > 0
        if r["tokens"] == 1:
            assert r["x_one_token"] == r["warm_x_one_token"] == 1.0
        else:
            assert r["warm_x_one_token"] == pytest.approx(r["warm_ms"] / rows[rows.index(r) - 1]["warm_ms"])
    # the back-to-back passes: each runner's in one stretch (3 + 1 reps x 2 token counts x bursts of 3, after
    # its prefills), each token count's in bursts of 3
    runners = list(dict.fromkeys(runner for runner, _ in order))
    tail = order[-2 * (2 + 4 * 2 * 3):]
    first, second = tail[: len(tail) // 2], tail[len(tail) // 2:]
    assert {r for r, _ in first} == {runners[0]} and {r for r, _ in second} == {runners[1]}
    for stretch in (first, second):
        sizes = [n for _, n in stretch[2:]]  # after the two prefills
        assert sizes == [n for n in (1, 3) for _ in range(3)] * 4
    assert "warm x 1" in capsys.readouterr().out


def test_tiny_sampling_bench_times_each_step_beside_what_it_replaced(tmp_path, capsys):
    """`make bench-sampling` on a small vocabulary: per vocabulary and top_p a row for the draw and the
    draft token (one row) and for p at each row count, each with its timings (the kernel's where it is
    built, torch's, the way before); and its 'before' ways
    compute what specdec's do (p to rounding, the cut's tokens; the old draft's token from the support
    draft_token draws from), so that the ratios compare like with like."""
    from bench import sampling
    from speculative.protocol import SamplingParams
    from speculative.sampling import draft_token, logits_to_probs

    out = tmp_path / "sampling.json"
    sampling.main(["--vocab", "700", "--rows", "1,3", "--top-p", "1.0,0.8", "--reps", "3", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [(r["step"], r["rows"], r["top_p"]) for r in rows] == [
        (step, n, top_p) for top_p in (1.0, 0.8) for step, n in (("draw", 1), ("p", 1), ("draft token", 1), ("p", 3))]
    kernel = q4_kernel.available()
    assert all(r["torch_us"] > 0 and r["before_us"] > 0 and (r["kernel_us"] > 0 if kernel else r["kernel_us"] is None)
               for r in rows)
    assert "torch / kernel" in capsys.readouterr().out
    logits = sampling.chat_like_rows(4, 700, seed=3)
    g = torch.Generator().manual_seed(0)
    for top_p in (1.0, 0.8, 0.3):
        params = SamplingParams(sampling.TEMPERATURE, top_p=top_p)
        now, before = logits_to_probs(logits, params), sampling.probs_by_sorting(logits, params)
        assert torch.equal(now > 0, before > 0) and torch.allclose(now, before, atol=1e-6)
        _, ids, _ = draft_token(logits[0], params, 0.0, sampling.SUPPORT, g)
        assert all(sampling.draft_as_it_was(logits[0], params, g) in ids.tolist() for _ in range(20))


def test_tiny_long_prompts_bench(pair, tmp_path, capsys):
    """`make bench-long-prompts`: an arm per --prefill-chunk, each long prompt's TTFT and the streams' waits
    across it measured."""
    from bench.long_prompts import main as long_prompts_main

    draft, target = pair
    out = tmp_path / "long_prompts.json"
    long_prompts_main(["--target-model", str(target), "--draft", "model", "--draft-model", str(draft), "--quantize",
                       "none", "--streams", "2", "--prompts", "2", "--prompt-tokens", "300", "--stream-tokens", "200",
                       "--chunks", "16,0", "--threads", "1", "--out", str(out)])
    result = json.loads(out.read_text())
    assert [r["prefill_chunk"] for r in result["rows"]] == [16, 0]
    for arm in result["arms"].values():
        assert len(arm["windows"]) == 2
        assert all(w["prompt_tokens"] > 300 and w["ttft_ms"] > 0 and len(w["stall_ms"]) == 2 for w in arm["windows"])
    assert "| 16 |" in capsys.readouterr().out
