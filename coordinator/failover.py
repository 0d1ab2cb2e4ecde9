"""A request's draft and target, each one replica of its pool at a time, moving on when it fails.

When a call fails with a status that means the replica (or its copy of the session) is gone,
the session must start again, on another replica (or the same one, if only the session was
evicted), carrying the whole prefix. A call that starts a session carries it: it is made again
at once, up to TRIES times. Any other call carries only what is new: it raises SessionLost, and
the round (speculative/round.py) starts the session again from what its Sequence says is
committed. Nothing is lost and nothing repeated.

- The draft: with no draft replica left a start raises SessionLost too, and the round goes on
  without drafts (target-only rounds); it drafts again once a replica is back. A draft replica
  with no room for the session (RESOURCE_EXHAUSTED: its sessions or tokens at their caps) is
  left alone by the request for FULL_WAIT: it drafts on another or not at all, rather than fail
  (drafting is optional: a draft filled by other callers failed every drafting request).
- A late draft gives way: a draft call not answered within its replica's bound (a few times
  its recent calls' 99th percentile, at least 50 ms: pool.RecentLatency) raises SessionLost at
  the bound, and the round goes on with a plain target step. Its answer, when it comes, is
  discarded and the session it was for released; until then the request leaves that replica
  alone (it drafts on another, or not at all), then starts a session there again. A replica
  late MISSES times in a row is taken out as a failed one is, until its health check passes.
  A request that replays from its seed (sampled under a fixed K, or a seeded one's AcceptanceK:
  `patient`) waits up to PATIENT_BOUND instead: a round that went on without its draft would draw
  other random numbers, and the seed would give another output under load than without it. An
  answer past the bound still counts as late for the replica (and as the bound in its latency
  record), so a replica grown slow is taken out for new requests by patient requests as by the
  others; a patient request itself keeps its session there (one started again, or none, would draw
  other numbers too), unless a call of its passes PATIENT_BOUND.
- The target: with no target replica left the request fails with UNAVAILABLE. A start refused
  for want of room (RESOURCE_EXHAUSTED: the replica's sessions, queue or tokens at their caps, as
  another coordinator's requests may fill them) is made on another replica where one is left, the
  full one left alone by the request for FULL_WAIT; where none is, the refusal is the request's. A target
  session started again draws from a generator seeded from the request's seed and the position
  it starts at (round._start_params: not the numbers that drew the output so far), so a sampled
  request stays exactly target-distributed but is no longer token-for-token the run without the
  fault; greedy output is identical.
- A target replica with no room for a session's next tokens (RESOURCE_EXHAUSTED mid-request, its
  sessions together at --max-kv-tokens while the session alone would fit: errors.ROOM_LATER) has the
  session given back there, freeing its tokens for the others, and the request starts it again once
  there is room (on a replica not tried since its last pause, or after a pause, doubling from
  ROOM_POLL's first to its last, each replica again), waiting up to ROOM_WAIT. While requests wait
  so, this coordinator admits no new request (its first start is RESOURCE_EXHAUSTED, 429 over HTTP,
  as a full replica's is): those that gave room back go first, and a stream of short new requests
  cannot starve a long one. Requests that wait hold no target session, so they cannot deadlock each
  other (they keep their draft's). Not so a request that would replay from its seed (a sampled one
  under a fixed K or a seeded AcceptanceK: `patient`): a session started again draws afresh, so it
  fails there as before, and so does one under the lockstep gate, whose turn a wait would hold; a
  session that alone would pass the cap, a full queue (--max-queue), the session cap, and a start
  after a fault (a replica lost, a session evicted) that finds no room fail at once too.

A session started again takes a new id on the service (`<id>.<n>`): what is left of the one
before (on a replica that hung and woke up, or behind a late call) never meets it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import replace

import grpc

from speculative.errors import ROOM_LATER
from speculative.protocol import Cost, Proposal, ProposeCall, Verdict, VerifyCall
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
MISSES = 3  # late draft calls in a row that take a replica out
FORGET_WAIT = 120.0  # s: how long a release that failed waits for its hung replica to serve again
FORGET_POLL = 0.5    # s: how often it looks
FULL_WAIT = 1.0  # s: how long a request leaves a replica that had no room for its session
ROOM_WAIT = 60.0  # s: how long a request that gave its target session's room back waits to start it again
ROOM_POLL = 0.02, 0.5  # s: its first wait before trying again, and the longest (doubling in between)
RELEASE_WAIT = 1.0  # s: how long it waits for its session's release first (then that goes on in the background)
PATIENT_BOUND = 10.0  # s: how long a replaying request waits for a draft call before it is late
# work left to the background: releases on replicas a request moved away from (see _lost), late
# calls awaited to drop their answers (see FailoverDraft._late)
FORGETTING: set[asyncio.Task] = set()


def _room_later(error: PeerError) -> bool:
    """Whether a refusal is a target's sessions at --max-kv-tokens where the call alone would fit."""
    return error.code == grpc.StatusCode.RESOURCE_EXHAUSTED and ROOM_LATER in error.details


