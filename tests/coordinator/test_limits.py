"""--max-request-bytes: gRPC refuses a request over it with RESOURCE_EXHAUSTED before the coordinator
parses it, and requests in flight and after go on as before."""

from __future__ import annotations

import os
import subprocess
import sys

import grpc
import pytest

from coordinator.launch import ROOT, wait_serving
from runtime.ports import free_port
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

LIMIT = 65536
REQUEST = pb.GenerateRequest(prompt="def fibonacci(n):", max_new_tokens=32, temperature=0.0)
OVERSIZED = pb.GenerateRequest(prompt="x" * LIMIT, max_new_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def small(stack, tmp_path_factory):
    """A second coordinator, in front of `stack`'s services, that takes requests of at most LIMIT bytes."""
    addr = f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("limits") / "coordinator.log"
    command = [sys.executable, "-m", "coordinator", "--draft", stack.draft_addr, "--target", stack.target_addr,
               "--port", addr.split(":")[1], "--max-request-bytes", str(LIMIT)]
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"}, stdout=log.open("w"),
                            stderr=subprocess.STDOUT)
    try:
        wait_serving(addr, 120, {"coordinator": proc}, {"coordinator": log})
        with grpc.insecure_channel(addr) as channel:
            yield pb_grpc.GenerationStub(channel)
    finally:
        proc.terminate()
        proc.wait(30)


def test_an_oversized_request_is_refused_and_disturbs_nothing(small, client):
    expected = list(client.Generate(REQUEST, timeout=120).token_ids)
    assert OVERSIZED.ByteSize() > LIMIT
    stream = small.GenerateStream(REQUEST, timeout=120)
    first = next(stream)
    with pytest.raises(grpc.RpcError) as err:
        small.Generate(OVERSIZED, timeout=60)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert f"larger than max ({OVERSIZED.ByteSize()} vs. {LIMIT})" in err.value.details(), err.value.details()
    streamed = [*first.token_ids, *(t for chunk in stream for t in chunk.token_ids)]
    assert streamed == expected and len(expected) > 0
    assert list(small.Generate(REQUEST, timeout=120).token_ids) == expected


def test_the_default_limit_lets_the_same_request_through_to_the_coordinators_own_checks(client):
    with pytest.raises(grpc.RpcError) as err:  # 65536 bytes of prompt: parsed, then too long for the tiny context
        client.Generate(OVERSIZED, timeout=60)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()


def test_k_is_capped_by_what_the_services_take_a_call_and_drafting_by_the_drafts_context(pair, reference):
    """Services taking at most 4 draft tokens a call (--max-tokens-per-call) report it; the
    coordinator (K up to 16 of its own) then offers K <= 4, refuses 5 itself, cuts its default
    K to 4, and its pre-draft (K + 1 tokens) to 4. (Adaptive K may find no round of this
    disagreeing pair worth drafting, so pre-drafts are counted at the fixed K.) A draft whose
    context (--max-context 48) is shorter than the target's (512) bounds the drafting, not the
    requests: the context a request may fill is the target's, and one that runs past the
    draft's drafts until the draft's session is full, then decodes on; greedy, the target's output."""
    from coordinator.launch import LocalStack

    draft, target = pair
    cap = ["--max-tokens-per-call", "4"]
    with LocalStack(draft, target, draft_args=[*cap, "--max-context", "48"], target_args=cap,
                    coordinator_args=["--predraft"]) as stack, grpc.insecure_channel(stack.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        info = stub.GetInfo(pb.GetInfoRequest())
        assert (info.max_context, info.draft.max_context, info.target.max_context) == (512, 48, 512)
        reply = stub.Generate(pb.GenerateRequest(prompt="def f(x):", max_new_tokens=120, temperature=0.0,
                                                 num_speculative_tokens=4))
        assert list(reply.token_ids) == reference("def f(x):", 120) and reply.stats.draft_tokens > 0
        assert info.max_speculative_tokens == 4 and info.default_speculative_tokens == 4
        assert info.draft.max_tokens_per_call == 4 and info.target.max_tokens_per_call == 4
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(prompt="def f(x):", max_new_tokens=8, num_speculative_tokens=5))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "[0, 4]" in err.value.details()
        for k in (None, 4):
            request = pb.GenerateRequest(prompt="def f(x):", max_new_tokens=24, temperature=0.0)
            if k is not None:
                request.num_speculative_tokens = k
            reply = stub.Generate(request)
            assert len(reply.token_ids) == 24 and reply.stats.num_speculative_tokens == 4
            assert reply.stats.predrafts > 0 or k is None
