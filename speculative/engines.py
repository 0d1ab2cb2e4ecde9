"""The draft and target engines: what each model service computes per call.

Engines are synchronous and run on their service's model thread; they validate
their input before touching a session, so a bad request leaves no trace.
"""

from __future__ import annotations

import math

import torch

from .errors import InvalidRequest
from .model_runner import ModelRunner, Timer
from .sessions import Session
from .round import Proposal, Verdict
from .sampling import (
    SamplingParams,
    decode_supports,
    draft_support,
    encode_supports,
    logits_to_probs,
    rejection_sample,
    sample,
)

DRAFT_SEED_SALT = 0x9E3779B97F4A7C15  # the draft's generator differs from the target's


def check_params(params: SamplingParams) -> None:
    t = params.temperature
    if math.isnan(t) or math.isinf(t) or t < 0:
        raise InvalidRequest(f"temperature must be a finite number >= 0, not {t}")
    if params.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0, not {params.top_k}")
    if not (0.0 < params.top_p <= 1.0):  # also rejects NaN
        raise InvalidRequest(f"top_p must lie in (0, 1], not {params.top_p}")


class DraftEngine:
    """Proposes K tokens per call, each with the sparse q it was sampled from."""

    def __init__(self, runner: ModelRunner, max_support: int = 64, max_tokens: int = 16):
        self.runner = runner
        self.max_support = max_support
        self.max_tokens = max_tokens

    def propose(
        self, session_id: str, start: bool, rollback: int, append: list[int], k: int, params: SamplingParams
    ) -> tuple[Proposal, float]:
        with self.runner.lock:
            timer = Timer()
            session = self._advance(session_id, start, rollback, append, k, params)
            tokens, q_ids, q_probs = self._draft(session, k, params)
            session.proposed = len(tokens)
            sizes, ids_bytes, probs_bytes = encode_supports(q_ids, q_probs)
            return Proposal(tokens, sizes, ids_bytes, probs_bytes), timer.ms

    def _advance(self, session_id: str, start: bool, rollback: int, append: list[int], k: int,
                 params: SamplingParams) -> Session:
        """Validate a call, then roll back the rejected proposals and append the new tokens."""
        runner = self.runner
        check_params(params)
        if not 0 <= k <= self.max_tokens:
            raise InvalidRequest(f"num_tokens must lie in [0, {self.max_tokens}], not {k}")
        runner.check_tokens(append, "appended")
        if start:
            if rollback or not append:
                raise InvalidRequest("a new session needs its prompt in `append` and nothing to roll back")
            runner.check_context(session_id, len(append) + k)
            session = runner.start_session(session_id, params.seed ^ DRAFT_SEED_SALT)
        else:
            session = runner.sessions.get(session_id)
            if rollback > session.proposed:
                raise InvalidRequest(f"cannot roll back {rollback} tokens: only {session.proposed} were proposed")
            runner.check_context(session_id, len(session.tokens) - rollback + len(append) + k)
        session.truncate(len(session.tokens) - rollback)
        session.tokens.extend(append)
        session.proposed = 0
        return session

    def _draft(self, session: Session, k: int, params: SamplingParams):
        """Sample k tokens autoregressively, each from its q. -> (tokens, q_ids, q_probs)"""
        runner = self.runner
        if k == 0:
            if len(session.tokens) > session.cached:
                runner.forward(session)  # prefill only
            return [], [], []
        vocab = runner.vocab_size  # ids the tokenizer can produce
        tokens: list[int] = []
        q_ids: list[torch.Tensor] = []
        q_probs: list[torch.Tensor] = []
        for _ in range(k):
            logits = runner.forward(session)[-1, :vocab]  # [V]
            if params.greedy:
                x = int(logits.argmax())
                ids, q = torch.tensor([x]), torch.ones(1)
            else:
                ids, q = draft_support(logits_to_probs(logits, params), self.max_support)
                x = int(ids[sample(q, session.generator)])
            tokens.append(x)
            q_ids.append(ids)
            q_probs.append(q)
            session.tokens.append(x)  # the last one is fed on the next call, if accepted
        return tokens, q_ids, q_probs


class OracleDraftEngine(DraftEngine):
    """Benchmark only: a draft that replays known continuations (the target's own greedy
    output), with one-hot q, and runs no model. Acceptance is 1.0 and the draft costs ~nothing:
    what is left of a round is the machinery's own cost, its ceiling."""

    def __init__(self, runner: ModelRunner, references: list[list[int]], max_tokens: int = 16):
        super().__init__(runner, max_support=1, max_tokens=max_tokens)
        self.references = [tuple(r) for r in references]

    def _draft(self, session: Session, k: int, params: SamplingParams):
        n = len(session.tokens)
        prefix = tuple(session.tokens)
        reference = next((r for r in self.references if len(r) > n and r[:n] == prefix), ())
        tokens = list(reference[n : n + k])
        session.tokens.extend(tokens)
        return tokens, [torch.tensor([t]) for t in tokens], [torch.ones(1) for _ in tokens]


class TargetEngine:
    """Verifies a proposal in one forward pass and applies rejection sampling."""

    def __init__(self, runner: ModelRunner, max_tokens: int = 16):
        self.runner = runner
        self.max_tokens = max_tokens

    def verify(
        self, session_id: str, start: bool, append: list[int], proposal: Proposal, params: SamplingParams
    ) -> tuple[Verdict, float]:
        runner = self.runner
        with runner.lock:
            timer = Timer()
            check_params(params)
            k = len(proposal.tokens)
            if k > self.max_tokens:
                raise InvalidRequest(f"at most {self.max_tokens} draft tokens per call, got {k}")
            runner.check_tokens(append, "appended")
            runner.check_tokens(proposal.tokens, "draft")
            q_ids, q_probs = decode_supports(
                k, list(proposal.support_sizes), proposal.support_ids, proposal.support_probs,
                runner.logits_size, runner.device,
            )
            for i, (x, ids, q) in enumerate(zip(proposal.tokens, q_ids, q_probs)):
                if not bool((q[ids == x] > 0).any()):
                    raise InvalidRequest(f"draft token {x} at position {i} has no probability in its q")
            if start:
                if not append:
                    raise InvalidRequest("a new session needs its prompt in `append`")
                runner.check_context(session_id, len(append) + k)
                session = runner.start_session(session_id, params.seed)
            else:
                session = runner.sessions.get(session_id)
                runner.check_context(session_id, len(session.tokens) + len(append) + k)

            committed = len(session.tokens) + len(append)
            session.tokens.extend(append)
            session.tokens.extend(proposal.tokens)
            try:
                logits = runner.forward(session, k + 1)  # [K+1, V]: positions of x_1..x_K and the bonus
                p = logits_to_probs(logits, params)
                draft = torch.tensor(proposal.tokens, dtype=torch.long, device=runner.device)
                accepted, token = rejection_sample(p, draft, q_ids, q_probs, session.generator)
            except Exception:
                runner.sessions.release(session_id)  # its cache may be half-written
                raise
            session.truncate(committed + accepted)  # roll back the rejected draft tokens
            session.tokens.append(token)  # sampled here; enters the cache next call
            return Verdict(accepted, token), timer.ms
