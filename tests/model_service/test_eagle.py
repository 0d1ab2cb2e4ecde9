"""The eagle drafting method (model_service/eagle.py) in the speculative round, in one process: the
target's features reach the head at the right positions, greedy output is the target's and
sampled output follows the target's distribution, whatever the head; bad features are refused."""

from __future__ import annotations

import asyncio
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from model_service import features as wire
from model_service import q4_kernel
from model_service.eagle import CHAIN_MAX, EagleDraft
from model_service.eagle_head import Eagle3Config, Eagle3Head
from model_service.engines import TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.metrics import ModelMetrics
from model_service.model_runner import ModelRunner
from speculative.errors import CapacityExceeded, InvalidRequest
from speculative.protocol import Features, Proposal, ProposeCall, SamplingParams, VerifyCall
from speculative.round import FixedK, Stats, generate
from speculative.sampling import logits_to_probs
from speculative.tiny import make_model, make_tokenizer
from tests.stats import chi2_stat, fits

GREEDY = SamplingParams(0.0)
LAYERS = (1, 0, 1)  # any order, repeats allowed: the head concatenates what it is given


def make_head(target_dir: Path, out: Path, seed: int = 0, std: float = 0.2, draft_vocab: int | None = None) -> Path:
    """A random EAGLE-3 head for `target_dir`'s model, saved in the speculators layout."""
    config = AutoModelForCausalLM.from_pretrained(target_dir).config
    vocab = config.vocab_size
    torch.manual_seed(seed)
    head = Eagle3Head(Eagle3Config(hidden_size=config.hidden_size, intermediate_size=96, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, vocab_size=vocab,
                                   draft_vocab_size=draft_vocab or vocab, aux_layer_ids=list(LAYERS)))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, std)
    head.set_vocab(torch.randperm(vocab)[: draft_vocab or vocab].sort().values)
    head.embeddings_from_target = True  # saved without them: they load from the target's directory
    head.save(out)
    return out


def run(draft, target, prompt, n, k, params, predraft=False, stats=None, p_min=0.0) -> list[int]:
    stats = stats if stats is not None else Stats()

    async def go():
        out = []
        async for new in generate(LocalDraft(draft), LocalTarget(target), prompt, max_new_tokens=n, k=k,
                                  params=params, max_context=256, stats=stats, predraft=predraft, p_min=p_min,
                                  feature_layers=draft.layers, eos_token_ids=set(target.runner.eos_token_ids)):
            out += new
        return out

    return asyncio.run(go())


@pytest.fixture(scope="module")
def eagle(pair, tmp_path_factory):
    _, target_dir = pair
    # the head alone (no prompt lookup): the tests that use it check what the head drafts
    return EagleDraft.load(make_head(target_dir, tmp_path_factory.mktemp("head")), target_dir, "cpu", lookup=range(0))


@pytest.mark.parametrize("vocab,quantize", [("bpe", "none"), ("chars", "none"), ("chars", "int8"), ("chars", "int4")])
def test_greedy_output_is_the_targets_with_and_without_predrafting(pair, small_vocab_pair, tmp_path, vocab,
                                                                   quantize):
    """On the 12-token vocabulary a random head's tokens are often accepted, on the BPE one seldom:
    both paths of every round (kept, rolled back) run; the head's linears in int8 and int4 too."""
    if quantize == "int4" and not q4_kernel.available():
        pytest.skip("specdec's int4 kernel is not built here")
    _, target_dir = pair if vocab == "bpe" else small_vocab_pair
    eagle = EagleDraft.load(make_head(target_dir, tmp_path / "head", std=0.5), target_dir, "cpu", quantize=quantize)
    assert (eagle.head._q4_step is not None) == (quantize == "int4")  # int4: the fused step (q4_eagle_step)
    target = TargetEngine(ModelRunner(target_dir))
    prompt = [5, 1, 4, 9, 10, 7]
    with torch.inference_mode():
        expected = target.runner.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)
    expected = expected[0, len(prompt):].tolist()
    # p_min: pre-drafts cut short, so that a hit's next call appends nothing and brings rows for
    # tokens the head proposed itself
    for predraft, p_min in ((False, 0.0), (True, 0.0), (True, 0.1)):
        stats = Stats()
        assert run(eagle, target, prompt, 40, 4, GREEDY, predraft, stats, p_min) == expected
        assert stats.draft_tokens > (len(expected) if p_min == 0 else 0)
        assert vocab == "bpe" or stats.accepted_tokens > 0
    assert vocab == "bpe" or eagle.copied > 0  # the lookup proposed too (40 tokens of 12 ids repeat)
    assert len(target.runner.sessions) == 0 and len(eagle.sessions) == 0


