"""A model service's threads: how many torch threads by role, and the one model thread its
passes run on (so the event loop never blocks)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import math
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

log = logging.getLogger("specdec")

GIL_SWITCH_INTERVAL = 0.0005  # seconds; see set_threads


def available_cpus() -> int:
    """CPUs this process may use: its affinity mask, and a cgroup CPU quota (a container's limit) when lower."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def default_threads(role: str, cpus: int) -> tuple[int, int]:
    """(threads, batched threads) for a service of `role` that may use `cpus` CPUs.

    With every service at torch's default (all cores each), each process's OpenMP workers spin for
    cores the others hold and concurrent requests run far slower: the draft, whose small matrices
    gain little from more threads, takes one. The target takes every CPU, for passes over several
    sessions too: a small draft's work under load is a fraction of the target's, and the target's
    memory-bound passes gain from every core's bandwidth. (Measurements: docs/performance.md.)"""
    if role == "draft":
        return 1, 1
    return cpus, cpus


def resolve_threads(args: argparse.Namespace) -> None:
    """Fill --threads / --batched-threads left at 0 with default_threads."""
    threads, batched = default_threads(getattr(args, "role", "target"), available_cpus())
    args.threads = args.threads or threads
    args.batched_threads = args.batched_threads or (batched if args.threads == threads else args.threads)


def pass_threads(threads: int) -> None:
    """Torch's threads for the pass about to run (one session's or several's: ModelRunner.forward_many,
    EagleDraft.propose_many), set only where they differ."""
    import torch

    if threads != torch.get_num_threads():
        torch.set_num_threads(threads)


def set_threads(threads: int) -> None:
    """Torch threads of a model service, and how soon its two Python threads hand over the GIL."""
    import torch

    # The model thread and the event loop take turns at the GIL; a thread that wants it waits up
    # to this interval (Python's default: 5 ms) for the other to give it up. Between two passes
    # the loop answers and reads calls while the model thread waits to start the next pass, and
    # a shorter interval shortens the target's idle gap between passes under load (0.5 ms: more
    # tokens/s at 8 streams, none fewer at one; docs/performance.md).
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


class PassSource(Protocol):
    """What the model thread takes its passes from (batcher.Batcher)."""

    waiting: deque  # the calls queued for a pass (each with the .loop and the .future its caller waits on)

    def ready(self, now: float) -> list | float | None: ...

    def pass_for(self, batch: list) -> tuple[Callable[[], Any], asyncio.AbstractEventLoop, Callable]: ...


class ModelThreadStopped(RuntimeError):
    """The model thread stopped (ModelThread.failed): the service cannot run its model any more (UNAVAILABLE)."""


class ModelThread:
    """The one thread a model service runs its model on, so the event loop never blocks.

    It runs two kinds of work: jobs (`run`, `submit`: loading, releasing sessions...), first and
    in order, and the passes of the batchers attached to it. Between two passes it
    takes the next batch itself, under its own lock, instead of waiting for the event loop to
    hand it over: under load the loop is answering the last pass's calls just then, and the
    target would sit idle for its turn.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.jobs: deque[tuple[Callable[[], Any], asyncio.AbstractEventLoop | None, asyncio.Future | None]] = deque()
        self.batchers: list[PassSource] = []  # (batcher.Batcher)
        self.thread: threading.Thread | None = None
        self.pending: tuple | None = None  # an outcome held back until the next forward starts
        # what stopped the thread: a fault of its own (a job's or a pass's error is its callers'); then
        # whatever is queued or comes fails at once (UNAVAILABLE), and on_failure(message) is told, once
        self.failed: BaseException | None = None
        self.on_failure: Callable[[str], None] | None = None

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        self._add(lambda: fn(*args), loop, future)
        return await future

    def submit(self, fn: Callable[[], Any]) -> None:
        """Run fn on the model thread; nothing waits for it (errors are logged)."""
        self._add(fn, None, None)

    def _add(self, fn: Callable[[], Any], loop, future) -> None:
        with self.cond:
            self.jobs.append((fn, loop, future))
            self.wake()

    def waiting(self) -> bool:
        """Whether calls wait for a pass in any of its batchers (read without the lock: a hint)."""
        return any(batcher.waiting for batcher in self.batchers)

    def wake(self) -> None:
        """Under self.cond: there is new work (the thread starts with the first)."""
        if self.failed is not None:
            self._fail_queued()
            return
        if self.thread is None:
            self.thread = threading.Thread(target=self._main, name="model", daemon=True)
            self.thread.start()
        self.cond.notify()

    def _next(self, done: tuple | None) -> tuple[Callable[[], Any], Any, Any]:
        """Post `done` (the last work's outcome), then wait for the next job or pass. A next pass
        found at once is taken first, and its Python runs before the event loop wakes to take
        the GIL for the outcome. -> (fn, loop, future or deliver callback)"""
        with self.cond:
            try:
                while True:
                    if self.jobs:
                        work = self.jobs.popleft()
                        break
                    now, timeout, work = time.monotonic(), None, None
                    for batcher in self.batchers:
                        ready = batcher.ready(now)
                        if isinstance(ready, list):
                            try:
                                work = batcher.pass_for(ready)
                            except BaseException:
                                batcher.waiting.extendleft(reversed(ready))  # (failed with the rest: _fail_queued)
                                raise
                            break
                        if ready is not None:
                            timeout = ready - now if timeout is None else min(timeout, ready - now)
                    if work is not None:
                        break
                    done = self._post(done)
                    self.cond.wait(timeout)
            except BaseException:
                self._post(done)  # (not posted yet, its caller waits for it)
                raise
        if callable(work[2]) and done is not None:
            # a pass: post the last outcome when its forward starts (flush). Posted now, the
            # loop would wake and take the GIL while this thread still runs the pass's Python
            # (validation, inputs): ~0.6 ms per pass at 8 streams
            self.pending = done
        else:
            self._post(done)
        return work

    def flush(self) -> None:
        """On the model thread, as a pass's forward starts: post the outcome held back for it."""
        pending, self.pending = self.pending, None
        self._post(pending)

    @staticmethod
    def _post(done: tuple | None) -> None:
        if done is None:
            return None
        loop, future, result, error = done
        if loop is None:  # nobody waits for it
            if error is not None:
                log.error("model thread job failed", exc_info=error)
            return None
        try:
            if callable(future):  # a batcher's pass: deliver every call's result at once
                loop.call_soon_threadsafe(future, result, error)
            else:
                loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:  # the loop is closed: nobody waits any more
            pass
        return None

    def _main(self) -> None:
        done = None
        try:
            while True:
                fn, loop, future = self._next(done)
                try:
                    result, error = fn(), None
                except BaseException as exc:  # handed to the caller
                    result, error = None, exc
                self.flush()  # if the pass never reached its forward
                done = (loop, future, result, error)
        except BaseException as exc:  # a fault in the thread's own work (taking the next pass): it runs nothing more
            log.critical("the model thread stopped: %s: %s", type(exc).__name__, exc, exc_info=exc)
            with self.cond:
                self.failed = exc
            if self.on_failure is not None:  # (told first: NOT_SERVING before its callers hear UNAVAILABLE)
                self.on_failure(f"its model thread stopped ({type(exc).__name__}: {exc})")
            with self.cond:
                self._fail_queued()

    def _fail_queued(self) -> None:
        """Under self.cond, the thread stopped: every job and call waiting fails (ModelThreadStopped)."""
        error = ModelThreadStopped(f"the service's model thread stopped ({type(self.failed).__name__}: "
                                   f"{self.failed}); it runs no more calls")
        while self.jobs:
            _, loop, future = self.jobs.popleft()
            if loop is not None:  # (a job nobody waits for, a release: nothing to tell)
                self._post((loop, future, None, error))
        for batcher in self.batchers:
            while batcher.waiting:
                item = batcher.waiting.popleft()
                self._post((item.loop, item.future, None, error))


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
