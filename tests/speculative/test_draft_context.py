"""A draft whose context is shorter than the target's bounds the drafting, not the request: rounds
draft while the draft's session has room, then the target decodes on alone, and the output is the
target's either way."""

from __future__ import annotations

import asyncio

import pytest

from model_service.engines import DraftEngine, TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from coordinator.adaptive import AcceptanceK
from speculative.protocol import SamplingParams
from speculative.round import FixedK, Stats, generate
from speculative.tiny import make_model, make_tokenizer

GREEDY = SamplingParams(0.0)
DRAFT_CONTEXT = 40


class Watched(LocalDraft):
    """A LocalDraft that records, after each call, how many tokens the session holds."""

    def __init__(self, engine, stats: Stats | None = None):
        super().__init__(engine)
        self.held: list[int] = []
        self.stats = stats
        self.released: list[int] = []  # the rounds run when each release came

    async def release(self, session_id):
        self.released.append(self.stats.rounds if self.stats is not None else -1)
        await super().release(session_id)

    async def propose(self, call, **kwargs):
        result = await super().propose(call, **kwargs)
        self.held.append(len(self.engine.runner.sessions.get(call.session_id).tokens))
        return result


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("context")
    tokenizer = make_tokenizer(tmp / "tok", "chars")
    return make_model(tmp / "m", tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, max_context=128, init_std=0.3)


def run(draft: Watched, target: ModelRunner, prompt: list[int], n: int, k, predraft: bool,
        stats: Stats, params: SamplingParams = GREEDY) -> list[int]:
    async def go() -> list[int]:
        out = []
        async for new in generate(draft, LocalTarget(TargetEngine(target)), prompt, max_new_tokens=n, k=k,
                                  params=params, max_context=target.max_context,
                                  draft_context=draft.engine.runner.max_context, stats=stats, predraft=predraft):
            out += new
        return out

    return asyncio.run(go())


def alone(target: ModelRunner, prompt: list[int], n: int) -> list[int]:
    """The target's greedy tokens, decoded alone (K = 0 every round; no EOS stops it)."""
    nobody = Watched(DraftEngine(target))
    out = run(nobody, target, prompt, n, 0, False, Stats())
    assert nobody.held == []
    return out


@pytest.mark.parametrize("predraft", [False, True])
def test_drafting_stops_where_the_drafts_context_ends_and_the_request_goes_on(model_dir, predraft):
    """The target drafting for itself (its guesses hold) through a draft session of 40 tokens: the
    request runs to 90 tokens, the draft's session never passes 40 (the draft would refuse it: the
    request would fail), it drafts up to that, its session is released, and then the target alone
    decodes the rest; the output is the target's."""
    target = ModelRunner(model_dir)
    assert target.max_context == 128
    prompt = [2 + i % 9 for i in range(10)]
    expected = alone(target, prompt, 80)
    assert len(expected) == 80
    stats = Stats()
    draft = Watched(DraftEngine(ModelRunner(model_dir, max_context=DRAFT_CONTEXT)), stats)
    assert run(draft, target, prompt, 80, 4, predraft, stats) == expected
    # its session was released once it was full, long before the request's end, and only then
    assert len(draft.released) == 1 and draft.released[0] < stats.rounds - 10
    # it drafted up to its context's end (a round of 4 short of it, at most)...
    assert DRAFT_CONTEXT - 4 <= max(draft.held) <= DRAFT_CONTEXT
    assert stats.draft_tokens >= (DRAFT_CONTEXT - len(prompt)) * 4 // 5 - 4
    assert stats.rounds > len(draft.held)  # ...and later rounds called it no more
    assert len(target.sessions) == 0 and len(draft.engine.runner.sessions) == 0


def test_a_prompt_past_the_drafts_context_is_decoded_by_the_target_alone(model_dir):
    target = ModelRunner(model_dir)
    prompt = [2 + i % 7 for i in range(DRAFT_CONTEXT + 5)]
    expected = alone(target, prompt, 20)
    draft = Watched(DraftEngine(ModelRunner(model_dir, max_context=DRAFT_CONTEXT)))
    stats = Stats()
    assert run(draft, target, prompt, 20, 4, False, stats) == expected
    assert draft.held == [] and stats.draft_tokens == 0


class Told(FixedK):
    """FixedK that records what each choice was told was left (K < it)."""

    def __init__(self, k: int, steps: int = 1):
        super().__init__(k, steps)
        self.told: list[int] = []

    def choose(self, remaining: int) -> int:
        self.told.append(remaining)
        return super().choose(remaining)


def test_the_policy_is_told_the_drafts_room_and_a_seeded_policy_decodes_several_tokens_past_it(model_dir):
    """The K policy learns the room (an adaptive one then neither drafts nor probes past the
    draft's context), and AcceptanceK, the seeded sampled requests' policy, decodes past it
    `steps` tokens a round: the same tokens as one a round, in fewer rounds."""
    target = ModelRunner(model_dir)
    prompt = [2 + i % 9 for i in range(10)]
    told = Told(4)
    run(Watched(DraftEngine(ModelRunner(model_dir, max_context=DRAFT_CONTEXT))), target, prompt, 60, told, False,
        Stats())
    assert told.told[0] == DRAFT_CONTEXT - len(prompt) + 1  # the room, not the 60 tokens left
    assert told.told[-1] == 1  # past the context: none (K < 1)
    assert sum(r == 1 for r in told.told) > 20
    seeded = SamplingParams(1.0, seed=3)
    outs, rounds = [], []
    for steps in (1, 8):
        stats = Stats()
        draft = Watched(DraftEngine(ModelRunner(model_dir, max_context=DRAFT_CONTEXT)))
        outs.append(run(draft, target, prompt, 60, AcceptanceK(4, None, steps), False, stats, seeded))
        rounds.append(stats.rounds)
        assert stats.draft_tokens > 0
    assert outs[0] == outs[1] and len(outs[0]) == 60
    assert rounds[1] < rounds[0] - 15