async def _serving_again(replica: Replica, deadline: float) -> bool:
    """Wait until the pool's health checks find `replica` serving again: False once it is removed
    from the pool or `deadline` (time.monotonic()) passes first."""
    while not replica.removed and time.monotonic() < deadline:
        await asyncio.sleep(FORGET_POLL)
        if replica.healthy:
            return True
    return False


class _Failover:
    def __init__(self, pool: Pool):
        self.pool = pool
        self.replica: Replica | None = None
        self.session: str | None = None  # the request's session's id on its replica (see `_name`)
        self.starts = 0  # sessions started for the request
        self.error: PeerError | None = None  # the last call's failure
        self.behind: set[Replica] = set()  # replicas yet to answer a late call of the request's
        self.full: dict[Replica, float] = {}  # replicas that had no room for the session: until when left alone
        self.prompt: list[int] | None = None  # the request's prompt: the pool prefers a replica holding it
        self.holder: Replica | None = None  # the replica that held the request's session last

    def _name(self, session_id: str, start: bool) -> str:
        """The session's id on the service: a start after the first takes a new one."""
        if start:
            self.session = f"{session_id}.{self.starts}" if self.starts else session_id
            self.starts += 1
        return self.session or session_id

    async def _take(self, wait: bool) -> Replica | None:
        """The request's replica, or a new one; None if the pool has no healthy one, even after a
        fresh health check (awaited if `wait`, else started for the next round's sake)."""
        if self.replica is None:
            if not self._candidates():
                if wait:
                    await self.pool.recheck()
                else:
                    self.pool.recheck_soon()
            if not self._candidates():
                return None
            self.replica = self.holder = self.pool.acquire(exclude=self._left(), prompt=self.prompt)
        return self.replica

    def _candidates(self) -> list[Replica]:
        left = self._left()
        return [r for r in self.pool.healthy() if r not in left]

    def _left(self) -> set[Replica]:
        """Replicas the request leaves alone now: those yet to answer a late call, and those full lately."""
        now = time.monotonic()
        return self.behind | {r for r, until in self.full.items() if until > now}

    def _lost(self, error: PeerError, session: str) -> None:
        self.error = error
        if error.code in MOVE:
            replica = self.replica
            self.pool.failed(replica, error)
            self.pool.release(replica)
            self.replica = None
            # its copy of the session, should it answer again (a hung replica): unary calls and batch
            # RPCs have no stream whose end would free it there. In the background, bounded by the call's timeout
            self._in_background(self._forget(replica, session))
        log.warning("%s call failed (%s); starting the session again %s", self.pool.name, error,
                    "on another replica" if error.code in MOVE else "on the same replica")

    @staticmethod
    def _in_background(work) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        FORGETTING.add(task)
        task.add_done_callback(FORGETTING.discard)
        return task

    @staticmethod
    async def _forget(replica: Replica, session: str) -> None:
        """Release `session` on a replica the request left. One that hung (stopped, swapping) does not
        answer within the call's timeout: then wait until its health check passes again (it woke up,
        its copy of the session with it), up to FORGET_WAIT, and try once more. A replica gone or
        removed from the pool holds nothing; one that never comes back frees the session itself,
        after its idle timeout."""
        deadline = time.monotonic() + FORGET_WAIT
        while True:
            try:
                await replica.peer.release(session)
                return
            except Exception as e:  # noqa: BLE001 - gone, hung, or never to answer
                log.debug("%s: releasing %s on %s failed: %s", replica.peer.name, session, replica.address, e)
            if not await _serving_again(replica, deadline):
                return

    async def release(self, session_id: str) -> None:
        """Release the request's session on its replica; a release that fails (a replica too slow to
        answer it in time, or hung) is made again in the background (`_forget`), not left to the
        replica's idle timeout. The request waits for it RELEASE_WAIT at most (a hung replica does not
        hold a cancel, or a reply, for the release's timeout); then it goes on in the background."""
        if self.replica is not None:
            replica, self.replica = self.replica, None
            task = asyncio.ensure_future(self._release(replica, self.session or session_id))
            self.pool.releasing.add(task)  # (a stopping coordinator closes the channel after it: Pool.close)
            task.add_done_callback(self.pool.releasing.discard)
            await asyncio.wait([task], timeout=RELEASE_WAIT)

    async def _release(self, replica: Replica, session: str) -> None:
        try:
            await replica.peer.release(session)
        except PeerError as e:
            log.info("%s: releasing %s on %s failed (%s): trying again in the background", self.pool.name,
                     session, replica.address, e)
            self._in_background(self._forget(replica, session))
        except Exception:  # (a fault of its own: logged, the request having ended)
            log.exception("%s: releasing %s on %s failed", self.pool.name, session, replica.address)
        finally:
            self.pool.release(replica)

    def noted(self, tokens: list[int]) -> None:
        """The request's sequence at its end, noted as held where its session was (a prompt that
        continues it goes there: Pool.acquire)."""
        if self.holder is not None:
            self.pool.affinity.note(tokens, self.holder.address)

    def close(self) -> None:
        """Give the replica back (after release, or when the request ends without it)."""
        if self.replica is not None:
            self.pool.release(self.replica)
            self.replica = None


