"""Engines in one process: KV-cache rollback, sessions, and what they refuse."""

from __future__ import annotations

import pytest
import torch

from model_service.engines import DraftEngine, TargetEngine
from speculative.errors import ROOM_LATER, CapacityExceeded, InvalidRequest, SessionExists, SessionNotFound
from model_service.model_runner import PREFILL_TOKENS, ModelRunner
from model_service.sessions import MAX_SESSION_ID
from speculative.protocol import PassCost, Proposal, ProposeCall, VerifyCall
from speculative.sampling import encode_supports
from speculative.protocol import SamplingParams

GREEDY = SamplingParams(0.0)


@pytest.fixture(scope="module")
def runners(pair):
    draft, target = pair
    return ModelRunner(draft), ModelRunner(target)


def fresh_logits(runner: ModelRunner, tokens: list[int]) -> torch.Tensor:
    """Next-token logits after a fresh prefill of `tokens` (no cache reuse)."""
    with torch.inference_mode():
        return runner.model(input_ids=torch.tensor([tokens], device=runner.device)).logits[0, -1].float().cpu()


def session_logits(runner: ModelRunner, session_id: str) -> torch.Tensor:
    session = runner.sessions.get(session_id)
    return runner.forward(session)[-1]


def one_hot_proposal(tokens: list[int]) -> Proposal:
    sizes, ids, probs = encode_supports([torch.tensor([t]) for t in tokens], [torch.ones(1) for _ in tokens])
    return Proposal(tokens, sizes, ids, probs)


def test_target_rollback_matches_fresh_prefill(runners):
    _, runner = runners
    target = TargetEngine(runner)
    prompt = [5, 17, 42, 9, 100]
    target.verify(VerifyCall("rb", True, prompt, Proposal(), GREEDY))
    rejected = 0
    for round_ in range(6):
        # propose tokens the greedy target will mostly reject
        proposal = one_hot_proposal([(7 * round_ + i) % 300 for i in range(4)])
        verdict, _ = target.verify(VerifyCall("rb", False, [], proposal, GREEDY))
        rejected += 4 - verdict.accepted
    assert rejected > 0
    session = runner.sessions.get("rb")
    assert session.cached == len(session.tokens) - 1  # the sampled token waits outside the cache
    assert session.cache.get_seq_length() == session.cached
    tokens = list(session.tokens)
    assert torch.allclose(session_logits(runner, "rb"), fresh_logits(runner, tokens), atol=1e-4)
    runner.sessions.release("rb")


def test_a_verify_reports_the_tokens_its_pass_fed(runners):
    """A pass's cost counts what it fed, a prompt included, not only the rows it scored: adaptive K
    prices passes by their tokens, and a prefill counted as one token read as a pass several times
    slower than calibrated (the target's scale, which every round's price reads)."""
    _, runner = runners
    target = TargetEngine(runner)
    prompt = list(range(3, 40))
    (_, first), (_, other) = target.verify_many([VerifyCall("fed-a", True, prompt, Proposal(), GREEDY),
                                                 VerifyCall("fed-b", True, prompt[:5], Proposal(), GREEDY)])
    assert first is other and (first.batch_size, first.batch_tokens) == (2, len(prompt) + 5)
    _, cost = target.verify(VerifyCall("fed-a", False, [], one_hot_proposal([7, 8, 9]), GREEDY))
    assert cost.batch_tokens == 4  # the last sampled token and 3 draft tokens: the rows it scores
    for session_id in ("fed-a", "fed-b"):
        runner.sessions.release(session_id)


def test_draft_rollback_matches_fresh_prefill(runners):
    runner, _ = runners
    draft = DraftEngine(runner)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    proposal, _ = draft.propose(ProposeCall("d", True, 0, prompt, 5, SamplingParams(1.0, seed=3)))
    assert len(proposal.tokens) == 5
    # keep two proposals, reject three, append a correction
    proposal2, _ = draft.propose(ProposeCall("d", False, 3, [77], 4, SamplingParams(1.0, seed=3)))
    session = runner.sessions.get("d")
    expected = prompt + proposal.tokens[:2] + [77] + proposal2.tokens
    assert session.tokens == expected
    draft.propose(ProposeCall("d", False, 4, [11], 0, GREEDY))  # roll back everything proposed, append, no proposal
    tokens = prompt + proposal.tokens[:2] + [77, 11]
    assert session.tokens == tokens
    assert torch.allclose(session_logits(runner, "d"), fresh_logits(runner, tokens), atol=1e-4)
    runner.sessions.release("d")