def test_the_head_drafts_from_the_targets_hidden_states_at_the_right_positions(pair, eagle):
    """Each round's first draft token is what the head gives when fed, offline, the target's own
    hidden states (transformers' output_hidden_states) for every committed position but the last,
    row p with token p + 1: an off-by-one anywhere on the way changes it."""
    _, target_dir = pair
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    target = TargetEngine(ModelRunner(target_dir))
    draft, head = LocalDraft(eagle), eagle.head
    prompt = [5, 17, 42, 9, 100, 7, 61]

    def expected_first(tokens: list[int]) -> int:
        with torch.inference_mode():
            states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
            feats = torch.cat([states[i][0, :-1] for i in LAYERS], dim=-1)  # positions 0 .. n-2
            n = len(tokens)
            _, logits = head.step(torch.tensor(tokens[1:]), head.fuse(feats), torch.arange(n - 1), head.new_cache())
            return int(head.draft_to_target(logits[-1].argmax()))

    async def go():
        verdict, _ = await LocalTarget(target).verify(VerifyCall("s", True, prompt, Proposal(), GREEDY, 1, LAYERS))
        tokens = prompt + [verdict.token]
        f = verdict.features
        assert (f.start, f.rows, f.width) == (0, len(prompt), len(LAYERS) * model.config.hidden_size)
        proposal, _ = await draft.propose(ProposeCall("s", True, 0, tokens, 3, GREEDY, features=f))
        checked = 0
        for _ in range(4):
            assert proposal.tokens[0] == expected_first(tokens)
            checked += 1
            verdict, _ = await LocalTarget(target).verify(VerifyCall("s", False, [], proposal, GREEDY))
            f = verdict.features
            assert f.start == len(tokens) - 1 and f.rows == verdict.accepted + 1  # the last token, then those kept
            rejected = len(proposal.tokens) - verdict.accepted
            tokens += proposal.tokens[: verdict.accepted] + [verdict.token]
            proposal, _ = await draft.propose(ProposeCall("s", False, rejected, [verdict.token], 3, GREEDY,
                                                          features=f))
        return checked

    assert asyncio.run(go()) == 4


def test_a_draft_left_behind_past_the_window_starts_again_after_the_gap(pair, eagle):
    """Rounds that draft nothing add rows the draft does not take in; once they are more than the
    window (generate's feature_window), the next draft call gets the last window's rows, after a gap,
    not every row since (speculative/round.py's FeatureLog), the head starts its rows again there,
    and the output is the target's."""
    _, target_dir = pair
    target = TargetEngine(ModelRunner(target_dir))
    prompt = [5, 17, 42, 9, 100, 7, 61]

    class Scripted(FixedK):
        schedule = [0, 2, 2, 2] + [0] * 12 + [2] * 30
        started: list[bool] = []  # per round: whether a draft call of it started the draft's session

        def choose(self, remaining: int) -> int:
            return min(self.schedule.pop(0) if self.schedule else 2, remaining - 1)

        def observe(self, r, wall_ms: float) -> None:
            self.started.append(r.draft_started)

    class Recording(LocalDraft):
        calls: list[tuple[int, int]] = []  # each call's feature rows: (start, rows)

        async def propose(self, call, *, turn=(0, 0)):
            if call.features is not None:
                self.calls.append((call.features.start, call.features.rows))
            return await super().propose(call)

    def go(k, window: int = 6) -> list[int]:
        async def rounds():
            out = []
            async for new in generate(Recording(eagle), LocalTarget(target), prompt, max_new_tokens=40, k=k,
                                      params=GREEDY, max_context=256, feature_layers=LAYERS, feature_window=window):
                out += new
            return out

        return asyncio.run(rounds())

    held = len(eagle.sessions)  # (the module's head: other tests' sessions)
    expected = go(0)
    assert Recording.calls == []
    assert go(Scripted(2)) == expected
    calls = Recording.calls
    gaps = [i for i in range(1, len(calls)) if calls[i][0] > sum(calls[i - 1])]
    assert len(gaps) == 1 and calls[gaps[0]][1] <= 6  # the window's rows, after the 12 rounds without a call
    assert all(rows <= 6 for _, rows in calls[gaps[0]:])
    assert Scripted.started[:3] == [False, True, False] and sum(Scripted.started) == 1  # (the gap is no new session)
    assert len(eagle.sessions) == held


def test_a_chats_next_turn_takes_the_kept_rows_and_drafts_as_one_that_computed_them(pair, tmp_path):
    """Prefix reuse on both sides: the next turn's target session sends the kept prefix's rows first,
    and the head's session takes its kept rows for them, computing only the new ones; its rows and
    its draft are those of a head that took every row in at once."""
    _, target_dir = pair
    head = make_head(target_dir, tmp_path / "head")
    kept, fresh = (EagleDraft.load(head, target_dir, "cpu", lookup=range(0), prefix_cache_mb=mb) for mb in (16, 0))
    target = TargetEngine(ModelRunner(target_dir, prefix_cache_mb=16))
    prompt = [(7 * i) % 300 + 3 for i in range(40)]

    def turn(name: str, tokens: list[int], draft: EagleDraft) -> tuple[list[int], Proposal]:
        verdict, _ = target.verify(VerifyCall(name, True, tokens, Proposal(), GREEDY, 1, LAYERS))
        tokens = [*tokens, verdict.token]
        proposal, _ = draft.propose(ProposeCall(name, True, 0, tokens, 3, GREEDY, features=verdict.features))
        return tokens, proposal

    tokens, proposal = turn("a", prompt, kept)
    for _ in range(3):  # a few rounds (each proposal rolled back), so that the kept rows come from several calls
        verdict, _ = target.verify(VerifyCall("a", False, [], Proposal(), GREEDY, 1))
        proposal, _ = kept.propose(ProposeCall("a", False, len(proposal.tokens), [verdict.token], 3, GREEDY,
                                               features=verdict.features))
        tokens.append(verdict.token)
    target.release("a")
    kept.release("a")
    assert kept.kept_positions == len(tokens) - 1  # (every position but the last, unscored)
    later = [*tokens, 11, 12, 13]
    _, reused = turn("b", later, kept)
    assert (kept.reuses, kept.reused_positions) == (1, len(tokens) - 1) and kept.kept_positions == 0
    metrics = ModelMetrics()
    metrics.watch(kept.sessions, kept=kept)  # (as the draft service does: the head's rows)
    assert metrics.registry.get_sample_value("specdec_prefix_cache_hit_tokens_total") == len(tokens) - 1
    target.release("b")
    _, computed = turn("c", later, fresh)  # (the target reuses again: its rows come whole all the same)
    assert reused.tokens == computed.tokens
    ours, theirs = kept.sessions.get("b").cache, fresh.sessions.get("c").cache
    assert (ours.base, ours.featured, len(ours.hidden)) == (theirs.base, theirs.featured, len(theirs.hidden))
    assert torch.allclose(torch.stack(ours.hidden), torch.stack(theirs.hidden), atol=1e-5)
    # a prompt that parts from the kept tokens within their rows: the rows up to the last whose next token
    # is shared (an off-by-one would keep a row that read another token)
    kept.release("b")
    fresh.release("c")
    parted = [*later[:40], 99, 98, 97, 96]
    turn("e", parted, kept)
    turn("f", parted, fresh)
    assert (kept.reuses, kept.reused_positions) == (2, len(tokens) - 1 + 39)
    ours, theirs = kept.sessions.get("e").cache, fresh.sessions.get("f").cache
    assert torch.allclose(torch.stack(ours.hidden), torch.stack(theirs.hidden), atol=1e-5)
    # a prompt sharing less than half of what was kept: rows from scratch
    kept.release("e")
    turn("d", [*later[:20], *range(200, 260)], kept)
    assert kept.reuses == 2 and kept.sessions.get("d").cache.featured == 80
    # kept rows go after the idle timeout, as sessions do
    kept.release("d")
    assert kept.kept_positions > 0
    kept.sessions.idle_timeout = -1
    kept.evict_idle()
    assert kept.kept_positions == 0 and not kept._kept


