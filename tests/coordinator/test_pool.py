"""A coordinator in front of pools: 2 draft and 2 target replicas on loopback. Requests spread over
the replicas with outputs identical to a single-replica stack; a replica added at run time gets
traffic; a replica removed gets none."""

from __future__ import annotations

import time

import grpc
import pytest

from coordinator.launch import LocalStack
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

PROMPTS = [[5 + i, 17, 42 + 3 * i, 9] for i in range(8)]


@pytest.fixture(scope="module")
def cluster(pair, request):
    draft, target = pair
    stack = LocalStack(draft, target, draft_replicas=2, target_replicas=2, discovery_files=True).start()
    request.addfinalizer(stack.stop)
    return stack


def generate_all(addr: str, n: int = 24) -> list[list[int]]:
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        futures = [stub.Generate.future(pb.GenerateRequest(prompt_token_ids=p, max_new_tokens=n, temperature=0.0,
                                                           num_speculative_tokens=3), timeout=120) for p in PROMPTS]
        return [list(f.result().token_ids) for f in futures]


def replicas(addr: str) -> dict[str, pb.ReplicaInfo]:
    with grpc.insecure_channel(addr) as channel:
        return {r.address: r for r in pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest()).replicas}


def wait_for(addr: str, check, timeout: float = 30.0) -> dict[str, pb.ReplicaInfo]:
    deadline = time.monotonic() + timeout
    while True:
        seen = replicas(addr)
        if check(seen):
            return seen
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)


def test_requests_spread_and_outputs_match_one_replica(cluster, stack):
    wait_for(cluster.addr, lambda seen: len(seen) == 4 and all(r.state == "serving" for r in seen.values()))
    assert generate_all(cluster.addr) == generate_all(stack.addr)
    seen = replicas(cluster.addr)
    assert {r.role for r in seen.values()} == {"draft", "target"} and len(seen) == 4
    for r in seen.values():
        assert r.state == "serving" and r.served >= 2 and r.outstanding == 0, r  # 8 requests over 2 replicas


def test_added_replica_gets_traffic_and_removed_one_none(cluster, stack):
    expected = generate_all(stack.addr)
    name = cluster.add_replica("target")
    new = cluster.addresses[name]
    wait_for(cluster.addr, lambda seen: new in seen and seen[new].state == "serving")
    assert generate_all(cluster.addr) == expected
    assert replicas(cluster.addr)[new].served >= 1

    gone = cluster.addresses["draft-1"]
    cluster.remove_replica("draft-1")
    wait_for(cluster.addr, lambda seen: gone not in seen)
    before = {a: r.served for a, r in replicas(cluster.addr).items()}
    assert generate_all(cluster.addr) == expected
    after = replicas(cluster.addr)
    drafts = [a for a, r in after.items() if r.role == "draft"]
    assert drafts == [cluster.addresses["draft"]] and after[drafts[0]].served == before[drafts[0]] + len(PROMPTS)


def test_a_replica_of_another_model_is_refused(cluster, stack, other_tokenizer_model):
    name = cluster.add_replica("draft", model=other_tokenizer_model)
    odd = cluster.addresses[name]
    seen = wait_for(cluster.addr, lambda seen: odd in seen and seen[odd].state == "refused")
    assert "model" in seen[odd].detail or "serves" in seen[odd].detail
    assert generate_all(cluster.addr) == generate_all(stack.addr)
    assert replicas(cluster.addr)[odd].served == 0
    # restarted at the same address with the pool's model it serves; with another again, it is refused
    cluster.restart_replica(name, model=cluster.draft_model)
    wait_for(cluster.addr, lambda seen: seen[odd].state == "serving")
    cluster.restart_replica(name, model=other_tokenizer_model)
    wait_for(cluster.addr, lambda seen: seen[odd].state == "refused")
    assert generate_all(cluster.addr) == generate_all(stack.addr)
