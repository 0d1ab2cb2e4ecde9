"""A target call with no proposal that decodes several tokens (VerifyRequest.decode_steps): the
same tokens as that many one-token calls, greedy and seeded sampled, through the engine, the round
and the gRPC service; its stops; what it refuses."""

from __future__ import annotations

import asyncio
import dataclasses

import grpc
import pytest

from model_service.engines import DraftEngine, TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.errors import InvalidRequest
from speculative.protocol import Proposal, ProposeCall, SamplingParams, VerifyCall
from speculative.round import FixedK, Stats, generate

from .test_engines import one_hot_proposal

GREEDY = SamplingParams(0.0)
PROMPT = [5, 17, 42, 9, 100, 3]


@pytest.fixture(scope="module")
def target(pair):
    _, target_dir = pair
    return TargetEngine(ModelRunner(target_dir))


def one_at_a_time(target: TargetEngine, session: str, params: SamplingParams, n: int,
                  prompt: list[int] = PROMPT) -> list[int]:
    verdict, _ = target.verify(VerifyCall(session, True, prompt, Proposal(), params))
    tokens = [verdict.token]
    while len(tokens) < n:
        verdict, _ = target.verify(VerifyCall(session, False, [], Proposal(), params))
        tokens.append(verdict.token)
    target.release(session)
    return tokens


def in_calls(target: TargetEngine, session: str, params: SamplingParams, n: int, steps: int) -> tuple[list[int], int]:
    """n tokens, `steps` a call. -> (tokens, calls)"""
    tokens, calls = [], 0
    start = True
    while len(tokens) < n:
        verdict, _ = target.verify(VerifyCall(session, start, PROMPT if start else [], Proposal(), params, steps))
        got = [verdict.token, *verdict.decoded]
        assert verdict.accepted == 0 and len(got) <= steps
        if len(got) < steps and len(tokens) + len(got) < n:  # stopped short only after an EOS
            assert got[-1] in target.runner.eos_token_ids
        tokens += got
        start, calls = False, calls + 1
    target.release(session)
    return tokens[:n], calls


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(1.0, seed=11), SamplingParams(0.8, top_k=20, seed=5)],
                         ids=["greedy", "sampled", "top-k"])
def test_several_steps_a_call_decode_what_one_step_a_call_does(target, params):
    want = one_at_a_time(target, "one", params, 24)
    got, calls = in_calls(target, "many", params, 24, steps=5)
    assert got == want
    assert calls <= len(want) // 2


def test_decoding_stops_after_an_eos(target):
    runner = target.runner
    want = one_at_a_time(target, "ref", GREEDY, 12)
    eos = want[4]  # a token the target decodes fifth: make it the end of a sequence
    saved = runner.eos_token_ids
    runner.eos_token_ids = [eos]
    try:
        verdict, _ = target.verify(VerifyCall("eos", True, PROMPT, Proposal(), GREEDY, 8))
    finally:
        runner.eos_token_ids = saved
        target.release("eos")
    tokens = [verdict.token, *verdict.decoded]
    assert tokens == want[: want.index(eos) + 1]


@pytest.mark.parametrize("lookup", [0, 4])
def test_decoding_stops_after_a_stop_token_id(target, lookup):
    """A request's stop token ids end a call's decode steps as an EOS does (the output ends there:
    steps past it would be thrown away), and a copy stops short of one."""
    prompt = PROMPT * 3  # (a context to copy from)
    plain, _ = target.verify(VerifyCall("plain", True, prompt, Proposal(), GREEDY, 10, lookup=lookup))
    target.release("plain")
    want = [plain.token, *plain.decoded]
    assert len(want) == 10  # (the test can fail)
    stop = want[5]
    params = dataclasses.replace(GREEDY, stop_token_ids=(stop,))
    verdict, _ = target.verify(VerifyCall("stop", True, prompt, Proposal(), params, 10, lookup=lookup))
    target.release("stop")
    assert [verdict.token, *verdict.decoded] == want[: want.index(stop) + 1]


