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
