"""Graceful shutdown: SIGTERM turns the coordinator NOT_SERVING at once, lets the request in
flight finish (within the grace period) with its whole, exact answer, then the process exits 0.
While it drains, health checks are answered (NOT_SERVING) and a new request is refused
UNAVAILABLE at once, not left waiting for the grace period to end.

The request is in flight by construction: the target is stopped (SIGSTOP) before it comes, so it
waits at its first verification until the test continues the target, after SIGTERM."""

from __future__ import annotations

import http.client
import json
import signal
import threading
import time
import urllib.parse

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.launch import LocalStack
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.faults.hook import freezer, hooked_stack


def until(what: str, condition, timeout: float = 30.0) -> None:
    """Poll condition() (a state) until it holds; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"not {what} after {timeout:.0f} s"
        time.sleep(0.05)


def serving(health) -> bool:
    """Whether the coordinator takes new work: SERVING, or NOT_SERVING once it drains; the check
    is answered either way (the server itself stops only once the request in flight is done)."""
    return health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_sigterm_finishes_the_request_in_flight_then_exits(pair, reference):
    draft, target = pair
    prompt, n = "def speculative_round(draft, target):", 120
    with LocalStack(draft, target, coordinator_args=["--shutdown-grace", "20"]) as stack:
        channel = grpc.insecure_channel(stack.addr)
        stub, health = pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
        tokens: list[int] = []
        outcome: list = []

        def stream() -> None:
            try:
                for chunk in stub.GenerateStream(pb.GenerateRequest(prompt=prompt, max_new_tokens=n, temperature=0.0,
                                                                    num_speculative_tokens=1), timeout=60):
                    tokens.extend(chunk.token_ids)
                outcome.append("ok")
            except grpc.RpcError as err:
                outcome.append(err)

        def leased() -> bool:  # the target replica is the request's: its first verification is on the way
            return [r.outstanding for r in stub.GetInfo(pb.GetInfoRequest(), timeout=10).replicas
                    if r.role == "target"] == [1]

        target_service, coordinator = stack.procs["target"], stack.procs["coordinator"]
        target_service.send_signal(signal.SIGSTOP)
        try:
            reader = threading.Thread(target=stream)
            reader.start()
            until("in flight", leased)
            coordinator.send_signal(signal.SIGTERM)
            until("NOT_SERVING", lambda: not serving(health))  # no new work, the request still held
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=4), timeout=10)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, refused.value
            assert "shutting down" in refused.value.details()
            assert reader.is_alive() and not outcome
        finally:
            target_service.send_signal(signal.SIGCONT)
        reader.join(60)
        assert outcome == ["ok"], outcome
        assert tokens == reference(prompt, n)  # the whole answer, exact
        assert coordinator.wait(30) == 0
        channel.close()


def active_sessions(address: str, stub_class) -> int:
    with grpc.insecure_channel(address) as channel:
        return stub_class(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10).active_sessions


@pytest.mark.parametrize("calls", [["--peer-calls", "unary"], ["--lockstep", "--lockstep-hold-ms", "300"]],
                         ids=["unary", "lockstep"])
def test_a_stopping_target_serves_its_sessions_rounds_however_they_come(pair, reference, calls):
    """Under unary per-round calls, or lockstep's (batch RPCs for a turn's calls, a stream opened for a session
    whose turn came alone), a generation is many calls: a target told to stop goes on serving the rounds of the
    sessions it holds through its grace (it refused them, cutting every generation in flight at once), and
    exits once they are released. The target is stopped (SIGSTOP) after each generation's first chunk, told to
    stop, and continued: the rest of the rounds come while it drains; the short one ends first, leaving the
    long one's turns alone."""
    draft, target = pair
    prompts = {"def speculative_round(draft, target):": 150, "def f(x):": 12}
    with LocalStack(draft, target, coordinator_args=[*calls, "--num-speculative-tokens", "1"],
                    target_args=["--shutdown-grace", "30"]) as stack:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.addr))
        target_service = stack.procs["target"]
        streams = {prompt: stub.GenerateStream(pb.GenerateRequest(prompt=prompt, max_new_tokens=n, temperature=0.0),
                                               timeout=120) for prompt, n in prompts.items()}
        tokens = {prompt: list(next(chunks).token_ids) for prompt, chunks in streams.items()}
        target_service.send_signal(signal.SIGSTOP)
        target_service.send_signal(signal.SIGTERM)  # (taken once it goes on)
        target_service.send_signal(signal.SIGCONT)
        failed: dict = {}

        def read(prompt: str) -> None:
            try:
                for chunk in streams[prompt]:
                    tokens[prompt].extend(chunk.token_ids)
            except grpc.RpcError as err:
                failed[prompt] = err

        readers = [threading.Thread(target=read, args=(prompt,)) for prompt in prompts]
        for reader in readers:
            reader.start()
        for reader in readers:
            reader.join(120)
        assert not failed, failed
        for prompt, n in prompts.items():
            assert tokens[prompt] == reference(prompt, n)  # the whole answer, exact
        assert target_service.wait(30) == 0