def test_features_are_the_targets_hidden_states_in_position_order(pair):
    _, target_dir = pair
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    target = TargetEngine(ModelRunner(target_dir))
    prompt = [3, 14, 15, 92, 65, 35]
    verdict, _ = target.verify(VerifyCall("f", True, prompt, Proposal(), GREEDY, 1, (1, 0)))
    got = wire.unpack(verdict.features)
    with torch.inference_mode():
        states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    want = torch.cat([states[1][0], states[0][0]], dim=-1)
    assert verdict.features.dtype == "float16" and got.shape == want.shape
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)
    # decoding on: one row a step, each position after the last
    verdict, _ = target.verify(VerifyCall("f", False, [], Proposal(), GREEDY, 4))
    assert verdict.features.start == len(prompt) and verdict.features.rows == 1 + len(verdict.decoded)
    # a session that asks for none gets none
    verdict, _ = target.verify(VerifyCall("g", True, prompt, Proposal(), GREEDY))
    assert verdict.features is None


def test_bad_feature_requests_are_refused_and_leave_no_trace(pair, eagle):
    _, target_dir = pair
    target = TargetEngine(ModelRunner(target_dir))
    with pytest.raises(InvalidRequest, match="feature layer 9"):
        target.verify(VerifyCall("t", True, [1, 2, 3], Proposal(), GREEDY, 1, (0, 9)))
    assert len(target.runner.sessions) == 0
    width = eagle.width
    rows = lambda start, n, w=width: Features(start, n, w, "float16", bytes(2 * w * n))  # noqa: E731
    tokens = [4, 5, 6, 7, 8]
    for features, message in ((rows(0, 4, width - 1), "values a row"), (rows(0, 5), "past the committed"),
                              (Features(0, 2, width, "float16", b"\0"), "bytes"),
                              (Features(0, 1, width, "int8", bytes(2 * width)), "dtype")):
        with pytest.raises(InvalidRequest, match=message):
            eagle.propose(ProposeCall("e", True, 0, tokens, 2, GREEDY, features=features))
        assert "e" not in eagle.sessions
    proposal, _ = eagle.propose(ProposeCall("e", True, 0, tokens, 2, GREEDY, features=rows(1, 3)))
    assert len(proposal.tokens) == 2  # drafts from a window that starts past 0
    with pytest.raises(InvalidRequest, match="past the committed"):  # row 7 would read token 8, not committed
        eagle.propose(ProposeCall("e", False, 2, [9, 10, 11], 2, GREEDY, features=rows(6, 2)))
    assert eagle.sessions.get("e").tokens == tokens + proposal.tokens
    # a gap (rows 4 and 5 never came: a long prefill's last rows only): the rows start again at 6
    proposal, _ = eagle.propose(ProposeCall("e", False, 2, [9, 10, 11], 2, GREEDY, features=rows(6, 1)))
    state = eagle.sessions.get("e").cache
    assert len(proposal.tokens) == 2 and state.base == 6 and state.featured == 7
    # no features at all: nothing to draft from
    proposal, _ = eagle.propose(ProposeCall("n", True, 0, tokens, 2, GREEDY))
    assert proposal.tokens == []


def test_tokens_far_past_the_feature_rows_are_not_chained_step_by_step(eagle):
    """A call whose tokens run more than CHAIN_MAX past its feature rows drafts nothing (a head step a
    token would hold the model thread, every other session waiting), and drafts again once features
    reach its tokens; within CHAIN_MAX the rows are chained to the last token as before."""
    width = eagle.width
    rows = lambda start, n: Features(start, n, width, "float16", bytes(2 * width * n))  # noqa: E731
    tokens = [4, 5, 6, 7] * 100  # 400 tokens, rows for the first two positions only
    try:
        proposal, _ = eagle.propose(ProposeCall("far", True, 0, tokens, 2, GREEDY, features=rows(0, 2)))
        assert proposal.tokens == [] and eagle.sessions.get("far").cache.end == 2  # none chained
        proposal, _ = eagle.propose(ProposeCall("far", False, 0, [4], 2, GREEDY, features=rows(2, 397)))
        assert len(proposal.tokens) == 2  # features up to its last token but one: chained one row, drafted
        near = tokens[: 2 + CHAIN_MAX + 1]
        proposal, _ = eagle.propose(ProposeCall("near", True, 0, near, 2, GREEDY, features=rows(0, 2)))
        assert len(proposal.tokens) == 2 and eagle.sessions.get("near").cache.end >= len(near) - 1
    finally:
        eagle.release("far")
        eagle.release("near")


