"""What every server offers generic gRPC tools: health checking and reflection; the CLIs."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from coordinator.launch import ROOT, LocalStack
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from model_service.engines import TargetEngine
from model_service.model_runner import ModelRunner
from model_service.service import auto_wait_ms
from model_service.threads import ModelThread
from runtime.ports import free_port
from runtime.server import serve
from speculative.protocol import PassCost
from target_service.servicer import SERVICE_NAME, TargetServicer
from tests.faults.hook import wait_until

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def test_not_serving_until_the_weights_are_loaded(pair):
    """A target service in this process whose load waits on a gate we open."""
    port = free_port()
    gate = threading.Event()
    servicer = TargetServicer(ModelThread())
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    async def load():
        await asyncio.to_thread(gate.wait)
        servicer.engine = TargetEngine(ModelRunner(pair[1]))

    def add(server):
        pb_grpc.add_TargetServicer_to_server(servicer, server)
        return [SERVICE_NAME]

    thread = threading.Thread(target=lambda: loop.run_until_complete(
        serve("target", "127.0.0.1", port, add, load, stop=stop)), daemon=True)
    thread.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    grpc.channel_ready_future(channel).result(timeout=30)
    health = health_pb2_grpc.HealthStub(channel)
    target = pb_grpc.TargetStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == NOT_SERVING
    assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status == NOT_SERVING
    with pytest.raises(grpc.RpcError) as err:
        target.GetModelInfo(pb.ModelInfoRequest())
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
    gate.set()
    deadline = time.monotonic() + 60  # the weights load
    while health.Check(health_pb2.HealthCheckRequest()).status != SERVING:
        assert time.monotonic() < deadline, "not SERVING 60 s after the weights could load"
        time.sleep(0.05)
    assert health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME)).status == SERVING
    assert target.GetModelInfo(pb.ModelInfoRequest()).vocab_size > 0
    loop.call_soon_threadsafe(stop.set)
    thread.join(timeout=30)
    assert not thread.is_alive()
    channel.close()


@pytest.mark.parametrize("which", ["addr", "draft_addr", "target_addr"])
def test_health_and_reflection(stack, which):
    channel = grpc.insecure_channel(getattr(stack, which))
    assert health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest()).status == SERVING
    services = set(ProtoReflectionDescriptorDatabase(channel).get_services())
    expected = {"addr": "specdec.v1.Generation", "draft_addr": "specdec.v1.Draft",
                "target_addr": "specdec.v1.Target"}[which]
    assert {expected, "grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection"} <= services
    channel.close()


def run_cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_client_cli(stack):
    out = run_cli("-m", "coordinator.client", "--addr", stack.addr, "--json", "--temperature", "0",
                  "--max-new-tokens", "12", "-k", "3", "def f(x):")
    assert out.returncode == 0, out.stderr
    reply = json.loads(out.stdout)
    assert set(reply) == {"text", "token_ids", "finish_reason", "stats"}
    assert 1 <= len(reply["token_ids"]) <= 12 and reply["finish_reason"] in ("length", "eos")
    assert reply["stats"]["num_speculative_tokens"] == 3 and "acceptance_rate" in reply["stats"]

    streamed = run_cli("-m", "coordinator.client", "--addr", stack.addr, "--stream", "--stats", "--temperature", "0",
                       "--max-new-tokens", "12", "-k", "3", "def f(x):")
    assert streamed.returncode == 0 and streamed.stdout.rstrip("\n") == reply["text"]
    assert "acceptance" in streamed.stderr

    bad = run_cli("-m", "coordinator.client", "--addr", stack.addr, "--top-p", "2", "x")
    assert bad.returncode == 1 and "INVALID_ARGUMENT" in bad.stderr and "top_p" in bad.stderr


def test_every_flag_is_documented_with_its_environment_variable():
    for module, prefix in [("draft_service", "SPECDEC_DRAFT"), ("target_service", "SPECDEC_TARGET"),
                           ("coordinator", "SPECDEC_COORDINATOR")]:
        out = run_cli("-m", module, "--help")
        assert out.returncode == 0, out.stderr
        for flag in ("--host", "--port"):
            assert flag in out.stdout
        assert f"{prefix}_PORT" in out.stdout.replace("\n", " ")


@pytest.mark.parametrize("flag, value, message", [
    ("--max-batch", "0", "--max-batch must be >= 1"),
    ("--batch-wait-ms", "-1", "--batch-wait-ms must lie in [0, 1000]"),
    ("--batch-wait-ms", "nan", "--batch-wait-ms must lie in [0, 1000]"),
    ("--batch-wait-ms", "soon", "a number of ms or auto, not 'soon'"),
])
@pytest.mark.parametrize("service", ["draft_service", "target_service"])
def test_a_model_service_refuses_bad_batching_flags(pair, service, flag, value, message):
    """...before it loads torch or a model: each refusal takes about the interpreter's start."""
    model = pair[0] if service == "draft_service" else pair[1]
    out = run_cli("-m", service, "--model", str(model), "--port", "0", flag, value)
    assert out.returncode != 0 and message in out.stderr
    assert "listening" not in out.stdout + out.stderr  # refused before it served anything


