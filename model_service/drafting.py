"""What a drafting method is: the one contract the draft service holds a method to, so that a new
way of drafting is one file.

  engines.py  DraftEngine        a small model samples each token from its own distribution
  ngram.py    NgramDraft         copies what followed the context's last n-gram (no model)
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
the committed tokens and sends deltas only (speculative/round.py). A call, in this order:
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
(pre-drafting), and the next rollback may then span both proposals.

q and exactness (speculative/sampling.py's terms). Each proposed token carries, sparsely, the q it
was drawn from: support_sizes[i] (id, probability) pairs in support_ids / support_probs
(speculative/protocol.py). The target accepts x with probability min(1, p(x) / q(x)) and
resamples from norm(max(0, p - q)) at the first rejection, so the emitted tokens follow p
exactly, whatever q is, as long as q is exactly what x was drawn from: x in its support with
q(x) > 0, probabilities summing to 1, ids below the vocabulary size. A deterministic method
(greedy, replay, lookup) ships q one-hot at its token (sampling.one_hot_supports); under greedy
params (temperature 0) the target compares tokens only. A method that samples draws from a
generator seeded from params.seed, not the target's own stream (engines.DRAFT_SEED_SALT).

release(session_id) drops a session (the coordinator's Release, the end of a stream, a
generation that failed) -> whether one was held; an unknown id is no error.

GetModelInfo answers info() plus max_tokens_per_call = max_tokens. info() holds ModelInfo's
fields (specdec.proto); the coordinator pairs a draft with a target only where vocab_size and
tokenizer_fingerprint agree (model_runner.tokenizer_fields computes both), and reads max_context
(tokens a session may hold) and, for adaptive K, the pass_ms_* fit of a call's time;
draft_method names the method (GetInfo shows it).

Serving. Besides the calls, the service reads (on its model thread unless said): `sessions`, the
SessionTable its metrics gauge (read from other threads: its iteration is a snapshot);
`at_work`, sessions used lately, read by the batcher from the event loop (it waits for their
calls; 0: it never waits); `evict_idle()` -> sessions dropped for idling past the timeout (the
sweeper); `tokenizer_files()` -> [(name, bytes)] as save_pretrained writes them (GetTokenizer).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from speculative.protocol import Cost, Proposal, SamplingParams

from .sessions import SessionTable


@dataclass
class ProposeCall:
    """One session's propose call: the delta (rollback, then append), then up to k tokens."""

    session_id: str
    start: bool
    rollback: int
    append: list[int]
    k: int
    params: SamplingParams
    p_min: float = 0.0  # stop drafting at a token whose top probability is below this


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


def one_result(results: list) -> tuple:
    """The single result of a *_many call: raise it if it is an error."""
    if isinstance(results[0], BaseException):
        raise results[0]
    return results[0]