def test_the_kv_token_cap_counts_what_calls_drafted_together_will_add(eagle, monkeypatch):
    """--max-kv-tokens on the head's sessions: calls admitted to one propose_many draft their tokens
    only after all are admitted, so the cap counts those tokens for the calls after them, as it would
    had they come one by one (it did not: four starts of 5 + 8 under a cap of 26 held 39 tokens)."""
    held = sum(len(s.tokens) for s in eagle.sessions)  # (other tests' sessions on the module's head)
    monkeypatch.setattr(eagle.host, "max_kv_tokens", held + 26)
    width = eagle.width
    rows = Features(0, 4, width, "float16", bytes(2 * width * 4))
    calls = [ProposeCall(f"cap{i}", True, 0, [4, 5, 6, 7, 8], 8, GREEDY, features=rows) for i in range(4)]
    results = eagle.propose_many(calls)
    try:
        admitted = [not isinstance(r, Exception) for r in results]
        assert admitted == [True, True, False, False], results
        assert all(isinstance(r, CapacityExceeded) for r in results[2:])
        assert sum(len(s.tokens) for s in eagle.sessions) <= held + 26
    finally:
        for call in calls:
            eagle.release(call.session_id)


def next_probs(model, ids, params):
    with torch.inference_mode():
        return logits_to_probs(model(input_ids=torch.tensor([ids])).logits[0, -1], params).double()


@pytest.mark.parametrize("quantize,prompt", [("none", [3, 5, 4, 7]), ("int4", [3, 5, 4, 7]),
                                             ("none", [3, 5, 4, 7, 3, 5, 4])])
def test_sampled_tokens_drafted_from_features_follow_the_target(small_vocab_pair, tmp_path, quantize, prompt):
    """k=2, 3 tokens: the first round has no features and decodes the first token alone; the
    second verifies the head's two tokens, so the second token's marginal is the head's doing.
    The head op by op, and in int4 through its one-call draft; after the prompt that repeats itself the
    lookup copies where the first token repeats it too (7 after 3 5 4: one-hot q at 3)."""
    if quantize == "int4" and not q4_kernel.available():
        pytest.skip("specdec's int4 kernel is not built here")
    _, target_dir = small_vocab_pair
    params = SamplingParams(1.0)
    eagle = EagleDraft.load(make_head(target_dir, tmp_path / "head", seed=3, std=0.5, draft_vocab=8), target_dir,
                            "cpu", quantize=quantize)
    assert (eagle.head._q4_step is not None) == (quantize == "int4")
    target = TargetEngine(ModelRunner(target_dir))
    model = target.runner.model
    eos = model.config.eos_token_id
    first = next_probs(model, prompt, params)
    v = first.shape[0]
    second = torch.zeros(v + 1, dtype=torch.float64)
    for x in range(v):
        if first[x] > 0:
            if x == eos:
                second[v] += first[x]
            else:
                second[:v] += first[x] * next_probs(model, prompt + [x], params)
    counts = torch.zeros(v + 1, dtype=torch.float64)
    stats = Stats()
    for seed in range(800):
        one = Stats()
        out = run(eagle, target, prompt, 3, 2, SamplingParams(1.0, seed=seed), stats=one)
        stats.merge(one)
        counts[out[1] if len(out) > 1 else v] += 1
    assert stats.draft_tokens > 500 and stats.accepted_tokens > 50  # the head's tokens were verified
    assert (eagle.copied > 20) == (len(prompt) > 4), eagle.copied  # copies verified too, where the context repeats
    assert fits(counts, second), chi2_stat(counts, second)


def test_the_lookup_copies_what_followed_the_last_ngram_and_forgets_rejected_copies(pair, tmp_path):
    """Where the context's last 3 or 4 tokens occurred before, the proposal is what followed them
    there (one-hot q), without features. A call that appends nothing copies on after its own copy
    (pre-drafting: the lookup then holds unconfirmed tokens); a rollback drops the rejected ones from
    what it holds, so the next copy reads the committed tokens only. Without the lookup, no
    features: no proposal."""
    _, target_dir = pair
    head = make_head(target_dir, tmp_path / "head")
    eagle, alone = EagleDraft.load(head, target_dir, "cpu"), EagleDraft.load(head, target_dir, "cpu", lookup=range(0))
    prompt = [11, 12, 13, 14, 11, 12, 13]  # 11 12 13 occurred before: 14 followed it
    proposal, _ = eagle.propose(ProposeCall("s", True, 0, prompt, 4, GREEDY))
    assert proposal.tokens == [14, 11, 12, 13] and proposal.support_sizes == [1] * 4  # (the copy reads itself on)
    assert alone.propose(ProposeCall("s", True, 0, prompt, 4, GREEDY))[0].tokens == []
    proposal, _ = eagle.propose(ProposeCall("s", False, 0, [], 2, GREEDY))  # on after 14 11 12 13
    assert proposal.tokens == [14, 11]
    # all 6 rejected, 20 committed: 12 13 20 occurred nowhere (had the rejected tokens stayed where the
    # lookup reads, it would still end in 11 12 13 and copy)
    proposal, _ = eagle.propose(ProposeCall("s", False, 6, [20], 4, GREEDY))
    assert proposal.tokens == []
    # 11 12 13 14 11 12 13 20 14 11 12: 14 11 12 occurred at 3..5, and 13 20 14 followed
    proposal, _ = eagle.propose(ProposeCall("s", False, 0, [14, 11, 12], 3, GREEDY))
    assert proposal.tokens == [13, 20, 14]
    assert eagle.copied == 9


