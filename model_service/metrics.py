"""A model service's Prometheus metrics (served by runtime.metrics.start)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

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

    def watch(self, table, pool_positions=None, grammars=None, kept=None) -> None:
        """Read the session gauges from a SessionTable at each scrape (list() of its values is one
        atomic copy under the GIL, so the model thread can go on changing the table), the pool's
        size from `pool_positions()`, the structured-output work from `grammars` (grammar.Grammars),
        and the prefix reuse from `kept` (the table where None; anything with its keep_positions,
        kept_positions, reuses and reused_positions: an EagleDraft's kept rows)."""
        self.sessions.set_function(lambda: len(table))
        self.kv_tokens.set_function(lambda: sum(s.cached for s in table))
        kept = table if kept is None else kept
        if getattr(kept, "keep_positions", 0):
            self.registry.register(_PrefixReuse(kept))
        if pool_positions is not None:
            self.kv_pool.set_function(pool_positions)
        if grammars is not None:
            self.registry.register(_GrammarWork(grammars))


class _GrammarWork:
    """specdec_grammar_mask_seconds_total and specdec_grammar_compiles_total, read at each scrape."""

    def __init__(self, grammars):
        self.grammars = grammars

    def collect(self):
        yield CounterMetricFamily("specdec_grammar_mask_seconds", "time computing structured-output token masks"
                                  " (on the model thread, beside the passes)", value=self.grammars.ms / 1e3)
        yield CounterMetricFamily("specdec_grammar_compiles", "structured-output constraints compiled (cache misses)",
                                  value=self.grammars.compiled)


class _PrefixReuse:
    """The prefix reuse of a SessionTable (sessions.py), read at each scrape: kept caches and what new sessions took."""

    def __init__(self, table):
        self.table = table

    def collect(self):
        t = self.table
        yield GaugeMetricFamily("specdec_prefix_cache_positions", "positions held by finished sessions' caches kept"
                                " for a prompt that begins with their tokens", value=t.kept_positions)
        yield CounterMetricFamily("specdec_prefix_cache_hits", "new sessions that took a kept cache", value=t.reuses)
        yield CounterMetricFamily("specdec_prefix_cache_hit_tokens", "prompt positions that came cached (not computed)",
                                  value=t.reused_positions)
