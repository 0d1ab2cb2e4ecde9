"""What a drafting method is: the one contract the draft service holds a method to, so that a new
way of drafting is one file.

  engines.py  DraftEngine        a small model samples each token from its own distribution
  ngram.py    NgramDraft         copies what followed the context's last n-gram (no model)
  eagle.py    EagleDraft         an EAGLE-3 head drafts from the target's hidden states (features)
  oracle.py   OracleDraftEngine  replays known continuations (benchmark only)

draft_service/__main__.py picks the method (--method); the servicer, the batcher and the
coordinator see only this contract. Nothing in it assumes a model: a method may draft from a
lookup table.

Calls. The service calls `propose_many` on its one model thread, one batch at a time, each
ProposeCall for a distinct session. -> per call, in order, (Proposal, Cost), or the exception
that call alone met: InvalidRequest, SessionNotFound, SessionExists, CapacityExceeded become
their gRPC statuses, anything else INTERNAL. A refused call leaves its session as it was and the
other calls alone; a call the method fails half-way through may drop its session instead.

Sessions. The method holds each session's sequence, keyed by session_id; the coordinator holds
the committed tokens and sends deltas only (speculative/round.py). A call (ProposeCall,
speculative/protocol.py) is, in this order, what `advance` below does for every method:
  start     the session is new (SessionExists if held): `append` is its prompt (not empty) and
            `rollback` is 0. Otherwise the session must be held (SessionNotFound).
  rollback  drop the session's last `rollback` proposed tokens: the rejected ones (InvalidRequest
            if more than the session holds unconfirmed).
  append    append these committed tokens (the target's recovered or bonus token, or a prompt).
  k         propose up to k tokens (InvalidRequest unless 0 <= k <= max_tokens): fewer where the
            method has nothing it trusts (p_min: stop at a token whose top probability is below
            it), none for k = 0 (the call only takes `append` in). An empty proposal is valid.
The proposed tokens stay in the session, unconfirmed, after the appended ones: the next call
rolls back those the target rejected. A call that appends nothing drafts on after them
(pre-drafting), and the next rollback may then span both proposals. A method that reads the
target's hidden states (info()'s feature_layers) also gets, in `features`, the target's rows new
to it; a method that reads none gets none. A start call may carry a structured-output constraint
(`constraint`): a method given the service's grammar.Grammars in `advance` gets the session's
matcher (session.grammar) and drafts only tokens it allows (the model and EAGLE methods mask q, the
n-gram method cuts its copy); a method that ignores it stays exact (the target masks p).

q and exactness (speculative/sampling.py's terms). Each proposed token carries, sparsely, the q it
was drawn from: support_sizes[i] (id, probability) pairs in support_ids / support_probs
(speculative/protocol.py). The target accepts x with probability min(1, p(x) / q(x)) and
resamples from norm(max(0, p - q)) at the first rejection, so the emitted tokens follow p
exactly, whatever q is, as long as q is exactly what x was drawn from: x in its support with
q(x) > 0, probabilities summing to 1, ids below the vocabulary size. A deterministic method
(greedy, replay, lookup) ships q one-hot at its token (sampling.one_hot_supports); under greedy
params (temperature 0) the target compares tokens only. A method that samples draws from a
generator seeded from params.seed, not the target's own stream (DRAFT_SEED_SALT).

release(session_id) drops a session (the coordinator's Release, the end of a stream, a
generation that failed) -> whether one was held; an unknown id is no error.

GetModelInfo answers info() plus max_tokens_per_call = max_tokens. info() holds ModelInfo's
fields (specdec.proto); the coordinator pairs a draft with a target only where vocab_size and
tokenizer_fingerprint agree (model_runner.tokenizer_fields computes both), and reads max_context
(tokens a session may hold) and, for adaptive K, the pass_ms_* fit of a call's time;
draft_method names the method (GetInfo shows it); feature_layers and feature_width, where the
method reads the target's hidden states, ask the target sessions for them.

Serving. Besides the calls, the service reads (on its model thread unless said): `sessions`, the
SessionTable its metrics gauge (read from other threads: its iteration is a snapshot);
`at_work`, sessions used lately, read by the batcher from the event loop (it waits for their
calls; 0: it never waits); `evict_idle()` -> sessions dropped for idling past the timeout (the
sweeper); `tokenizer_files()` -> [(name, bytes)] as save_pretrained writes them (GetTokenizer).
"""

from __future__ import annotations

from typing import Protocol

import torch

from speculative.errors import InvalidRequest
from speculative.protocol import Cost, Proposal, ProposeCall

from .model_runner import mix_seed
from .sessions import Session, SessionTable, check_session_id

DRAFT_SEED_SALT = 0x9E3779B97F4A7C15  # a draft's generator differs from the target's


