"""Lockstep: the draft's and the target's calls of many generations, in turns that never overlap.

By default the coordinator pipelines: while the target verifies some sessions the draft
drafts for others, which is right when each model has its own hardware. Where the two
services share a few cores (one host, a CPU box), their passes then compete for them, and
the target, the busier of the two, runs its passes on one thread beside the draft's. With
`--lockstep` the coordinator instead lets the generations' calls reach the models in turns:
every generation waiting for the draft goes at once, and only when those calls are back and
every generation waits again, every one waiting for the target. Each service then sees its
whole group together (one batch) and has the cores to itself while it runs.

`PhaseGate` holds the calls; `GatedDraft` and `GatedTarget` wrap a DraftPeer / TargetPeer that
takes a call's turn (the round does not know). A generation that is neither waiting nor calling
(streaming its tokens, starting, ending) would hold everyone up, so a turn also starts once calls
have waited `hold_s` with none in flight. Each call let through is passed its turn (`turn`: a
random id and the number of calls): the gRPC peers send a turn's calls to one service as one
batch RPC, which the service serves in one pass, or each call saying its turn (`turn_id`,
`turn_size`), and the service then waits for all of the turn's calls before the pass (its
--turn-wait-ms). Ids are random: several coordinators may share a service.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Callable
from typing import Protocol

from speculative.protocol import Cost, Proposal, ProposeCall, Verdict, VerifyCall

DRAFT, TARGET = "draft", "target"


class TurnDraftPeer(Protocol):
    """A DraftPeer that is told the turn (id, number of calls) its call was let through in ((0, 0):
    not gated): the gRPC peers and the failover pass it on, the in-process ones ignore it."""

    async def propose(self, call: ProposeCall, *, turn: tuple[int, int] = (0, 0)) -> tuple[Proposal, Cost]: ...

    async def release(self, session_id: str) -> None: ...


class TurnTargetPeer(Protocol):
    """A TargetPeer that is told its call's turn (as TurnDraftPeer)."""

    async def verify(self, call: VerifyCall, *, turn: tuple[int, int] = (0, 0)) -> tuple[Verdict, Cost]: ...

    async def release(self, session_id: str) -> None: ...


class PhaseGate:
    """Lets calls through in turns: all those waiting for the draft, then all those waiting for the target.

    A turn starts when no call is in flight and either every live generation is waiting
    (`joined` / `left` count them) or calls have waited `hold_s` since the last turn ended (or
    since the first of them came, if later). The draft's turn comes first when calls wait for both.
    """

    def __init__(self, hold_s: float = 0.005):
        self.hold_s = hold_s
        self.live = 0
        self.waiting: dict[str, list[asyncio.Future]] = {DRAFT: [], TARGET: []}
        self.in_flight = 0
        self.turns = {DRAFT: 0, TARGET: 0}
        self.timer: asyncio.TimerHandle | None = None
        # called as each turn begins: (model, calls let through, whether the hold ran out before every
        # live generation waited)
        self.on_turn: Callable[[str, int, bool], None] | None = None

    def joined(self) -> None:
        self.live += 1

    def left(self) -> None:
        self.live -= 1
        self._next()

    async def enter(self, model: str) -> tuple[int, int]:
        """Wait for `model`'s turn; the caller then makes its call and calls `exit` after it.
        -> (the turn's id, the number of calls let through in it)"""
        future = asyncio.get_running_loop().create_future()
        self.waiting[model].append(future)
        self._next()
        try:
            return await future
        except asyncio.CancelledError:
            if future.cancelled():  # cancelled while waiting: never let through
                if future in self.waiting[model]:
                    self.waiting[model].remove(future)
                self._next()
            else:  # let through (counted in flight), but it will not call
                self.exit()
            raise

    def exit(self) -> None:
        self.in_flight -= 1
        self._next()

    def _next(self, timed_out: bool = False) -> None:
        waiting = len(self.waiting[DRAFT]) + len(self.waiting[TARGET])
        if self.in_flight > 0 or waiting == 0:
            return
        if waiting < self.live and not timed_out:
            if self.timer is None:
                self.timer = asyncio.get_running_loop().call_later(self.hold_s, self._expire)
            return
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        model = DRAFT if self.waiting[DRAFT] else TARGET
        # (a cancelled one has left the list, or leaves it when its caller resumes)
        turn, self.waiting[model] = [f for f in self.waiting[model] if not f.done()], []
        self.turns[model] += 1
        # in flight from now, not from when its callers resume: no other turn may start in between
        self.in_flight += len(turn)
        ticket = (random.getrandbits(63) | 1, len(turn))
        for future in turn:
            future.set_result(ticket)
        if self.on_turn is not None:
            self.on_turn(model, len(turn), waiting < self.live)

    def _expire(self) -> None:
        self.timer = None
        self._next(timed_out=True)


class GatedDraft:
    """A DraftPeer whose proposals wait for the draft's turn at `gate`."""

    def __init__(self, peer: TurnDraftPeer, gate: PhaseGate):
        self.peer = peer
        self.gate = gate

    async def propose(self, call: ProposeCall) -> tuple[Proposal, Cost]:
        turn = await self.gate.enter(DRAFT)
        try:
            return await self.peer.propose(call, turn=turn)
        finally:
            self.gate.exit()

    async def release(self, session_id: str) -> None:
        await self.peer.release(session_id)


class GatedTarget:
    """A TargetPeer whose verifications wait for the target's turn at `gate`."""

    def __init__(self, peer: TurnTargetPeer, gate: PhaseGate):
        self.peer = peer
        self.gate = gate

    async def verify(self, call: VerifyCall) -> tuple[Verdict, Cost]:
        turn = await self.gate.enter(TARGET)
        try:
            return await self.peer.verify(call, turn=turn)
        finally:
            self.gate.exit()

    async def release(self, session_id: str) -> None:
        await self.peer.release(session_id)