class FailoverDraft(_Failover):
    def __init__(self, pool: Pool, patient: bool = False):
        """patient: the request replays from its seed (the module's docstring): late only past PATIENT_BOUND."""
        super().__init__(pool)
        self.patient = patient

    async def propose(self, call: ProposeCall, *, turn: tuple[int, int] = (0, 0)) -> tuple[Proposal, Cost]:
        start, prefix = call.start, len(call.append)
        for _ in range(TRIES if start else 1):
            replica = await self._take(wait=False)
            if replica is None:
                break
            session = self._name(call.session_id, start)
            began = time.perf_counter()
            bound = replica.recent.bound(start, prefix)
            answering = asyncio.ensure_future(replica.peer.propose(replace(call, session_id=session), turn=turn))
            try:
                await asyncio.wait([answering], timeout=max(bound, PATIENT_BOUND) if self.patient else bound)
            except asyncio.CancelledError:
                answering.cancel()
                raise
            if not answering.done():
                self._late(replica, session, answering, bound, start, prefix)
                break
            took = time.perf_counter() - began
            try:
                answer = answering.result()
            except PeerError as e:
                if e.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    self._no_room(replica, e, session, start)
                    continue
                if e.code not in RESTART:
                    raise
                self._lost(e, session)
                continue
            replica.recent.add(min(took, bound), start, prefix)
            if took <= bound:
                replica.missed = 0
            else:  # a patient call past the bound was late all the same: the replica's record as any request's
                replica.missed += 1
                if replica.missed >= MISSES:  # taken out for new requests; this one keeps its session there
                    # (drafting elsewhere or not at all, it would draw other numbers: its seed another output)
                    self.pool.failed(replica, PeerError(replica.peer, grpc.StatusCode.DEADLINE_EXCEEDED,
                                                        f"late {replica.missed} calls in a row"))
            return answer
        raise SessionLost(call.session_id)

    def _no_room(self, replica: Replica, error: PeerError, session: str, start: bool) -> None:
        """`replica` has no room for the session (FULL_WAIT); one it held is released there. (Also a
        queue full for a moment (--max-queue): the session goes all the same, and starts again later.)"""
        self.error = error
        self.full[replica] = time.monotonic() + FULL_WAIT
        if self.replica is replica:  # (not where the request let it go meanwhile: a pre-draft's answer)
            self.pool.release(replica)
            self.replica = None
        if not start:
            self._in_background(self._forget(replica, session))
        log.info("draft replica %s has no room for a session (%s): the request drafts elsewhere or not at all"
                 " for %.0f s", replica.address, error, FULL_WAIT)

    def _late(self, replica: Replica, session: str, call: asyncio.Future, bound: float, start: bool,
              prefix: int) -> None:
        """`call` is late: the round goes on without it; the request leaves `replica` alone until it answers."""
        replica.missed += 1
        if self.pool.late is not None:
            self.pool.late.inc()
        log.info("draft replica %s is late (no answer in %.0f ms, %d in a row): the round goes on without it",
                 replica.address, bound * 1e3, replica.missed)
        if replica.missed >= MISSES:
            self.pool.failed(replica, PeerError(replica.peer, grpc.StatusCode.DEADLINE_EXCEEDED,
                                                f"late {replica.missed} calls in a row"))
        self.pool.release(replica)
        self.replica = None
        self.behind.add(replica)
        self._in_background(self._discard(replica, session, call, bound, start, prefix))

    async def _discard(self, replica: Replica, session: str, call: asyncio.Future, bound: float, start: bool,
                       prefix: int) -> None:
        """Wait for a late call's answer, drop it, release the session it was for."""
        try:
            await call
            # a late answer counts as the bound it missed: a replica grown slower for good raises its
            # bound over a few calls rather than staying late for ever (or at one stall's length)
            replica.recent.add(bound, start, prefix)
        except PeerError as e:
            if e.code in MOVE:
                self.pool.failed(replica, e)
        except Exception as e:  # noqa: BLE001 - the answer is dropped whatever it is
            log.debug("draft %s: a late call failed: %s", replica.address, e)
        finally:
            self.behind.discard(replica)
        await self._forget(replica, session)


