"""The lockstep gate: the draft's and the target's calls never overlap, every live generation's
call joins its model's turn, a generation that does not call holds the others only `hold_s`,
a cancelled call frees its place, the tokens are those of the ungated round, and each call knows
its turn (id and size)."""

from __future__ import annotations

import asyncio
import time

import pytest

from model_service.engines import DraftEngine, TargetEngine
from model_service.local import LocalDraft, LocalTarget
from coordinator.lockstep import DRAFT, TARGET, GatedDraft, GatedTarget, PhaseGate
from model_service.model_runner import ModelRunner
from speculative.round import generate
from speculative.protocol import SamplingParams


class Recorder:
    """Wraps the local peers: each call takes `ms` of wall time (an await, as a gRPC call would),
    and every call's model, interval and turn is recorded."""

    def __init__(self, draft: LocalDraft, target: LocalTarget, ms: float = 2.0):
        self.draft, self.target, self.ms = draft, target, ms
        self.calls: list[tuple[str, float, float, str, tuple[int, int]]] = []  # model, start, end, session, turn
        self.active = {DRAFT: 0, TARGET: 0}
        self.overlaps = 0

    async def timed(self, model: str, session_id: str, turn: tuple[int, int], call):
        other = TARGET if model == DRAFT else DRAFT
        self.active[model] += 1
        self.overlaps += self.active[other] > 0
        start = time.perf_counter()
        await asyncio.sleep(self.ms / 1e3)
        try:
            return call()
        finally:
            self.active[model] -= 1
            self.calls.append((model, start, time.perf_counter(), session_id, turn))


class RecordedDraft:
    def __init__(self, rec: Recorder):
        self.rec = rec

    async def propose(self, call, turn=(0, 0)):
        return await self.rec.timed(DRAFT, call.session_id, turn, lambda: self.rec.draft.engine.propose(call))

    async def release(self, session_id: str) -> None:
        await self.rec.draft.release(session_id)


class RecordedTarget:
    def __init__(self, rec: Recorder):
        self.rec = rec

    async def verify(self, call, turn=(0, 0)):
        return await self.rec.timed(TARGET, call.session_id, turn, lambda: self.rec.target.engine.verify(call))

    async def release(self, session_id: str) -> None:
        await self.rec.target.release(session_id)


def local_peers(pair):
    draft_dir, target_dir = pair
    return LocalDraft(DraftEngine(ModelRunner(draft_dir))), LocalTarget(TargetEngine(ModelRunner(target_dir)))


PROMPTS = [[5, 9, 17], [40] * 11, [3, 1, 4, 1, 5, 9, 2, 6], [77, 78], [100, 101, 102, 103, 104, 105]]


async def run_generations(draft, target, gate: PhaseGate | None, ks, max_new=(12, 20, 7, 16, 9)):
    params = SamplingParams(0.0)
    outputs = [[] for _ in PROMPTS]

    async def one(i: int) -> None:
        d, t = (draft, target) if gate is None else (GatedDraft(draft, gate), GatedTarget(target, gate))
        if gate is not None:
            gate.joined()
        try:
            async for new in generate(d, t, PROMPTS[i], max_new_tokens=max_new[i], k=ks[i], params=params,
                                      max_context=256, session_id=f"g{i}"):
                outputs[i].extend(new)
        finally:
            if gate is not None:
                gate.left()

    await asyncio.gather(*(one(i) for i in range(len(PROMPTS))))
    return outputs


def test_turns_never_overlap_and_gather_every_generation(pair):
    ks = [3, 1, 4, 0, 2]  # mixed K; K = 0 rounds skip the draft
    plain = asyncio.run(run_generations(*local_peers(pair), None, ks))

    rec = Recorder(*local_peers(pair))
    gate = PhaseGate(hold_s=1.0)  # long: every turn must start because all live generations wait
    gated = asyncio.run(run_generations(RecordedDraft(rec), RecordedTarget(rec), gate, ks))
    assert gated == plain  # the gate changes when calls run, never what they compute

    ungated = Recorder(*local_peers(pair))
    asyncio.run(run_generations(RecordedDraft(ungated), RecordedTarget(ungated), None, ks))
    assert ungated.overlaps > 0  # without the gate the two models' calls do overlap here

    assert rec.overlaps == 0
    assert gate.in_flight == 0 and gate.live == 0 and not any(gate.waiting.values())
    # consecutive calls to one model form a turn: the first draft turn has the four generations
    # with K > 0, the first target turn all five (the K = 0 one went straight to it)
    turns, current = [], None
    for model, *_ in sorted(rec.calls, key=lambda c: c[1]):
        if current is None or current[0] != model:
            current = [model, 0]
            turns.append(current)
        current[1] += 1
    assert turns[0] == [DRAFT, 4] and turns[1] == [TARGET, 5]  # K = 0 goes straight to the target
    assert len(turns) <= gate.turns[DRAFT] + gate.turns[TARGET]  # (two target turns in a row read as one)
    assert_turn_sizes(rec.calls)