def test_sessions_cap_and_idle_eviction(pair):
    _, target_dir = pair
    runner = ModelRunner(target_dir, max_sessions=2, idle_timeout=60.0)
    target = TargetEngine(runner)
    target.verify(VerifyCall("a", True, [1, 2], Proposal(), GREEDY))
    target.verify(VerifyCall("b", True, [1, 2], Proposal(), GREEDY))
    with pytest.raises(CapacityExceeded):
        target.verify(VerifyCall("c", True, [1, 2], Proposal(), GREEDY))
    with pytest.raises(SessionExists):
        target.verify(VerifyCall("a", True, [1, 2], Proposal(), GREEDY))
    runner.sessions.get("a").last_used -= 120  # abandoned two minutes ago
    target.verify(VerifyCall("c", True, [1, 2], Proposal(), GREEDY))  # evicts "a"
    with pytest.raises(SessionNotFound):
        target.verify(VerifyCall("a", False, [], Proposal(), GREEDY))
    assert len(runner.sessions) == 2


def test_engines_refuse_bad_input_and_leave_no_trace(runners):
    draft_runner, runner = runners
    target, draft = TargetEngine(runner), DraftEngine(draft_runner)
    target.verify(VerifyCall("ok", True, [1, 2, 3], Proposal(), GREEDY))
    before = list(runner.sessions.get("ok").tokens)
    good = one_hot_proposal([4, 5])
    cases = [
        (InvalidRequest, dict(start=True, append=[])),                                       # empty prompt
        (SessionNotFound, dict(session_id="nope")),
        (InvalidRequest, dict(session_id="")),                                               # names no session
        (InvalidRequest, dict(session_id="", start=True, append=[1, 2])),
        (InvalidRequest, dict(session_id="s" * (MAX_SESSION_ID + 1), start=True, append=[1, 2])),
        (InvalidRequest, dict(append=[runner.logits_size])),                                 # id out of vocab
        (InvalidRequest, dict(proposal=one_hot_proposal([-1]))),                             # draft id out of vocab
        (InvalidRequest, dict(proposal=Proposal([4, 5], [1], good.support_ids[:4], good.support_probs[:4]))),
        (InvalidRequest, dict(proposal=Proposal([4, 6], good.support_sizes, good.support_ids, good.support_probs))),
        (InvalidRequest, dict(params=SamplingParams(float("nan")))),
        (InvalidRequest, dict(params=SamplingParams(-1.0))),
        (InvalidRequest, dict(params=SamplingParams(1.0, top_p=0.0))),
        (InvalidRequest, dict(params=SamplingParams(1.0, top_p=1.5))),
        (InvalidRequest, dict(params=SamplingParams(1.0, top_k=-1))),
        (InvalidRequest, dict(append=[1] * (runner.max_context + 1))),                      # beyond the context
    ]
    for error, change in cases:
        call = dict(session_id="ok", start=False, append=[], proposal=good, params=GREEDY) | change
        with pytest.raises(error):
            target.verify(VerifyCall(**call))
        assert runner.sessions.get("ok").tokens == before, change
    with pytest.raises(InvalidRequest):
        draft.propose(ProposeCall("x", True, 0, [1], 17, GREEDY))  # K beyond the limit
    with pytest.raises(InvalidRequest, match="empty"):
        draft.propose(ProposeCall("", True, 0, [1], 2, GREEDY))
    with pytest.raises(InvalidRequest):
        draft.propose(ProposeCall("x", True, 1, [1], 2, GREEDY))  # rollback on a new session
    draft.propose(ProposeCall("x", True, 0, [1, 2], 2, GREEDY))
    with pytest.raises(InvalidRequest):
        draft.propose(ProposeCall("x", False, 3, [], 2, GREEDY))  # more than was proposed


