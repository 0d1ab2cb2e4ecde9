"""OpenTelemetry tracing: one trace per request across the coordinator and the model services.

Off unless configured, through the standard variables only:

  OTEL_EXPORTER_OTLP_ENDPOINT (or ..._TRACES_ENDPOINT)   where spans go, over OTLP/gRPC (e.g.
                                                        http://collector:4317); or
  OTEL_TRACES_EXPORTER=otlp | console                   (console: printed, for a look by hand)
  OTEL_SERVICE_NAME                                     default specdec-coordinator / -draft / -target
  OTEL_TRACES_SAMPLER, OTEL_TRACES_SAMPLER_ARG          e.g. parentbased_traceidratio and 0.1
  OTEL_SDK_DISABLED=true, OTEL_TRACES_EXPORTER=none     off, whatever else is set

Spans (names, parents):

  coordinator   generate (one per request, either front door)
                  round (one per speculative round)
                    propose / verify (CLIENT: one per call to a draft / target replica)
  draft, target   propose / verify (SERVER: the call inside the service, child of the coordinator's)
                    queued (waiting for the model's next pass), model (that pass, shared by
                    batch_size sessions)

The coordinator's call span travels in the request itself (ProposeRequest.traceparent and
VerifyRequest.traceparent, W3C trace context), not in gRPC metadata: per-round calls share one
stream per session and batch RPCs carry several sessions' calls, so the context belongs to the
call, not to the RPC. With tracing off the API's no-op tracer runs: no span is recorded and
`traceparent` stays empty.
"""

from __future__ import annotations

import dataclasses
import os
import time
from contextlib import contextmanager

from opentelemetry import propagate, trace
from opentelemetry.trace import SpanKind, Status, StatusCode

tracer = trace.get_tracer("specdec")
_provider = None


def wanted() -> bool:
    """Whether the OTEL_* variables ask for traces."""
    if os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter:
        return exporter != "none"
    return bool(os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT"))


def configure(role: str) -> bool:
    """Set this process's tracer provider from the OTEL_* variables, once; `role` names the service
    where OTEL_SERVICE_NAME does not. -> whether tracing is on."""
    global _provider
    if _provider is not None:
        return True
    if not wanted():
        return False
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter

    name = os.environ.get("OTEL_SERVICE_NAME") or f"specdec-{role}"
    provider = TracerProvider(resource=Resource.create({"service.name": name}))  # sampler: OTEL_TRACES_SAMPLER
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "console":
        exporter = ConsoleSpanExporter(service_name=name)
    else:
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = OTLPSpanExporter()  # endpoint, headers, TLS: OTEL_EXPORTER_OTLP_*
    provider.add_span_processor(BatchSpanProcessor(exporter))
    trace.set_tracer_provider(provider)
    _provider = provider
    return True


def shutdown() -> None:
    """Send the spans still buffered (a service stopping)."""
    if _provider is not None:
        _provider.shutdown()


def traceparent() -> str:
    """The current span's W3C traceparent ('' where none is recording)."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return carrier.get("traceparent", "")


def parent_of(traceparent: str):
    """The context a received traceparent names (None: none)."""
    return propagate.extract({"traceparent": traceparent}) if traceparent else None


@contextmanager
def client_span(name: str, call, **attributes):
    """A span for one call to a model service, current while it runs; the call (a ProposeCall or
    VerifyCall) gets its traceparent. -> (span, the call to send)"""
    with tracer.start_as_current_span(name, kind=SpanKind.CLIENT, attributes=attributes) as span:
        if span.is_recording():
            call = dataclasses.replace(call, trace=traceparent())
        yield span, call


def record_call(name: str, call, start: float, end: float, cost=None, error: BaseException | None = None,
                **attributes) -> None:
    """A model service's span for one per-round call, made once it has ended: from `start` to `end`
    (time.perf_counter seconds), a child of the caller's span (call.trace), with its children
    queued (start .. the pass) and model (the pass: cost.pass_ms before `end`)."""
    if not call.trace or _provider is None:
        return
    offset = time.time_ns() - time.perf_counter_ns()  # perf_counter -> epoch nanoseconds
    t0, t1 = int(start * 1e9) + offset, int(end * 1e9) + offset
    span = tracer.start_span(name, context=parent_of(call.trace), kind=SpanKind.SERVER, start_time=t0,
                             attributes={"specdec.session": call.session_id, "specdec.start": call.start,
                                         **attributes})
    if not span.is_recording():
        return
    if cost is not None:
        span.set_attribute("specdec.batch_size", cost.batch_size)
        span.set_attribute("specdec.batch_tokens", cost.batch_tokens)
        model_start = max(t0, t1 - int(cost.pass_ms * 1e6))
        context = trace.set_span_in_context(span)
        tracer.start_span("queued", context=context, start_time=t0).end(end_time=model_start)
        model = tracer.start_span("model", context=context, start_time=model_start,
                                  attributes={"specdec.batch_size": cost.batch_size})
        model.end(end_time=t1)
    if error is not None:
        span.record_exception(error)
        span.set_status(Status(StatusCode.ERROR, str(error)))
    span.end(end_time=t1)
