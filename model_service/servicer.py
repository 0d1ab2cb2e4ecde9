"""The servicer both model services build on: engine errors as gRPC statuses, the RPCs they
share (GetModelInfo, GetTokenizer, Release), and per-round calls (unary, stream, batch) queued on
the batcher."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import grpc

from runtime import tracing
from runtime.host import host_facts
from specdec.v1 import specdec_pb2 as pb
from speculative.errors import (CapacityExceeded, InvalidRequest, SessionExists, SessionNotFound, WorkerLost,
                               status_details)

from .batcher import Batcher, Batching
from .metrics import ModelMetrics
from .threads import ModelThread, ModelThreadStopped

log = logging.getLogger("specdec")


class Stopping(Exception):
    """A call that would start a session on a service that is stopping (it goes to another replica)."""

    def __init__(self):
        super().__init__("the server is shutting down: retry on another replica")


STATUS_OF = {
    Stopping: grpc.StatusCode.UNAVAILABLE,
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    SessionExists: grpc.StatusCode.ALREADY_EXISTS,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    WorkerLost: grpc.StatusCode.UNAVAILABLE,
    ModelThreadStopped: grpc.StatusCode.UNAVAILABLE,
}


def status_of(exc: BaseException) -> grpc.StatusCode:
    for kind, code in STATUS_OF.items():
        if isinstance(exc, kind):
            return code
    return grpc.StatusCode.INTERNAL


def translate(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """An engine error as a gRPC status and its message (INTERNAL, logged, if unexpected)."""
    code = status_of(exc)
    if code == grpc.StatusCode.INTERNAL:
        log.exception("internal error", exc_info=exc)
        return code, status_details(f"{type(exc).__name__}: {exc}")
    return code, status_details(str(exc))


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the engine error's status (see translate)."""
    await context.abort(*translate(exc))


OK_STATUS = pb.CallStatus()


def call_status(exc: BaseException) -> pb.CallStatus:
    """One batched call's error as its status (see translate)."""
    code, message = translate(exc)
    return pb.CallStatus(code=code.value[0], message=message)