@pytest.mark.parametrize("arch", ["qwen2", "qwen3", "mistral", "mistral+window", "phi3", "granite", "smollm3"])
def test_other_model_families_decode_exactly(tmp_path, arch):
    """(mistral+window: a sliding window of 8 keys, shorter than prompt and answer)"""
    import asyncio
    import json

    from model_service.local import LocalDraft, LocalTarget
    from speculative.round import generate
    from speculative.tiny import make_pair

    arch, _, window = arch.partition("+")
    draft_dir, target_dir = make_pair(tmp_path, arch=arch)
    if window:
        for path in (draft_dir / "config.json", target_dir / "config.json"):
            path.write_text(json.dumps({**json.loads(path.read_text()), "sliding_window": 8}))
    draft, target = ModelRunner(draft_dir), ModelRunner(target_dir)
    assert target.forward_kind.startswith("fast") and target.fast.window == (8 if window else None)
    prompt = target.tokenizer("def f(x): return")["input_ids"]
    with torch.inference_mode():
        expected = target.model.generate(torch.tensor([prompt], device=target.device), max_new_tokens=24,
                                         do_sample=False)[0, len(prompt):]

    async def run() -> list[int]:
        out = []
        async for new in generate(LocalDraft(DraftEngine(draft)), LocalTarget(TargetEngine(target)), prompt,
                                  max_new_tokens=24, k=3, params=GREEDY, eos_token_ids=set(target.eos_token_ids),
                                  max_context=target.max_context):
            out += new
        return out

    assert asyncio.run(run()) == expected.tolist()
    assert len(target.sessions) == 0 and len(draft.sessions) == 0  # released at the end


def test_an_output_layer_wider_than_the_vocabulary_emits_only_its_ids(tmp_path):
    """A target whose output layer is padded past its tokenizer (as Qwen2.5 7B's against its 0.5B)
    scores only the ids the tokenizer can produce: greedy output is its argmax over those, sampled
    output stays among them, and a draft whose layer is not padded serves it (it never holds an
    id it cannot embed). Random weights make the padded ids win often."""
    import asyncio

    from model_service.local import LocalDraft, LocalTarget
    from speculative.round import Stats, generate
    from speculative.tiny import make_model, make_tokenizer

    tokenizer = make_tokenizer(tmp_path / "tok", "chars")
    vocab = len(tokenizer)
    target_dir = make_model(tmp_path / "t", tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, init_std=0.3,
                            seed=1, vocab_size=vocab + 20)
    draft_dir = make_model(tmp_path / "d", tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, init_std=0.3, seed=2)
    target, draft = ModelRunner(target_dir), ModelRunner(draft_dir)
    assert (target.logits_size, target.vocab_size, draft.logits_size) == (vocab + 20, vocab, vocab)
    prompt, n = [2, 3, 4], 40
    expected, ids = [], list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = target.model(input_ids=torch.tensor([ids], device=target.device)).logits[0, -1]
            expected.append(int(logits[:vocab].argmax()))
            ids.append(expected[-1])
        # unmasked, the padded ids would have been chosen
        assert any(int(target.model(input_ids=torch.tensor([prompt + expected[:i]], device=target.device))
                       .logits[0, -1].argmax()) >= vocab for i in range(n))

    def run(drafter: ModelRunner, params: SamplingParams, stats: Stats) -> list[int]:
        async def go() -> list[int]:
            out = []
            async for new in generate(LocalDraft(DraftEngine(drafter)), LocalTarget(TargetEngine(target)), prompt,
                                      max_new_tokens=n, k=4, params=params, max_context=target.max_context,
                                      stats=stats):
                out += new
            return out
        return asyncio.run(go())

    assert run(draft, GREEDY, Stats()) == expected
    itself = Stats()
    assert run(ModelRunner(target_dir), GREEDY, itself) == expected
    assert itself.accepted_tokens == itself.draft_tokens  # drafting for itself, it agrees with itself
    for seed in range(5):
        assert all(t < vocab for t in run(draft, SamplingParams(1.0, seed=seed), Stats()))


