"""What the three gRPC servers share: flags from the environment, health, reflection,
error translation, the model thread, and a graceful stop on SIGTERM / SIGINT. TLS and message
size limits: transport.py.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import math
import os
import random
import signal
import sys
import threading
import time
from collections import deque
from pathlib import Path
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Any, NamedTuple

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from specdec.v1 import specdec_pb2 as pb

from .errors import CapacityExceeded, InvalidRequest, SessionExists, SessionNotFound, WorkerLost
from .interceptors import UndecodableRequests
from .metrics import ModelMetrics, add_metrics_flag, start as start_metrics
from .sampling import SamplingParams
from .transport import MAX_MESSAGE_BYTES, MESSAGE_LIMITS, add_tls_flags, server_credentials

log = logging.getLogger("specdec")

GIL_SWITCH_INTERVAL = 0.0005  # seconds; see set_threads
CHANNEL_OPTIONS = MESSAGE_LIMITS + [("grpc.enable_retries", 0)]  # the coordinator's, to its model services

STATUS_OF = {
    InvalidRequest: grpc.StatusCode.INVALID_ARGUMENT,
    SessionNotFound: grpc.StatusCode.NOT_FOUND,
    SessionExists: grpc.StatusCode.ALREADY_EXISTS,
    CapacityExceeded: grpc.StatusCode.RESOURCE_EXHAUSTED,
    WorkerLost: grpc.StatusCode.UNAVAILABLE,
}


class EnvArgumentParser(argparse.ArgumentParser):
    """argparse whose every flag may also come from an environment variable PREFIX_FLAG."""

    def __init__(self, env_prefix: str, **kwargs: Any):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        self.env_prefix = env_prefix
        super().__init__(**kwargs)

    def add_argument(self, *names: str, **kwargs: Any):  # type: ignore[override]
        flag = next((n for n in names if n.startswith("--")), None)
        if flag is not None and flag != "--help":
            env = f"{self.env_prefix}_{flag[2:].replace('-', '_').upper()}"
            if env in os.environ:
                value = os.environ[env]
                if kwargs.get("action") == "store_true":
                    value = value.lower() in ("1", "true", "yes", "on")
                kwargs["default"] = value
                kwargs["required"] = False
            default = kwargs.get("default")
            shown = "" if default is None or kwargs.get("action") == "store_true" else f" (default: {default})"
            kwargs["help"] = f"{kwargs.get('help', '')}{shown} [env {env}]".strip()
        return super().add_argument(*names, **kwargs)


def add_common_flags(parser: EnvArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    parser.add_argument("--port", type=int, default=port, help="port to serve on (0: pick a free one)")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    parser.add_argument("--shutdown-grace", type=float, default=20.0,
                        help="seconds in-flight calls get to finish after SIGTERM (health turns NOT_SERVING at once)")
    add_tls_flags(parser)


SHIPPED_MODELS = Path(__file__).resolve().parent.parent / "models"


def add_model_flags(parser: EnvArgumentParser, role: str) -> None:
    """Model flags; --model defaults to the shipped models/<role> when the checkout has it."""
    shipped = SHIPPED_MODELS / role
    default = str(shipped) if (shipped / "config.json").is_file() else None
    parser.add_argument("--model", default=default, required=default is None,
                        help="local Hugging Face model directory (nothing is downloaded); "
                             f"default: the shipped models/{role}")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when present)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="weights and activations dtype")
    parser.add_argument("--forward", default="auto", choices=["auto", "transformers"],
                        help="auto: the lean forward for Llama/Mistral/Qwen2 models, transformers' own for others;"
                             " transformers: always transformers' own")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch intra-op threads for this process (0: by role: " + (
                            "the target takes every CPU this process may use" if role == "target" else
                            "1, the draft's small matrices gain little from more and leave the rest to the target")
                        + "; see default_threads)")
    parser.add_argument("--max-sessions", type=int, default=256, help="sessions held at once")
    parser.add_argument("--session-idle-timeout", type=float, default=600.0,
                        help="seconds after which an idle (abandoned) session is evicted")
    parser.add_argument("--max-kv-tokens", type=int, default=0,
                        help="cap on tokens held by all sessions together, beyond which calls get RESOURCE_EXHAUSTED"
                             " (0: only --max-sessions x the context)")
    parser.add_argument("--max-context", type=int, default=0,
                        help="cap on tokens per session (0: the model's max_position_embeddings)")
    parser.add_argument("--max-tokens-per-call", type=int, default=16, help="most draft tokens per round (K)")
    parser.add_argument("--kv-pool-capacity", type=int, default=None,
                        help="the lean forward keeps sessions' KV caches as slots of one tensor, so a pass over"
                             " several sessions runs attention once per layer; the tensor holds slots x the longest"
                             " pooled session, at most this many positions (default 1024, fast_forward.POOL_CAPACITY);"
                             " a longer session moves to a cache of its own. 0: every session's cache on its own")
    parser.add_argument("--batched-threads", type=int, default=0,
                        help="torch threads for passes over several sessions (0: by role: the target leaves one CPU"
                             " to the draft, which works at the same time under load; the draft: --threads)")
    parser.set_defaults(role=role)
    parser.add_argument("--max-queue", type=int, default=1024,
                        help="calls that may wait for the model; beyond, RESOURCE_EXHAUSTED")
    parser.add_argument("--max-batch", type=int, default=32,
                        help="most sessions per model pass (continuous batching; 1: one session at a time)")
    parser.add_argument("--batch-wait-ms", type=float, default=0.5 if role == "draft" else 0.0,
                        help="when fewer calls wait than sessions are at work, wait up to this long for the others before a"
                             " pass (never with one session at work). The draft gains (the calls of a group of"
                             " sessions verified together come a moment apart); the target, the busier service, would"
                             " only idle")
    parser.add_argument("--turn-wait-ms", type=float, default=3.0,
                        help="the longest a pass waits for the rest of a coordinator's lockstep turn (--lockstep): each of"
                             " its calls says which turn and how many calls it has; a pass serves one turn")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks to shard the model over, placed by Ray (one GPU each on GPU machines, one CPU"
                             " each on CPU); rank 0 runs in this process")
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster for the tensor-parallel ranks (HOST:PORT of its head, or auto on one of its nodes);"
                             " default: a local Ray instance, started and stopped with the service")
    parser.add_argument("--tp-start-timeout", type=float, default=120.0,
                        help="seconds to wait for the ranks' placement, weights and process group")
    add_metrics_flag(parser)


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

    Measured on 2 cores with the toy pair: with every service at torch's default (all cores each),
    8 concurrent requests made 335 tok/s; with target 2 / batched 1 and draft 1, 1,100 tok/s. Each
    process's OpenMP workers spin for cores the others hold. The target takes every CPU for a pass
    over one session (the draft waits on it), and leaves one to the draft for passes over several
    (the draft then works at the same time for other sessions); the draft takes one."""
    if role == "draft":
        return 1, 1
    return cpus, max(1, cpus - 1)


