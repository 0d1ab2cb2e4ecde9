"""Lockstep: the draft's and the target's calls of many generations, in turns that never overlap.

By default the coordinator pipelines: while the target verifies some sessions the draft
drafts for others, which is right when each model has its own hardware. Where the two
services share a few cores (one host, a CPU box), their passes then compete for them, and
the target, the busier of the two, runs its passes on one thread beside the draft's. With
`--lockstep` the coordinator instead lets the generations' calls reach the models in turns:
every generation waiting for the draft goes at once, and only when those calls are back and
every generation waits again, every one waiting for the target. Each service then sees its
whole group together (one batch) and has the cores to itself while it runs.

With `--lockstep-groups G` (G > 1) the generations form G groups, each in lockstep of its
own, and the groups take turns at each model: while one group's calls are at the target,
another's are at the draft. Both models work at once, as when pipelining, but each pass
serves a whole group instead of whichever calls happened to be waiting (the free-running
pipeline splits 8 streams into target passes of ~2.7 sessions on average; two groups give
passes of 4).

`PhaseGate` holds the calls; `GatedDraft` and `GatedTarget` wrap any DraftPeer / TargetPeer
(the round does not know). A generation that is neither waiting nor calling (streaming its
tokens, starting, ending) would hold everyone up, so a turn also starts once calls have
waited `hold_s` with none in flight. Each call let through carries its turn's size
(`TURN_SIZE`, sent as `turn_size`), so a model service can wait for the rest of a turn
before it starts the pass (its --turn-wait-ms).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable

from .round import Cost, DraftPeer, Proposal, TargetPeer, Verdict
from .sampling import SamplingParams

DRAFT, TARGET = "draft", "target"

# the number of calls let through in the turn of the call being made (0: not gated); the gRPC
# peers send it as the request's turn_size
TURN_SIZE: contextvars.ContextVar[int] = contextvars.ContextVar("specdec_turn_size", default=0)


class PhaseGate:
    """Lets calls through in turns: all those waiting for the draft, then all those waiting for the target.

    A turn starts when no call is in flight and either every live generation is waiting
    (`joined` / `left` count them) or calls have waited `hold_s` since the last turn ended (or
    since the first of them came, if later). The draft's turn comes first when calls wait for both.
    Gates of one `Lockstep` (its groups) also share the models: a turn starts only on a model
    no other group's turn holds; the model is free again when that turn's last call is back.
    """

    def __init__(self, hold_s: float = 0.005, lockstep: Lockstep | None = None):
        self.hold_s = hold_s
        self.lockstep = lockstep
        self.live = 0
        self.waiting: dict[str, list[asyncio.Future]] = {DRAFT: [], TARGET: []}
        self.in_flight = 0
        self.holds: str | None = None  # the model this gate's turn holds (with a lockstep)
        self.expired = False  # the hold ran out while the models were held by other groups
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

    async def enter(self, model: str) -> int:
        """Wait for `model`'s turn; the caller then makes its call and calls `exit` after it.
        -> the number of calls let through in this turn"""
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
        if self.in_flight == 0:
            self._free()
        self._next()

    def _free(self) -> None:
        """This gate's turn is over: its model is free for the other groups."""
        if self.holds is not None:
            self.lockstep.holder[self.holds] = None
            self.holds = None
            self.lockstep.freed(self)

    def _next(self, timed_out: bool = False) -> None:
        waiting = len(self.waiting[DRAFT]) + len(self.waiting[TARGET])
        if self.in_flight > 0 or waiting == 0:
            return
        self.expired = self.expired or timed_out
        if waiting < self.live and not self.expired:
            if self.timer is None:
                self.timer = asyncio.get_running_loop().call_later(self.hold_s, self._expire)
            return
        models = [m for m in (DRAFT, TARGET) if self.waiting[m]]
        if self.lockstep is not None:
            models = [m for m in models if self.lockstep.holder[m] is None]
            if not models:
                return  # another group's turn holds the model; its end looks here again
            self.lockstep.holder[models[0]] = self
            self.holds = models[0]
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.expired = False
        model = models[0]
        turn, self.waiting[model] = [f for f in self.waiting[model] if not f.done()], []
        # (a cancelled one has left, or leaves the list when its caller resumes)
        self.turns[model] += 1
        # in flight from now, not from when its callers resume: no other turn may start in between
        self.in_flight += len(turn)
        for future in turn:
            future.set_result(len(turn))
        if self.on_turn is not None:
            self.on_turn(model, len(turn), waiting < self.live)
        if not turn:
            self._free()

    def _expire(self) -> None:
        self.timer = None
        self._next(timed_out=True)


class Lockstep:
    """The coordinator's gates: `groups` PhaseGates sharing the two models. A generation joins
    the group with the fewest live generations."""

    def __init__(self, groups: int = 1, hold_s: float = 0.005):
        if groups < 1:
            raise ValueError(f"lockstep groups must be >= 1, not {groups}")
        self.holder: dict[str, PhaseGate | None] = {DRAFT: None, TARGET: None}
        self.gates = [PhaseGate(hold_s, self if groups > 1 else None) for _ in range(groups)]

    @property
    def on_turn(self) -> Callable[[str, int, bool], None] | None:
        return self.gates[0].on_turn

    @on_turn.setter
    def on_turn(self, report: Callable[[str, int, bool], None] | None) -> None:
        for gate in self.gates:
            gate.on_turn = report

    def join(self) -> PhaseGate:
        """A generation starts: -> its group's gate (call its `left` when the generation ends)."""
        gate = min(self.gates, key=lambda g: g.live)
        gate.joined()
        return gate

    def freed(self, by: PhaseGate) -> None:
        """`by`'s turn let its model go: the other groups' waiting calls may take it."""
        for gate in self.gates:
            if gate is not by:
                gate._next()


class GatedDraft:
    """A DraftPeer whose proposals wait for the draft's turn at `gate`."""

    def __init__(self, peer: DraftPeer, gate: PhaseGate):
        self.peer = peer
        self.gate = gate

    async def propose(self, session_id: str, start: bool, rollback: int, append: list[int], k: int,
                      params: SamplingParams, p_min: float = 0.0) -> tuple[Proposal, Cost]:
        turn = TURN_SIZE.set(await self.gate.enter(DRAFT))
        try:
            return await self.peer.propose(session_id, start, rollback, append, k, params, p_min)
        finally:
            TURN_SIZE.reset(turn)
            self.gate.exit()

    async def release(self, session_id: str) -> None:
        await self.peer.release(session_id)


class GatedTarget:
    """A TargetPeer whose verifications wait for the target's turn at `gate`."""

    def __init__(self, peer: TargetPeer, gate: PhaseGate):
        self.peer = peer
        self.gate = gate

    async def verify(self, session_id: str, start: bool, append: list[int], proposal: Proposal,
                     params: SamplingParams) -> tuple[Verdict, Cost]:
        turn = TURN_SIZE.set(await self.gate.enter(TARGET))
        try:
            return await self.peer.verify(session_id, start, append, proposal, params)
        finally:
            TURN_SIZE.reset(turn)
            self.gate.exit()

    async def release(self, session_id: str) -> None:
        await self.peer.release(session_id)