def test_generation_closed_early_releases_both_sessions(runners):
    import asyncio

    from model_service.local import LocalDraft, LocalTarget
    from speculative.round import generate

    draft, target = runners
    before = len(target.sessions), len(draft.sessions)

    async def first_round_then_close() -> int:
        rounds = generate(LocalDraft(DraftEngine(draft)), LocalTarget(TargetEngine(target)), [1, 2, 3],
                          max_new_tokens=200, k=3, params=SamplingParams(1.0, seed=1), max_context=512)
        await rounds.__anext__()
        held = len(target.sessions), len(draft.sessions)
        await rounds.aclose()
        return held

    assert asyncio.run(first_round_then_close()) == (before[0] + 1, before[1] + 1)
    assert (len(target.sessions), len(draft.sessions)) == before


def test_oracle_draft_replays_the_reference(runners):
    import asyncio

    from model_service.oracle import OracleDraftEngine
    from model_service.local import LocalDraft, LocalTarget
    from speculative.round import Stats, generate

    draft_runner, target = runners
    prompt = [4, 8, 15, 16, 23, 42]
    with torch.inference_mode():
        reference = target.model.generate(torch.tensor([prompt], device=target.device), max_new_tokens=30,
                                          do_sample=False)[0].tolist()
    oracle = OracleDraftEngine(draft_runner, [[1, 2, 3], reference])
    stats = Stats()

    async def run() -> list[int]:
        out = []
        async for new in generate(LocalDraft(oracle), LocalTarget(TargetEngine(target)), prompt, max_new_tokens=30,
                                  k=4, params=GREEDY, max_context=512, stats=stats):
            out += new
        return out

    assert asyncio.run(run()) == reference[len(prompt):]
    assert stats.acceptance_rate == 1.0 and stats.rounds == 6  # 30 tokens, 5 per round


@pytest.mark.parametrize("run_model", [False, True], ids=["free", "at the model's cost"])
def test_a_corrupting_oracle_sets_the_acceptance_and_keeps_the_output(runners, run_model):
    """--oracle-acceptance 0.7: each proposed token is accepted with probability ~0.7 given the ones
    before it, and the output is still the target's (greedy); --oracle-cost model runs the
    draft's passes too (its forwards counted), and its cache stays consistent with the replay."""
    import asyncio

    from model_service.local import LocalDraft, LocalTarget
    from model_service.oracle import OracleDraftEngine
    from speculative.round import Stats, generate

    draft_runner, target = runners
    prompts = [[4, 8, 15, 16, 23, 42], [7, 7, 1, 2], [3, 1, 4, 1, 5]]
    with torch.inference_mode():
        references = [target.model.generate(torch.tensor([p], device=target.device), max_new_tokens=120,
                                            do_sample=False)[0].tolist() for p in prompts]
    oracle = OracleDraftEngine(draft_runner, references, acceptance=0.7, run_model=run_model, seed=3)
    forwards, runs = [], []
    draft_runner.on_forward = lambda: forwards.append(1)

    async def run(prompt, n) -> list[int]:  # (n: up to the reference's end, an EOS where generate stopped)
        out, stats = [], Stats()
        async for new in generate(LocalDraft(oracle), LocalTarget(TargetEngine(target)), prompt, max_new_tokens=n,
                                  k=4, params=GREEDY, max_context=512, stats=stats):
            out += new
        runs.append(stats)
        return out

    try:
        for prompt, reference in zip(prompts, references):
            assert asyncio.run(run(prompt, len(reference) - len(prompt))) == reference[len(prompt):]
    finally:
        draft_runner.on_forward = None
    # per-token acceptance a, K = 4: E[accepted] / K = (a + a^2 + a^3 + a^4) / 4 = 0.4375 at a = 0.7;
    # over ~100 rounds a standard error of ~0.04 (the last rounds of a short reference propose less)
    rounds = sum(s.rounds for s in runs)
    rate = sum(s.acceptance_rate * s.rounds for s in runs) / rounds
    assert rounds > 60 and 0.3 < rate < 0.58, (rounds, rate)
    assert (len(forwards) >= 2 * rounds) == run_model  # the model's steps each round (or none)