def resolve_threads(args: argparse.Namespace) -> None:
    """Fill --threads / --batched-threads left at 0 with default_threads."""
    threads, batched = default_threads(getattr(args, "role", "target"), available_cpus())
    args.threads = args.threads or threads
    args.batched_threads = args.batched_threads or (batched if args.threads == threads else args.threads)


def set_threads(threads: int) -> None:
    """Torch threads of a model service, and how soon its two Python threads hand over the GIL."""
    import torch

    # The model thread and the event loop take turns at the GIL; a thread that wants it waits up
    # to this interval (Python's default: 5 ms) for the other to give it up. Between two passes
    # the loop answers and reads calls while the model thread waits to start the next pass:
    # on the shipped pair at 8 streams the target idled 2.9 ms between passes with 5 ms and
    # 1.9 ms with 0.5 ms, and served 376 against 337 tok/s (medians of 8 interleaved runs; one
    # stream unchanged, 160 against 157); in three more pairs 0.5 ms won each time.
    sys.setswitchinterval(GIL_SWITCH_INTERVAL)
    if threads > 0:
        torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set in this process
        pass


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
        return code, f"{type(exc).__name__}: {exc}"
    return code, str(exc)


async def abort_with(context: grpc.aio.ServicerContext, exc: BaseException) -> None:
    """End the call with the engine error's status (see translate)."""
    await context.abort(*translate(exc))


