"""Graceful shutdown: SIGTERM turns the coordinator NOT_SERVING at once, lets the request in
flight finish (within the grace period) with its whole, exact answer, then the process exits 0."""

from __future__ import annotations

import signal
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.launch import LocalStack
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc


def test_sigterm_finishes_the_request_in_flight_then_exits(pair, reference):
    draft, target = pair
    prompt, n = "def speculative_round(draft, target):", 120
    with LocalStack(draft, target, coordinator_args=["--shutdown-grace", "20"]) as stack:
        channel = grpc.insecure_channel(stack.addr)
        stub, health = pb_grpc.GenerationStub(channel), health_pb2_grpc.HealthStub(channel)
        first_chunk = threading.Event()
        tokens: list[int] = []
        outcome: list = []

        def stream() -> None:
            try:
                # K = 1 against a disagreeing draft: many short rounds, a request that takes a while
                for chunk in stub.GenerateStream(pb.GenerateRequest(prompt=prompt, max_new_tokens=n, temperature=0.0,
                                                                    num_speculative_tokens=1), timeout=60):
                    tokens.extend(chunk.token_ids)
                    first_chunk.set()
                    time.sleep(0.02)  # a slow reader: the stream is still open when SIGTERM arrives
                outcome.append("ok")
            except grpc.RpcError as err:
                outcome.append(err)

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(30)
        coordinator = stack.procs["coordinator"]
        coordinator.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # no new work: NOT_SERVING, or refused outright once the server stopped accepting
        try:
            status = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE
        reader.join(60)
        assert outcome == ["ok"], outcome
        assert tokens == reference(prompt, n)  # the whole answer, exact
        assert coordinator.wait(30) == 0
        channel.close()
