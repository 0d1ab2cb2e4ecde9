"""The coordinator's Prometheus metrics (served by runtime.metrics.start) and each request's clock."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from runtime.metrics import LATENCY


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
        self.late_drafts = Counter("specdec_late_draft_calls", "draft calls the round stopped waiting for (a"
                                   " replica's latency bound ran out: failover.py); their answers are dropped",
                                   registry=r)
        self.active = Gauge("specdec_active_requests", "requests in progress", registry=r)
        self.drafting = Gauge("specdec_drafting", "1 where requests draft; 0 while the coordinator serves without a"
                              " draft (none was ready at start-up, --draft-wait)", registry=r)
        # the Responses API's kept responses (coordinator/responses.py's Store: it sets their functions)
        self.kept_responses = Gauge("specdec_kept_responses", "Responses API responses kept (store)", registry=r)
        self.kept_response_bytes = Gauge("specdec_kept_response_bytes", "bytes of the kept responses' JSON, as"
                                         " --store-responses-mb counts them", registry=r)
        # --lockstep only (coordinator/lockstep.py)
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
