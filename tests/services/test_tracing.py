"""Tracing across the three processes (runtime/tracing.py): a local stack whose services export OTLP
to a receiver in the test gives one trace per request, through either front door, with spans from
the coordinator, the draft and the target, each under the span that caused it (the client's own
traceparent at the top); with tracing turned off nothing is exported."""

from __future__ import annotations

import json
import urllib.request

import grpc
import pytest

from coordinator.launch import LocalStack
from runtime import trace_receiver, tracing
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.protocol import ProposeCall, SamplingParams


CLIENT_TRACE, CLIENT_SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
HTTP_TRACE = "0af7651916cd43dd8448eb211c80319c"


@pytest.fixture(scope="module")
def receiver():
    server, found, port = trace_receiver.serve()
    yield found, f"http://127.0.0.1:{port}"
    server.stop(0)


def _one_request(stack, metadata=(), **fields) -> pb.GenerateResponse:
    with grpc.insecure_channel(stack.addr) as channel:
        return pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(prompt="def fibonacci(n):", **fields),
                                                        metadata=metadata)


def test_one_request_is_one_trace_over_the_three_services(pair, receiver, monkeypatch):
    found, endpoint = receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    draft, target = pair
    stack = LocalStack(draft, target, http_port=0).start()
    try:
        # the client's own trace context (W3C traceparent in the metadata): the request joins its trace
        reply = _one_request(stack, [("traceparent", f"00-{CLIENT_TRACE}-{CLIENT_SPAN}-01")], max_new_tokens=16,
                             temperature=0, num_speculative_tokens=3)
        # and through the HTTP front door, its traceparent header
        body = json.dumps({"prompt": "def f(x):", "max_tokens": 4, "temperature": 0}).encode()
        urllib.request.urlopen(urllib.request.Request(
            f"{stack.http_url}/v1/completions", body, {"Content-Type": "application/json",
                                                       "traceparent": f"00-{HTTP_TRACE}-{CLIENT_SPAN}-01"}), timeout=60)
    finally:
        stack.stop()  # each service sends what it buffered as it stops
    spans = found.take()
    (http,) = [s for s in spans if s["name"] == "generate" and s["trace"] == HTTP_TRACE]
    assert http["parent"] == CLIENT_SPAN and http["attrs"]["specdec.method"] == "/v1/completions"
    assert http["attrs"]["specdec.generated_tokens"] == 4
    # (adaptive K, having seen the draft fail, may not draft at all here: the draft's spans are optional)
    assert {s["service"] for s in spans if s["trace"] == HTTP_TRACE} >= {"specdec-coordinator", "specdec-target"}
    spans = [s for s in spans if s["trace"] != HTTP_TRACE]
    print(trace_receiver.tree(spans))
    by_id = {s["id"]: s for s in spans}
    (request,) = [s for s in spans if s["name"] == "generate"]
    assert request["service"] == "specdec-coordinator" and request["parent"] == CLIENT_SPAN
    assert request["trace"] == CLIENT_TRACE
    assert request["attrs"]["specdec.generated_tokens"] == len(reply.token_ids) == 16
    assert {s["trace"] for s in spans} == {request["trace"]}  # (one request: one trace, nothing else)
    assert {s["service"] for s in spans} == {"specdec-coordinator", "specdec-draft", "specdec-target"}

    def parent(span):
        return by_id[span["parent"]]

    rounds = [s for s in spans if s["name"] == "round"]
    assert len(rounds) == reply.stats.rounds and all(parent(r) is request for r in rounds)
    assert sum(r["attrs"]["specdec.accepted"] for r in rounds) == reply.stats.accepted_tokens
    for name, role in (("propose", "specdec-draft"), ("verify", "specdec-target")):
        calls = [s for s in spans if s["name"] == name and s["service"] == "specdec-coordinator"]
        served = [s for s in spans if s["name"] == name and s["service"] == role]
        assert calls and all(parent(c)["name"] == "round" for c in calls)
        # every call the service answered hangs under the coordinator's span for it, one each
        assert sorted(parent(s)["id"] for s in served) == sorted(c["id"] for c in calls)
        for s in served:
            children = sorted(c["name"] for c in spans if c["parent"] == s["id"])
            assert children == ["model", "queued"], children
            assert s["attrs"]["specdec.batch_size"] >= 1 and s["attrs"]["specdec.session"]
    assert len([s for s in spans if s["name"] == "verify" and s["service"] == "specdec-target"]) == len(rounds)


def test_nothing_is_exported_when_tracing_is_turned_off(pair, receiver, monkeypatch):
    found, endpoint = receiver
    found.take()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")  # off, whatever else is set
    draft, target = pair
    stack = LocalStack(draft, target).start()
    try:
        reply = _one_request(stack, max_new_tokens=8, temperature=0)
    finally:
        stack.stop()
    assert len(reply.token_ids) == 8
    assert found.take() == []


def test_untraced_calls_carry_no_context(monkeypatch):
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER",
                 "OTEL_SDK_DISABLED"):
        monkeypatch.delenv(name, raising=False)
    assert not tracing.wanted()
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    assert tracing.wanted()
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")
    assert not tracing.wanted()
    call = ProposeCall("s", True, 0, [1, 2], 3, SamplingParams(0.0))
    with tracing.client_span("propose", call) as (span, sent):  # this process has no provider: a no-op span
        assert not span.is_recording() and sent.trace == ""
