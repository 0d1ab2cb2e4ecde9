"""A model service's Prometheus metrics (served by runtime.metrics.start)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from runtime.metrics import LATENCY


class ModelMetrics:
    """A draft or target service: its calls, its sessions and what waits for its model thread."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.calls = Counter("specdec_model_calls", "per-round calls answered, by method and gRPC status",
                             ["method", "status"], registry=r)
        self.latency = Histogram("specdec_model_call_seconds", "per-round call time inside the service",
                                 ["method"], buckets=LATENCY, registry=r)
        self.batch_rpcs = Counter("specdec_batch_rpcs", "batch RPCs answered (ProposeBatch / VerifyBatch:"
                                  " a lockstep turn's calls in one message), by method", ["method"], registry=r)
        self.batch = Histogram("specdec_batch_size", "sessions per model forward pass",
                               buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=r)
        self.queue = Gauge("specdec_queue_depth", "calls waiting for or running on the model thread", registry=r)
        self.sessions = Gauge("specdec_active_sessions", "sessions holding a KV cache", registry=r)
        self.kv_tokens = Gauge("specdec_kv_cache_tokens", "tokens held in KV caches, all sessions", registry=r)
        self.kv_pool = Gauge("specdec_kv_pool_positions", "positions the KV pool has room for (slots x"
                             " capacity: its memory; 0 without one)", registry=r)

    def watch(self, table, pool_positions=None) -> None:
        """Read the session gauges from a SessionTable at each scrape (list() of its values is one
        atomic copy under the GIL, so the model thread can go on changing the table), and the pool's
        size from `pool_positions()`."""
        self.sessions.set_function(lambda: len(table))
        self.kv_tokens.set_function(lambda: sum(s.cached for s in table))
        if pool_positions is not None:
            self.kv_pool.set_function(pool_positions)
