"""The speculative round — propose -> verify -> accept / roll back — over two peers.

`speculative_round` is the one place the algorithm lives. Its peers are
interfaces: in one process they wrap the engines directly (`local.py`); across
processes they are gRPC stubs (coordinator/peers.py). Either way they receive
deltas only:

  draft   holds committed[:draft_seen] + its `unconfirmed` last proposals;
          each call rolls back the rejected ones and appends what is new.
  target  holds every committed token (the last one, which it sampled itself,
          not yet in its KV cache); each call appends what is new (normally
          nothing) plus the K draft tokens, scored in one forward pass.

A draft that reads the target's hidden states (an EAGLE head: `feature_layers`) gets them the
other way: the target session, asked for those layers when it starts, returns with every answer
the rows of the positions it fed and committed (protocol.Features), and the next call to the
draft carries the rows new to it with the tokens they belong to. Such a draft cannot draft before
the target's first pass, so a round before it drafts nothing.

A peer that no longer holds the session (its replica was lost: coordinator/failover.py)
raises SessionLost; the round then counts nothing as held there and calls again as a new
session carrying every committed token. A draft that cannot start one either leaves the
round without a proposal.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field, replace
from typing import Protocol

from opentelemetry import trace
from opentelemetry.context import Context

from .protocol import (Constraint, Cost, DraftPeer, Features, Logprobs, Proposal, ProposeCall, SamplingParams,
                       TargetPeer, Verdict, VerifyCall)
from .prediction import Prediction, as_proposal

tracer = trace.get_tracer("specdec")  # a no-op unless runtime/tracing.py configured one

FEATURE_WINDOW = 128  # feature rows a sequence keeps for a draft session started again (see FeatureLog)
SEED_STEP = 0x9E3779B97F4A7C15  # a session started after output seeds seed + this x its start (_start_params)


class SessionLost(Exception):
    """The peer holds nothing of the session any more: start it again with every committed token."""


class KPolicy(Protocol):
    """Chooses each round's number of draft tokens (FixedK below; coordinator/adaptive.py)."""

    # after choose: the probability below which the draft stops this round (the round's p_min is
    # the larger of it and the request's); 0 where the policy never stops the draft
    stop_below: float
    # whether its K sequence is a function of the request, so that a seeded sampled request replays
    # (FixedK, AcceptanceK): then a round whose draft proposes nothing commits one token, since how
    # many decode steps a call carries follows timings and load and would move later rounds' draws
    replays: bool
    k: int  # the most tokens it drafts a round (0: it never drafts; a feature-reading draft's rows are not asked for)

    # remaining: tokens still to generate, or fewer where the draft has less room (K < remaining)
    def choose(self, remaining: int) -> int: ...

    def decode_steps(self, remaining: int) -> int: ...  # tokens a round that drafts nothing asks the target for

    def observe(self, r: "Round", wall_ms: float) -> None: ...


class FixedK:
    """The same K every round (a request's num_speculative_tokens); at K = 0, `steps` tokens a
    call (see speculative_round)."""

    adaptive = False
    stop_below = 0.0
    replays = True

    def __init__(self, k: int, steps: int = 1):
        self.k = k
        self.steps = steps

    def choose(self, remaining: int) -> int:
        return max(0, min(self.k, remaining - 1))

    def decode_steps(self, remaining: int) -> int:
        return max(1, min(self.steps, remaining))

    def observe(self, r: "Round", wall_ms: float) -> None:
        pass