def test_kv_token_cap_refuses_growth_and_leaves_sessions_alone(pair):
    target = TargetEngine(ModelRunner(pair[1]))
    target.runner.max_kv_tokens = 50
    target.verify(VerifyCall("a", True, list(range(1, 31)), Proposal(), GREEDY))  # 30 tokens, then the sampled one
    with pytest.raises(CapacityExceeded, match="--max-kv-tokens"):
        target.verify(VerifyCall("b", True, list(range(1, 31)), Proposal(), GREEDY))
    assert "b" not in target.runner.sessions
    held = list(target.runner.sessions.get("a").tokens)
    with pytest.raises(CapacityExceeded):
        target.verify(VerifyCall("a", False, list(range(1, 21)), Proposal(), GREEDY))
    assert target.runner.sessions.get("a").tokens == held
    target.verify(VerifyCall("a", False, [], one_hot_proposal([5, 6]), GREEDY))  # growth within the cap is fine


def test_kv_token_cap_counts_the_sampled_token_of_a_call_that_appends_and_verifies_nothing(pair):
    """A call with nothing to append or verify still feeds the token sampled last call and samples
    another (K = 0 rounds, most of a request's under adaptive K on CPU): past the cap it is refused."""
    target = TargetEngine(ModelRunner(pair[1]))
    target.runner.max_kv_tokens = 14
    target.verify(VerifyCall("a", True, list(range(1, 11)), Proposal(), GREEDY))  # 10, and the one sampled
    grown = 0
    with pytest.raises(CapacityExceeded, match="--max-kv-tokens"):
        for _ in range(10):
            target.verify(VerifyCall("a", False, [], Proposal(), GREEDY))
            grown += 1
    assert grown == 3 and len(target.runner.sessions.get("a").tokens) == 14
    with pytest.raises(CapacityExceeded, match="--max-kv-tokens"):  # decode steps' first token too
        target.verify(VerifyCall("a", False, [], Proposal(), GREEDY, steps=8))
    assert len(target.runner.sessions.get("a").tokens) == 14
    decoded = TargetEngine(ModelRunner(pair[1]))  # and decode steps stop at the cap
    decoded.runner.max_kv_tokens = 14
    decoded.verify(VerifyCall("a", True, list(range(1, 11)), Proposal(), GREEDY))
    verdict, _ = decoded.verify(VerifyCall("a", False, [], Proposal(), GREEDY, steps=8))
    assert 1 + len(verdict.decoded) == 3 and len(decoded.runner.sessions.get("a").tokens) == 14
    with pytest.raises(CapacityExceeded, match="for all sessions together") as alone:  # no room will come for it
        target.verify(VerifyCall("b", True, list(range(1, 15)), Proposal(), GREEDY))
    assert ROOM_LATER not in str(alone.value)
    target.runner.sessions.release("a")
    assert target.verify(VerifyCall("b", True, list(range(1, 14)), Proposal(), GREEDY))[0].token >= 0
    with pytest.raises(CapacityExceeded) as later:
        target.verify(VerifyCall("c", True, [1, 2], Proposal(), GREEDY))
    assert ROOM_LATER in str(later.value)  # (it fits alone: room comes as "b" ends)


def test_kv_token_cap_counts_what_calls_sharing_a_pass_will_add(pair):
    """Calls admitted to one pass grow their sessions only in it (the draft's K tokens, the
    target's sampled token): the cap must count that growth for the calls after them, as it
    would had they come one by one."""

    draft = DraftEngine(ModelRunner(pair[0]))
    draft.runner.max_kv_tokens = 20
    calls = [ProposeCall(s, True, 0, [5, 6, 7, 8, 9], 8, GREEDY) for s in ("a", "b")]
    first, second = draft.propose_many(calls)
    assert not isinstance(first, Exception) and len(first[0].tokens) == 8
    assert isinstance(second, CapacityExceeded) and "b" not in draft.runner.sessions
    assert sum(len(s.tokens) for s in draft.runner.sessions._sessions.values()) <= 20
    target = TargetEngine(ModelRunner(pair[1]))
    target.runner.max_kv_tokens = 21
    calls = [VerifyCall(s, True, list(range(1, 11)), Proposal(), GREEDY) for s in ("a", "b")]
    first, second = target.verify_many(calls)  # 10 tokens each, then each one sampled: 22 in all
    assert not isinstance(first, Exception) and isinstance(second, CapacityExceeded)
    assert sum(len(s.tokens) for s in target.runner.sessions._sessions.values()) == 11