def test_the_target_waits_half_its_pass_for_sessions_at_work_and_the_draft_half_a_ms(stack):
    """By default (--batch-wait-ms: the target auto, the draft 0.5) each service says at start-up how
    long a pass waits for the calls of sessions at work; the target's is auto_wait_ms of the pass
    it calibrated."""
    target_log = stack.logs["target"].read_text()
    fitted = re.search(r"pass PassCost\(fixed=([-\d.e]+), per_token=([-\d.e]+), per_session=([-\d.e]+), "
                       r"multi_row=([-\d.e]+), free_rows=([-\d.e]+)\)", target_log)
    assert fitted, target_log[-2000:]
    cost = PassCost(*map(float, fitted.groups()))
    waits = re.search(r"a pass waits up to ([\d.]+) ms", target_log)
    assert waits and float(waits.group(1)) == pytest.approx(auto_wait_ms(cost), abs=0.006)
    assert 0 < auto_wait_ms(cost) == pytest.approx(min(8.0, 0.5 * cost(1, 1)))
    assert "a pass waits up to 0.50 ms" in stack.logs["draft"].read_text()


def test_a_long_error_message_is_cut_to_fit_a_grpc_status():
    """gRPC refuses a status whose details pass 16 KiB of metadata (8 KiB now and then), percent-encoded
    on the wire: the client got RESOURCE_EXHAUSTED from gRPC itself, not the error, where a message
    quoted a long input. Cut by its size on the wire, the status and the message's start arrive."""
    from concurrent import futures

    from model_service.servicer import call_status, translate
    from speculative.errors import InvalidRequest

    def abort(request, context):
        context.abort(grpc.StatusCode.INVALID_ARGUMENT, translate(InvalidRequest(request.decode()))[1])

    server = grpc.server(futures.ThreadPoolExecutor(2))
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("t.T", {
        "Abort": grpc.unary_unary_rpc_method_handler(abort)})])
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_unary("/t.T/Abort")
            for text in ("é" * 100_000, "%" * 100_000, "x" * 100_000, "\n" * 30_000, "é" * 1_500, "short"):
                for _ in range(5):  # (the soft limit refuses at random: each five times)
                    with pytest.raises(grpc.RpcError) as refused:
                        call(f"the regex constraint does not compile: {text}".encode(), timeout=30)
                    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT, refused.value.details()
                    assert refused.value.details().startswith("the regex constraint does not compile: ")
                    assert (refused.value.details().endswith(" characters in all)") == (len(text) > 1_000))
    finally:
        server.stop(None)
    long = InvalidRequest("x" * 100_000)
    assert call_status(long).message == translate(long)[1] and translate(InvalidRequest("short"))[1] == "short"


def test_a_service_whose_model_thread_stops_says_so_and_fails_its_calls(pair, tmp_path):
    """Not SERVING (the coordinator's pool takes the replica out; Kubernetes' gRPC probes restart it), and
    a call fails at once with UNAVAILABLE rather than hang until its deadline."""
    port, log = free_port(), tmp_path / "draft.log"
    service = LocalStack.launcher([sys.executable, "-m", "tests.services.broken_draft", "--model", str(pair[0]),
                                   "--port", str(port)], ROOT, dict(os.environ), log, "w")
    try:
        channel = grpc.insecure_channel(f"127.0.0.1:{port}")
        health = health_pb2_grpc.HealthStub(channel)

        def status():
            try:
                return health.Check(health_pb2.HealthCheckRequest(), timeout=5).status
            except grpc.RpcError:
                return None

        wait_until("SERVING", lambda: status() == SERVING or service.poll() is not None, timeout=120)
        assert service.poll() is None, log.read_text()[-2000:]
        greedy = pb.SamplingParams(temperature=0.0, top_p=1.0)
        with pytest.raises(grpc.RpcError) as failed:
            pb_grpc.DraftStub(channel).Propose(pb.ProposeRequest(session_id="s", start=True, append=[5, 6, 7],
                                                                 num_tokens=2, sampling=greedy), timeout=30)
        assert failed.value.code() == grpc.StatusCode.UNAVAILABLE, failed.value.details()
        assert "model thread stopped (RuntimeError: taking a pass broke)" in failed.value.details()
        wait_until("NOT_SERVING", lambda: status() == NOT_SERVING)
        assert "NOT_SERVING: its model thread stopped (RuntimeError: taking a pass broke)" in log.read_text()
        channel.close()
    finally:
        service.terminate()
        service.wait(timeout=60)