class ModelServicer:
    """GetModelInfo, GetTokenizer and Release: the RPCs both model services share; and the
    batcher their per-round calls (Propose / Verify) go through.

    `engine` (a drafting method, drafting.py, or a TargetEngine) is None until it is loaded
    (the weights, or a method's tokenizer); calls before that get UNAVAILABLE. The servicer
    uses only what drafting.py's "Serving" lists.
    """

    def __init__(self, thread: ModelThread, batching: Batching = Batching(), metrics: ModelMetrics | None = None):
        self.thread = thread
        self.engine = None
        self.metrics = metrics
        self.stopping = False  # set by the first call `admits` is asked about: the server is closing
        self.batcher = Batcher(thread, self.run_many, batching, self._observe_pass,
                               lambda: self.engine.at_work if self.engine is not None else 0)

    def admits(self, method: str, request) -> bool:
        """Whether a stopping service still takes a call (runtime.interceptors.Drain asks, its first request
        for a stream): a release, a per-round call of a session it holds (unary or on a stream), and a batch
        RPC, whose calls that would start a session are refused one by one (`batch`): the generations in flight
        go on through the grace, whichever way their calls come. A call that would start a session is refused
        (UNAVAILABLE: the coordinator takes it to another replica)."""
        self.stopping = True
        if method.endswith("/Release") or hasattr(request, "calls"):  # (ProposeBatch / VerifyBatch)
            return True
        return hasattr(request, "start") and not request.start

    def held_lately(self, window: float) -> int:
        """Sessions held and used within the last `window` s (one nobody releases, its coordinator gone, is
        not waited for: its idle timeout frees it)."""
        return 0 if self.engine is None else self.engine.sessions.recently_used(window)

    def run_many(self, calls: list) -> list:
        """One pass over calls of several sessions, on the model thread (the engine's batched method)."""
        raise NotImplementedError

    def _observe_pass(self, size: int) -> None:
        if self.metrics is not None:
            self.metrics.batch.observe(size)

    async def ready(self, context: grpc.aio.ServicerContext):
        if self.engine is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "weights are still loading; retry when SERVING")
        return self.engine

    async def call(self, context: grpc.aio.ServicerContext, method: str, session_id: str, call: Any,
                   turn: tuple[int, int] = (0, 0)) -> Any:
        """Queue one per-round call (of lockstep turn (id, calls), if any) for the model's next pass;
        engine errors become gRPC statuses.
        -> (result, Cost) with service_ms counted from now: waiting for the model is time in here."""
        try:
            return await self.run_call(method, session_id, call, turn)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # translated, never raised into grpc
            await abort_with(context, exc)

    async def run_call(self, method: str, session_id: str, call: Any, turn: tuple[int, int] = (0, 0),
                       queued: asyncio.Future | None = None) -> Any:
        """`call` without the translation: raises the engine's error (`queued`: its future, if it
        is queued already). -> (result, Cost)"""
        metrics, status, start = self.metrics, grpc.StatusCode.OK, time.perf_counter()
        if metrics is not None:
            metrics.queue.inc()
        try:
            if queued is None:
                await self.compile_constraints([call])
            result, cost = await (queued if queued is not None else self.batcher.submit(session_id, call, turn))
            end = time.perf_counter()
            tracing.record_call(method, call, start, end, cost)
            return result, dataclasses.replace(cost, service_ms=(end - start) * 1e3)
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            status = status_of(exc)
            tracing.record_call(method, call, start, time.perf_counter(), error=exc)
            raise
        finally:
            if metrics is not None:
                metrics.queue.dec()
                metrics.calls.labels(method, status.name).inc()
                metrics.latency.labels(method).observe(time.perf_counter() - start)

    async def compile_constraints(self, calls: list) -> None:
        """Compile the structured-output constraints that start calls bring, off the model thread and
        the event loop (grammar.Grammars.compile caches them, a refusal too): the pass then only
        copies a compiled matcher. A refusal is the call's own error, raised when it runs."""
        grammars = getattr(self.engine, "grammars", None)
        starting = [call.constraint for call in calls if getattr(call, "start", False)
                    and getattr(call, "constraint", None) is not None]
        if grammars is None or not starting:
            return

        def compile_all() -> None:
            for constraint in starting:
                try:
                    grammars.compile(constraint)
                except InvalidRequest:
                    pass

        await asyncio.to_thread(compile_all)

    async def batch(self, context: grpc.aio.ServicerContext, method: str, requests: Sequence[Any],
                    make_call: Callable[[Any], Any], make_reply: Callable[..., Any], empty: Any) -> tuple[list, list]:
        """Answer a batch RPC's requests (one per session): queued together, each --max-batch of
        them a turn of its own, so a pass serves them and waits for no one else. One request's
        error is its own. -> (replies, statuses), `empty` where a request failed"""
        await self.ready(context)
        sessions = [request.session_id for request in requests]
        if len(set(sessions)) != len(sessions):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "a batch holds at most one call per session")
        if self.metrics is not None:
            self.metrics.batch_rpcs.labels(method).inc()
        calls = [(request.session_id, make_call(request)) for request in requests]
        await self.compile_constraints([call for _, call in calls])
        size = self.batcher.max_batch
        refused = [self.stopping and getattr(call, "start", False) for _, call in calls]  # (see admits)
        taken = [pair for pair, no in zip(calls, refused) if not no]
        queued = []  # (a call refused for a full queue: its future holds CapacityExceeded)
        for start in range(0, len(taken), size):
            chunk = taken[start : start + size]
            queued += self.batcher.enqueue(chunk, (random.getrandbits(63) | 1, len(chunk)))
        futures = iter(queued)
        results = await asyncio.gather(*(self.refuse(Stopping()) if no else
                                         self.run_call(method, session_id, call, queued=next(futures))
                                         for (session_id, call), no in zip(calls, refused)),
                                       return_exceptions=True)
        replies, statuses = [], []
        for result in results:
            if isinstance(result, asyncio.CancelledError):
                raise result
            if isinstance(result, BaseException):
                replies.append(empty)
                statuses.append(call_status(result))
            else:
                replies.append(make_reply(*result))
                statuses.append(OK_STATUS)
        return replies, statuses

    @staticmethod
    async def refuse(error: Exception):
        raise error

    async def stream(self, requests, context, step: Callable[..., Awaitable[Any]]):
        """Answer a stream of requests with `step`; release the sessions it used when it ends: those
        of its calls that succeeded, and of a start call cut short by a cancel (it may have started
        its session). A failed call's session is not its: it may be another client's."""
        sessions: set[str] = set()
        try:
            async for request in requests:
                try:
                    reply = await step(request, context)
                except asyncio.CancelledError:
                    if request.start:
                        sessions.add(request.session_id)
                    raise
                sessions.add(request.session_id)
                yield reply
        finally:
            if sessions and self.engine is not None:
                engine = self.engine

                def release() -> None:
                    for session_id in sessions:
                        engine.release(session_id)

                self.thread.submit(release)  # not awaited: this may run under cancellation

    async def GetModelInfo(self, request, context):
        engine = await self.ready(context)
        return pb.ModelInfo(**engine.info(), max_tokens_per_call=engine.max_tokens, **host_facts())

    async def GetTokenizer(self, request, context):
        engine = await self.ready(context)
        chunk = 1 << 20
        for name, data in engine.tokenizer_files():
            for offset in range(0, max(len(data), 1), chunk):
                yield pb.TokenizerFile(name=name, data=data[offset : offset + chunk])

    async def Release(self, request, context):
        engine = await self.ready(context)
        return pb.ReleaseResponse(released=await self.thread.run(lambda: engine.release(request.session_id)))