def test_a_copy_stops_short_of_a_stop_token_id(target):
    target.verify(VerifyCall("copy", True, PROMPT * 2, Proposal(), GREEDY))
    session = target.runner.sessions.get("copy")
    session.tokens.extend(PROMPT)  # (read by the copy only; the session is dropped after)
    try:
        copy = target._copy(session, 4, 8)
        assert len(copy) == 4  # (the test can fail)
        assert target._copy(session, 4, 8, (copy[2],)) == copy[: copy.index(copy[2])]
    finally:
        target.release("copy")


def test_decoding_stops_at_the_context(pair):
    _, target_dir = pair
    target = TargetEngine(ModelRunner(target_dir, max_context=len(PROMPT) + 3))
    verdict, _ = target.verify(VerifyCall("ctx", True, PROMPT, Proposal(), GREEDY, 8))
    assert 1 + len(verdict.decoded) == 3  # the prompt and 3 tokens fill the context
    assert len(target.runner.sessions.get("ctx").tokens) == len(PROMPT) + 3


def test_decoding_on_never_holds_back_another_session(target):
    """In a pass with draft tokens to verify, a call asking for several tokens gets one; and the
    steps stop once other calls wait for the model (busy), after at least the first token."""

    want = one_at_a_time(target, "ref", GREEDY, 6)
    target.verify(VerifyCall("spec", True, PROMPT, Proposal(), GREEDY))
    mixed = target.verify_many([VerifyCall("plain", True, PROMPT, Proposal(), GREEDY, 6),
                                VerifyCall("spec", False, [], one_hot_proposal([1, 2]), GREEDY)])
    (plain, _), (spec, _) = mixed
    assert plain.token == want[0] and plain.decoded == [] and spec.decoded == []
    target.release("plain")
    answers = iter([False, False])  # nothing waits before the next two passes, then something does
    try:
        [(verdict, _)] = target.verify_many([VerifyCall("yield", True, PROMPT, Proposal(), GREEDY, 6)],
                                            busy=lambda: next(answers, True))
    finally:
        for session in ("spec", "yield"):
            target.release(session)
    assert [verdict.token, *verdict.decoded] == want[:3]  # two more passes, then others wait


def test_the_engine_refuses_steps_it_cannot_take(target):
    with pytest.raises(InvalidRequest, match="decode_steps must lie in"):
        target.verify(VerifyCall("big", True, PROMPT, Proposal(), GREEDY, target.max_tokens + 1))
    with pytest.raises(InvalidRequest, match="decode_steps=3"):
        target.verify(VerifyCall("mixed", True, PROMPT, one_hot_proposal([1, 2]), GREEDY, 3))
    assert len(target.runner.sessions) == 0  # refused before touching a session


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(0.9, seed=7)], ids=["greedy", "sampled"])
def test_a_round_without_drafting_decodes_steps_and_the_output_is_unchanged(pair, target, params):
    draft_dir, _ = pair
    draft = LocalDraft(DraftEngine(ModelRunner(draft_dir)))

    def run(steps: int) -> tuple[list[int], Stats]:
        stats = Stats()

        async def go():
            out = []
            async for new in generate(draft, LocalTarget(target), PROMPT, max_new_tokens=30, k=FixedK(0, steps),
                                      params=params, max_context=256, stats=stats, session_id=f"r{steps}"):
                out.extend(new)
            return out

        return asyncio.run(go()), stats

    one, one_stats = run(1)
    many, many_stats = run(8)
    assert many == one and len(many) == 30
    assert one_stats.rounds == 30
    assert many_stats.rounds == 5  # the first token alone (time to first token), then 8 + 8 + 8 + 5