def test_a_lone_session_gets_every_thread_only_while_no_other_is_at_work(pair, monkeypatch):
    """--threads for a pass over the one session at work, or one feeding a prompt (PREFILL_TOKENS
    or more); --batched-threads for a batch of verifications, and for a single session's pass
    while other sessions were used within the last BUSY_WINDOW seconds (their drafts keep the
    other cores busy)."""
    _, target_dir = pair
    runner = ModelRunner(target_dir)
    runner.threads, runner.batched_threads = 2, 1
    target = TargetEngine(runner)
    seen = []
    monkeypatch.setattr(torch, "set_num_threads", seen.append)
    monkeypatch.setattr(torch, "get_num_threads", lambda: seen[-1] if seen else 0)
    target.verify(VerifyCall("a", True, [1, 2], Proposal(), GREEDY))
    assert seen[-1] == 2  # alone
    target.verify(VerifyCall("b", True, [3, 4], Proposal(), GREEDY))
    assert seen[-1] == 1  # "a" was used a moment ago
    target.verify(VerifyCall("a", False, [], Proposal(), GREEDY))
    assert seen[-1] == 1
    runner.sessions.get("b").last_used -= 2.0  # "b" idle since
    target.verify(VerifyCall("a", False, [], Proposal(), GREEDY))
    assert seen[-1] == 2
    assert runner.sessions.recently_used(1.0) == 1 and runner.sessions.recently_used(5.0) == 2
    target.verify(VerifyCall("b", False, [], Proposal(), GREEDY))
    assert seen[-1] == 1 and runner.at_work == 2
    target.verify(VerifyCall("c", True, list(range(1, 1 + PREFILL_TOKENS)), Proposal(), GREEDY))
    assert seen[-1] == 2  # a prompt's pass: every thread, others at work or not


def test_every_bit_of_a_seed_moves_the_session_generator(runners):
    """torch's CPU generator keeps 32 bits of its seed: seeds differing above them (or only in the
    top bit of 64) must still draw differently, and one seed must draw the same each time."""
    _, target = runners

    def draws(seed: int) -> list[float]:
        session = target.start_session("seeded", seed)
        try:
            return torch.rand(4, generator=session.generator, device=session.generator.device).tolist()
        finally:
            target.sessions.release("seeded")

    seeds = [5, 5 + 2**32, 5 + 2**63, 2**64 - 1, 0]
    assert len({tuple(draws(s)) for s in seeds}) == len(seeds)
    assert draws(5 + 2**32) == draws(5 + 2**32)


def test_calibrate_fits_the_pass_and_reports_it(runners):
    """calibrate() fits fixed + per token + per session + the jump past one row by least squares
    on timed passes; the fit reproduces those timings' order (more tokens cost more) and the
    service reports every term (adaptive K prices rounds with them)."""
    _, target = runners
    cost = target.calibrate(context=16, reps=1)
    assert min(cost.fixed, cost.per_token, cost.per_session, cost.multi_row) >= 0.0
    assert cost(9, 1) >= cost(2, 1) >= cost(1, 1) > 0.0
    info = target.info()
    assert [info[f"pass_ms_{name}"] for name in ("fixed", "per_token", "per_session", "multi_row", "free_rows")] == [
        cost.fixed, cost.per_token, cost.per_session, cost.multi_row, cost.free_rows]


def test_a_context_shorter_than_the_calibrations_calibrates_on_what_fits(pair):
    """--max-context below calibrate's 64 cached tokens + 8 new ones (a draft's context cut short)
    once failed the service's start (a scratch session past the context); it times passes on as
    many cached tokens as fit, and a context that fits no shape times nothing."""
    _, target_dir = pair
    cost = ModelRunner(target_dir, max_context=24).calibrate(reps=1)
    assert cost(2, 1) >= cost(1, 1) > 0.0
    assert ModelRunner(target_dir, max_context=8).calibrate(reps=1) == PassCost()


