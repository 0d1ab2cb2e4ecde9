"""A small OTLP/gRPC trace receiver: keeps the spans services send it and prints them as trees.

    python -m runtime.trace_receiver [--port 4317]
    OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:4317 OTEL_EXPORTER_OTLP_INSECURE=true make run

For a look at specdec's traces (runtime/tracing.py) without a tracing backend, and what the tests
and `make bench-tracing` collect spans with. Each batch of spans a service exports is printed as
the trees it completes: span name, service, duration, attributes.
"""

from __future__ import annotations

import argparse
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as otlp
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as otlp_grpc


def _value(v):
    kind = v.WhichOneof("value")
    return getattr(v, kind) if kind else None


class Receiver(otlp_grpc.TraceServiceServicer):
    """Keeps every span it is sent as a dict: service, name, trace, id, parent (hex; '' for a
    root), start (epoch ns), ms, attrs."""

    def __init__(self, on_spans=None):
        self.spans: list[dict] = []
        self.lock = threading.Lock()
        self.on_spans = on_spans

    def Export(self, request, context):
        got = []
        for resource in request.resource_spans:
            service = {a.key: _value(a.value) for a in resource.resource.attributes}.get("service.name", "?")
            for scope in resource.scope_spans:
                for s in scope.spans:
                    got.append({"service": service, "name": s.name, "trace": s.trace_id.hex(), "id": s.span_id.hex(),
                                "parent": s.parent_span_id.hex(), "start": s.start_time_unix_nano,
                                "ms": (s.end_time_unix_nano - s.start_time_unix_nano) / 1e6,
                                "attrs": {a.key: _value(a.value) for a in s.attributes}})
        with self.lock:
            self.spans.extend(got)
        if self.on_spans is not None:
            self.on_spans(got)
        return otlp.ExportTraceServiceResponse()

    def take(self) -> list[dict]:
        """The spans received so far, forgotten here."""
        with self.lock:
            spans, self.spans = self.spans, []
        return spans


def serve(port: int = 0, host: str = "127.0.0.1", on_spans=None) -> tuple[grpc.Server, Receiver, int]:
    """Start a receiver. -> (server, receiver, the port bound)"""
    server = grpc.server(futures.ThreadPoolExecutor(4))
    receiver = Receiver(on_spans)
    otlp_grpc.add_TraceServiceServicer_to_server(receiver, server)
    bound = server.add_insecure_port(f"{host}:{port}")
    server.start()
    return server, receiver, bound


def tree(spans: list[dict], attributes: bool = True) -> str:
    """The spans as indented trees, children in start order (a span whose parent is not among them
    is a root)."""
    ids = {s["id"] for s in spans}
    children: dict[str, list[dict]] = {}
    for s in spans:
        children.setdefault(s["parent"] if s["parent"] in ids else "", []).append(s)
    lines = []

    def walk(parent: str, depth: int) -> None:
        for s in sorted(children.get(parent, []), key=lambda s: s["start"]):
            shown = ", ".join(f"{k.removeprefix('specdec.')}={v}" for k, v in s["attrs"].items()) if attributes else ""
            lines.append(f"{'  ' * depth}{s['name']} [{s['service']}] {s['ms']:.2f} ms" + (f"  {shown}" if shown else ""))
            walk(s["id"], depth + 1)

    walk("", 0)
    return "\n".join(lines)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m runtime.trace_receiver", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=4317)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    server, _, port = serve(args.port, args.host, lambda spans: print(tree(spans), "\n", flush=True))
    print(f"OTLP/gRPC trace receiver on {args.host}:{port}", flush=True)
    try:
        server.wait_for_termination()
    except KeyboardInterrupt:
        server.stop(0)


if __name__ == "__main__":
    main()