OK_STATUS = pb.CallStatus()


def call_status(exc: BaseException) -> pb.CallStatus:
    """One batched call's error as its status (see translate)."""
    code, message = translate(exc)
    return pb.CallStatus(code=code.value[0], message=message)


class ModelThread:
    """The one thread a model service runs its model on, so the event loop never blocks.

    It runs two kinds of work: jobs (`run`, `submit`: loading, releasing sessions...), first and
    in order, and the passes of the batchers attached to it. Between two passes it
    takes the next batch itself, under its own lock, instead of waiting for the event loop to
    hand it over: at 8 streams the loop is answering the last pass's calls just then, and the
    target sat idle ~1-2 ms per pass for its turn.
    """

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.jobs: deque[tuple[Callable[[], Any], asyncio.AbstractEventLoop | None, asyncio.Future | None]] = deque()
        self.batchers: list[Batcher] = []
        self.thread: threading.Thread | None = None
        self.pending: tuple | None = None  # an outcome held back until the next forward starts

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

    def wake(self) -> None:
        """Under self.cond: there is new work (the thread starts with the first)."""
        if self.thread is None:
            self.thread = threading.Thread(target=self._main, name="model", daemon=True)
            self.thread.start()
        self.cond.notify()

    def _next(self, done: tuple | None) -> tuple[Callable[[], Any], Any, Any]:
        """Post `done` (the last work's outcome), then wait for the next job or pass. A next pass
        found at once is taken first, and its Python runs before the event loop wakes to take
        the GIL for the outcome. -> (fn, loop, future or deliver callback)"""
        with self.cond:
            while True:
                if self.jobs:
                    work = self.jobs.popleft()
                    break
                now, timeout, work = time.monotonic(), None, None
                for batcher in self.batchers:
                    ready = batcher.ready(now)
                    if isinstance(ready, list):
                        work = batcher.pass_for(ready)
                        break
                    if ready is not None:
                        timeout = ready - now if timeout is None else min(timeout, ready - now)
                if work is not None:
                    break
                done = self._post(done)
                self.cond.wait(timeout)
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
        while True:
            fn, loop, future = self._next(done)
            try:
                result, error = fn(), None
            except BaseException as exc:  # handed to the caller
                result, error = None, exc
            self.flush()  # if the pass never reached its forward
            done = (loop, future, result, error)


def _settle(future: asyncio.Future, result: Any, error: BaseException | None) -> None:
    if future.done():
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class Health:
    """grpc.health.v1 for the whole server and each named service."""

    def __init__(self, services: Iterable[str]):
        self.servicer = health.aio.HealthServicer()
        self.services = ["", *services]

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.services:
            await self.servicer.set(name, status)


