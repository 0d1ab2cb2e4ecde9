"""Continuous batching: calls from many sessions wait here for the model thread's next pass."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from speculative.errors import CapacityExceeded

from .threads import ModelThread, _settle


# The most tokens of a long feed (a prompt) a target pass takes while other sessions' calls wait (theirs run
# between its parts instead of after its whole prefill): TargetEngine.prefill_chunk, --prefill-chunk. auto: a
# part's pass about PREFILL_PART_MS at the model's calibrated cost of a token (ModelRunner.calibrate: int4
# SmolLM2 on 2 CPU cores ~0.65-0.75 ms, 112-128 tokens; 128 cut three streams' stall under a 2,000-token
# prompt from ~2.6 s to ~0.4 s: docs/performance.md; a bigger model takes fewer, a GPU far more), within
# PREFILL_CHUNK_RANGE and in multiples of 16; but enough that a pass's fixed cost (its weights' reads) is at most
# PREFILL_FIXED_SHARE of it (float32 SmolLM2 there: 20.5 ms fixed, 1.07 a token: 160, not 80, whose passes would
# add ~20% to a prompt's prefill); by the device where no pass was timed
PREFILL_PART_MS = 90.0
PREFILL_FIXED_SHARE = 0.1
PREFILL_CHUNK_RANGE = (32, 4096)
PREFILL_CHUNK = {"cpu": 128, "cuda": 512}


def prefill_chunk_for(device: str, per_token_ms: float = 0.0, fixed_ms: float = 0.0) -> int:
    """The default prefill chunk of a target on `device` (a torch device's name: "cpu", "cuda:0"...) whose
    pass costs `fixed_ms` + `per_token_ms` a token (PassCost.fixed, .per_token; 0: not timed)."""
    if per_token_ms > 0:
        least, most = PREFILL_CHUNK_RANGE
        tokens = max(PREFILL_PART_MS, fixed_ms * (1 - PREFILL_FIXED_SHARE) / PREFILL_FIXED_SHARE) / per_token_ms
        return max(least, min(most, int(tokens) // 16 * 16))
    return PREFILL_CHUNK.get(str(device).split(":")[0], PREFILL_CHUNK["cuda"])


class Unfinished:
    """A call's result when its work goes on in a later pass (a long prompt fed in parts: TargetEngine):
    the Batcher queues the call again, first, instead of answering it."""

    def __repr__(self) -> str:
        return "UNFINISHED"


UNFINISHED = Unfinished()


@dataclass(frozen=True)
class Batching:
    """How a model service batches its calls (its flags --max-batch, --batch-wait-ms,
    --turn-wait-ms, --max-queue; see Batcher)."""

    max_batch: int = 32     # most calls (sessions) per pass
    wait: float = 0.0       # seconds a pass waits for the calls of sessions at work that have not come yet
    turn_wait: float = 0.003  # seconds a pass waits for the rest of a lockstep turn's calls
    # a call that starts a session while this many wait: RESOURCE_EXHAUSTED, not an ever longer wait (a live
    # session's next call is queued all the same: its session was let in, and --max-sessions bounds those)
    max_queue: int = 1024

    def __post_init__(self) -> None:
        if self.max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, not {self.max_batch}")
        for name in ("wait", "turn_wait"):
            if not 0 <= getattr(self, name) <= 1:  # also NaN
                raise ValueError(f"{name} must lie in [0, 1] s, not {getattr(self, name)}")
        if self.max_queue < 1:
            raise ValueError(f"max_queue must be >= 1, not {self.max_queue}")


class Waiting(NamedTuple):
    """A call in a Batcher's queue."""

    session_id: str
    call: Any
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    turn: int = 0  # the coordinator's lockstep turn it came in (0: none), and that turn's number of calls
    turn_size: int = 0
    again: bool = False  # queued again for its next part (its turn-mates answered: nothing to wait for)


class Batcher:
    """Continuous batching over a model service's one model thread.

    Calls wait in a queue. Whenever the model is free, everything waiting (up to
    `max_batch` calls, one per session: a session's second call waits for the next
    pass) goes into its next pass, run by `run_many` (an engine's propose_many or
    verify_many) on the model thread, which takes the batch itself (see ModelThread).
    A call that finds the model idle runs at once, except with `wait` > 0 while fewer
    calls wait than `at_work()` sessions are at work: the pass then waits up to that long
    once for the others (the draft's calls for a group of sessions verified together arrive
    ~0.1-0.3 ms apart; without the wait the first drafts alone and the rest wait for all of
    its steps). Calls the coordinator let through together in a lockstep turn say so (`turn`:
    its id and its number of calls): a pass serves one turn's calls only (or only calls of no
    turn), and waits up to `turn_wait` for all of them, since a turn's calls sent one by one
    arrive over ~1 ms (a turn split over several replicas waits it out: each gets part of it; a
    batch RPC is queued at once as a whole turn, see ModelServicer.batch). A call that fails,
    fails alone.
    """

    def __init__(self, thread: ModelThread, run_many: Callable[[list], list], batching: Batching = Batching(),
                 on_pass: Callable[[int], None] | None = None, at_work: Callable[[], int] | None = None):
        """at_work() -> sessions used lately (the runner's count); on_pass(size) after each pass."""
        self.thread = thread
        self.run_many = run_many
        self.max_batch = batching.max_batch
        self.max_queue = batching.max_queue
        self.wait = batching.wait
        self.turn_wait = batching.turn_wait
        self.on_pass = on_pass
        self.at_work = at_work
        self.waiting: deque[Waiting] = deque()  # guarded by the thread's lock
        self.deadline: float | None = None  # when the pass now waiting for stragglers stops waiting
        thread.batchers.append(self)

    async def submit(self, session_id: str, call: Any, turn: tuple[int, int] = (0, 0)) -> Any:
        """Queue `call` for a pass; `turn`: (id, calls) of the lockstep turn it came in ((0, 0): none)."""
        return await self.enqueue([(session_id, call)], turn)[0]

    def enqueue(self, calls: list[tuple[str, Any]], turn: tuple[int, int] = (0, 0)) -> list[asyncio.Future]:
        """Queue (session id, call) pairs together, all of `turn`. -> their futures; a call that would start a
        session (`call.start`) while max_queue calls wait fails with CapacityExceeded. A live session's call
        is never refused here: the request it serves was let in, and cutting it short mid-answer would lose
        its work (its sessions are bounded by --max-sessions)."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in calls]
        with self.thread.cond:
            room, taken = self.max_queue - len(self.waiting), []
            for (session_id, call), future in zip(calls, futures):
                if getattr(call, "start", True) and room - len(taken) <= 0:
                    waiting = len(self.waiting) + len(taken)
                    future.set_exception(CapacityExceeded(
                        f"{waiting} calls already wait for the model (--max-queue); retry later"))
                else:
                    taken.append((session_id, call, future))
            if turn[1]:  # (a pass waits for the turn's calls less those refused here)
                turn = (turn[0], turn[1] - (len(calls) - len(taken)))
            self.waiting.extend(Waiting(session_id, call, future, loop, *turn) for session_id, call, future in taken)
            self.thread.wake()
        return futures

    def ready(self, now: float) -> list | float | None:
        """Under the thread's lock: the calls of the next pass (never none), or when to look again (None: no calls)."""
        while True:
            taken = self._ready(now)
            if taken != []:  # (none: the callers of those it would take gave up as it took them)
                return taken

    def _ready(self, now: float) -> list | float | None:
        while self.waiting and self.waiting[0].future.done():  # its caller gave up before it ran
            self.waiting.popleft()
        if not self.waiting:
            self.deadline = None
            return None
        head = self.waiting[0]
        if head.turn and not head.again:  # the rest of its lockstep turn is on its way (not for a part's next)
            want, wait = head.turn_size, self.turn_wait
            have = sum(item.turn == head.turn for item in self.waiting)
        elif self.wait and self.at_work is not None:  # the rest of a group of sessions is likely a moment away
            want, wait, have = self.at_work(), self.wait, len(self.waiting)
        else:
            want = wait = have = 0
        if wait and have < min(want, self.max_batch):
            if self.deadline is None:
                self.deadline = now + wait
            if now < self.deadline:
                return self.deadline
        self.deadline = None
        return self._take()

    def _take(self) -> list[Waiting]:
        batch, sessions, later = [], set(), []
        turn = self.waiting[0].turn
        while self.waiting and len(batch) < self.max_batch:
            item = self.waiting.popleft()
            if item.future.done():
                continue
            if item.session_id in sessions or item.turn != turn:
                later.append(item)
            else:
                sessions.add(item.session_id)
                batch.append(item)
        self.waiting.extendleft(reversed(later))
        return batch

    def pass_for(self, batch: list) -> tuple[Callable[[], Any], asyncio.AbstractEventLoop, Callable]:
        """-> (run the pass, the loop its callers wait on, deliver its results there)"""

        def run() -> Any:
            results = self.run_many([item.call for item in batch])
            if isinstance(results, list) and len(results) == len(batch):
                # (in its lockstep turn, if any, with the turn's calls not yet served; not waited for: ready)
                again = [item._replace(again=True) for item, result in zip(batch, results) if result is UNFINISHED]
                if again:  # first in the next pass (taken on this thread, before the loop hears of this one)
                    with self.thread.cond:
                        self.waiting.extendleft(reversed(again))
            return results

        def deliver(results: Any, error: BaseException | None) -> None:
            if error is not None or not isinstance(results, list) or len(results) != len(batch):
                # not one call's fault: every call in the pass gets it
                results = [error or RuntimeError("the pass returned no result per call")] * len(batch)
            if self.on_pass is not None:
                self.on_pass(len(batch))
            for item, result in zip(batch, results):
                if isinstance(result, BaseException):
                    _settle(item.future, None, result)
                elif result is not UNFINISHED:
                    _settle(item.future, result, None)

        return run, batch[0].loop, deliver
