"""Prometheus metrics of the three services (`--metrics-port`; 0 leaves them off).

Each process serves its own /metrics on its own port: model_service/metrics.py (ModelMetrics)
and coordinator/metrics.py (CoordinatorMetrics) say what. Names are prefixed `specdec_`;
counters carry prometheus_client's `_total` suffix. Per-request figures also stay in
each response's GenerationStats.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server

from .cli import PORT

# seconds: sub-millisecond calls on a GPU up to long generations
LATENCY = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def add_metrics_flag(parser) -> None:
    parser.add_argument("--metrics-port", type=PORT, default=0,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: off)")


def start(registry: CollectorRegistry, host: str, port: int) -> None:
    if port:
        try:
            start_http_server(port, addr=host, registry=registry)
        except OSError as e:  # (taken, or a host it cannot bind)
            raise SystemExit(f"--metrics-port: cannot serve metrics on {host}:{port}: {e.strerror or e}") from None
