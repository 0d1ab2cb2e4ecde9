"""Server interceptors every specdec server installs.

`UndecodableRequests`: a request whose bytes protobuf cannot parse gets INVALID_ARGUMENT naming
the message type, instead of grpc.aio's UNKNOWN "Unexpected DecodeError" (or INTERNAL from the
synchronous server): a malformed message is the client's error, and says so.

`Drain`: a graceful stop that answers. Once closed, a new call ends UNAVAILABLE at once (the client
retries elsewhere) while the calls in flight go on, and health checks still say NOT_SERVING; the
server is stopped only when they are done (or the grace is spent). grpc's own `stop(grace)` refuses
new calls too, but a call that reaches the server as the stop begins can wait unanswered for the
whole grace period (seen in CI: a health check's 5 s deadline passed during a 20 s grace).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    """Stands in for a request that failed to parse; the handler is never called with it."""

    def __init__(self, error: DecodeError):
        self.error = error


def _lenient(deserialize):
    def parse(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as exc:
            return _Undecodable(exc)

    return parse


async def _refuse(context: grpc.aio.ServicerContext, request: _Undecodable) -> None:
    await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"the request is not a valid message: {request.error}")


async def _responses(result):
    """A streaming handler's responses: it yields them, or writes them with context.write."""
    if inspect.isasyncgen(result):
        async for response in result:
            yield response
    else:
        await result


class UndecodableRequests(grpc.aio.ServerInterceptor):
    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        deserialize = _lenient(handler.request_deserializer)
        if handler.unary_unary is not None:
            inner = handler.unary_unary

            async def unary_unary(request, context):
                if isinstance(request, _Undecodable):
                    await _refuse(context, request)
                return await inner(request, context)

            return grpc.unary_unary_rpc_method_handler(unary_unary, deserialize, handler.response_serializer)
        if handler.unary_stream is not None:
            inner = handler.unary_stream

            async def unary_stream(request, context):
                if isinstance(request, _Undecodable):
                    await _refuse(context, request)
                async for response in _responses(inner(request, context)):
                    yield response

            return grpc.unary_stream_rpc_method_handler(unary_stream, deserialize, handler.response_serializer)

        def checked(requests, context):
            async def each():
                async for request in requests:
                    if isinstance(request, _Undecodable):
                        await _refuse(context, request)
                    yield request

            return each()

        if handler.stream_unary is not None:
            inner = handler.stream_unary

            async def stream_unary(requests, context):
                return await inner(checked(requests, context), context)

            return grpc.stream_unary_rpc_method_handler(stream_unary, deserialize, handler.response_serializer)
        inner = handler.stream_stream

        async def stream_stream(requests, context):
            async for response in _responses(inner(checked(requests, context), context)):
                yield response

        return grpc.stream_stream_rpc_method_handler(stream_stream, deserialize, handler.response_serializer)


def _kind(handler) -> str:
    return ("unary_unary" if handler.unary_unary else "unary_stream" if handler.unary_stream else
            "stream_unary" if handler.stream_unary else "stream_stream")


def _like(handler, behaviour):
    """`behaviour` as a handler of `handler`'s kind, with its (de)serializers."""
    make = getattr(grpc, f"{_kind(handler)}_rpc_method_handler")
    return make(behaviour, handler.request_deserializer, handler.response_serializer)


def refusal(handler, code: grpc.StatusCode, details: str):
    """A handler of `handler`'s kind that ends every call with `code` (auth.RequireApiKey, Drain)."""

    async def refuse(request_or_requests, context):  # a coroutine serves every kind of call
        await context.abort(code, details)

    return _like(handler, refuse)


async def _peeked(requests) -> tuple[Any, Any]:
    """(the first request of a stream of them or None where it ends at once, the stream as it was)."""
    iterator = requests.__aiter__()
    try:
        first = await iterator.__anext__()
    except StopAsyncIteration:
        return None, requests

    async def again():
        yield first
        async for request in iterator:
            yield request

    return first, again()


class Drain(grpc.aio.ServerInterceptor):
    """Counts the calls in flight; after `close()` refuses new ones with UNAVAILABLE, but for those whose
    (first) request `admits(method, request)` lets through (a model service's: the next call of a
    session it holds, whose generation the grace is for, and a release). Health checks and reflection
    are neither counted (a Watch lasts as long as its client) nor refused."""

    OPEN = ("/grpc.health.v1.Health/", "/grpc.reflection.")
    REFUSAL = "the server is shutting down: retry on another replica"

    def __init__(self, admits: Callable[[str, Any], bool] | None = None):
        self.admits = admits
        self.active = 0
        self.closing = False
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        self.closing = True

    async def idle(self) -> None:
        """Until no counted call is in flight."""
        await self._idle.wait()

    def _enter(self) -> None:
        self.active += 1
        self._idle.clear()

    def _leave(self) -> None:
        self.active -= 1
        if self.active == 0:
            self._idle.set()

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(self.OPEN):
            return handler
        kind, method = _kind(handler), handler_call_details.method
        if self.closing and self.admits is None:
            return refusal(handler, grpc.StatusCode.UNAVAILABLE, self.REFUSAL)
        inner = getattr(handler, kind)
        streamed = kind.startswith("stream_")

        async def admitted(request_or_requests, context):
            """The call's request(s), once `admits` let it through a closing server (else it is refused)."""
            if not self.closing:
                return request_or_requests
            first, request_or_requests = (await _peeked(request_or_requests)) if streamed else \
                (request_or_requests, request_or_requests)
            if first is None or not self.admits(method, first):
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.REFUSAL)
            return request_or_requests

        if kind.endswith("_unary"):
            async def counted(request_or_requests, context):
                request_or_requests = await admitted(request_or_requests, context)
                self._enter()
                try:
                    return await inner(request_or_requests, context)
                finally:
                    self._leave()
        else:
            async def counted(request_or_requests, context):
                request_or_requests = await admitted(request_or_requests, context)
                self._enter()
                try:
                    async for response in _responses(inner(request_or_requests, context)):
                        yield response
                finally:
                    self._leave()
        return _like(handler, counted)
