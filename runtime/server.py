"""A specdec gRPC server's life: health (NOT_SERVING until loaded), reflection, message limits,
undecodable requests refused, TLS, and a graceful stop on SIGTERM / SIGINT. The coordinator and
both model services start theirs with `serve`.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from . import tracing
from .interceptors import Drain, UndecodableRequests
from .transport import MAX_MESSAGE_BYTES

log = logging.getLogger("specdec")


class Health:
    """grpc.health.v1 for the whole server ("": whether it is up, a liveness probe's) and each named service
    (whether it would serve a call now, a readiness probe's: see `serve`'s `readiness`)."""

    def __init__(self, services: Iterable[str]):
        self.servicer = health.aio.HealthServicer()
        self.services = ["", *services]

    async def set(self, serving: bool, named_only: bool = False) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in self.services[1:] if named_only else self.services:
            await self.servicer.set(name, status)

    async def follow(self, readiness: Callable[[], AsyncIterator[bool]], name: str) -> None:
        """The named services' status as `readiness` says, until cancelled (the server stopping); a change
        after the first is logged."""
        first = True
        async for ready in readiness():
            await self.set(ready, named_only=True)
            if not (first and ready):
                log.log(logging.INFO if ready else logging.WARNING, "%s %s", name,
                        "ready again: its services SERVING" if ready else
                        "not ready: its services NOT_SERVING (the server itself SERVING)")
            first = False


QUIET_POLL_S = 0.05  # how often a stopping server looks again whether its service holds sessions


async def drained(drain: Drain, quiet: Callable[[], bool] | None) -> None:
    """Until no call is in flight and, where given, quiet() (between one session's calls none may be)."""
    await drain.idle()
    while quiet is not None and not quiet():
        await asyncio.sleep(QUIET_POLL_S)
        await drain.idle()


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
    interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    admits: Callable[[str, Any], bool] | None = None,
    quiet: Callable[[], bool] | None = None,
    readiness: Callable[[], AsyncIterator[bool]] | None = None,
) -> None:
    """Start the server NOT_SERVING, run `load`, turn SERVING, and stop cleanly on SIGTERM /
    SIGINT (or when `stop` is set, if given).

    add_servicers registers the servicers and returns their full service names. `load` may return
    a future that resolves (with a message) if the service breaks later (a tensor-parallel rank
    dies, a model service's model thread stops): health then turns NOT_SERVING for good, and the
    server stays up to say why.
    `credentials` (server_credentials) make it serve TLS; a message larger than `max_request_bytes`
    is refused with RESOURCE_EXHAUSTED. `interceptors` run before the server's own (auth.RequireApiKey).
    Stopping, new calls are refused but those `admits(method, request)` lets through (interceptors.Drain),
    and the server waits up to `grace` for the calls in flight to end and, where given, for `quiet()` (a
    model service: no session held, so that a generation calling once per round may finish).
    Once loaded, `readiness` (where given: whether a call would be served, at once and at each change; the
    coordinator's, a healthy target replica) sets the named services' status; "" stays SERVING until the stop.
    """
    if tracing.configure(name):
        log.info("%s: tracing on (OTEL_* variables)", name)
    drain = Drain(admits)
    # (no SO_REUSEPORT: a second server started on a port one serves is refused, not given half its calls)
    server = grpc.aio.server(options=[("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                                      ("grpc.max_receive_message_length", max_request_bytes), ("grpc.so_reuseport", 0)],
                             interceptors=[drain, *interceptors, UndecodableRequests()])
    service_names = add_servicers(server)
    checks = Health(service_names)
    health_pb2_grpc.add_HealthServicer_to_server(checks.servicer, server)
    reflection.enable_server_reflection([*service_names, health.SERVICE_NAME, reflection.SERVICE_NAME], server)
    try:
        if credentials is None:
            bound = server.add_insecure_port(f"{host}:{port}")
        else:
            bound = server.add_secure_port(f"{host}:{port}", credentials)
    except RuntimeError as e:  # (grpc's "Failed to bind to address")
        why = "taken, or not this machine's" + (", or --tls-cert and --tls-key unusable" if credentials else "")
        raise SystemExit(f"{name}: cannot listen on {host}:{port} ({why}): {e}") from None
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
        following = None if readiness is None else asyncio.ensure_future(checks.follow(readiness, name))
        broken = loader.result()
        try:
            if broken is not None:
                await asyncio.wait({stopper, broken}, return_when=asyncio.FIRST_COMPLETED)
                if broken.done() and not stopper.done():
                    if following is not None:
                        following.cancel()
                    await checks.set(False)
                    log.error("%s NOT_SERVING: %s", name, broken.result())
                    print(f"{name} NOT_SERVING: {broken.result()}", flush=True)
            await stopper
        finally:
            if following is not None:
                following.cancel()
    elif loader in done:
        log.error("%s failed to start: %s", name, loader.exception())
        stopper.cancel()
        await server.stop(0)
        raise SystemExit(f"{name} failed to start: {loader.exception()}")
    else:
        loader.cancel()
    log.info("%s stopping", name)
    # NOT_SERVING and new calls refused at once; the calls in flight get up to `grace` to finish
    await checks.set(False)
    drain.close()
    began = asyncio.get_running_loop().time()
    try:
        await asyncio.wait_for(drained(drain, quiet), grace)
    except TimeoutError:
        log.warning("%s: %d calls still in flight after the %g s grace%s: cancelled", name, drain.active, grace,
                    "" if quiet is None or quiet() else ", sessions still held")
    await server.stop(max(0.0, grace - (asyncio.get_running_loop().time() - began)))
    if on_stop is not None:
        await on_stop()
    await asyncio.to_thread(tracing.shutdown)  # the spans still buffered