class FeatureLog:
    """The target's feature rows a sequence has received and still needs: those not yet sent to
    the draft, and the last `window` rows, from which a draft session started again (its replica
    was lost) drafts: it attends to those rows only, so the restart costs `window` rows on the
    wire, not the whole prefix. A draft that has fallen further behind (rounds that call no draft
    keep adding rows) gets those `window` rows too and starts its rows again after the gap
    (model_service/eagle.py): taking in every row since would cost its next call more than a round
    (SmolLM2's head, int4, 1 thread: 9.7 ms for 128 rows, 43 for 512). Until the draft's first call
    the log keeps the first answer's rows (a prompt's, which that call takes in), or `window` if
    more, the latest as rounds go on; never more than `max_bytes`. It holds the answers' rows as
    they came and joins them only when they are sent: a round's rows are added, the log not copied."""

    def __init__(self, window: int = FEATURE_WINDOW, max_bytes: int = 8 << 20):
        self.window = window
        self.max_bytes = max_bytes
        self.parts: list[Features] = []  # in position order, each from where the one before ends
        self.first = 0  # the first answer's rows

    @property
    def end(self) -> int:
        return self.parts[-1].end if self.parts else 0

    def add(self, features: Features | None, sent: int) -> None:
        """Take an answer's rows in; `sent`: the draft holds the rows before this position."""
        if features is None or not features.rows:
            return
        if self.parts and features.start < self.end:  # rows again (a target session started again)
            self.parts = [Features.join([self.since(0), features])]  # (rare: the later rows, as join takes them)
        elif self.parts and features.start == self.end:
            if features.width != self.parts[0].width:
                raise ValueError(f"features do not join: widths {self.parts[0].width}, {features.width}")
            self.parts.append(features)
        else:  # the first rows, or rows after a gap: the rows start again there
            self.parts = [features]
        self.first = self.first or features.rows
        self.sent(sent)

    def since(self, position: int) -> Features | None:
        """The rows from `position` on, None if there are none."""
        cut = [p if p.start >= position else p.since(position) for p in self.parts if p.end > position]
        if not cut:
            return None
        if len({p.dtype for p in cut}) > 1:  # one dtype a message: bfloat16 keeps the range of both
            cut = [p.as_bfloat16() for p in cut]
        if len(cut) == 1:
            return cut[0]
        return Features(cut[0].start, sum(p.rows for p in cut), cut[0].width, cut[0].dtype,
                        b"".join(p.data for p in cut))

    def held(self) -> Features | None:
        """Every row held (a draft session's start: the prompt's, or a restart's last window)."""
        return self.since(0)

    def sent(self, position: int) -> None:
        """The draft holds the rows before `position` (0: none yet): keep what a restart or it
        still needs, within the bounds above."""
        if not self.parts:
            return
        end = self.end
        keep = max(end - (self.window if position > 0 else max(self.window, self.first)),
                   end - self.max_bytes // max(1, self.parts[0].row_bytes))
        self.parts = [p if p.start >= keep else p.since(keep) for p in self.parts if p.end > keep]


@dataclass
class Sequence:
    """The coordinator's view of one generation: what each peer already holds."""

    session_id: str
    tokens: list[int]            # committed: prompt + generated
    draft_seen: int = 0          # committed tokens in the draft session
    draft_unconfirmed: int = 0   # proposals the draft session holds beyond them
    target_seen: int = 0         # committed tokens in the target session
    ready: Proposal | None = None  # pre-drafted, still valid: the first draft_unconfirmed it holds
    feature_layers: tuple[int, ...] = ()  # the target layers the draft reads (none: it reads no features)
    features: FeatureLog = field(default_factory=FeatureLog)
    draft_featured: int = 0      # the draft session holds feature rows up to this position
    constraint: Constraint | None = None  # the structured output both sessions follow (given on their start)
    drop_features: bool = False  # the target session is to send no more feature rows: said on its next verify
    draft_starts: int = 0        # draft calls that started its session (each takes in the whole context)
    target_starts: int = 0       # target calls that started its session
    output_from: int = 0         # the prompt's length: where the output begins (the target's penalties count from it)
    prompt_scores: PromptScores | None = None  # asked: the target's start scores the prompt (once)

    def draft_lost(self) -> None:
        """The draft session is gone: the next draft call starts it again."""
        self.draft_seen = self.draft_unconfirmed = self.draft_featured = 0
        self.ready = None


@dataclass
class PromptScores:
    """A generation's ask to have its prompt scored (generate's prompt_scores): each of its tokens after the
    first, its log-probability under the target with the `top` most likely tokens' beside it; `logprobs`
    filled in by the target session's first start (VerifyCall.prompt_logprobs), which pays for it with an
    output row per prompt token."""

    top: int
    logprobs: Logprobs | None = None


@dataclass
class Round:
    tokens: list[int]  # newly committed: accepted draft tokens + the recovered/bonus token (+ decoded ones)
    proposed: int
    accepted: int
    draft: Cost = field(default_factory=Cost)
    target: Cost = field(default_factory=Cost)
    asked: int = 0  # draft tokens asked for (the draft may stop short: p_min)
    draft_calls: int = 0  # calls to the draft this round (a pre-draft counts)
    predrafted: bool = False   # the draft drafted ahead while the target verified
    predraft_hit: bool = False  # ... and that draft is the next round's proposal
    feature_bytes: int = 0     # the target's feature rows this round (a feature-reading draft's)
    draft_lost: bool = False   # a draft call failed or was late (failover): the round went on without it
    draft_pass_ms: float = 0.0  # the passes its draft calls rode in, on the draft's model (draft.pass_ms: the last's)
    copied: int = 0  # of `tokens`, those the target copied from the context and kept (lookup: Verdict.copied)
    draft_started: bool = False  # a draft call of this round started the draft's session (took in the whole context)
    logprobs: Logprobs | None = None  # params.logprobs set: the target's, of `tokens`
    scored_prompt: bool = False  # its target call scored the prompt (PromptScores): a pass dearer than its tokens say
    # its target call started the session again (after a fault, or after giving a full target's room back:
    # coordinator/failover.py): its wall time may hold a wait and a prefill, no round's
    target_restarted: bool = False
    cached: int = 0  # its target call started the session with this many first tokens cached (Verdict.cached)
    predicted: bool = False  # what it verified was the request's prediction (offer), not the draft's


async def speculative_round(
    draft: DraftPeer, target: TargetPeer, seq: Sequence, k: int, params: SamplingParams, p_min: float = 0.0,
    predraft: bool = False, draft_context: int | None = None, max_call_tokens: int | None = None, steps: int = 1,
    lookup: int = 0, offer: list[int] = (),
) -> Round:
    """One round: the draft proposes up to k tokens, the target verifies them in one pass.

    k = 0 (no speculation this round): the target decodes `steps` tokens in the one call, a pass
    each (fewer after an EOS or at the context), each drawn as a round with nothing proposed draws
    its token, so the output is the same as `steps` such rounds': only the round trips are saved.
    The draft catches up on them, as on any committed token, at its next call. So does a round
    whose draft proposed nothing (the n-gram draft found no copy, a draft stopped at its first
    token, a lost draft call), which would otherwise pay a target call for one token (generate
    passes 1 where the output could depend on how many: see KPolicy.replays). lookup: such a call's
    passes also verify up to this many tokens the target copies from the context (VerifyCall.lookup),
    so that a pass may commit several.

    predraft (PEARL's post-verify): while the target verifies, the draft goes on drafting
    k + 1 tokens as if every proposed token were accepted, the first being its guess of the
    target's bonus token. If all are accepted and the guess is the target's token, the rest
    is the next round's proposal and the next round skips its draft call; otherwise it is
    rolled back with the rejected tokens. Exactness is unaffected: each token kept was drawn
    from the q it is verified against, on the very prefix the target commits. The pre-draft is
    cut to what the draft session's context (draft_context) and one call (max_call_tokens) allow,
    and skipped where that is nothing.

    offer: tokens the request itself proposes (its prediction, speculative/prediction.py), verified in
    the draft's place with q one-hot at each; the draft is not called (k is not read), and catches up on
    what the round commits at its next call, as after a round that drafts nothing.
    """
    if offer or seq.feature_layers and not seq.features.end:
        k = 0  # (no draft call) the draft drafts from the target's features: none yet before its first pass
    proposal, draft_cost = Proposal(), Cost()
    if offer:
        proposal = as_proposal(offer)
    starts = seq.draft_starts
    scoring = seq.prompt_scores is not None and seq.prompt_scores.logprobs is None
    target_starts = seq.target_starts
    ready, seq.ready = seq.ready, None
    held = 0  # proposals the draft holds past what is committed
    lost = False  # the draft lost its session this round (and holds nothing)
    if k > 0 and ready is not None:
        proposal, held = ready.slice(0, k), len(ready.tokens)
    elif k > 0:
        proposed = await _propose(draft, seq, k, params, p_min)
        lost = proposed is None
        proposal, draft_cost = proposed or (Proposal(), Cost())
        held = len(proposal.tokens)
    draft_pass_ms = draft_cost.pass_ms
    verify = _verify(target, seq, proposal, params, 1 if proposal.tokens else steps, lookup)
    ahead = None
    ahead_k = 0
    if predraft and proposal.tokens and len(proposal.tokens) == held:
        ahead_k = k + 1
        if max_call_tokens is not None:
            ahead_k = min(ahead_k, max_call_tokens)
        if draft_context is not None:  # the draft session holds the committed tokens and `held` proposals
            ahead_k = min(ahead_k, draft_context - len(seq.tokens) - held)
    if ahead_k > 0:
        ahead_call = ProposeCall(seq.session_id, False, 0, [], ahead_k, params.drafting(), p_min)
        (verdict, target_cost), predrafted = await asyncio.gather(verify, _unless_lost(draft.propose(ahead_call)))
        lost = predrafted is None  # a miss
        ahead, ahead_cost = predrafted or (Proposal(), Cost())
        draft_pass_ms += ahead_cost.pass_ms
        draft_cost = Cost(draft_cost.service_ms + ahead_cost.service_ms, draft_cost.wire_bytes + ahead_cost.wire_bytes,
                          ahead_cost.batch_size, ahead_cost.batch_tokens, ahead_cost.pass_ms)
    else:
        verdict, target_cost = await verify
    if params.logprobs is not None and (fault := verdict.logprobs_fault(params.logprobs)) is not None:
        raise RuntimeError(f"the target's answer: {fault}")  # (a peer over the wire says so itself: GrpcTarget)
    before = len(seq.tokens)
    accepted = proposal.tokens[: verdict.accepted]
    seq.tokens.extend(accepted)
    seq.tokens.append(verdict.token)
    seq.tokens.extend(verdict.decoded)
    seq.target_seen = len(seq.tokens)
    if seq.feature_layers:
        seq.features.add(verdict.features, seq.draft_featured)
    hit = False
    if k > 0:
        # the draft keeps the accepted proposals; the rest are rolled back next call
        seq.draft_seen = before + verdict.accepted
        seq.draft_unconfirmed = held - verdict.accepted + (len(ahead.tokens) if ahead else 0)
        hit = (ahead is not None and verdict.accepted == len(proposal.tokens) and bool(ahead.tokens)
               and ahead.tokens[0] == verdict.token)
        if hit:  # the draft's guess is the committed token; what it drafted after is the next proposal
            seq.draft_seen += 1
            seq.draft_unconfirmed -= 1
            seq.ready = ahead.slice(1) if len(ahead.tokens) > 1 else None
    if lost:
        seq.draft_lost()
    calls = (k > 0 and ready is None) + (ahead is not None)
    return Round(accepted + [verdict.token] + verdict.decoded, len(proposal.tokens), verdict.accepted, draft_cost,
                 target_cost, k, calls, ahead is not None, hit,
                 len(verdict.features.data) if verdict.features is not None else 0, lost, draft_pass_ms, verdict.copied,
                 draft_started=seq.draft_starts > starts, logprobs=verdict.logprobs,
                 scored_prompt=scoring and seq.prompt_scores.logprobs is not None,
                 target_restarted=seq.target_starts > max(1, target_starts), predicted=bool(offer),
                 cached=verdict.cached)


async def _propose(draft: DraftPeer, seq: Sequence, k: int, params: SamplingParams,
                   p_min: float) -> tuple[Proposal, Cost] | None:
    """The draft's proposal after the committed tokens, from a session started again if the draft
    lost it; None if it cannot start one. A feature-reading draft gets the rows new to it (a new
    session: those the sequence holds, FeatureLog)."""
    params = params.drafting()  # (what only the target reads stays off the draft's calls)
    reads = bool(seq.feature_layers)
    if seq.draft_seen:
        try:
            answer = await draft.propose(ProposeCall(
                seq.session_id, False, seq.draft_unconfirmed, seq.tokens[seq.draft_seen :], k, params, p_min,
                seq.features.since(seq.draft_featured) if reads else None))
            _featured(seq)
            return answer
        except SessionLost:
            seq.draft_lost()
    seq.draft_starts += 1
    params = _start_params(params, seq)
    answer = await _unless_lost(draft.propose(ProposeCall(seq.session_id, True, 0, seq.tokens[:], k, params, p_min,
                                                          seq.features.held() if reads else None, seq.constraint)))
    if answer is not None:
        _featured(seq)
    return answer


def _featured(seq: Sequence) -> None:
    """The draft session took every feature row the sequence has."""
    if seq.feature_layers:
        seq.draft_featured = seq.features.end
        seq.features.sent(seq.draft_featured)


async def _verify(target: TargetPeer, seq: Sequence, proposal: Proposal, params: SamplingParams,
                  steps: int, lookup: int = 0) -> tuple[Verdict, Cost]:
    """The target's verdict on the proposal, from a session started again if the target lost it."""
    if seq.target_seen:
        try:
            answer = await target.verify(VerifyCall(seq.session_id, False, seq.tokens[seq.target_seen :], proposal,
                                                    params, steps, drop_features=seq.drop_features, lookup=lookup))
            seq.drop_features = False
            return answer
        except SessionLost:
            seq.target_seen = 0
    seq.drop_features = False  # (a new session asks for seq.feature_layers, none once dropped)
    seq.target_starts += 1
    scores = seq.prompt_scores if seq.prompt_scores is not None and seq.prompt_scores.logprobs is None else None
    call = VerifyCall(seq.session_id, True, seq.tokens[:], proposal, _start_params(params, seq), steps,
                      seq.feature_layers, seq.constraint,
                      lookup=lookup, output_from=seq.output_from,
                      prompt_logprobs=scores.top if scores is not None else None)
    answer = await target.verify(call)
    if scores is not None:
        if (fault := answer[0].prompt_logprobs_fault(call)) is not None:
            raise RuntimeError(f"the target's answer: {fault}")  # (as a missing logprobs: GrpcTarget says so itself)
        # (the prompt's: a session started again after output, the first start lost, scored that too)
        scores.logprobs = answer[0].prompt_logprobs.slice(0, seq.output_from - 1)
    return answer


def _start_params(params: SamplingParams, seq: Sequence) -> SamplingParams:
    """The params of a session's start: one after output (a session started again, or a draft's first call a
    few rounds in) seeds its generator from the seed and the position it starts at. Seeded as the first
    start was, it would draw again the very numbers that drew the output so far, and the tokens after
    would not follow p (a draft's, q) independently of those before: the output would no longer be exactly
    the target's. Deterministic: a run with its faults at the same positions draws the same."""
    if params.greedy or len(seq.tokens) == seq.output_from:
        return params
    return replace(params, seed=(params.seed + SEED_STEP * len(seq.tokens)) % 2**64)


async def _unless_lost(call: Awaitable[tuple[Proposal, Cost]]) -> tuple[Proposal, Cost] | None:
    """The draft call's result, or None if the draft lost the session."""
    try:
        return await call
    except SessionLost:
        return None


@dataclass
class Stats:
    rounds: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    draft_calls: int = 0
    draft_ms: float = 0.0
    target_ms: float = 0.0
    wire_bytes: int = 0
    generated_tokens: int = 0
    rejected_rounds: int = 0
    verify_batch_sessions: int = 0  # summed over rounds: sessions in the target pass each round rode in
    predrafts: int = 0      # rounds that drafted ahead during verification
    predraft_hits: int = 0  # ... whose draft became the next proposal
    feature_bytes: int = 0  # the target's feature rows sent for the draft (a feature-reading draft)
    lost_draft_rounds: int = 0  # rounds that went on without a draft call that failed or was late
    draft_pass_ms: float = 0.0   # of draft_ms, on the draft's model (the passes its calls rode in)
    target_pass_ms: float = 0.0  # of target_ms, on the target's model
    copied_tokens: int = 0  # generated tokens the target copied from the context (lookup) and kept
    prediction_tokens: int = 0  # the request's prediction's tokens verified (in rounds that did: Round.predicted)
    accepted_prediction_tokens: int = 0  # ... and kept
    cached_prompt_tokens: int = 0  # the prompt's first tokens the target's first session took cached (prefix reuse)

    def add(self, r: Round) -> None:
        self.rounds += 1
        if not r.target_restarted:  # (a session started again after a fault holds more than the prompt)
            self.cached_prompt_tokens += r.cached
        if r.predicted:  # (not the draft's: its counts and acceptance leave such rounds out)
            self.prediction_tokens += r.proposed
            self.accepted_prediction_tokens += r.accepted
            self.verify_batch_sessions += r.target.batch_size
            self.feature_bytes += r.feature_bytes
            self.target_ms += r.target.service_ms
            self.target_pass_ms += r.target.pass_ms
            self.wire_bytes += r.target.wire_bytes
            return
        self.lost_draft_rounds += r.draft_lost
        self.verify_batch_sessions += r.target.batch_size
        self.predrafts += r.predrafted
        self.predraft_hits += r.predraft_hit
        self.feature_bytes += r.feature_bytes
        self.rejected_rounds += r.accepted < r.proposed
        self.draft_tokens += r.proposed
        self.accepted_tokens += r.accepted
        if len(self.accepted_per_position) < r.proposed:
            self.accepted_per_position += [0] * (r.proposed - len(self.accepted_per_position))
        for i in range(r.accepted):
            self.accepted_per_position[i] += 1
        self.draft_calls += r.draft_calls
        self.draft_ms += r.draft.service_ms
        self.target_ms += r.target.service_ms
        self.draft_pass_ms += r.draft_pass_ms
        self.target_pass_ms += r.target.pass_ms
        self.wire_bytes += r.draft.wire_bytes + r.target.wire_bytes
        self.copied_tokens += r.copied

    def merge(self, other: "Stats") -> None:
        """Add another generation's counts to these (for totals over requests)."""
        for name in ("rounds", "draft_tokens", "accepted_tokens", "draft_calls", "draft_ms", "target_ms",
                     "wire_bytes", "generated_tokens", "rejected_rounds", "predrafts", "predraft_hits",
                     "feature_bytes", "lost_draft_rounds", "draft_pass_ms", "target_pass_ms", "copied_tokens",
                     "prediction_tokens", "accepted_prediction_tokens", "cached_prompt_tokens"):
            setattr(self, name, getattr(self, name) + getattr(other, name))
        # (`other` may be a GenerationStats message, which carries the mean instead)
        self.verify_batch_sessions += getattr(other, "verify_batch_sessions", None) or round(
            other.mean_verify_batch * other.rounds)
        per = list(other.accepted_per_position)
        self.accepted_per_position += [0] * (len(per) - len(self.accepted_per_position))
        for i, n in enumerate(per):
            self.accepted_per_position[i] += n

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def alpha(self) -> float:
        """Leviathan's alpha: the chance a draft token is accepted when those before it were.
        (acceptance_rate is lower: it counts the tokens after a rejection as lost.)"""
        tried = self.accepted_tokens + self.rejected_rounds
        return self.accepted_tokens / tried if tried else 0.0

    @property
    def mean_verify_batch(self) -> float:
        return self.verify_batch_sessions / self.rounds if self.rounds else 0.0

    @property
    def mean_accepted(self) -> float:
        return self.accepted_tokens / self.rounds if self.rounds else 0.0


async def generate(
    draft: DraftPeer,
    target: TargetPeer,
    prompt: list[int],
    *,
    max_new_tokens: int,
    k: int | KPolicy,
    params: SamplingParams,
    eos_token_ids: frozenset[int] | set[int] = frozenset(),
    max_context: int,
    draft_context: int | None = None,
    stats: Stats | None = None,
    session_id: str | None = None,
    p_min: float = 0.0,
    predraft: bool = False,
    max_call_tokens: int | None = None,
    feature_layers: tuple[int, ...] = (),
    feature_window: int = FEATURE_WINDOW,
    constraint: Constraint | None = None,
    trace_context: Context | None = None,
    lookup: int = 0,
    logprobs: list[Logprobs] | None = None,
    prompt_scores: PromptScores | None = None,
    prediction: Prediction | None = None,
) -> AsyncIterator[list[int]]:
    """Yield each round's new tokens until max_new_tokens, the context or an EOS.

    k is a fixed number of draft tokens per round or a policy choosing it per round
    (coordinator/adaptive.py); max_context: the tokens the target's session may hold (the prompt
    and what is generated); draft_context: the draft's (None: the same), which where it is shorter
    bounds the drafting, not the request: a round drafts no more than the draft's session has room
    for, and once the sequence fills it the draft's session is released, the target is told to send
    no more feature rows and decodes on alone (a sequence whose prompt leaves the draft no room asks
    for none); max_call_tokens caps the tokens one call asks the draft for (a pre-draft asks k + 1);
    feature_layers: the target layers a feature-reading draft reads (its ModelInfo.feature_layers),
    feature_window: the rows kept for a draft session started again (FeatureLog); constraint: a
    structured output the generated tokens follow (both sessions get it on their start; the target
    masks p with it); trace_context: the request's span, each round's span's parent
    (runtime/tracing.py); lookup: in a round that decodes steps, the tokens each pass may also verify
    from the target's own copies of the context (speculative_round; greedy, or a policy that does not
    replay: see KPolicy.replays); logprobs: where params.logprobs is set, each round's Logprobs of the
    tokens it yields is appended to it before they are; prompt_scores: the target's first start scores
    the prompt into it (max_new_tokens 0: that start alone, a round that drafts nothing and yields
    nothing); prediction: the output the request expects (speculative/prediction.py), whose next tokens a
    round verifies in the draft's place wherever the output stands in it (the policy is neither asked nor
    told of such a round: it prices the draft). Tokens past an EOS or past max_new_tokens are dropped.
    Both sessions are released when the generator ends or is closed early.
    """
    if isinstance(k, int):
        k = FixedK(k)
    if not params.greedy and k.replays:
        # a sampled request under a replaying policy (a seeded one's AcceptanceK, a fixed K) replays from
        # the request alone; the draws of a call that copies depend on where its copies stop, and so on
        # how many tokens each call asks for
        lookup = 0
    asked_draft = False  # whether any round has called the draft (its session may exist)
    stats = stats if stats is not None else Stats()
    draft_context = max_context if draft_context is None else draft_context
    # no round can draft (a feature-reading draft's first round cannot, and commits one token), or the
    # policy never drafts (a request's K = 0): the draft is never called, nor are features asked for
    limit = min(max_new_tokens, max_context - len(prompt))
    if not k.k or draft_context - len(prompt) < (2 if feature_layers else 1) or limit <= 0:
        feature_layers = ()
    seq = Sequence(session_id or uuid.uuid4().hex, list(prompt), feature_layers=tuple(feature_layers),
                   features=FeatureLog(feature_window),
                   constraint=constraint.at(len(prompt)) if constraint is not None else None,
                   output_from=len(prompt), prompt_scores=prompt_scores)
    try:
        if limit <= 0 and prompt_scores is not None:  # the prompt scored, nothing generated
            stats.add(await speculative_round(draft, target, seq, 0, params, p_min))
            return
        while stats.generated_tokens < limit:
            remaining = limit - stats.generated_tokens
            start = time.perf_counter()
            # (a token of the round's own follows the offer: within what is left, and the context)
            offer = prediction.offer(seq.tokens[len(prompt):], min(remaining, max_context - len(seq.tokens)) - 1) \
                if prediction is not None else []
            if offer:
                with tracer.start_as_current_span("round", context=trace_context,
                                                  attributes={"specdec.predicted": len(offer)}) as span:
                    r = await speculative_round(draft, target, seq, 0, params, p_min, offer=offer)
                    if span.is_recording():
                        span.set_attributes({"specdec.accepted": r.accepted, "specdec.tokens": len(r.tokens)})
                prediction.kept(len(offer), r.accepted)
            else:
                # K < what is left to generate, and no more than the draft's session has room for beside
                # the committed tokens (told as such, a policy neither drafts nor probes past it)
                chosen = k.choose(min(remaining, max(0, draft_context - len(seq.tokens)) + 1))
                asked_draft = asked_draft or chosen > 0
                # the first token alone (time to first token); later rounds that draft nothing (chosen 0, or
                # the draft proposes nothing, where the output cannot depend on how many) may ask for more
                steps = k.decode_steps(remaining) \
                    if stats.rounds and (chosen == 0 or params.greedy or not k.replays) else 1
                with tracer.start_as_current_span("round", context=trace_context, attributes={
                        "specdec.k": chosen, "specdec.decode_steps": steps}) as span:
                    stop = max(p_min, k.stop_below) if chosen else p_min
                    r = await speculative_round(draft, target, seq, chosen, params, stop, predraft,
                                                draft_context=draft_context, max_call_tokens=max_call_tokens,
                                                steps=steps, lookup=lookup)
                    if span.is_recording():
                        span.set_attributes({"specdec.proposed": r.proposed, "specdec.accepted": r.accepted,
                                             "specdec.tokens": len(r.tokens), "specdec.predraft_hit": r.predraft_hit,
                                             "specdec.feature_bytes": r.feature_bytes,
                                             "specdec.draft_lost": r.draft_lost})
                k.observe(r, (time.perf_counter() - start) * 1e3)
            stats.add(r)
            new = r.tokens[:remaining]
            for i, t in enumerate(new):
                if t in eos_token_ids:
                    new = new[: i + 1]
                    break
            stats.generated_tokens += len(new)
            if logprobs is not None and r.logprobs is not None:
                logprobs.append(r.logprobs.slice(0, len(new)))
            if len(seq.tokens) >= draft_context and (asked_draft or seq.feature_layers):
                # the draft can take no more: its session goes now, not at the end (its memory and its
                # place in --max-sessions), and the target sends no more rows for it
                if asked_draft:
                    await asyncio.shield(asyncio.gather(draft.release(seq.session_id), return_exceptions=True))
                    asked_draft = False
                    seq.draft_lost()
                if seq.feature_layers:
                    seq.feature_layers, seq.features, seq.drop_features = (), FeatureLog(feature_window), True
            yield new
            if new[-1] in eos_token_ids:
                return
    finally:
        # Both, always (a call cancelled mid-flight may have started a session that nothing
        # here has recorded yet), and shielded: a generation ended by its client's deadline or
        # cancel must still free what it holds.
        releases = [target.release(seq.session_id)]
        if seq.draft_seen or asked_draft:
            releases.append(draft.release(seq.session_id))
        await asyncio.shield(asyncio.gather(*releases, return_exceptions=True))
