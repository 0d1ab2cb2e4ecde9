"""The draft and target engines: what each model service computes per call.

Engines are synchronous and run on their service's model thread; they validate
their input before touching a session, so a bad request leaves no trace.
DraftEngine is the model drafting method (the contract: drafting.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from speculative.errors import CapacityExceeded, InvalidRequest
from speculative.protocol import Cost, Proposal, SamplingParams, Verdict
from speculative.sampling import (
    check_supports,
    draft_support,
    encode_supports,
    greedy_verify,
    logits_to_probs,
    one_hot_supports,
    rejection_sample,
    sample,
    supports_to_tensors,
)

from .drafting import ProposeCall, one_result
from .model_runner import ModelRunner, Timer
from .sessions import Session, SessionTable

DRAFT_SEED_SALT = 0x9E3779B97F4A7C15  # the draft's generator differs from the target's


@dataclass
class VerifyCall:
    session_id: str
    start: bool
    append: list[int]
    proposal: Proposal
    params: SamplingParams
    steps: int = 1  # with no proposal: tokens to decode in this call (VerifyRequest.decode_steps)


class RunnerEngine:
    """What a model service asks of its engine besides the per-round calls (drafting.py's
    "Serving"), for an engine over one ModelRunner: its sessions, info, release."""

    def __init__(self, runner: ModelRunner, max_tokens: int = 16):
        self.runner = runner
        self.max_tokens = max_tokens

    @property
    def sessions(self) -> SessionTable:
        return self.runner.sessions

    @property
    def at_work(self) -> int:
        return self.runner.at_work

    def info(self) -> dict:
        return self.runner.info()

    def release(self, session_id: str) -> bool:
        with self.runner.lock:
            return self.runner.sessions.release(session_id)

    def evict_idle(self) -> int:
        with self.runner.lock:
            return self.runner.sessions.evict_idle()

    def tokenizer_files(self) -> list[tuple[str, bytes]]:
        return self.runner.tokenizer_files()


class DraftEngine(RunnerEngine):
    """A drafting method (drafting.py): a small model proposes K tokens per call, each sampled
    from its q, the model's p cut to its top `max_support` tokens.

    `propose_many` drafts for several sessions at once: each step is one forward pass
    over every session still drafting (sessions may ask for different K).
    """

    method = "model"  # ModelInfo.draft_method

    def __init__(self, runner: ModelRunner, max_support: int = 64, max_tokens: int = 16,
                 acceptance_prior: float = 0.0):
        super().__init__(runner, max_tokens)
        self.max_support = max_support
        self.acceptance_prior = acceptance_prior  # ModelInfo.acceptance_prior (0: not known)

    def info(self) -> dict:
        return {**self.runner.info(), "draft_method": self.method, "acceptance_prior": self.acceptance_prior}

    def propose(
        self, session_id: str, start: bool, rollback: int, append: list[int], k: int, params: SamplingParams,
        p_min: float = 0.0,
    ) -> tuple[Proposal, Cost]:
        return one_result(self.propose_many([ProposeCall(session_id, start, rollback, append, k, params, p_min)]))

    def propose_many(self, calls: list[ProposeCall]) -> list[tuple[Proposal, Cost] | Exception]:
        """-> per call, (proposal, the pass's cost) or the error that call alone met. Distinct sessions only."""
        with self.runner.lock:
            timer = Timer()
            results: list = [None] * len(calls)
            live: list[tuple[int, ProposeCall, Session]] = []
            pending = 0  # tokens the calls admitted so far will draft (the KV-token cap counts them)
            for i, call in enumerate(calls):
                try:
                    live.append((i, call, self._advance(call, pending)))
                    pending += call.k
                except Exception as exc:
                    results[i] = exc
            try:
                drafted = self._draft(live)
            except Exception as exc:
                for i, call, _ in live:
                    self.runner.sessions.release(call.session_id)  # caches may be half-written
                    results[i] = exc
                return results
            for (i, _, session), (tokens, q_ids, q_probs) in zip(live, drafted):
                session.proposed += len(tokens)
                if q_ids is None:  # greedy: q is one-hot at each token
                    sizes, ids_bytes, probs_bytes = one_hot_supports(tokens)
                else:
                    sizes, ids_bytes, probs_bytes = encode_supports(q_ids, q_probs)
                results[i] = Proposal(tokens, sizes, ids_bytes, probs_bytes)
            ms = timer.ms
            cost = Cost(ms, batch_size=len(live), batch_tokens=sum(len(t) for t, _, _ in drafted), pass_ms=ms)
            return [(r, cost) if isinstance(r, Proposal) else r for r in results]

    def _advance(self, call: ProposeCall, pending: int = 0) -> Session:
        """Validate a call, then roll back the rejected proposals and append the new tokens.
        pending: tokens the pass's calls admitted before this one will draft."""
        runner, k = self.runner, call.k
        runner.check_session_id(call.session_id)
        call.params.validate()
        if not 0 <= k <= self.max_tokens:
            raise InvalidRequest(f"num_tokens must lie in [0, {self.max_tokens}], not {k}")
        if not 0.0 <= call.p_min <= 1.0:  # also rejects NaN
            raise InvalidRequest(f"p_min must lie in [0, 1], not {call.p_min}")
        runner.check_tokens(call.append, "appended")
        if call.start:
            if call.rollback or not call.append:
                raise InvalidRequest("a new session needs its prompt in `append` and nothing to roll back")
            runner.check_context(call.session_id, len(call.append) + k, pending=pending)
            session = runner.start_session(call.session_id, call.params.seed ^ DRAFT_SEED_SALT)
        else:
            session = runner.sessions.get(call.session_id)
            if call.rollback > session.proposed:
                raise InvalidRequest(
                    f"cannot roll back {call.rollback} tokens: only {session.proposed} were proposed")
            runner.check_context(call.session_id, len(session.tokens) - call.rollback + len(call.append) + k,
                                 len(session.tokens), pending)
        session.truncate(len(session.tokens) - call.rollback)
        # proposals not rolled back stay unconfirmed until tokens are appended (a call appending
        # nothing drafts on from its own last proposal: pre-drafting)
        session.proposed = 0 if call.append else session.proposed - call.rollback
        session.tokens.extend(call.append)
        return session

    def _draft(self, live: list[tuple[int, ProposeCall, Session]]) -> list[tuple[list[int], list, list]]:
        """Sample each session's k tokens autoregressively, each from its q; one forward per step
        for all sessions still drafting. -> per session (tokens, q_ids, q_probs)."""
        runner = self.runner
        vocab = runner.vocab_size  # ids the tokenizer can produce
        out = [([], None, None) if call.params.greedy else ([], [], []) for _, call, _ in live]
        # sessions asking for no tokens only need their new tokens cached (prefill): first pass
        drafting = [j for j, (_, call, session) in enumerate(live) if call.k > 0 or len(session.tokens) > session.cached]
        while drafting:
            logits = runner.forward_many([(live[j][2], 1) for j in drafting])
            still = []
            for j, row in zip(drafting, logits):
                _, call, session = live[j]
                if call.k == 0:
                    continue
                tokens, q_ids, q_probs = out[j]
                row, params = row[-1, :vocab], call.params
                if params.greedy:
                    if call.p_min > 0 and float(torch.softmax(row, -1).max()) < call.p_min:
                        continue
                    x = int(row.argmax())
                else:
                    probs = logits_to_probs(row, params)
                    if call.p_min > 0 and float(probs.max()) < call.p_min:
                        continue
                    ids, q = draft_support(probs, self.max_support)
                    x = int(ids[sample(q, session.generator)])
                    q_ids.append(ids)
                    q_probs.append(q)
                tokens.append(x)
                session.tokens.append(x)  # the last one is fed on the next call, if accepted
                if len(tokens) < call.k:
                    still.append(j)
            drafting = still
        return out


class TargetEngine(RunnerEngine):
    """Verifies proposals and applies rejection sampling: `verify_many` scores the proposals of
    several sessions (any lengths, any K) in one forward pass; calls with no proposal may go on
    decoding on their own (`steps`), one pass per token over those still decoding.

    A pass's calls are answered together, so decoding on never holds back another session: it
    runs only where every call of the pass asked for it (a call in a pass with draft tokens to
    verify gets its one token), and stops early once `busy()` says other calls wait for the model
    (they join the next pass, not the end of this call's steps). A call always gets at least its
    first token; the coordinator asks again for the rest."""

    def verify(
        self, session_id: str, start: bool, append: list[int], proposal: Proposal, params: SamplingParams,
        steps: int = 1,
    ) -> tuple[Verdict, Cost]:
        return one_result(self.verify_many([VerifyCall(session_id, start, append, proposal, params, steps)]))

    def verify_many(self, calls: list[VerifyCall],
                    busy: Callable[[], bool] | None = None) -> list[tuple[Verdict, Cost] | Exception]:
        """-> per call, (verdict, the pass's cost) or the error that call alone met. Distinct sessions only.
        busy() -> whether other calls wait for the model (the service's model thread): decoding on stops."""
        runner = self.runner
        with runner.lock:
            timer = Timer()
            results: list = [None] * len(calls)
            live = []
            for i, call in enumerate(calls):
                try:
                    # each call adds its sampled token after the pass: the KV-token cap counts those
                    live.append((i, call, *self._advance(call, pending=len(live) + 1)))
                except Exception as exc:
                    results[i] = exc
            try:
                logits = runner.forward_many([(session, len(call.proposal.tokens) + 1)
                                              for _, call, session, *_ in live])
            except Exception as exc:
                for i, call, *_ in live:
                    runner.sessions.release(call.session_id)  # its cache may be half-written
                    results[i] = exc
                return results
            for (i, call, session, committed, q_ids, q_probs), rows in zip(live, logits):
                # rows: positions of x_1..x_K and the bonus, over the ids the tokenizer can produce (an
                # output layer padded past the vocabulary scores ids no text maps to and no draft holds)
                rows = rows[:, : runner.vocab_size]
                try:
                    if call.params.greedy:
                        accepted, token = greedy_verify(rows, list(call.proposal.tokens))
                    else:
                        draft = torch.tensor(call.proposal.tokens, dtype=torch.long, device=runner.device)
                        p = logits_to_probs(rows, call.params)
                        accepted, token = rejection_sample(p, draft, q_ids, q_probs, session.generator)
                except Exception as exc:
                    runner.sessions.release(call.session_id)
                    results[i] = exc
                    continue
                session.truncate(committed + accepted)  # roll back the rejected draft tokens
                session.tokens.append(token)  # sampled here; enters the cache next call
                results[i] = Verdict(accepted, token)
            pass_ms = timer.ms
            if live and all(call.steps > 1 for _, call, *_ in live):
                self._decode_on([(i, call, session) for i, call, session, *_ in live], results, busy)
            cost = Cost(timer.ms, batch_size=len(live),
                        batch_tokens=sum(len(c.proposal.tokens) + 1 for _, c, *_ in live), pass_ms=pass_ms)
            return [(r, cost) if isinstance(r, Verdict) else r for r in results]

    def _decode_on(self, calls: list[tuple[int, VerifyCall, Session]], results: list,
                   busy: Callable[[], bool] | None) -> None:
        """Go on decoding for the calls that asked for more than one token (no proposal): one pass
        per step over the sessions still decoding, each token drawn as a call with no proposal
        draws its own (the bonus of greedy_verify / rejection_sample with nothing proposed, on the
        session's generator), so a seeded request decodes the same tokens one call or several at a
        time. A session stops after an EOS, at its step count, at the context or at the KV cap."""
        runner = self.runner
        eos = set(runner.eos_token_ids)
        nothing = torch.empty(0, dtype=torch.long, device=runner.device)
        decoding = [(i, call, session) for i, call, session in calls
                    if isinstance(results[i], Verdict) and results[i].token not in eos]
        while decoding and not (busy is not None and busy()):
            fits = []  # sessions with room for one more token
            for i, call, session in decoding:
                try:
                    runner.check_context(call.session_id, len(session.tokens) + 1, len(session.tokens), len(fits))
                except (InvalidRequest, CapacityExceeded):
                    continue
                fits.append((i, call, session))
            if not fits:
                return
            try:
                logits = runner.forward_many([(session, 1) for _, _, session in fits])
            except Exception as exc:
                for i, call, _ in fits:
                    runner.sessions.release(call.session_id)  # its cache may be half-written
                    results[i] = exc
                return
            decoding = []
            for (i, call, session), rows in zip(fits, logits):
                rows = rows[:, : runner.vocab_size]
                if call.params.greedy:
                    _, token = greedy_verify(rows, [])
                else:
                    _, token = rejection_sample(logits_to_probs(rows, call.params), nothing, [], [], session.generator)
                session.tokens.append(token)
                results[i].decoded.append(token)
                if len(results[i].decoded) + 1 < call.steps and token not in eos:
                    decoding.append((i, call, session))

    def _advance(self, call: VerifyCall, pending: int = 1):
        """Validate a call; append its new tokens and the draft tokens to its session. pending:
        tokens the pass will add beyond what the sessions hold (one sampled token per call).
        -> (session, committed length, q_ids, q_probs)"""
        runner, proposal = self.runner, call.proposal
        runner.check_session_id(call.session_id)
        call.params.validate()
        k = len(proposal.tokens)
        if k > self.max_tokens:
            raise InvalidRequest(f"at most {self.max_tokens} draft tokens per call, got {k}")
        if call.steps > self.max_tokens:
            raise InvalidRequest(f"decode_steps must lie in [0, {self.max_tokens}], not {call.steps}")
        if call.steps > 1 and k:
            raise InvalidRequest(f"decode_steps={call.steps} asks the target to decode on its own: a call with "
                                 f"draft tokens verifies them and returns one token")
        runner.check_tokens(call.append, "appended")
        runner.check_tokens(proposal.tokens, "draft")
        supports = check_supports(list(proposal.tokens), list(proposal.support_sizes), proposal.support_ids,
                                  proposal.support_probs, runner.vocab_size)
        # greedy verification needs only the tokens (see greedy_verify)
        q_ids, q_probs = (None, None) if call.params.greedy else supports_to_tensors(*supports, runner.device)
        if call.start:
            if not call.append:
                raise InvalidRequest("a new session needs its prompt in `append`")
            runner.check_context(call.session_id, len(call.append) + k, pending=pending)
            session = runner.start_session(call.session_id, call.params.seed)
        else:
            session = runner.sessions.get(call.session_id)
            runner.check_context(call.session_id, len(session.tokens) + len(call.append) + k, len(session.tokens),
                                 pending)
        committed = len(session.tokens) + len(call.append)
        session.tokens.extend(call.append)
        session.tokens.extend(proposal.tokens)
        return session, committed, q_ids, q_probs