def assert_turn_sizes(calls) -> None:
    """Each call carried its turn: the calls of one turn id went to one model and number what the
    turn said; consecutive turns have different ids."""
    turns: dict[int, list] = {}
    for model, _, _, _, (turn, size) in calls:
        assert turn > 0 and size > 0
        turns.setdefault(turn, []).append((model, size))
    for members in turns.values():
        assert len(set(members)) == 1 and members[0][1] == len(members), members
    assert len(turns) > 2


async def until(condition, timeout: float = 30.0) -> None:
    """Let the event loop run the other tasks until condition() holds (fail after `timeout` s)."""
    async def poll() -> None:
        while not condition():
            await asyncio.sleep(0)

    await asyncio.wait_for(poll(), timeout)


def test_a_generation_that_does_not_call_holds_the_others_only_hold_s():
    async def scenario() -> float:
        gate = PhaseGate(hold_s=0.05)
        reported = []
        gate.on_turn = lambda *turn: reported.append(turn)
        gate.joined()  # a generation that is busy elsewhere (streaming, starting) and never calls
        gate.joined()
        start = time.perf_counter()
        # nobody else calls or leaves: only the hold running out can let it through (30 s: a hang)
        await asyncio.wait_for(gate.enter(TARGET), 30)
        waited = time.perf_counter() - start
        assert gate.in_flight == 1
        gate.exit()
        assert reported == [(TARGET, 1, True)]  # one call let through because the hold ran out
        gate.left()
        await gate.enter(DRAFT)  # now the only live generation: its turn starts at once
        gate.exit()
        assert reported[1:] == [(DRAFT, 1, False)]
        gate.left()
        return waited

    waited = asyncio.run(scenario())
    assert waited >= 0.04  # it was held (a loaded machine only makes the wait longer)


def test_a_call_waits_for_the_turn_in_flight_to_end():
    async def scenario() -> list[str]:
        gate = PhaseGate(hold_s=10.0)
        order, asked = [], []
        for _ in range(3):
            gate.joined()

        async def call(model: str, name: str, ms: float) -> None:
            asked.append(name)
            await gate.enter(model)  # (the gate decides in here, before the first await)
            order.append(f"{name}+")
            await asyncio.sleep(ms / 1e3)
            order.append(f"{name}-")
            gate.exit()
            if model == DRAFT:
                gate.left()  # that generation ends: the target's turn waits for no one

        a = asyncio.create_task(call(TARGET, "t1", 30))
        b = asyncio.create_task(call(DRAFT, "d1", 10))
        await until(lambda: len(asked) == 2)
        # two of three live generations wait: the turn waits for the third
        assert order == [] and gate.in_flight == 0 and len(gate.waiting[DRAFT] + gate.waiting[TARGET]) == 2
        c = asyncio.create_task(call(TARGET, "t2", 10))
        await asyncio.gather(a, b, c)
        for _ in range(2):
            gate.left()
        return order

    order = asyncio.run(scenario())
    # the draft's turn first; the target's two calls together, only after the draft's has ended (a
    # hold of 10 s: a turn that started on it would have come long after every call had come)
    assert order[:2] == ["d1+", "d1-"]
    assert sorted(order[2:4]) == ["t1+", "t2+"]


def test_a_cancelled_call_frees_its_place():
    async def scenario() -> None:
        gate = PhaseGate(hold_s=10.0)
        reported = []
        gate.on_turn = lambda *turn: reported.append(turn)
        gate.joined()
        gate.joined()
        waiting = asyncio.create_task(gate.enter(DRAFT))
        await until(lambda: gate.waiting[DRAFT])  # the call waits for its turn
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        gate.left()  # its generation ended
        await asyncio.wait_for(gate.enter(TARGET), 30)
        # the other, now alone, went at once: every live generation waited, not the 10 s hold
        assert reported == [(TARGET, 1, False)]
        assert gate.in_flight == 1 and not any(gate.waiting.values())
        gate.exit()
        gate.left()
        assert gate.in_flight == 0 and gate.live == 0

    asyncio.run(scenario())