@pytest.mark.parametrize("fail_on", [2, 5])
def test_a_lost_eagle_replica_leaves_the_output_unchanged(small_vocab_pair, tmp_path, fail_on):
    """Two eagle replicas behind failover (coordinator/failover.py), in one process: the one the
    request is on fails (UNAVAILABLE) on its `fail_on`-th call; the request starts a session on the
    other with the last window of feature rows, drafts on from them, and decodes what a faultless
    run decodes."""
    import grpc

    from coordinator.failover import FailoverDraft, FailoverTarget
    from coordinator.peers import PeerError
    from tests.coordinator.test_failover import local_pool

    _, target_dir = small_vocab_pair
    head = make_head(target_dir, tmp_path / "head", std=0.5)

    class Flaky(LocalDraft):
        def __init__(self, address: str, fail_on: int | None):
            super().__init__(EagleDraft.load(head, target_dir, "cpu"))
            self.address, self.name, self.calls, self.fail_on = address, "draft", 0, fail_on

        async def propose(self, call, *, turn=(0, 0)):
            self.calls += 1
            if self.calls == self.fail_on:
                raise PeerError(self, grpc.StatusCode.UNAVAILABLE, "killed")
            return await super().propose(call)

    target = LocalTarget(TargetEngine(ModelRunner(target_dir)))
    target.address, target.name = "t0", "target"

    def go(fail_on: int | None) -> tuple[list[int], list[Flaky]]:
        replicas = [Flaky("d0", fail_on), Flaky("d1", None)]

        async def run():
            out = []
            async for new in generate(FailoverDraft(local_pool("draft", replicas)),
                                      FailoverTarget(local_pool("target", [target])), [5, 1, 4, 9, 10, 7],
                                      max_new_tokens=60, k=3, params=GREEDY, max_context=256, predraft=True,
                                      feature_layers=LAYERS):
                out += new
            return out

        return asyncio.run(run()), replicas

    expected, _ = go(None)
    got, replicas = go(fail_on)
    assert got == expected and len(got) == 60
    assert replicas[1].calls > 2  # the request moved there and drafted on
    assert [len(r.engine.sessions) for r in replicas] == [0, 0]


def test_sessions_drafted_together_propose_what_each_would_alone(pair, tmp_path):
    """propose_many drafts every session's tokens in one head step per token (step_many): the same
    proposals, greedy and sampled, as each session drafted in a call of its own."""
    _, target_dir = pair
    head = make_head(target_dir, tmp_path / "head", std=0.5)
    target = TargetEngine(ModelRunner(target_dir))
    prompts = {"a": [5, 1, 4, 9, 10, 7], "b": [3, 14, 15, 92, 65, 35, 89, 79], "c": [2, 7, 1]}
    calls = []
    for name, prompt in prompts.items():
        verdict, _ = target.verify(VerifyCall(name, True, prompt, Proposal(), GREEDY, 1, LAYERS))
        params = GREEDY if name != "b" else SamplingParams(0.8, seed=5)
        calls.append(ProposeCall(name, True, 0, prompt + [verdict.token], 2 + len(name) * 2, params,
                                 features=verdict.features))
    together = EagleDraft.load(head, target_dir, "cpu").propose_many(calls)
    alone = EagleDraft.load(head, target_dir, "cpu")
    for call, (proposal, cost) in zip(calls, together):
        single, _ = alone.propose(call)
        assert proposal.tokens == single.tokens and len(proposal.tokens) == call.k
        assert (proposal.support_sizes, proposal.support_ids) == (single.support_sizes, single.support_ids)
        # (q to float rounding: a product over three rows sums in another order than over one)
        torch.testing.assert_close(torch.frombuffer(bytearray(proposal.support_probs), dtype=torch.float32),
                                   torch.frombuffer(bytearray(single.support_probs), dtype=torch.float32))
        assert cost.batch_size == 3


def test_a_lone_sessions_call_gets_threads_and_one_among_others_batched_threads(pair, tmp_path):
    """--threads / --batched-threads of the draft service reach the head's calls as ModelRunner's
    passes get them: a call of the one session at work runs on `threads`, a call of several sessions,
    or of one while others are at work, on `batched_threads`; unset, the process's own count stays."""
    _, target_dir = pair
    head = make_head(target_dir, tmp_path / "head")
    target = TargetEngine(ModelRunner(target_dir))
    prompts = {"a": [5, 1, 4, 9, 10, 7], "b": [3, 14, 15, 92, 65, 35]}
    calls = {}
    for name, prompt in prompts.items():
        verdict, _ = target.verify(VerifyCall(name, True, prompt, Proposal(), GREEDY, 1, LAYERS))
        calls[name] = ProposeCall(name, True, 0, prompt + [verdict.token], 2, GREEDY, features=verdict.features)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        draft = EagleDraft.load(head, target_dir, "cpu", threads=3, batched_threads=1)
        draft.propose(calls["a"])
        assert torch.get_num_threads() == 3 and draft.at_work == 1
        draft.propose(calls["b"])  # a is still at work
        assert torch.get_num_threads() == 1 and draft.at_work == 2
        torch.set_num_threads(2)
        unset = EagleDraft.load(head, target_dir, "cpu")
        unset.propose(calls["a"])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_the_int8_head_keeps_fc_float_and_computes_near_the_float_head(pair, tmp_path):
    """--head-quantize int8 quantizes the decoder layer's linears and lm_head; fc, which takes the
    target's hidden states side by side, stays float: one huge channel (as a middle layer's outliers
    are) would take fc's per-row int8 scale and crush every other channel of the features."""
    _, target_dir = pair
    directory = make_head(target_dir, tmp_path / "head")
    head = EagleDraft.load(directory, target_dir, "cpu").head
    int8 = EagleDraft.load(directory, target_dir, "cpu", quantize="int8").head
    assert isinstance(int8.fc, torch.nn.Linear) and int8.fc.weight.dtype == torch.float32
    assert not isinstance(int8.lm_head, torch.nn.Linear)  # (a dynamically quantized one)
    # serving joins q/k/v and gate/up, quantized with a scale per output row: each part as alone
    assert int8.layer.qkv_proj.weight().qscheme() == torch.per_channel_affine
    assert int8.layer.gate_up_proj.weight().qscheme() == torch.per_channel_affine
    torch.manual_seed(0)
    features = torch.randn(6, head.fc.in_features)
    features[:, 3] = 400.0  # an outlier channel
    with torch.inference_mode():
        exact, fused = head.fuse(features), int8.fuse(features)
    torch.testing.assert_close(fused, exact)