def test_a_coordinator_stopped_past_its_grace_releases_its_generations_sessions(pair):
    """--shutdown-grace 0 cuts the generations in flight at once; before the coordinator exits, their sessions'
    releases are answered (unary Release calls under --peer-calls unary), not dropped with its channels: the
    services hold no session of theirs after it (they held them until their idle timeout). An HTTP stream cut
    ends with its error event and [DONE], its body whole (it was closed mid-body, a traceback logged)."""
    with hooked_stack(pair, http_port=0, coordinator_args=["--peer-calls", "unary", "--shutdown-grace", "0"]) as (
            stack, hook):
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.addr))
        coordinator, target_service = stack.procs["coordinator"], stack.procs["target"]
        # The target stopped once the fourth generation's first verification is answered: every generation is
        # under way and none can end before the SIGTERM is taken (a 400-token stream of this tiny model could, on
        # a loaded machine: CI saw its last event a plain chunk); continued once the HTTP stream is cut, it
        # answers the releases the coordinator waits for
        hook.arm("target", "done", True, 4, freezer(target_service))
        try:
            streams = [stub.GenerateStream(pb.GenerateRequest(prompt=f"def f{i}(x):", max_new_tokens=400,
                                                              temperature=0.0, num_speculative_tokens=1), timeout=60)
                       for i in range(3)]
            for stream in streams:
                next(stream)  # each under way: its sessions held on both services
            address = urllib.parse.urlsplit(stack.http_url)
            connection = http.client.HTTPConnection(address.hostname, address.port, timeout=60)
            asked = {"model": "target", "prompt": "def g(x):", "stream": True, "max_tokens": 400, "ignore_eos": True,
                     "temperature": 0}
            connection.request("POST", "/v1/completions", json.dumps(asked))
            events = connection.getresponse()
            assert events.status == 200 and events.readline().startswith(b"data: ")  # under way
            assert hook.done.wait(60) and not hook.errors, hook.errors  # (the target stopped)
            coordinator.send_signal(signal.SIGTERM)
            sent = [line.strip() for line in iter(events.readline, b"") if line.startswith(b"data: ")]
        finally:
            hook.disarm()
            target_service.send_signal(signal.SIGCONT)
        assert sent[-1] == b"data: [DONE]"  # the body whole (IncompleteRead, before)
        assert json.loads(sent[-2][len(b"data: "):])["error"]["code"] == "unavailable"
        cut = 0
        for stream in streams:
            try:
                for _ in stream:
                    pass
            except grpc.RpcError:
                cut += 1
        assert coordinator.wait(30) == 0
        assert cut == len(streams)  # (every generation was cut: their releases are what is checked)
        assert active_sessions(stack.target_addr, pb_grpc.TargetStub) == 0
        assert active_sessions(stack.draft_addr, pb_grpc.DraftStub) == 0
        assert "Exception in ASGI application" not in (stack.log_dir / "coordinator.log").read_text()


def test_a_stopping_target_refuses_new_sessions_one_by_one_and_stops_once_released(pair):
    """A stopping target refuses a call that would start a session (UNAVAILABLE: the coordinator goes to another
    replica), unary or within a batch RPC, where the batch's call for a session it holds is served; a release
    is served, and the target exits once it holds no session in use."""
    draft, target = pair
    greedy = pb.SamplingParams(temperature=0.0, top_p=1.0)
    with LocalStack(draft, target, target_args=["--shutdown-grace", "60"]) as stack:
        channel = grpc.insecure_channel(stack.target_addr)
        stub, health = pb_grpc.TargetStub(channel), health_pb2_grpc.HealthStub(channel)
        first = stub.Verify(pb.VerifyRequest(session_id="live", start=True, append=[3, 1, 4], sampling=greedy),
                            timeout=30)
        stack.procs["target"].send_signal(signal.SIGTERM)
        until("NOT_SERVING", lambda: not serving(health))
        batch = stub.VerifyBatch(pb.VerifyBatchRequest(calls=[
            pb.VerifyRequest(session_id="live", append=[first.token], sampling=greedy),
            pb.VerifyRequest(session_id="new", start=True, append=[2, 7], sampling=greedy)]), timeout=30)
        assert [s.code for s in batch.statuses] == [0, grpc.StatusCode.UNAVAILABLE.value[0]], batch.statuses
        assert "shutting down" in batch.statuses[1].message
        with pytest.raises(grpc.RpcError) as refused:
            stub.Verify(pb.VerifyRequest(session_id="other", start=True, append=[5], sampling=greedy), timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stack.procs["target"].poll() is None  # still serving "live"
        assert stub.Release(pb.ReleaseRequest(session_id="live"), timeout=30).released
        assert stack.procs["target"].wait(30) == 0
        channel.close()


def test_a_stopping_target_does_not_wait_its_grace_for_a_session_nobody_uses(pair):
    """A session no generation calls on any more (its coordinator gone, its release lost) does not hold a stopping
    target for its whole grace: it stops once its sessions have gone unused for QUIET_WINDOW_S (5 s), not 60."""
    draft, target = pair
    with LocalStack(draft, target, target_args=["--shutdown-grace", "60"]) as stack:
        with grpc.insecure_channel(stack.target_addr) as channel:
            greedy = pb.SamplingParams(temperature=0.0, top_p=1.0)
            pb_grpc.TargetStub(channel).Verify(pb.VerifyRequest(session_id="orphan", start=True, append=[3, 1, 4],
                                                                sampling=greedy), timeout=30)
        stack.procs["target"].send_signal(signal.SIGTERM)
        assert stack.procs["target"].wait(40) == 0
