"""In-process peers: the engines behind the DraftPeer / TargetPeer interfaces, no gRPC.

Used by the tests and by the bench to run the very round the coordinator runs,
in one process.
"""

from __future__ import annotations

from .engines import DraftEngine, TargetEngine
from .round import Cost, Proposal, Verdict
from .sampling import SamplingParams


class LocalDraft:
    def __init__(self, engine: DraftEngine):
        self.engine = engine

    async def propose(
        self, session_id: str, start: bool, rollback: int, append: list[int], k: int, params: SamplingParams
    ) -> tuple[Proposal, Cost]:
        proposal, ms = self.engine.propose(session_id, start, rollback, append, k, params)
        return proposal, Cost(ms)

    async def release(self, session_id: str) -> None:
        self.engine.runner.sessions.release(session_id)


class LocalTarget:
    def __init__(self, engine: TargetEngine):
        self.engine = engine

    async def verify(
        self, session_id: str, start: bool, append: list[int], proposal: Proposal, params: SamplingParams
    ) -> tuple[Verdict, Cost]:
        verdict, ms = self.engine.verify(session_id, start, append, proposal, params)
        return verdict, Cost(ms)

    async def release(self, session_id: str) -> None:
        self.engine.runner.sessions.release(session_id)
