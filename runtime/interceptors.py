"""Server interceptors every specdec server installs.

`UndecodableRequests`: a request whose bytes protobuf cannot parse gets INVALID_ARGUMENT naming
the message type, instead of grpc.aio's UNKNOWN "Unexpected DecodeError" (or INTERNAL from the
synchronous server): a malformed message is the client's error, and says so.
"""

from __future__ import annotations

import inspect

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
