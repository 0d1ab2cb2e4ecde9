"""A request's draft and target, each one replica of its pool at a time, moving on when it fails.

When a call fails with a status that means the replica (or its copy of the session) is gone,
the session must start again, on another replica (or the same one, if only the session was
evicted), carrying the whole prefix. A call that starts a session carries it: it is made again
at once, up to TRIES times. Any other call carries only what is new: it raises SessionLost, and
the round (speculative/round.py) starts the session again from what its Sequence says is
committed. Nothing is lost and nothing repeated.

- The draft: with no draft replica left a start raises SessionLost too, and the round goes on
  without drafts (target-only rounds); it drafts again once a replica is back.
- The target: with no target replica left the request fails with UNAVAILABLE. A target
  session started again draws from a generator seeded afresh with the request's seed, so
  a sampled request stays exactly target-distributed but is no longer token-for-token the
  run without the fault; greedy output is identical.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from speculative.protocol import Cost, Proposal, SamplingParams, Verdict
from speculative.round import SessionLost

from .peers import PeerError
from .pool import Pool, Replica

log = logging.getLogger("specdec.failover")

# the replica or the session on it is gone: start again elsewhere (NOT_FOUND: evicted, same replica will do).
# Not INTERNAL / UNKNOWN: an error inside the engine belongs to the request that met it, and moving
# it would take every replica out of the pool in turn, failing everyone else's requests with it.
MOVE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.CANCELLED}
RESTART = MOVE | {grpc.StatusCode.NOT_FOUND}
TRIES = 3
FORGETTING: set[asyncio.Task] = set()  # releases sent to replicas a request moved away from (see _lost)


class _Failover:
    def __init__(self, pool: Pool):
        self.pool = pool
        self.replica: Replica | None = None

    async def _take(self, wait: bool) -> Replica | None:
        """The request's replica, or a new one; None if the pool has no healthy one, even after a
        fresh health check (awaited if `wait`, else started for the next round's sake)."""
        if self.replica is None:
            if not self.pool.healthy():
                if wait:
                    await self.pool.recheck()
                else:
                    self.pool.recheck_soon()
            if not self.pool.healthy():
                return None
            self.replica = self.pool.acquire()
        return self.replica

    def _lost(self, error: PeerError, session_id: str) -> None:
        if error.code in MOVE:
            replica = self.replica
            self.pool.failed(replica, error)
            self.pool.release(replica)
            self.replica = None
            # its copy of the session, should it answer again (a hung replica): unary calls and batch
            # RPCs have no stream whose end would free it there. In the background, bounded by the call's timeout
            forget = asyncio.ensure_future(self._forget(replica, session_id))
            FORGETTING.add(forget)
            forget.add_done_callback(FORGETTING.discard)
        log.warning("%s call failed (%s); starting the session again %s", self.pool.name, error,
                    "on another replica" if error.code in MOVE else "on the same replica")

    @staticmethod
    async def _forget(replica: Replica, session_id: str) -> None:
        try:
            await replica.peer.release(session_id)
        except Exception as e:  # gone, never to answer, or since removed from the pool: nothing is held there then
            log.debug("%s: releasing %s on %s failed: %s", replica.peer.name, session_id, replica.address, e)

    async def release(self, session_id: str) -> None:
        if self.replica is not None:
            replica, self.replica = self.replica, None
            try:
                await replica.peer.release(session_id)
            except PeerError:
                pass
            finally:
                self.pool.release(replica)

    def close(self) -> None:
        """Give the replica back (after release, or when the request ends without it)."""
        if self.replica is not None:
            self.pool.release(self.replica)
            self.replica = None


class FailoverDraft(_Failover):
    async def propose(self, session_id: str, start: bool, rollback: int, append: list[int], k: int,
                      params: SamplingParams, p_min: float = 0.0, *,
                      turn: tuple[int, int] = (0, 0)) -> tuple[Proposal, Cost]:
        for _ in range(TRIES if start else 1):
            replica = await self._take(wait=False)
            if replica is None:
                break
            try:
                return await replica.peer.propose(session_id, start, rollback, append, k, params, p_min, turn=turn)
            except PeerError as e:
                if e.code not in RESTART:
                    raise
                self._lost(e, session_id)
        raise SessionLost(session_id)


class FailoverTarget(_Failover):
    async def verify(self, session_id: str, start: bool, append: list[int], proposal: Proposal,
                     params: SamplingParams, *, turn: tuple[int, int] = (0, 0)) -> tuple[Verdict, Cost]:
        error: PeerError | None = None
        for _ in range(TRIES if start else 1):
            replica = await self._take(wait=True)
            if replica is None:
                break
            try:
                return await replica.peer.verify(session_id, start, append, proposal, params, turn=turn)
            except PeerError as e:
                if e.code not in RESTART:
                    raise
                error = e
                self._lost(e, session_id)
        if not start:
            raise SessionLost(session_id)
        detail = f" (last error: {error})" if error else ""
        raise self.pool.unavailable(f"no target replica left to continue this request on{detail}")
