"""Prometheus metrics of the three services agree with what the requests reported."""

from __future__ import annotations

import signal
import time
import urllib.request

import grpc
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.ports import free_port
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.faults.hook import freezer, hooked_stack


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """{(sample name, sorted labels): value} from http://127.0.0.1:port/metrics."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples, name: str, **labels) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def eventually(check, timeout: float = 30.0) -> None:
    """Retry check() until it passes: a status can reach the client a moment before the
    service has counted it (an abort is sent as it is raised; a stream's last message
    before its handler returns)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return check()
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@pytest.fixture(scope="module")
def metered_stack(pair):
    """A stack with the three services' metrics on ports of their own, its coordinator telling a fault hook
    (stack.hook) every moment of its per-round calls while a test has armed it: (stack, {role: metrics port})."""
    ports = {role: free_port() for role in ("draft", "target", "coordinator")}
    with hooked_stack(pair, draft_args=["--metrics-port", str(ports["draft"])],
                      target_args=["--metrics-port", str(ports["target"])],
                      coordinator_args=["--metrics-port", str(ports["coordinator"])]) as (stack, hook):
        stack.hook = hook
        yield stack, ports


def test_metrics_count_what_requests_report(metered_stack):
    stack, ports = metered_stack
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.addr))
    replies = [stub.Generate(pb.GenerateRequest(prompt_token_ids=[5, 6, 7, 8], max_new_tokens=20, temperature=0.0,
                                                num_speculative_tokens=k)) for k in (1, 3)]
    chunks = list(stub.GenerateStream(pb.GenerateRequest(prompt="def f(x):", max_new_tokens=9, temperature=0.8,
                                                         seed=3, num_speculative_tokens=2)))
    with pytest.raises(grpc.RpcError) as bad:
        stub.Generate(pb.GenerateRequest(prompt="x", temperature=-1.0))
    assert bad.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    stats = [r.stats for r in replies] + [chunks[-1].stats]

    def check() -> None:
        c = scrape(ports["coordinator"])
        assert value(c, "specdec_requests_total", method="Generate", status="OK") == 2
        assert value(c, "specdec_requests_total", method="GenerateStream", status="OK") == 1
        assert value(c, "specdec_requests_total", method="Generate", status="INVALID_ARGUMENT") == 1
        assert value(c, "specdec_draft_tokens_total") == sum(s.draft_tokens for s in stats)
        assert value(c, "specdec_accepted_tokens_total") == sum(s.accepted_tokens for s in stats)
        assert value(c, "specdec_generated_tokens_total") == sum(s.generated_tokens for s in stats) == 20 + 20 + 9
        rounds = sum(s.rounds for s in stats)
        assert value(c, "specdec_rounds_total") == rounds
        per_pos = sum(v for (name, _), v in c.items() if name == "specdec_accepted_tokens_per_pos_total")
        assert per_pos == sum(s.accepted_tokens for s in stats)
        assert value(c, "specdec_time_to_first_token_seconds_count") == 3
        assert value(c, "specdec_inter_token_seconds_count") == 20 + 20 + 9 - 3
        assert value(c, "specdec_verify_seconds_count") == rounds
        assert value(c, "specdec_request_seconds_count") == 4
        assert value(c, "specdec_active_requests") == 0
        assert value(c, "specdec_drafting") == 1

        t = scrape(ports["target"])
        assert value(t, "specdec_model_calls_total", method="verify", status="OK") == rounds
        assert value(t, "specdec_model_call_seconds_count", method="verify") == rounds
        assert value(t, "specdec_batch_size_count") == rounds
        assert value(t, "specdec_queue_depth") == 0
        d = scrape(ports["draft"])
        proposed = value(d, "specdec_model_calls_total", method="propose", status="OK")
        if sum(s.lost_draft_rounds for s in stats) == 0:
            assert proposed == sum(s.draft_calls for s in stats)
        else:  # a round that went on without a late draft call (a loaded machine) counts calls not sent
            assert 0 < proposed <= sum(s.draft_calls for s in stats)
        for samples in (t, d):  # every session was released when its request ended
            assert value(samples, "specdec_active_sessions") == 0
            assert value(samples, "specdec_kv_cache_tokens") == 0
            assert value(samples, "specdec_kv_pool_positions") >= 8 * 256  # kept for the next sessions

    eventually(check)


def test_model_service_counts_refused_calls(metered_stack):
    stack, ports = metered_stack
    stub = pb_grpc.TargetStub(grpc.insecure_channel(stack.target_addr))
    before = value(scrape(ports["target"]), "specdec_model_calls_total", method="verify", status="NOT_FOUND")
    with pytest.raises(grpc.RpcError) as e:
        stub.Verify(pb.VerifyRequest(session_id="nobody", append=[1],
                                    sampling=pb.SamplingParams(temperature=1.0, top_p=1.0)))
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    eventually(lambda: _assert_equal(
        value(scrape(ports["target"]), "specdec_model_calls_total", method="verify", status="NOT_FOUND"), before + 1))


def _assert_equal(a, b) -> None:
    assert a == b


def test_a_request_ended_early_counts_its_rounds_and_why(metered_stack):
    """A stream its client cancels and a request past its deadline: their rounds still count
    (the tokens counted are those the time-to-first/inter-token histograms saw), and the deadline
    is counted as DEADLINE_EXCEEDED, what its client saw, not CANCELLED."""
    stack, ports = metered_stack
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.addr))
    names = ("specdec_generated_tokens_total", "specdec_rounds_total", "specdec_time_to_first_token_seconds_count",
             "specdec_inter_token_seconds_count", "specdec_verify_seconds_count")
    before = scrape(ports["coordinator"])
    target = stack.procs["target"]
    # the target stopped at the stream's fifth verification: it cannot end before its client cancels it, and the
    # request after it cannot end before its deadline
    stack.hook.arm("target", "write", False, 4, freezer(target))
    try:
        stream = stub.GenerateStream(pb.GenerateRequest(prompt_token_ids=[5] * 8, max_new_tokens=400,
                                                        temperature=0.0, num_speculative_tokens=1))
        received = sum(len(next(stream).token_ids) for _ in range(3))
        assert stack.hook.done.wait(60) and not stack.hook.errors, stack.hook.errors
        stream.cancel()
        with pytest.raises(grpc.RpcError) as late:
            stub.Generate(pb.GenerateRequest(prompt_token_ids=[5] * 8, max_new_tokens=400, temperature=0.0,
                                             num_speculative_tokens=1), timeout=0.2)
        assert late.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    finally:
        stack.hook.disarm()
        target.send_signal(signal.SIGCONT)

    def check() -> None:
        c = scrape(ports["coordinator"])
        delta = {name: value(c, name) - value(before, name) for name in names}
        assert value(c, "specdec_requests_total", method="GenerateStream", status="CANCELLED") == 1
        assert value(c, "specdec_requests_total", method="Generate", status="DEADLINE_EXCEEDED") == 1
        assert value(c, "specdec_active_requests") == 0
        assert value(c, "specdec_drafting") == 1
        tokens = delta["specdec_generated_tokens_total"]
        assert tokens >= received > 0
        assert tokens == delta["specdec_time_to_first_token_seconds_count"] + delta["specdec_inter_token_seconds_count"]
        assert 0 < delta["specdec_rounds_total"] <= delta["specdec_verify_seconds_count"]
        for role in ("draft", "target"):
            assert value(scrape(ports[role]), "specdec_active_sessions") == 0

    eventually(check)
