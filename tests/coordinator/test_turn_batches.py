"""The coordinator's side of batched lockstep turns (Peer.turn_call), against a fake stub: the
calls of one turn to one service leave as one batch RPC, each caller gets its own reply or its
own error, and a failed RPC fails every call in it."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from coordinator.peers import GrpcDraft, PeerError
from specdec.v1 import specdec_pb2 as pb
from speculative.lockstep import TURN
from speculative.sampling import SamplingParams

GREEDY = SamplingParams(0.0, 0, 1.0, 0)


class FakeDraftStub:
    """ProposeBatch answers each call with its session's number as the one token, or NOT_FOUND
    for sessions named in `missing`; `fail` makes the whole RPC fail with that code."""

    def __init__(self, missing=(), fail: grpc.StatusCode | None = None):
        self.batches: list[list[str]] = []
        self.unary: list[str] = []
        self.missing = set(missing)
        self.fail = fail

    async def ProposeBatch(self, request, timeout=None):
        self.batches.append([call.session_id for call in request.calls])
        await asyncio.sleep(0.01)
        if self.fail is not None:
            raise grpc.aio.AioRpcError(self.fail, grpc.aio.Metadata(), grpc.aio.Metadata(), "the fake failed")
        replies, statuses = [], []
        for call in request.calls:
            if call.session_id in self.missing:
                replies.append(pb.ProposeResponse())
                statuses.append(pb.CallStatus(code=grpc.StatusCode.NOT_FOUND.value[0], message="no such session"))
            else:
                token = int(call.session_id.removeprefix("s"))
                replies.append(pb.ProposeResponse(proposal=pb.DraftProposal(tokens=[token]), batch_size=len(request.calls)))
                statuses.append(pb.CallStatus())
        return pb.ProposeBatchResponse(replies=replies, statuses=statuses)

    async def Propose(self, request, timeout=None):
        self.unary.append(request.session_id)
        return pb.ProposeResponse(proposal=pb.DraftProposal(tokens=[0]), batch_size=1)

    def ProposeStream(self):
        raise AssertionError("the peer is unary")


def peer(stub: FakeDraftStub) -> GrpcDraft:
    made = GrpcDraft("127.0.0.1:1", streaming=False)  # the channel never connects: the stub is fake
    made.stub = stub
    return made


async def propose(draft: GrpcDraft, session: str, turn: tuple[int, int], delay: float = 0.0):
    if delay:
        await asyncio.sleep(delay)
    TURN.set(turn)
    proposal, cost = await draft.propose(session, False, 0, [], 1, GREEDY)
    return proposal.tokens, cost.batch_size


async def settle(calls):
    return await asyncio.gather(*calls, return_exceptions=True)


def test_a_turn_goes_as_one_batch_and_each_call_gets_its_own_answer():
    async def main():
        stub = FakeDraftStub(missing={"s2"})
        draft = peer(stub)
        results = await settle([propose(draft, f"s{i}", (7, 4)) for i in range(4)])
        await draft.close()
        return stub, results

    stub, results = asyncio.run(main())
    assert stub.batches == [["s0", "s1", "s2", "s3"]] and not stub.unary
    assert results[0] == ([0], 4) and results[1] == ([1], 4) and results[3] == ([3], 4)
    assert isinstance(results[2], PeerError) and results[2].code == grpc.StatusCode.NOT_FOUND
    assert "no such session" in str(results[2])


def test_a_turn_split_over_replicas_goes_without_waiting_for_the_rest():
    """Three calls of a turn of five reach this peer (the others went elsewhere): they leave at the
    event loop's next pass, and a call of the turn that comes later goes in a batch of its own.
    Calls of another turn never share a batch with them."""

    async def main():
        stub = FakeDraftStub()
        draft = peer(stub)
        results = await settle([propose(draft, "s0", (7, 5)), propose(draft, "s1", (7, 5)),
                                propose(draft, "s2", (8, 2)), propose(draft, "s3", (7, 5)),
                                propose(draft, "s4", (7, 5), delay=0.005)])
        await draft.close()
        return stub, results

    stub, results = asyncio.run(main())
    assert sorted(stub.batches) == [["s0", "s1", "s3"], ["s2"], ["s4"]]
    assert [tokens for tokens, _ in results] == [[0], [1], [2], [3], [4]]


def test_a_failed_batch_fails_each_of_its_calls_with_its_status():
    async def main():
        stub = FakeDraftStub(fail=grpc.StatusCode.UNAVAILABLE)
        draft = peer(stub)
        results = await settle([propose(draft, f"s{i}", (9, 3)) for i in range(3)])
        await draft.close()
        return stub, results

    stub, results = asyncio.run(main())
    assert len(stub.batches) == 1
    assert all(isinstance(r, PeerError) and r.code == grpc.StatusCode.UNAVAILABLE for r in results), results


def test_a_cancelled_caller_leaves_the_rest_of_its_batch_answered():
    async def main():
        stub = FakeDraftStub()
        draft = peer(stub)
        tasks = [asyncio.ensure_future(propose(draft, f"s{i}", (5, 3))) for i in range(3)]
        await asyncio.sleep(0.002)  # the batch is on its way
        tasks[1].cancel()
        results = await settle(tasks)
        await draft.close()
        return stub, results

    stub, results = asyncio.run(main())
    assert stub.batches == [["s0", "s1", "s2"]]
    assert results[0] == ([0], 3) and results[2] == ([2], 3)
    assert isinstance(results[1], asyncio.CancelledError)


@pytest.mark.parametrize("turn, batch_turns", [((0, 0), True), ((3, 1), True), ((3, 2), False)])
def test_calls_outside_a_turn_of_several_go_one_by_one(turn, batch_turns):
    """Ungated calls, a turn of one call, and --lockstep-calls each: no batch RPC."""

    async def main():
        stub = FakeDraftStub()
        draft = peer(stub)
        draft.batch_turns = batch_turns
        results = await settle([propose(draft, f"s{i}", turn) for i in range(2)])
        await draft.close()
        return stub, results

    stub, results = asyncio.run(main())
    assert not stub.batches and stub.unary == ["s0", "s1"]
    assert results == [([0], 1), ([0], 1)]
