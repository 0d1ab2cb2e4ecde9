"""In-process peers: the engines behind the DraftPeer / TargetPeer interfaces, no gRPC.

Used by the tests and by the bench to run the very round the coordinator runs,
in one process. A lockstep `turn` (coordinator/lockstep.py) is taken and ignored: the
engine's pass is the call's own.
"""

from __future__ import annotations

from speculative.protocol import Cost, Proposal, ProposeCall, Verdict, VerifyCall

from .drafting import DraftMethod, one_result
from .engines import TargetEngine


class LocalDraft:
    """Any drafting method (drafting.py) as a DraftPeer."""

    def __init__(self, engine: DraftMethod):
        self.engine = engine

    async def propose(self, call: ProposeCall, *, turn: tuple[int, int] = (0, 0)) -> tuple[Proposal, Cost]:
        return one_result(self.engine.propose_many([call]))

    async def release(self, session_id: str) -> None:
        self.engine.release(session_id)


class LocalTarget:
    def __init__(self, engine: TargetEngine):
        self.engine = engine

    async def verify(self, call: VerifyCall, *, turn: tuple[int, int] = (0, 0)) -> tuple[Verdict, Cost]:
        return one_result(self.engine.verify_many([call]))

    async def release(self, session_id: str) -> None:
        self.engine.release(session_id)
