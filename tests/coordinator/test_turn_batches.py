"""The coordinator's side of batched lockstep turns (Peer.turn_call), against a fake stub: the
calls of one turn to one service leave as one batch RPC, each caller gets its own reply or its
own error, a failed RPC fails every call in it, and a call alone goes as any other call."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.peers import GrpcDraft, PeerError
from specdec.v1 import specdec_pb2 as pb
from speculative.protocol import ProposeCall, SamplingParams

GREEDY = SamplingParams(0.0, 0, 1.0, 0)


def reply(session_id: str, batch_size: int) -> pb.ProposeResponse:
    """Session "sN" gets the one token N."""
    return pb.ProposeResponse(proposal=pb.DraftProposal(tokens=[int(session_id.removeprefix("s"))]),
                              batch_size=batch_size)


class FakeDraftStub:
    """ProposeBatch answers each call with its session's number as the one token, or NOT_FOUND
    for sessions named in `missing`; `fail` makes the whole RPC fail (a grpc status code, or any
    other exception). `events` records the calls in the order they were answered. `sent` is set
    as a batch RPC comes; with `hold`, its answer waits until `answer` is set."""

    def __init__(self, missing=(), fail=None, hold: bool = False):
        self.batches: list[list[str]] = []
        self.unary: list[str] = []
        self.events: list[str] = []
        self.missing = set(missing)
        self.fail = fail
        self.sent, self.answer = asyncio.Event(), asyncio.Event()
        if not hold:
            self.answer.set()

    async def ProposeBatch(self, request, timeout=None):
        self.batches.append([call.session_id for call in request.calls])
        self.sent.set()
        await self.answer.wait()
        await asyncio.sleep(0)  # answered in a later pass of the event loop, as an RPC is
        if isinstance(self.fail, grpc.StatusCode):
            raise grpc.aio.AioRpcError(self.fail, grpc.aio.Metadata(), grpc.aio.Metadata(), "the fake failed")
        if self.fail is not None:
            raise self.fail
        replies, statuses = [], []
        for call in request.calls:
            if call.session_id in self.missing:
                replies.append(pb.ProposeResponse())
                statuses.append(pb.CallStatus(code=grpc.StatusCode.NOT_FOUND.value[0], message="no such session"))
            else:
                replies.append(reply(call.session_id, len(request.calls)))
                statuses.append(pb.CallStatus())
        self.events.append("batch " + " ".join(call.session_id for call in request.calls))
        return pb.ProposeBatchResponse(replies=replies, statuses=statuses)

    async def Propose(self, request, timeout=None):
        self.unary.append(request.session_id)
        return reply(request.session_id, 1)

    def ProposeStream(self):
        raise AssertionError("the peer is unary")

    async def Release(self, request, timeout=None):
        self.events.append(f"release {request.session_id}")
        return pb.ReleaseResponse(released=True)


def peer(stub: FakeDraftStub) -> GrpcDraft:
    made = GrpcDraft("127.0.0.1:1", streaming=False)  # the channel never connects: the stub is fake
    made.stub = stub
    return made


async def propose(draft: GrpcDraft, session: str, turn: tuple[int, int], after: asyncio.Event | None = None):
    """`after`: the call is made once that is set."""
    if after is not None:
        await after.wait()
    proposal, cost = await draft.propose(ProposeCall(session, False, 0, [], 1, GREEDY), turn=turn)
    return proposal.tokens, cost.batch_size


def run(stub: FakeDraftStub, calls, batch_turns: bool = True):
    """Run `calls(draft)` (-> awaitables) on a peer over `stub`. -> their results or errors
    (30 s: calls that wait for each other for ever fail)"""

    async def main():
        draft = peer(stub)
        draft.batch_turns = batch_turns
        results = await asyncio.wait_for(asyncio.gather(*calls(draft), return_exceptions=True), 30)
        await draft.close()
        return results

    return asyncio.run(main())


def test_a_turn_goes_as_one_batch_and_each_call_gets_its_own_answer():
    stub = FakeDraftStub(missing={"s2"})
    results = run(stub, lambda draft: [propose(draft, f"s{i}", (7, 4)) for i in range(4)])
    assert stub.batches == [["s0", "s1", "s2", "s3"]] and not stub.unary
    assert results[0] == ([0], 4) and results[1] == ([1], 4) and results[3] == ([3], 4)
    assert isinstance(results[2], PeerError) and results[2].code == grpc.StatusCode.NOT_FOUND
    assert "no such session" in str(results[2])


def test_a_turn_split_over_replicas_goes_without_waiting_for_the_rest():
    """Three calls of a turn of five reach this peer (the others went elsewhere): they leave at the
    event loop's next pass; a call of the turn that comes later, alone, goes as any other call.
    Calls of another turn never share a batch with them."""
    stub = FakeDraftStub()
    results = run(stub, lambda draft: [
        propose(draft, "s0", (7, 5)), propose(draft, "s1", (7, 5)), propose(draft, "s2", (8, 2)),
        propose(draft, "s3", (7, 5)), propose(draft, "s4", (7, 5), after=stub.sent)])  # s4: after the batch left
    assert stub.batches == [["s0", "s1", "s3"]] and sorted(stub.unary) == ["s2", "s4"]
    assert results == [([0], 3), ([1], 3), ([2], 1), ([3], 3), ([4], 1)]


@pytest.mark.parametrize("fail, code", [(grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNAVAILABLE),
                                        (RuntimeError("the channel closed"), grpc.StatusCode.UNAVAILABLE)])
def test_a_failed_batch_fails_each_of_its_calls_with_its_status(fail, code):
    stub = FakeDraftStub(fail=fail)
    results = run(stub, lambda draft: [propose(draft, f"s{i}", (9, 3)) for i in range(3)])
    assert len(stub.batches) == 1
    assert all(isinstance(r, PeerError) and r.code == code for r in results), results


def test_a_service_without_batch_rpcs_gets_the_calls_one_by_one():
    stub = FakeDraftStub(fail=grpc.StatusCode.UNIMPLEMENTED)

    async def twice(draft):
        first = await asyncio.gather(*(propose(draft, f"s{i}", (9, 2)) for i in range(2)))
        return first + await asyncio.gather(*(propose(draft, f"s{i}", (10, 2)) for i in range(2, 4)))

    [results] = run(stub, lambda draft: [twice(draft)])
    assert len(stub.batches) == 1 and stub.unary == ["s0", "s1", "s2", "s3"]  # tried once, then never again
    assert results == [([0], 1), ([1], 1), ([2], 1), ([3], 1)]


def test_a_cancelled_caller_leaves_the_rest_of_its_batch_answered_and_is_released_after_it():
    stub = FakeDraftStub(hold=True)

    async def main(draft):
        tasks = [asyncio.ensure_future(propose(draft, f"s{i}", (5, 3))) for i in range(3)]
        await stub.sent.wait()  # the batch is on its way (its answer held)
        tasks[1].cancel()
        await asyncio.sleep(0)  # (one pass of the loop: the cancel lands)
        releasing = asyncio.ensure_future(draft.release("s1"))  # the generation ends: its call is still in the batch
        await asyncio.sleep(0)  # (one pass: the release goes as far as it can)
        before_the_answer = list(stub.events), releasing.done()
        stub.answer.set()
        await releasing
        return before_the_answer, await asyncio.gather(*tasks, return_exceptions=True)

    [(before_the_answer, results)] = run(stub, lambda draft: [main(draft)])
    assert before_the_answer == ([], False)  # the release waits for the batch its call is in
    assert stub.batches == [["s0", "s1", "s2"]]
    assert results[0] == ([0], 3) and results[2] == ([2], 3)
    assert isinstance(results[1], asyncio.CancelledError)
    assert stub.events == ["batch s0 s1 s2", "release s1"]


@pytest.mark.parametrize("turn, batch_turns", [((0, 0), True), ((3, 1), True), ((3, 2), False)])
def test_calls_outside_a_turn_of_several_go_one_by_one(turn, batch_turns):
    """Ungated calls, a turn of one call, and --lockstep-calls each: no batch RPC."""
    stub = FakeDraftStub()
    results = run(stub, lambda draft: [propose(draft, f"s{i}", turn) for i in range(2)], batch_turns)
    assert not stub.batches and stub.unary == ["s0", "s1"]
    assert results == [([0], 1), ([1], 1)]


def test_a_cancel_as_the_stream_answers_is_not_lost():
    """A generation cancelled (its client's deadline) just as its call's answer arrives must see
    the cancel, not carry on with the answer (Python 3.11's wait_for dropped it)."""

    class FakeStream:
        def __init__(self):
            self.answer = asyncio.get_running_loop().create_future()
            self.reading = asyncio.Event()

        async def write(self, request):
            pass

        def read(self):
            self.reading.set()
            return self.answer

        def cancel(self):  # as a grpc.aio stream call's: the coordinator drops a stream whose call gave up
            return True

    async def main():
        draft = GrpcDraft("127.0.0.1:1")  # streaming; the channel never connects
        stream = FakeStream()
        task = asyncio.create_task(draft._step(None, lambda: stream, "s0", pb.ProposeRequest(session_id="s0")))
        await stream.reading.wait()  # the call waits for its answer
        stream.answer.set_result(reply("s0", 1))
        task.cancel()  # in the same pass of the loop
        try:
            await task
            return "answered"
        except asyncio.CancelledError:
            return "cancelled"
        finally:
            await draft.close()

    assert asyncio.run(main()) == "cancelled"


def test_a_stream_that_cannot_be_ended_is_cancelled_at_its_release():
    """A release ends the session's stream (the service then releases the session); a stream whose
    end cannot be sent is cancelled instead, which the service takes as the end too, rather than
    left open with the session on it."""

    class Stuck:
        cancelled = False

        async def done_writing(self):
            raise grpc.aio.UsageError("a write is still on its way")

        def cancel(self):
            self.cancelled = True
            return True

    async def main():
        draft = GrpcDraft("127.0.0.1:1")  # the channel never connects: a unary Release would fail
        stream = draft.streams["s0"] = Stuck()
        try:
            await draft.release("s0")
        finally:
            await draft.close()
        return stream, draft.streams

    stream, streams = asyncio.run(main())
    assert stream.cancelled and "s0" not in streams
