"""In-process peers: the engines behind the DraftPeer / TargetPeer interfaces, no gRPC.

Used by the tests and by the bench to run the very round the coordinator runs,
in one process. A lockstep `turn` (coordinator/lockstep.py) is taken and ignored: the
engine's pass is the call's own.
"""

from __future__ import annotations

from .drafting import DraftMethod, ProposeCall, one_result
from .engines import TargetEngine
from speculative.protocol import Cost, Proposal, SamplingParams, Verdict


class LocalDraft:
    """Any drafting method (drafting.py) as a DraftPeer."""

    def __init__(self, engine: DraftMethod):
        self.engine = engine

    async def propose(
        self, session_id: str, start: bool, rollback: int, append: list[int], k: int, params: SamplingParams,
        p_min: float = 0.0, *, turn: tuple[int, int] = (0, 0),
    ) -> tuple[Proposal, Cost]:
        return one_result(self.engine.propose_many([ProposeCall(session_id, start, rollback, append, k, params, p_min)]))

    async def release(self, session_id: str) -> None:
        self.engine.release(session_id)


class LocalTarget:
    def __init__(self, engine: TargetEngine):
        self.engine = engine

    async def verify(
        self, session_id: str, start: bool, append: list[int], proposal: Proposal, params: SamplingParams,
        steps: int = 1, *, turn: tuple[int, int] = (0, 0),
    ) -> tuple[Verdict, Cost]:
        return self.engine.verify(session_id, start, append, proposal, params, steps)

    async def release(self, session_id: str) -> None:
        self.engine.release(session_id)