def test_a_constrained_eagle_draft_proposes_only_allowed_tokens_and_keeps_the_output(small_vocab_pair, tmp_path):
    """Structured output (model_service/grammar.py): the head's q is masked by the constraint, mapped
    from target ids to its draft vocabulary (one smaller than the target's here), so every token it
    proposes is one the regex allows; the output is the target's own under the constraint."""
    from speculative.protocol import Constraint

    _, target_dir = small_vocab_pair
    eagle = EagleDraft.load(make_head(target_dir, tmp_path / "head", std=0.5, draft_vocab=9), target_dir, "cpu")
    target = TargetEngine(ModelRunner(target_dir))
    tokenizer = eagle.tokenizer
    prompt = tokenizer.encode("ab ca bad")
    rule = Constraint("regex", r"[abc][d-g]{3,12}\.")
    proposed: list[list[int]] = []

    class Watched(LocalDraft):
        async def propose(self, call):
            proposal, cost = await super().propose(call)
            proposed.append(list(proposal.tokens))
            return proposal, cost

    def go(k: int, params: SamplingParams) -> list[int]:
        async def collect():
            out = []
            async for new in generate(Watched(eagle), LocalTarget(target), prompt, max_new_tokens=20, k=k,
                                      params=params, max_context=256, feature_layers=eagle.layers,
                                      eos_token_ids=set(target.runner.eos_token_ids), constraint=rule):
                out += new
            return out

        return asyncio.run(collect())

    alone = go(0, GREEDY)
    text = tokenizer.decode(alone, skip_special_tokens=True)
    assert text[0] in "abc" and set(text[1:-1]) <= set("defg") and text.endswith("."), text
    assert go(4, GREEDY) == alone
    for seed in range(3):
        sampled = tokenizer.decode(go(4, SamplingParams(1.0, seed=seed)), skip_special_tokens=True)
        assert sampled[0] in "abc" and set(sampled[1:-1]) <= set("defg") and sampled.endswith("."), sampled
    drafted = [t for p in proposed for t in p]
    assert drafted, "the head proposed nothing"
    for p in proposed:  # each proposal continues an output the regex allows
        assert all(tokenizer.decode([t]) in set("abcdefg.") or t in target.runner.eos_token_ids for t in p)


def test_a_head_over_a_padded_output_layer_proposes_only_the_tokenizers_ids(tmp_path):
    """A target whose output layer is padded past its tokenizer (as many are, to a multiple of 64 or
    128) scores ids no text maps to, and the target refuses draft tokens there: a head whose draft
    vocabulary holds such ids draws none of them, greedy or sampled."""
    tokenizer = make_tokenizer(tmp_path / "tok", vocab="chars")
    target_dir = make_model(tmp_path / "target", tokenizer, vocab_size=len(tokenizer) + 40, hidden=32, heads=4,
                            kv_heads=2, layers=4)
    head_dir = tmp_path / "head"
    make_head(target_dir, head_dir, std=1.0)  # every target id, the padding's 40 too
    draft = EagleDraft.load(head_dir, target_dir, "cpu")
    target = TargetEngine(ModelRunner(target_dir))
    for params in (GREEDY, SamplingParams(1.0, seed=3)):
        stats = Stats()
        out = run(draft, target, [3, 5, 4, 7, 2], 40, 4, params, stats=stats)
        # every round after the first (no features yet) drafted its 4 (the last may ask fewer)
        assert out and stats.rounds > 2 and stats.draft_tokens >= 4 * (stats.rounds - 2)
    assert int(draft._target_ids.max()) >= len(tokenizer) and draft._known is not None


