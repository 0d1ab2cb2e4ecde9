"""A per-round call whose stream broke between two rounds (its service died) fails as a PeerError
naming the service, the one error the failover layer acts on, never as an unexpected exception."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.peers import GrpcDraft, PeerError


class FinishedStream:
    """A ProposeStream whose RPC already ended: grpc.aio's write then raises InvalidStateError."""

    def __init__(self, code=grpc.StatusCode.UNAVAILABLE, details="Socket closed"):
        self._code, self._details, self.cancelled = code, details, False

    async def write(self, request):
        raise asyncio.InvalidStateError("RPC already finished.")

    async def read(self):  # pragma: no cover - never reached
        raise AssertionError("read after a failed write")

    def done(self) -> bool:
        return True

    async def code(self):
        return self._code

    async def details(self):
        return self._details

    def cancel(self):
        self.cancelled = True


@pytest.mark.parametrize("code, expected", [(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
                                            (grpc.StatusCode.OK, grpc.StatusCode.UNAVAILABLE)])
def test_a_write_on_a_finished_stream_is_a_peer_error(code, expected):
    async def go():
        peer = GrpcDraft("127.0.0.1:1", timeout=5.0)
        try:
            with pytest.raises(PeerError) as e:
                await peer._step(None, lambda: FinishedStream(code), "s1", object())
            assert "s1" not in peer.streams  # the next round opens a new stream
            return e.value
        finally:
            await peer.channel.close()

    error = asyncio.run(go())
    assert error.code == expected
    assert "draft service at 127.0.0.1:1" in str(error)
