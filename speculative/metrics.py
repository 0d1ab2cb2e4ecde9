"""Prometheus metrics of the three services (`--metrics-port`; 0 leaves them off).

Each process serves its own /metrics on its own port. Names are prefixed `specdec_`;
counters carry prometheus_client's `_total` suffix. Per-request figures also stay in
each response's GenerationStats.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server

# seconds: sub-millisecond calls on a GPU up to long generations
LATENCY = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)


def add_metrics_flag(parser) -> None:
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="serve Prometheus metrics at http://HOST:PORT/metrics (0: off)")


def start(registry: CollectorRegistry, host: str, port: int) -> None:
    if port:
        start_http_server(port, addr=host, registry=registry)


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
        self.kv_tokens.set_function(lambda: sum(s.cached for s in list(table._sessions.values())))
        if pool_positions is not None:
            self.kv_pool.set_function(pool_positions)


class CoordinatorMetrics:
    """Requests as clients see them, and what speculation did for them."""

    def __init__(self, registry: CollectorRegistry | None = None):
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("specdec_requests", "finished requests, by method and gRPC status",
                                ["method", "status"], registry=r)
        self.draft_tokens = Counter("specdec_draft_tokens", "draft tokens proposed", registry=r)
        self.accepted_tokens = Counter("specdec_accepted_tokens", "draft tokens accepted", registry=r)
        self.accepted_per_pos = Counter("specdec_accepted_tokens_per_pos",
                                        "rounds whose draft token at this position was accepted", ["position"],
                                        registry=r)
        self.generated_tokens = Counter("specdec_generated_tokens", "tokens returned to clients", registry=r)
        self.rounds = Counter("specdec_rounds", "speculative rounds (target forward passes)", registry=r)
        self.request_latency = Histogram("specdec_request_seconds", "request time, end to end",
                                         buckets=LATENCY, registry=r)
        self.ttft = Histogram("specdec_time_to_first_token_seconds", "request start to its first token",
                              buckets=LATENCY, registry=r)
        self.itl = Histogram("specdec_inter_token_seconds", "time between tokens of a request (a round's"
                             " tokens arrive together: its time is shared among them)", buckets=LATENCY, registry=r)
        self.propose = Histogram("specdec_propose_seconds", "draft call, as the coordinator sees it",
                                 buckets=LATENCY, registry=r)
        self.verify = Histogram("specdec_verify_seconds", "target call, as the coordinator sees it",
                                buckets=LATENCY, registry=r)
        self.active = Gauge("specdec_active_requests", "requests in progress", registry=r)
        # --lockstep only (speculative/lockstep.py)
        self.lockstep_turns = Counter("specdec_lockstep_turns", "lockstep turns, by model and by what started"
                                      " them: all_waiting (every live generation waited) or hold_expired"
                                      " (--lockstep-hold-ms ran out first)", ["model", "start"], registry=r)
        self.lockstep_turn_calls = Histogram("specdec_lockstep_turn_calls", "calls let through per lockstep turn",
                                             ["model"], buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)

    def lockstep_turn(self, model: str, calls: int, hold_expired: bool) -> None:
        """A PhaseGate turn began (its on_turn)."""
        self.lockstep_turns.labels(model=model, start="hold_expired" if hold_expired else "all_waiting").inc()
        self.lockstep_turn_calls.labels(model=model).observe(calls)

    def add_stats(self, stats) -> None:
        """A request's speculative-round counts (speculative.round.Stats), whether it finished or not."""
        self.rounds.inc(stats.rounds)
        self.draft_tokens.inc(stats.draft_tokens)
        self.accepted_tokens.inc(stats.accepted_tokens)
        self.generated_tokens.inc(stats.generated_tokens)
        for position, n in enumerate(stats.accepted_per_position):
            if n:
                self.accepted_per_pos.labels(position=str(position)).inc(n)


class TokenClock:
    """Time to first token and inter-token gaps of one request."""

    def __init__(self, metrics: CoordinatorMetrics | None):
        self.metrics = metrics
        self.start = self.last = time.perf_counter()
        self.first = True

    def tokens(self, n: int) -> None:
        """A round delivered n tokens: they share the time since the last round."""
        if self.metrics is None or n <= 0:
            return
        now = time.perf_counter()
        if self.first:
            self.metrics.ttft.observe(now - self.start)
            self.first, n, gap = False, n - 1, 0.0  # the first round's other tokens came with the first
        else:
            gap = (now - self.last) / n
        for _ in range(n):
            self.metrics.itl.observe(gap)
        self.last = now
