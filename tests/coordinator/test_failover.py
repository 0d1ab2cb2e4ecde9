"""Losing a replica mid-request: a draft replica killed mid-stream, then a target replica killed
mid-stream (two of each to start with). The streams go on without an error and the greedy output
is token for token what a stack that lost nothing produces."""

from __future__ import annotations

import signal
import time

import grpc
import pytest

from coordinator.launch import LocalStack
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

PROMPT = [5, 17, 42, 9, 100, 3]
REQUEST = dict(prompt_token_ids=PROMPT, max_new_tokens=400, temperature=0.0, num_speculative_tokens=1)


@pytest.fixture(scope="module")
def cluster(pair, request):
    draft, target = pair
    stack = LocalStack(draft, target, draft_replicas=2, target_replicas=2).start()
    request.addfinalizer(stack.stop)
    return stack


def busy_replica(stub, role: str) -> str:
    """The address of the `role` replica the one request in flight is pinned to."""
    for _ in range(100):
        busy = [r.address for r in stub.GetInfo(pb.GetInfoRequest()).replicas if r.role == role and r.outstanding]
        if busy:
            return busy[0]
        time.sleep(0.01)
    raise AssertionError("no replica is serving the request")


@pytest.mark.parametrize("role", ["draft", "target"])
def test_a_replica_killed_mid_stream_costs_nothing(cluster, stack, role):
    with grpc.insecure_channel(stack.addr) as channel:
        expected = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(**REQUEST)).token_ids)
    with grpc.insecure_channel(cluster.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        stream = stub.GenerateStream(pb.GenerateRequest(**REQUEST), timeout=120)
        first = next(stream)
        victim = busy_replica(stub, role)
        name = next(n for n, a in cluster.addresses.items() if a == victim)
        cluster.procs[name].send_signal(signal.SIGKILL)
        rest = list(stream)  # no error: the request moved to the other replica
        tokens = list(first.token_ids) + [t for chunk in rest for t in chunk.token_ids]
        assert tokens == expected and rest[-1].stats.generated_tokens == len(expected)
        log = cluster.logs["coordinator"].read_text()
        assert f"{role} call failed" in log  # the kill really came mid-stream and was met
        seen = {r.address: r for r in stub.GetInfo(pb.GetInfoRequest()).replicas}
        assert seen[victim].state != "serving"
        # the next request goes to the replica left
        again = stub.Generate(pb.GenerateRequest(**REQUEST), timeout=120)
        assert list(again.token_ids) == expected


def test_a_sampled_request_survives_its_target(pair, stack):
    """Sampling through a target loss: the stream goes on, what was sent before the kill is what a
    faultless run with the same seed sends, and the count adds up (no token lost or repeated).
    After the loss the new target session is seeded afresh: the rest is target-distributed, but
    not token for token the faultless run's."""
    draft, target = pair
    sampled = dict(REQUEST, temperature=1.0, top_p=0.95, seed=7, max_new_tokens=300)
    with grpc.insecure_channel(stack.addr) as channel:
        faultless = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(**sampled)).token_ids)
    with LocalStack(draft, target, target_replicas=2) as two, grpc.insecure_channel(two.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        stream = stub.GenerateStream(pb.GenerateRequest(**sampled), timeout=120)
        first = next(stream)
        victim = busy_replica(stub, "target")
        name = next(n for n, a in two.addresses.items() if a == victim)
        two.procs[name].send_signal(signal.SIGKILL)
        rest = list(stream)
        before = list(first.token_ids)
        tokens = before + [t for chunk in rest for t in chunk.token_ids]
        assert before == faultless[: len(before)]
        assert rest[-1].stats.generated_tokens == len(tokens)
        assert len(tokens) == sampled["max_new_tokens"] or rest[-1].finish_reason == pb.FINISH_REASON_EOS
        assert "target call failed" in two.logs["coordinator"].read_text()


def test_a_draft_lost_on_a_pre_draft_costs_nothing(pair):
    """In one process: the draft replica a --predraft request is on fails (UNAVAILABLE) on a
    pre-draft call, which drafts on from proposals the target has not verified yet. The request
    moves to the other replica without carrying those proposals as its prompt (the next round's
    rollback would reach past what the new session proposed: INVALID_ARGUMENT) and decodes what a
    faultless run decodes."""
    import asyncio

    from coordinator.failover import FailoverDraft, FailoverTarget
    from coordinator.peers import PeerError
    from coordinator.pool import Pool, Replica
    from model_service.engines import DraftEngine, TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from model_service.model_runner import ModelRunner
    from speculative.round import generate
    from speculative.protocol import SamplingParams

    draft_dir, target_dir = pair  # a draft that mostly disagrees: rounds roll proposals back

    class Flaky(LocalDraft):
        def __init__(self, address: str, fail_on: int | None):
            super().__init__(DraftEngine(ModelRunner(draft_dir)))
            self.address, self.name, self.pre_drafts, self.fail_on = address, "draft", 0, fail_on

        async def propose(self, session_id, start, rollback, append, k, params, p_min=0.0, *, turn=(0, 0)):
            if not start and not rollback and not append:
                self.pre_drafts += 1
                if self.pre_drafts == self.fail_on:
                    raise PeerError(self, grpc.StatusCode.UNAVAILABLE, "killed")
            return await super().propose(session_id, start, rollback, append, k, params, p_min)

    def pool(name: str, peers) -> Pool:
        made = Pool(name, "127.0.0.1:1", lambda address, server_name: None)
        for peer in peers:
            peer.info = None
            made.replicas[peer.address] = Replica(peer)
            made.replicas[peer.address].healthy = True
        return made

    target = LocalTarget(TargetEngine(ModelRunner(target_dir)))
    target.address, target.name = "t0", "target"

    async def run(fail_on: int | None) -> list[int]:
        replicas = [Flaky("d0", fail_on), Flaky("d1", None)]
        out = []
        async for new in generate(FailoverDraft(pool("draft", replicas)), FailoverTarget(pool("target", [target])),
                                  PROMPT, max_new_tokens=60, k=3, params=SamplingParams(0.0), max_context=512,
                                  predraft=True, max_call_tokens=16):
            out += new
        # the replica it left still held its session (a failed unary call frees nothing): released too
        assert [len(r.engine.runner.sessions) for r in replicas] == [0, 0]
        return out

    expected = asyncio.run(run(None))
    assert len(expected) == 60
    for fail_on in (1, 2, 5):
        assert asyncio.run(run(fail_on)) == expected


@pytest.mark.parametrize("after_chunks", [2])
def test_the_lone_draft_killed_mid_stream_falls_back_to_the_target(pair, stack, after_chunks):
    """One draft replica, SIGKILLed while a greedy stream runs (its next call is a write on a
    stream whose RPC has ended): the stream goes on, target alone, and its tokens are the same."""
    draft, target = pair
    with grpc.insecure_channel(stack.addr) as channel:
        expected = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(**REQUEST)).token_ids)
    lone = LocalStack(draft, target).start()
    try:
        with grpc.insecure_channel(lone.addr) as channel:
            stub = pb_grpc.GenerationStub(channel)
            stream = stub.GenerateStream(pb.GenerateRequest(**REQUEST), timeout=120)
            head = [next(stream) for _ in range(after_chunks)]
            lone.procs["draft"].send_signal(signal.SIGKILL)
            lone.procs["draft"].wait(10)
            rest = list(stream)  # no error: a draft is never needed for the answer
            tokens = [t for chunk in head + rest for t in chunk.token_ids]
            assert tokens == expected and rest[-1].stats.generated_tokens == len(expected)
            again = stub.Generate(pb.GenerateRequest(**REQUEST), timeout=120)  # served by the target alone
            assert list(again.token_ids) == expected and again.stats.draft_tokens == 0
    finally:
        lone.stop()
