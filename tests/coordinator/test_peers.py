"""A per-round call whose stream broke between two rounds (its service died) fails as a PeerError
naming the service, the one error the failover layer acts on, never as an unexpected exception."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.peers import FEED_SECONDS, GrpcDraft, PeerError
from specdec.v1 import specdec_pb2 as pb


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


class OpenStream(FinishedStream):
    """A stream whose RPC is live: writes go through, reads wait (the service is hung)."""

    def __init__(self):
        super().__init__(grpc.StatusCode.OK)
        self.reading = asyncio.Event()

    async def write(self, request):
        pass

    async def read(self):
        self.reading.set()
        await asyncio.Event().wait()

    def done(self) -> bool:
        return False


def test_any_exception_from_a_call_is_a_peer_error():
    """Not only an RPC error: whatever a call raises reaches the failover as a PeerError naming the service."""
    async def broken(request, timeout):
        raise RuntimeError("the channel is closed")

    async def go():
        peer = GrpcDraft("127.0.0.1:1", timeout=5.0)
        try:
            with pytest.raises(PeerError) as e:
                await peer.call(broken, object())
            return e.value
        finally:
            await peer.channel.close()

    error = asyncio.run(go())
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert "draft service at 127.0.0.1:1" in str(error) and "RuntimeError" in str(error)


def test_a_call_given_up_leaves_no_stream_behind():
    """A per-round call whose caller gives up mid-read (a late draft, a client's cancel) ends its
    stream: the answer, should it come, must not be read as the next call's."""
    async def go():
        peer = GrpcDraft("127.0.0.1:1", timeout=5.0)
        stream = OpenStream()
        try:
            call = asyncio.ensure_future(peer._step(None, lambda: stream, "s1", object()))
            await stream.reading.wait()
            assert "s1" in peer.streams
            call.cancel()
            with pytest.raises(asyncio.CancelledError):
                await call
            assert "s1" not in peer.streams and stream.cancelled
        finally:
            await peer.channel.close()

    asyncio.run(go())


def test_a_hung_stream_meets_the_call_deadline():
    async def go():
        peer = GrpcDraft("127.0.0.1:1", timeout=0.05)
        stream = OpenStream()
        try:
            with pytest.raises(PeerError) as e:
                await peer._step(None, lambda: stream, "s1", object())
            assert "s1" not in peer.streams and stream.cancelled
            return e.value
        finally:
            await peer.channel.close()

    assert asyncio.run(go()).code == grpc.StatusCode.DEADLINE_EXCEEDED


def test_a_call_that_feeds_a_long_prompt_has_time_for_it():
    """The deadline grows with the tokens a call feeds (FEED_SECONDS each): a prefill of thousands of tokens
    on a few CPU cores is not a hung service. A call feeding nothing still meets the call timeout: the long
    call's answer comes only after a short call sent after it has timed out."""
    answered = asyncio.Event()

    class Answering(OpenStream):
        async def read(self):
            self.reading.set()
            await answered.wait()  # (the service's work: until the short call's deadline has passed)
            return "answer"

    async def go():
        peer = GrpcDraft("127.0.0.1:1", timeout=0.05)
        try:
            # 0.05 + 1000 x 0.02 = 20.05 s: past the short call's deadline however slow the machine
            long = pb.ProposeRequest(session_id="s1", append=list(range(1000)))
            assert peer.deadline(long) == pytest.approx(0.05 + 1000 * FEED_SECONDS)
            fed = asyncio.ensure_future(peer._step(None, Answering, "s1", long))
            with pytest.raises(PeerError) as e:
                await peer._step(None, OpenStream, "s2", pb.ProposeRequest(session_id="s2"))
            answered.set()
            assert await fed == "answer"
            return e.value
        finally:
            await peer.channel.close()

    assert asyncio.run(go()).code == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize("details, expected", [
    ("Internal error from Core", grpc.StatusCode.UNAVAILABLE),  # gRPC core: the service hung up mid-call
    ("Received RST_STREAM with code 2", grpc.StatusCode.UNAVAILABLE),
    ("the service's own failure", grpc.StatusCode.INTERNAL)])  # a status the service gave stays
def test_a_connection_dropped_mid_call_is_unavailable(details, expected):
    async def go():
        peer = GrpcDraft("127.0.0.1:1", timeout=5.0)
        try:
            with pytest.raises(PeerError) as e:
                await peer._step(None, lambda: FinishedStream(grpc.StatusCode.INTERNAL, details), "s1", object())
            return e.value
        finally:
            await peer.channel.close()

    error = asyncio.run(go())
    assert error.code == expected and details in str(error)


def _info(host: str, device: str, cpus: list[int]):
    from specdec.v1 import specdec_pb2 as pb

    return pb.ModelInfo(host_id=host, device=device, cpus=cpus)


@pytest.mark.parametrize("draft, target, shared", [
    (("boot-a", "cpu", [0, 1]), ("boot-a", "cpu", [0, 1]), True),      # one machine, the same cores
    (("boot-a", "cpu", [0]), ("boot-a", "cpu", [0, 1]), True),         # some in common
    (("boot-a", "cpu", [0]), ("boot-a", "cpu", [1]), False),           # pinned apart
    (("boot-a", "cpu", [0, 1]), ("boot-b", "cpu", [0, 1]), False),     # two machines
    (("boot-a", "cuda:0", [0, 1]), ("boot-a", "cuda:1", [0, 1]), False),  # GPUs compute, not the cores
    (("", "cpu", [0]), ("", "cpu", [0]), False),                       # a service that does not say
])
def test_share_cpus(draft, target, shared):
    from coordinator.peers import share_cpus

    assert share_cpus(_info(*draft), _info(*target)) is shared