@pytest.mark.parametrize("truth", [PassCost(fixed=34.0, per_token=1.3, per_session=0.1, multi_row=2.0, free_rows=8),
                                   PassCost(fixed=8.0, per_token=0.2, per_session=0.4),
                                   PassCost(fixed=7.0, per_token=1.4, free_rows=4)])
def test_the_fit_finds_the_rows_a_pass_carries_free(truth):
    """A pass that streams its weights once carries a few rows at its fixed cost (SmolLM2 float32,
    one session: 5 tokens cost what 1 does; 16 sessions of 8 ~1.3 ms a token more): the fit tries
    each FREE_ROWS and keeps the best, so timings made by such a cost give it back, and a linear
    one stays linear."""
    from model_service.model_runner import fit_pass_cost

    shapes = [(1, 1), (1, 2), (1, 4), (1, 8), (4, 1), (4, 5), (8, 1), (8, 5), (16, 1), (16, 3), (16, 8)]
    fit = fit_pass_cost(shapes, [truth(s * t, s) for s, t in shapes])
    for name in ("fixed", "per_token", "per_session", "multi_row", "free_rows"):
        assert getattr(fit, name) == pytest.approx(getattr(truth, name), abs=1e-6), name


def test_a_spell_of_contention_does_not_skew_the_calibration(runners, monkeypatch):
    """Services started together calibrate on shared cores: here 16 timed passes in a row run 30x
    slower (another process's spell, longer than a rep of the 11 shapes), and the fit still gives
    back the pass cost the clock was made from, since every shape is timed once a rep, interleaved,
    and keeps its fastest. (Timed shape by shape, the median of 3, fixed came out at 13.9 ms, not 8;
    a median of the interleaved reps would take the spell's time for the shapes it caught twice.)"""
    from types import SimpleNamespace

    from model_service import model_runner

    _, target = runners
    truth = PassCost(fixed=8.0, per_token=0.5, per_session=0.3, free_rows=4)
    clock = SimpleNamespace(now=0.0, passes=0)
    forward_many = ModelRunner.forward_many

    def contended(self, feeds):
        clock.passes += 1
        slow = 30.0 if 20 <= clock.passes < 36 else 1.0  # after the 12 warm-up passes, timed ones 8..23
        clock.now += slow * truth(sum(n for _, n in feeds), len(feeds)) / 1e3
        return forward_many(self, feeds)

    monkeypatch.setattr(ModelRunner, "forward_many", contended)
    monkeypatch.setattr(model_runner, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    cost = target.calibrate(context=16, reps=3)
    assert clock.passes == 1 + 11 * 4  # a pass of all scratch sessions, then the warm-up and 3 timed reps
    for name in ("fixed", "per_token", "per_session", "free_rows"):
        assert getattr(cost, name) == pytest.approx(getattr(truth, name), abs=1e-6), name


def test_calibrate_times_no_shape_cold(runners, monkeypatch):
    """A first call compiles (TorchScript's layer loop, oneDNN's primitive for a shape) and, timed,
    skewed the fit (SmolLM2: fixed 35 ms and no jump past one row, against 23 and 7.6 warm): here
    each shape's first pass takes 50 ms more, and the fit does not see it. The time is calibrate's
    clock's, made up (a pass 1 ms, a first one 51), not the machine's: a load cannot move it."""
    from types import SimpleNamespace

    from model_service import model_runner

    _, target = runners
    seen = set()
    clock = SimpleNamespace(now=0.0)
    forward_many = ModelRunner.forward_many

    def compiling_first(self, feeds):
        shape = (len(feeds), feeds[0][1])
        clock.now += 0.001
        if shape not in seen:  # a first call that compiles
            seen.add(shape)
            clock.now += 0.05
        return forward_many(self, feeds)

    monkeypatch.setattr(ModelRunner, "forward_many", compiling_first)
    monkeypatch.setattr(model_runner, "time", SimpleNamespace(perf_counter=lambda: clock.now))
    cost = target.calibrate(context=16, reps=1)
    assert len(seen) >= 8
    # every pass timed took 1 ms: the fit is a fixed 1 ms (a first pass timed would add 50 to its shape)
    assert cost(1, 1) == pytest.approx(1.0) and cost(8, 1) == pytest.approx(1.0) and cost(16, 8) == pytest.approx(1.0)