def test_calibration_prices_a_drafted_token_as_one_head_step(eagle, monkeypatch):
    """Adaptive K charges k drafted tokens k x (fixed / sessions + per_token + per_session): the
    fit must be one head step's time (and what each further session adds to it), not a call's
    that takes in a whole context of feature rows. On a fake clock a step costs 2 ms + 0.5 ms
    a row: a 64-row take-in costs 34 ms, which the old fit charged for every drafted token."""
    import types

    from coordinator.adaptive import CostModel
    from model_service import model_runner as module  # (whose clock the calibration reads: fastest_ms)
    from speculative.protocol import PassCost

    clock = [0.0]
    monkeypatch.setattr(module, "time", types.SimpleNamespace(perf_counter=lambda: clock[0]))
    head = eagle.head
    real_step, real_many = head.step, head.step_many

    def timed(real):
        def run(ids, *args, **kwargs):
            clock[0] += (2.0 + 0.5 * len(ids)) / 1e3
            return real(ids, *args, **kwargs)
        return run

    monkeypatch.setattr(head, "step", timed(real_step))
    monkeypatch.setattr(head, "step_many", timed(real_many))
    cost = eagle.calibrate(context=64)
    assert cost.fixed == pytest.approx(2.0) and cost.per_session == pytest.approx(0.5) and cost.per_token == 0.0
    costs = CostModel(PassCost(), cost, overhead_ms=0.0)
    assert costs.round_cost(4, 1, 1) - costs.round_cost(0, 1, 1) == pytest.approx(4 * 2.5)  # four steps
    assert costs.round_cost(4, 4, 4) - costs.round_cost(0, 4, 4) == pytest.approx(4 * (2.0 / 4 + 0.5))


def test_a_head_with_a_shorter_context_drafts_until_it_is_full_then_asks_for_no_features(small_vocab_pair,
                                                                                          tmp_path):
    """A head whose context (its --max-context, or its config's max_position_embeddings) is shorter
    than the target's bounds the drafting, not the request (speculative/round.py's draft_context):
    it drafts from features while its session has room, the target decodes the rest alone, and
    the output is the target's. A prompt that leaves the head no room asks the target for no
    features at all."""
    _, target_dir = small_vocab_pair
    eagle = EagleDraft.load(make_head(target_dir, tmp_path / "head", std=0.5), target_dir, "cpu", max_context=24)
    assert eagle.info()["max_context"] == 24
    assert eagle.info()["kv_dtype"] == "float32"  # (the head's own cache, as its weights: GetModelInfo says so)
    runner = ModelRunner(target_dir)
    target = TargetEngine(runner)

    def go(prompt: list[int], k: int, stats: Stats) -> list[int]:
        async def rounds():
            out = []
            async for new in generate(LocalDraft(eagle), LocalTarget(target), prompt, max_new_tokens=40, k=k,
                                      params=GREEDY, max_context=runner.max_context, draft_context=24,
                                      stats=stats, feature_layers=eagle.layers):
                out += new
            return out

        return asyncio.run(rounds())

    for prompt in ([5, 1, 4, 9, 10, 7], [2 + i % 9 for i in range(23)], list(range(2, 12)) * 3):
        alone, drafted = Stats(), Stats()
        expected = go(prompt, 0, alone)
        assert len(expected) == 40 and alone.draft_tokens == 0 and alone.feature_bytes == 0  # K = 0: no rows asked
        assert go(prompt, 3, drafted) == expected
        if len(prompt) < 23:
            # rows up to the head's context only: once it is full the target is told to send no more
            assert drafted.draft_tokens > 0 and 0 < drafted.feature_bytes <= (24 + 4) * 2 * eagle.width
        elif len(prompt) == 23:  # the head could draft from features only after the first round, which fills it
            assert drafted.feature_bytes == 0
        else:  # no room at all: the draft is never called
            assert drafted.draft_tokens == 0 and drafted.feature_bytes == 0 and drafted.draft_calls == 0
    assert len(eagle.sessions) == 0 and len(runner.sessions) == 0


