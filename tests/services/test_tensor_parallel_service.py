"""A tensor-parallel target (TP = 2: rank 0 in the service, rank 1 a Ray actor) through the
full gRPC stack: the same greedy and seeded-sampled outputs as TP = 1, rollbacks included; a
dead rank turns the service NOT_SERVING naming it; SIGTERM leaves no process behind."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.launch import LocalStack
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

PROMPTS = [
    "def speculative_round(draft, target):",
    "for i in range(10):\n    print(",
    "The draft proposes tokens; the target",
]


@pytest.fixture(scope="module")
def tp_stack(pair, request):
    """The stack with a TP = 2 target (one torch thread a rank). The module's last test kills its rank 1."""
    draft, target = pair
    stack = LocalStack(draft, target, target_args=["--tensor-parallel-size", "2"]).start()
    request.addfinalizer(stack.stop)
    return stack


@pytest.fixture(scope="module")
def tp_client(tp_stack, request):
    channel = grpc.insecure_channel(tp_stack.addr)
    request.addfinalizer(channel.close)
    return pb_grpc.GenerationStub(channel)


@pytest.mark.parametrize("k", [0, 2, 5])
def test_greedy_equals_tp1_and_the_target_alone(tp_client, client, reference, k):
    rejected = 0
    for prompt in PROMPTS:
        request = pb.GenerateRequest(prompt=prompt, max_new_tokens=40, temperature=0.0, num_speculative_tokens=k)
        sharded, whole = tp_client.Generate(request), client.Generate(request)
        assert list(sharded.token_ids) == list(whole.token_ids) == reference(prompt, 40), (prompt, k)
        rejected += sharded.stats.rejected_rounds
    if k:  # the pair's draft mostly disagrees: rollbacks happened on both ranks
        assert rejected > 0


def test_seeded_sampling_equals_tp1(tp_client, client):
    for seed in (1, 2, 3):
        request = pb.GenerateRequest(prompt=PROMPTS[2], max_new_tokens=32, temperature=1.0, top_p=0.95, seed=seed,
                                     num_speculative_tokens=3)
        sharded, whole = tp_client.Generate(request), client.Generate(request)
        # (a round that went on without a late draft call draws other numbers, exactly all the same)
        lost = sharded.stats.lost_draft_rounds or whole.stats.lost_draft_rounds
        assert list(sharded.token_ids) == list(whole.token_ids) or lost, seed


def test_info_reports_the_size(tp_client):
    target = tp_client.GetInfo(pb.GetInfoRequest()).target
    assert target.tensor_parallel_size == 2
    assert len(target.rank_loads) == 2 and all(load.load_seconds > 0 for load in target.rank_loads)


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parent = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry.name))
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def alive(pid: int) -> bool:
    try:
        return not Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return False


def test_a_dead_rank_turns_the_service_not_serving_and_sigterm_leaves_nothing(tp_stack):
    """(The module's stack, after the tests above: it is of no use after this one.)"""
    addr, proc, log = tp_stack.target_addr, tp_stack.procs["target"], tp_stack.logs["target"]
    try:
        worker = int(re.search(r"worker pids \[(\d+)\]", log.read_text()).group(1))
        assert worker in descendants(proc.pid) or alive(worker)
        os.kill(worker, signal.SIGKILL)
        with grpc.insecure_channel(addr) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            deadline = time.monotonic() + 30
            while health.Check(health_pb2.HealthCheckRequest(), timeout=5).status == health_pb2.HealthCheckResponse.SERVING:
                assert time.monotonic() < deadline, "still SERVING 30 s after its rank 1 died"
                time.sleep(0.2)
            target_stub = pb_grpc.TargetStub(channel)
            with pytest.raises(grpc.RpcError) as failed:
                target_stub.Verify(pb.VerifyRequest(session_id="s", start=True, append=[1, 2, 3],
                                                   sampling=pb.SamplingParams(top_p=1.0)), timeout=30)
            assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
            assert "rank 1" in failed.value.details()
        assert "NOT_SERVING: tensor-parallel worker rank 1" in log.read_text()
        family = descendants(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        deadline = time.monotonic() + 30  # its workers end with it (Ray's actor a moment later)
        while [pid for pid in family if alive(pid)]:
            assert time.monotonic() < deadline, log.read_text()[-2000:]
            time.sleep(0.1)
    finally:
        if proc.poll() is None:
            proc.kill()