class FailoverTarget(_Failover):
    def __init__(self, pool: Pool, wait_for_room: bool = True):
        """wait_for_room: a session given back at a full replica is started again when there is room
        (the module's docstring); False: the request fails there."""
        super().__init__(pool)
        self.wait_for_room = wait_for_room
        self.gave_room = False  # the request gave its session's room back: it starts again when there is room

    async def verify(self, call: VerifyCall, *, turn: tuple[int, int] = (0, 0)) -> tuple[Verdict, Cost]:
        if not call.start:
            try:
                return await self._verify(call, turn)
            except PeerError as e:
                if not (self.wait_for_room and _room_later(e)):
                    raise
                await self._give_room(e)
                raise SessionLost(call.session_id) from e
        if not self.gave_room:
            if not self.starts and self.pool.room_waiters:  # the request's first start: after those waiting
                raise PeerError(self.pool, grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"{self.pool.room_waiters} requests wait for room to go on (--max-kv-tokens);"
                                f" retry later")
            return await self._verify(call, turn)
        until, pause = time.monotonic() + ROOM_WAIT, ROOM_POLL[0]
        tried: set[Replica] = set()  # replicas that refused since the last pause: left alone until it
        self.pool.room_waiters += 1
        try:
            while True:  # the session given back: started again where there is room
                try:
                    answer = await self._verify(call, turn)
                    self.gave_room = False
                    return answer
                except PeerError as e:
                    if not _room_later(e):
                        raise
                    if self.replica is not None:  # the next try: a replica not tried since the last pause
                        tried.add(self.replica)
                        self.full[self.replica] = until
                        self.pool.release(self.replica)
                        self.replica = None
                    if time.monotonic() + pause > until:
                        raise
                    if not self._candidates():  # every replica tried: a pause, doubling, then each again
                        await asyncio.sleep(pause)
                        pause = min(2 * pause, ROOM_POLL[1])
                        for replica in tried:
                            self.full.pop(replica, None)
                        tried.clear()
        finally:
            self.pool.room_waiters -= 1
            for replica in tried:
                self.full.pop(replica, None)

    def _elsewhere(self, replica: Replica, error: PeerError) -> bool:
        """A start refused for want of room (its sessions, its queue, its tokens) goes to another replica
        where there is one: `replica` is not asked again for this start, then left alone by the request for
        FULL_WAIT (not so while the request waits for room: that loop goes round the replicas itself). False:
        none other, the refusal stands."""
        if self.gave_room or not [r for r in self._candidates() if r is not replica]:
            return False
        self.error = error
        self.full[replica] = math.inf  # (until the start is made: then for FULL_WAIT, _verify)
        self.pool.release(replica)
        self.replica = None
        log.info("target replica %s has no room for a session (%s): starting it on another", replica.address, error)
        return True

    async def _give_room(self, error: PeerError) -> None:
        """Release the session on its replica, which has no room for its next tokens (the release runs on
        should the request be cancelled meanwhile: its room is what the others wait for)."""
        self.error, self.gave_room = error, True
        replica, self.replica = self.replica, None
        if replica is None:
            return
        log.info("target replica %s is full (%s): the request gives its session's room back and starts again"
                 " when there is room", replica.address, error)
        self.pool.release(replica)
        # (a release that fails is tried again in the background, until the replica serves again or is gone)
        await asyncio.wait([self._in_background(self._forget(replica, self.session or ""))], timeout=RELEASE_WAIT)

    async def _verify(self, call: VerifyCall, turn: tuple[int, int]) -> tuple[Verdict, Cost]:
        start, tries, refused = call.start, 0, []
        try:
            while tries < (TRIES if start else 1):
                replica = await self._take(wait=True)
                if replica is None:
                    break
                session = self._name(call.session_id, start)
                try:
                    return await replica.peer.verify(replace(call, session_id=session), turn=turn)
                except PeerError as e:
                    if start and e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and self._elsewhere(replica, e):
                        refused.append(replica)
                        continue
                    if e.code not in RESTART:
                        raise
                    self._lost(e, session)
                tries += 1
        finally:
            for replica in refused:  # (each refused this start once at most: then left alone FULL_WAIT)
                self.full[replica] = time.monotonic() + FULL_WAIT
        if not start:
            raise SessionLost(call.session_id)
        detail = f" (last error: {self.error})" if self.error else ""
        raise self.pool.unavailable(f"no target replica left to continue this request on{detail}")