@pytest.mark.parametrize("padded", [False, True])
def test_sessions_drafted_in_one_call_match_the_step_by_step_loop(tmp_path, padded):
    """An int4 head drafts its sessions in one call (Eagle3Head.draft_fused, q4_kernel's q4_eagle_draft),
    greedy and sampled together: per session the tokens, the rows it appends (out_hidden and keys and
    values) and the stops at p_min are the step-by-step loop's (step_many and draft_token), bit for bit;
    a sampled token's q the loop's (its support's ids, the probabilities to float rounding), drawn with
    as many of its generator's uniforms; sessions of different k drafting together; over a draft
    vocabulary smaller than the target's, and one whose ids past the tokenizer are never drawn (padded);
    a support cut short of the draft vocabulary (max_support). A session with a constraint goes the
    loop's way while the others still draft in one call."""
    if not q4_kernel.available():
        pytest.skip("specdec's int4 kernel is not built here")
    from speculative.protocol import Constraint

    tokenizer = make_tokenizer(tmp_path / "tok", vocab="chars")
    target_dir = make_model(tmp_path / "target", tokenizer, vocab_size=len(tokenizer) + (40 if padded else 0),
                            hidden=32, heads=4, kv_heads=2, layers=4)
    head_dir = make_head(target_dir, tmp_path / "head", std=0.6, draft_vocab=None if padded else 8)
    target = TargetEngine(ModelRunner(target_dir))
    prompts = {"a": [5, 1, 4, 9, 10, 7], "b": [3, 11, 2, 6, 5, 3, 8, 7], "c": [2, 7, 1]}
    ks = {"a": 4, "b": 7, "c": 1}
    sampled = {"a": SamplingParams(0.8, seed=3), "b": SamplingParams(1.4, top_k=5, seed=4),
               "c": SamplingParams(0.6, top_p=0.8, seed=5)}
    mixed = {"a": SamplingParams(1.0, top_k=3, top_p=0.7, seed=6), "b": GREEDY,
             "c": SamplingParams(2.0, seed=7, min_p=0.3)}
    # (params per session, p_min, max_support): some drafts stopped short at p_min (checked below)
    cases = [({n: GREEDY for n in prompts}, p_min, 64) for p_min in (0.0, 0.3, 0.9)] + [
        (sampled, 0.0, 64), (sampled, 0.0, 2), (sampled, 0.3, 3), (sampled, 0.3, 64), (mixed, 0.0, 5), (mixed, 0.2, 64)]

    def draft(fused: bool, params: dict, p_min: float, max_support: int, constrained: str | None = None):
        eagle = EagleDraft.load(head_dir, target_dir, "cpu", quantize="int4", lookup=range(0))
        eagle.fused_draft, eagle.max_support = fused, max_support
        calls = []
        for name, prompt in prompts.items():
            verdict, _ = target.verify(VerifyCall(name, True, prompt, Proposal(), params[name], 1, eagle.layers))
            calls.append(ProposeCall(name, True, 0, prompt + [verdict.token], ks[name], params[name], p_min=p_min,
                                     features=verdict.features,
                                     constraint=Constraint("regex", "[a-z ]*") if name == constrained else None))
            target.release(name)
        spy = []
        real = eagle.head.step_many
        eagle.head.step_many = lambda *a, **k: spy.append(len(a[0])) or real(*a, **k)
        proposals = [p for p, _ in eagle.propose_many(calls)]
        sessions = {name: eagle.sessions.get(name) for name in prompts}
        return proposals, sessions, spy

    stopped, drew = set(), 0
    for params, p_min, max_support in cases:
        (fused, fused_sessions, fused_steps), (loop, loop_sessions, loop_steps) = \
            draft(True, params, p_min, max_support), draft(False, params, p_min, max_support)
        assert fused_steps == [] and bool(loop_steps) == any(len(p.tokens) > 1 for p in loop)
        for name, a_prop, b_prop in zip(prompts, fused, loop):
            assert a_prop.tokens == b_prop.tokens and a_prop.support_sizes == b_prop.support_sizes
            assert a_prop.support_ids == b_prop.support_ids
            a_q, b_q = (np.frombuffer(p.support_probs, dtype=np.float32) for p in (a_prop, b_prop))
            np.testing.assert_allclose(a_q, b_q, rtol=1e-5, atol=1e-6)
            if not params[name].greedy:
                assert all(size <= max_support for size in a_prop.support_sizes)
                drew += len(a_prop.tokens)
            a, b = fused_sessions[name].cache, loop_sessions[name].cache
            assert (a.base, a.featured, a.end, a.cache.length) == (b.base, b.featured, b.end, b.cache.length)
            assert all(torch.equal(x, y) for x, y in zip(a.hidden, b.hidden))
            n = a.cache.length
            assert torch.equal(a.cache.k[:, :n], b.cache.k[:, :n]) and torch.equal(a.cache.v[:, :n], b.cache.v[:, :n])
            assert torch.equal(fused_sessions[name].generator.get_state(), loop_sessions[name].generator.get_state())
        stopped |= {(p_min, len(p.tokens) < ks[name]) for name, p in zip(prompts, fused)}
        assert all(len(p.tokens) == ks[name] for name, p in zip(prompts, fused)) or p_min > 0
        if padded:
            assert all(t < len(tokenizer) for p in fused for t in p.tokens)
    assert any(p_min > 0 and short for p_min, short in stopped)  # p_min cut a draft short
    assert drew > 20  # sampled tokens compared
    # a session with a constraint drafts step by step, the others in one call, as each would alone
    (fused, _, fused_steps), (loop, _, _) = draft(True, mixed, 0.0, 64, "b"), draft(False, mixed, 0.0, 64, "b")
    assert [p.tokens for p in fused] == [p.tokens for p in loop] and len(fused[1].tokens) == ks["b"]
    assert fused_steps == [1] * (ks["b"] - 1)  # the loop's steps: "b"'s only


def test_the_one_call_draft_refuses_what_it_cannot_draft(pair, tmp_path):
    """q4_eagle_draft's checks: a list per session that does not match the caches, and a draft reaching
    past the RoPE table, are refused with the op's name (nothing is written: the caches keep their rows)."""
    if not q4_kernel.available():
        pytest.skip("specdec's int4 kernel is not built here")
    _, target_dir = pair
    eagle = EagleDraft.load(make_head(target_dir, tmp_path / "head"), target_dir, "cpu", quantize="int4")
    head, c = eagle.head, eagle.head.config
    norms, tiles, outs = head._q4_step
    cache = head.new_cache()
    cache.reserve(8, torch.float32)
    cos, sin = head._rope_table(8, "cpu")

    def call(ks, positions, cos=cos, sin=sin):
        return torch.ops.specdec.q4_eagle_draft(
            torch.zeros(1, c.hidden_size), head.embed_tokens.weight, cos, sin, [cache.k], [cache.v], [0], positions,
            ks, [0.0] * len(ks), None, eagle._target_ids, c.num_attention_heads, c.num_key_value_heads, c.head_dim,
            c.rms_norm_eps, c.head_dim ** -0.5, c.norm_before_residual, norms, tiles, outs, [0.0] * len(ks),
            [0] * len(ks), [1.0] * len(ks), [0.0] * len(ks), 64, None)

    tokens, rows, steps, support, q = call([3], [0])
    assert tokens.shape == (1, 3) and steps.tolist() == [2] and rows.shape == (1, 2, c.hidden_size)
    assert support.shape == q.shape == (1, 3, 0)  # greedy: no q
    before = cache.k.clone()
    with pytest.raises(RuntimeError, match="q4_eagle_draft: a cache, past, position, k and p_min per row"):
        call([3, 3], [0, 0])
    with pytest.raises(RuntimeError, match="q4_eagle_draft: the RoPE tables hold"):
        call([3], [0], cos[:1], sin[:1])
    assert torch.equal(cache.k, before)