class DraftMethod(Protocol):
    """A drafting method, as the draft service calls it (the module docstring is the contract)."""

    max_tokens: int  # the most tokens one call may ask for (GetModelInfo's max_tokens_per_call)
    sessions: SessionTable
    at_work: int

    def propose_many(self, calls: list[ProposeCall]) -> list[tuple[Proposal, Cost] | Exception]: ...

    def release(self, session_id: str) -> bool: ...

    def info(self) -> dict: ...

    def evict_idle(self) -> int: ...

    def tokenizer_files(self) -> list[tuple[str, bytes]]: ...


class SessionHost(Protocol):
    """What `advance` needs of a method: its sessions and the checks a call must pass (a model's
    ModelRunner, or MethodSessions for a method without one)."""

    sessions: SessionTable

    def check_session_id(self, session_id: str) -> None: ...

    def check_tokens(self, tokens: list[int], what: str) -> None: ...

    def check_context(self, session_id: str, length: int, held: int = 0, pending: int = 0) -> None: ...

    def start_session(self, session_id: str, seed: int, prompt: list[int] | None = None) -> Session: ...


def advance(call: ProposeCall, max_tokens: int, host: SessionHost, pending: int = 0, grammars=None) -> Session:
    """The session bookkeeping every method does first: validate the call, then roll back the
    rejected proposals and append the committed tokens (the contract's start / rollback / append).
    A refused call leaves its session as it was. pending: tokens the calls admitted to the same
    pass before this one will draft (a KV-token cap counts them). -> the session, its proposals
    not rolled back still unconfirmed unless tokens were appended. grammars (grammar.Grammars): where
    the method masks its q with a start call's constraint, the session gets its matcher (a
    constraint that does not compile is the call's InvalidRequest); a method without one drafts
    unmasked (the target still rejects what the constraint forbids)."""
    k = call.k
    host.check_session_id(call.session_id)
    call.params.validate()
    if not 0 <= k <= max_tokens:
        raise InvalidRequest(f"num_tokens must lie in [0, {max_tokens}], not {k}")
    if not 0.0 <= call.p_min <= 1.0:  # also rejects NaN
        raise InvalidRequest(f"p_min must lie in [0, 1], not {call.p_min}")
    host.check_tokens(call.append, "appended")
    if call.start:
        if call.rollback or not call.append:
            raise InvalidRequest("a new session needs its prompt in `append` and nothing to roll back")
        host.check_context(call.session_id, len(call.append) + k, pending=pending)
        ruled = grammars.session(call.constraint) if grammars is not None and call.constraint is not None else None
        session = host.start_session(call.session_id, call.params.seed ^ DRAFT_SEED_SALT, call.append)
        session.grammar = ruled
    else:
        session = host.sessions.get(call.session_id)
        if call.rollback > session.proposed:
            raise InvalidRequest(f"cannot roll back {call.rollback} tokens: only {session.proposed} were proposed")
        host.check_context(call.session_id, len(session.tokens) - call.rollback + len(call.append) + k,
                           len(session.tokens), pending)
    session.truncate(len(session.tokens) - call.rollback)
    # proposals not rolled back stay unconfirmed until tokens are appended (a call appending nothing
    # drafts on from its own last proposal: pre-drafting)
    session.proposed = 0 if call.append else session.proposed - call.rollback
    session.tokens.extend(call.append)
    return session


class MethodSessions:
    """A SessionHost for a method that holds no ModelRunner (ngram.py, eagle.py): a session table,
    ids below `vocab_size`, at most `max_context` tokens a session and `max_kv_tokens` (0: no cap)
    all sessions together, as ModelRunner.check_context counts them."""

    def __init__(self, table: SessionTable, vocab_size: int, max_context: int, device: torch.device | str = "cpu",
                 max_kv_tokens: int = 0):
        self.sessions = table
        self.vocab_size = vocab_size
        self.max_context = max_context
        self.max_kv_tokens = max_kv_tokens
        self.device = device  # where a session's generator draws

    def check_session_id(self, session_id: str) -> None:
        check_session_id(session_id)

    def check_tokens(self, tokens: list[int], what: str) -> None:
        bad = [t for t in tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(f"{what} token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")

    def check_context(self, session_id: str, length: int, held: int = 0, pending: int = 0) -> None:
        self.sessions.check_room(session_id, length, self.max_context, self.max_kv_tokens, held, pending)

    def start_session(self, session_id: str, seed: int, prompt: list[int] | None = None) -> Session:
        """(prompt: unused; a method without a model keeps no cache to reuse)"""
        if not session_id:
            raise InvalidRequest("session_id is empty")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(mix_seed(seed))
        return self.sessions.create(session_id, generator)


def one_result(results: list) -> tuple:
    """The single result of a *_many call: raise it if it is an error."""
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]