class Unsure:
    """A draft peer whose draft stops before its first token (p_min 1.0: no token is that sure) on
    the calls `unsure(n)` names (n counts its calls from 0): it proposes nothing there."""

    def __init__(self, draft: LocalDraft, unsure):
        self.draft, self.unsure, self.calls = draft, unsure, 0

    async def propose(self, call: ProposeCall, *, turn: tuple[int, int] = (0, 0)):
        n, self.calls = self.calls, self.calls + 1
        return await self.draft.propose(dataclasses.replace(call, p_min=1.0) if self.unsure(n) else call)

    async def release(self, session_id: str) -> None:
        await self.draft.release(session_id)


def decode(draft, target: TargetEngine, params: SamplingParams, k, session: str) -> tuple[list[int], Stats]:
    stats = Stats()

    async def go():
        out = []
        async for new in generate(draft, LocalTarget(target), PROMPT, max_new_tokens=30, k=k, params=params,
                                  max_context=256, stats=stats, session_id=session):
            out.extend(new)
        return out

    return asyncio.run(go()), stats


class Timed(FixedK):
    """FixedK as a policy whose K follows timings (AdaptiveK): no replay is promised."""

    replays = False


@pytest.mark.parametrize("params, policy, rounds", [
    (GREEDY, FixedK, 5),  # 1 token first, then 8 + 8 + 8 + 5
    (SamplingParams(0.9, seed=7), Timed, 5),
    # seeded sampled under a policy that replays: how many steps a call carries follows timings and
    # load, and would move where later rounds draft, so such a round commits one token
    (SamplingParams(0.9, seed=7), FixedK, 30),
], ids=["greedy", "sampled", "sampled-replays"])
def test_a_round_whose_draft_proposes_nothing_decodes_steps(pair, target, params, policy, rounds):
    """A round that asks for draft tokens and gets none decodes as a K = 0 round does: `steps`
    tokens in its one target call, each drawn as a round with nothing proposed draws it."""
    draft_dir, _ = pair
    draft = Unsure(LocalDraft(DraftEngine(ModelRunner(draft_dir))), lambda n: True)
    want, _ = decode(draft, target, params, FixedK(0, 1), "plain")
    got, stats = decode(draft, target, params, policy(4, 8), "unsure")
    assert got == want and len(got) == 30
    assert stats.rounds == rounds
    assert stats.draft_calls == min(rounds, 29)  # each round asks the draft, but one for the last token alone
    assert stats.draft_tokens == 0


def test_rounds_that_draft_and_rounds_that_decode_steps_mix(pair, target):
    """Greedy: the target's own tokens, whichever rounds proposed (the draft catches up on the
    decoded tokens at its next call)."""
    draft_dir, _ = pair
    draft = Unsure(LocalDraft(DraftEngine(ModelRunner(draft_dir))), lambda n: n % 3 == 1)
    want, _ = decode(draft, target, GREEDY, FixedK(0, 1), "plain")
    got, stats = decode(draft, target, GREEDY, FixedK(3, 6), "mixed")
    assert got == want
    assert stats.draft_tokens > 0 and stats.rounds < 30 - stats.accepted_tokens  # some rounds decoded several


def test_the_service_decodes_steps_over_grpc(stack):
    channel = grpc.insecure_channel(stack.target_addr)
    stub = pb_grpc.TargetStub(channel)
    greedy = pb.SamplingParams(temperature=0.0, top_p=1.0)
    try:
        first = stub.Verify(pb.VerifyRequest(session_id="g1", start=True, append=PROMPT, sampling=greedy,
                                             decode_steps=6))
        one = [stub.Verify(pb.VerifyRequest(session_id="g2", start=True, append=PROMPT, sampling=greedy)).token]
        for _ in range(5):
            one.append(stub.Verify(pb.VerifyRequest(session_id="g2", sampling=greedy)).token)
        assert [first.token, *first.decoded] == one
        with pytest.raises(grpc.RpcError) as err:
            stub.Verify(pb.VerifyRequest(session_id="g1", sampling=greedy, decode_steps=1000))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "decode_steps" in err.value.details()
    finally:
        for session in ("g1", "g2"):
            stub.Release(pb.ReleaseRequest(session_id=session))
        channel.close()