async def serve(
    name: str,
    host: str,
    port: int,
    add_servicers: Callable[[grpc.aio.Server], list[str]],
    load: Callable[[], Awaitable[None]],
    on_stop: Callable[[], Awaitable[None]] | None = None,
    grace: float = 5.0,
    stop: asyncio.Event | None = None,
    credentials: grpc.ServerCredentials | None = None,
    max_request_bytes: int = MAX_MESSAGE_BYTES,
) -> None:
    """Start the server NOT_SERVING, run `load`, turn SERVING, and stop cleanly on SIGTERM /
    SIGINT (or when `stop` is set, if given).

    add_servicers registers the servicers and returns their full service names. `load` may return
    a future that resolves (with a message) if the service breaks later, e.g. a tensor-parallel
    rank dies: health then turns NOT_SERVING for good, and the server stays up to say why.
    `credentials` (server_credentials) make it serve TLS; a message larger than `max_request_bytes`
    is refused with RESOURCE_EXHAUSTED.
    """
    server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_receive_message_length", max_request_bytes)],
                             interceptors=[UndecodableRequests()])
    service_names = add_servicers(server)
    checks = Health(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(checks.servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    if credentials is None:
        bound = server.add_insecure_port(f"{host}:{port}")
    else:
        bound = server.add_secure_port(f"{host}:{port}", credentials)
    await checks.set(False)
    await server.start()
    log.info("%s listening on %s:%d, %s (NOT_SERVING until ready)", name, host, bound,
             "plaintext" if credentials is None else "TLS")
    print(f"{name} listening on {host}:{bound}", flush=True)

    if stop is None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
    loader = asyncio.ensure_future(load())
    stopper = asyncio.ensure_future(stop.wait())
    done, _ = await asyncio.wait({loader, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if loader in done and loader.exception() is None:
        await checks.set(True)
        log.info("%s SERVING", name)
        print(f"{name} ready", flush=True)
        broken = loader.result()
        if broken is not None:
            await asyncio.wait({stopper, broken}, return_when=asyncio.FIRST_COMPLETED)
            if broken.done() and not stopper.done():
                await checks.set(False)
                log.error("%s NOT_SERVING: %s", name, broken.result())
                print(f"{name} NOT_SERVING: {broken.result()}", flush=True)
        await stopper
    elif loader in done:
        log.error("%s failed to start: %s", name, loader.exception())
        stopper.cancel()
        await server.stop(0)
        raise SystemExit(f"{name} failed to start: {loader.exception()}")
    else:
        loader.cancel()
    log.info("%s stopping", name)
    await checks.set(False)
    await server.stop(grace)
    if on_stop is not None:
        await on_stop()


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")


# ------------------------------------------------------- model services

def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(msg.temperature, msg.top_k, msg.top_p, msg.seed)


class Waiting(NamedTuple):
    """A call in a Batcher's queue."""

    session_id: str
    call: Any
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    turn: int = 0  # the coordinator's lockstep turn it came in (0: none), and that turn's number of calls
    turn_size: int = 0


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

    def __init__(self, thread: ModelThread, run_many: Callable[[list], list], max_batch: int = 32,
                 on_pass: Callable[[int], None] | None = None, max_queue: int = 1024):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, not {max_batch}")
        self.thread = thread
        self.run_many = run_many
        self.max_batch = max_batch
        self.on_pass = on_pass
        self.max_queue = max_queue  # more calls waiting than this: RESOURCE_EXHAUSTED, not an ever longer wait
        self.wait = 0.0  # seconds a pass waits for the calls of sessions at work that have not come yet
        self.turn_wait = 0.003  # seconds a pass waits for the rest of a lockstep turn's calls
        self.at_work: Callable[[], int] | None = None  # -> sessions used lately (the runner's count)
        self.waiting: deque[Waiting] = deque()  # guarded by the thread's lock
        self.deadline: float | None = None  # when the pass now waiting for stragglers stops waiting
        thread.batchers.append(self)

    async def submit(self, session_id: str, call: Any, turn: tuple[int, int] = (0, 0)) -> Any:
        """Queue `call` for a pass; `turn`: (id, calls) of the lockstep turn it came in ((0, 0): none)."""
        return await self.enqueue([(session_id, call)], turn)[0]

    def enqueue(self, calls: list[tuple[str, Any]], turn: tuple[int, int] = (0, 0)) -> list[asyncio.Future]:
        """Queue (session id, call) pairs together, all of `turn`. -> their futures"""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in calls]
        with self.thread.cond:
            if len(self.waiting) + len(calls) > self.max_queue:
                raise CapacityExceeded(f"{len(self.waiting)} calls already wait for the model (--max-queue); retry later")
            self.waiting.extend(Waiting(session_id, call, future, loop, *turn)
                                for (session_id, call), future in zip(calls, futures))
            self.thread.wake()
        return futures

    def ready(self, now: float) -> list | float | None:
        """Under the thread's lock: the calls of the next pass, or when to look again (None: no calls)."""
        while self.waiting and self.waiting[0].future.done():  # its caller gave up before it ran
            self.waiting.popleft()
        if not self.waiting:
            self.deadline = None
            return None
        head = self.waiting[0]
        if head.turn:  # the rest of its lockstep turn is on its way
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

        def deliver(results: Any, error: BaseException | None) -> None:
            if error is not None or not isinstance(results, list) or len(results) != len(batch):
                # not one call's fault: every call in the pass gets it
                results = [error or RuntimeError("the pass returned no result per call")] * len(batch)
            if self.on_pass is not None:
                self.on_pass(len(batch))
            for item, result in zip(batch, results):
                if isinstance(result, BaseException):
                    _settle(item.future, None, result)
                else:
                    _settle(item.future, result, None)

        return (lambda: self.run_many([item.call for item in batch])), batch[0].loop, deliver


class ModelServicer:
    """GetModelInfo, GetTokenizer and Release: the RPCs both model services share; and the
    batcher their per-round calls (Propose / Verify) go through.

    `engine` (a DraftEngine or TargetEngine) is None until the weights are
    loaded; calls before that get UNAVAILABLE.
    """

    run_many_name = ""  # the engine's batched method: propose_many / verify_many

    def __init__(self, thread: ModelThread, metrics: ModelMetrics | None = None, max_batch: int = 32):
        self.thread = thread
        self.engine = None
        self.metrics = metrics
        self.batcher = Batcher(thread, lambda calls: getattr(self.engine, self.run_many_name)(calls), max_batch,
                               self._observe_pass)
        self.batcher.at_work = lambda: self.engine.runner.at_work if self.engine is not None else 0

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
            result, cost = await (queued if queued is not None else self.batcher.submit(session_id, call, turn))
            return result, dataclasses.replace(cost, service_ms=(time.perf_counter() - start) * 1e3)
        except asyncio.CancelledError:
            status = grpc.StatusCode.CANCELLED
            raise
        except Exception as exc:
            status = status_of(exc)
            raise
        finally:
            if metrics is not None:
                metrics.queue.dec()
                metrics.calls.labels(method, status.name).inc()
                metrics.latency.labels(method).observe(time.perf_counter() - start)

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
        size = self.batcher.max_batch
        try:
            queued = []
            for start in range(0, len(calls), size):
                chunk = calls[start : start + size]
                queued += self.batcher.enqueue(chunk, (random.getrandbits(63) | 1, len(chunk)))
        except CapacityExceeded as exc:
            for future in queued:
                future.cancel()
            if self.metrics is not None:
                self.metrics.calls.labels(method, status_of(exc).name).inc(len(calls))
            return [empty] * len(calls), [call_status(exc)] * len(calls)
        results = await asyncio.gather(*(self.run_call(method, session_id, call, queued=future)
                                         for (session_id, call), future in zip(calls, queued)),
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
                runner = self.engine.runner

                def release() -> None:
                    with runner.lock:
                        for session_id in sessions:
                            runner.sessions.release(session_id)

                self.thread.submit(release)  # not awaited: this may run under cancellation

    async def GetModelInfo(self, request, context):
        engine = await self.ready(context)
        return pb.ModelInfo(**engine.runner.info(), max_tokens_per_call=engine.max_tokens)

    async def GetTokenizer(self, request, context):
        runner = (await self.ready(context)).runner
        chunk = 1 << 20
        for name, data in runner.tokenizer_files():
            for offset in range(0, max(len(data), 1), chunk):
                yield pb.TokenizerFile(name=name, data=data[offset : offset + chunk])

    async def Release(self, request, context):
        runner = (await self.ready(context)).runner

        def release() -> bool:
            with runner.lock:
                return runner.sessions.release(request.session_id)

        return pb.ReleaseResponse(released=await self.thread.run(release))


async def sweep_idle_sessions(runner, thread: ModelThread, every: float = 30.0) -> None:
    """Evict abandoned sessions in the background (on the model thread, which owns them)."""

    def evict() -> int:
        with runner.lock:
            return runner.sessions.evict_idle()

    while True:
        await asyncio.sleep(every)
        evicted = await thread.run(evict)
        if evicted:
            log.info("evicted %d idle sessions", evicted)


def run_model_service(name: str, args: argparse.Namespace, servicer: ModelServicer, add_to_server, service_name: str,
                      make_engine: Callable[[Any], Any]) -> None:
    """Main body of a model service: load the model off the event loop, then serve."""
    from .model_runner import ModelRunner

    setup_logging(args.log_level)
    credentials = server_credentials(args)  # before the weights: a bad certificate path fails at once
    resolve_threads(args)
    set_threads(args.threads)
    if args.max_batch < 1:
        raise SystemExit(f"--max-batch must be >= 1, not {args.max_batch}")
    servicer.batcher.max_batch = args.max_batch
    if not 0 <= args.batch_wait_ms <= 1000:  # also NaN
        raise SystemExit(f"--batch-wait-ms must lie in [0, 1000], not {args.batch_wait_ms}")
    servicer.batcher.wait = args.batch_wait_ms / 1e3
    if not 0 <= args.turn_wait_ms <= 1000:  # also NaN
        raise SystemExit(f"--turn-wait-ms must lie in [0, 1000], not {args.turn_wait_ms}")
    servicer.batcher.turn_wait = args.turn_wait_ms / 1e3
    servicer.batcher.max_queue = args.max_queue
    if args.kv_pool_capacity is not None and args.kv_pool_capacity < 0:
        raise SystemExit(f"--kv-pool-capacity must be >= 0, not {args.kv_pool_capacity}")

    async def main() -> None:
        sweeper: asyncio.Task | None = None
        runner = None

        async def load() -> asyncio.Future | None:
            nonlocal sweeper, runner
            runner = await servicer.thread.run(
                lambda: ModelRunner(args.model, args.device, args.dtype, args.max_sessions,
                                    args.session_idle_timeout, args.max_context or None, args.forward,
                                    args.tensor_parallel_size, args.ray_address, args.tp_start_timeout,
                                    args.kv_pool_capacity, getattr(args, "vocab_subset", 0))
            )
            runner.batched_threads = args.batched_threads
            runner.on_forward = servicer.thread.flush
            runner.max_kv_tokens = args.max_kv_tokens
            runner.pass_cost = await servicer.thread.run(runner.calibrate)
            servicer.engine = make_engine(runner)
            servicer.metrics.watch(runner.sessions, runner.kv_pool_positions)
            log.info("%s loaded %s (%d parameters) on %s, %s forward, %d threads (%d for batched passes); pass %s",
                     name, runner.name, runner.num_parameters, runner.device, runner.forward_kind, args.threads,
                     args.batched_threads, runner.pass_cost)
            sweeper = asyncio.ensure_future(sweep_idle_sessions(runner, servicer.thread, min(30.0, args.session_idle_timeout)))
            if runner.tp is None:
                return None
            from .tensor_parallel import watch

            loop = asyncio.get_running_loop()
            broken = loop.create_future()
            watch(runner.tp, lambda message: loop.call_soon_threadsafe(broken.set_result, message))
            return broken

        def add(server: grpc.aio.Server) -> list[str]:
            add_to_server(servicer, server)
            return [service_name]

        if servicer.metrics is None:
            servicer.metrics = ModelMetrics()
        start_metrics(servicer.metrics.registry, args.host, args.metrics_port)

        async def on_stop() -> None:
            if sweeper is not None:
                sweeper.cancel()
            if runner is not None:
                await servicer.thread.run(runner.close)

        await serve(name, args.host, args.port, add, load, on_stop, grace=args.shutdown_grace,
                    credentials=credentials)

    asyncio.run(main())
