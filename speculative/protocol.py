"""What the coordinator and the model services say to each other, free of torch.

The round (round.py), both model services and the coordinator share these words:

  SamplingParams   how a request samples (temperature 0 = greedy); `validate` is the one check
  ProposeCall      one session's call to the draft: the delta (roll back, append), then up to k tokens
  Proposal         K draft tokens and the sparse q each was sampled from (wire layout below)
  VerifyCall       one session's call to the target: the delta and the proposal to verify
  Verdict          how many of them the target accepted, and its own next token (or tokens: a
                   call with no proposal may ask the target to decode several on its own)
  Logprobs         per token a verdict commits, its log-probability under the target and the most
                   likely tokens' (a request's SamplingParams.logprobs asks for them); of a prompt's
                   tokens too (VerifyCall.prompt_logprobs, on a session's start)
  Constraint       a structured-output constraint (JSON schema, regex, grammar, choice) a session
                   follows: the target masks p with it, the draft masks q (model_service/grammar.py)
  Features         the target's hidden states at some layers for consecutive committed
                   positions: what goes the other way, from the target to a draft that reads
                   them (an EAGLE head), as packed bytes (wire layout below)
  Cost             what one peer call cost (time in the service, bytes on the wire, its batch)
  PassCost         a model pass's time as a service measured it (adaptive K reads it)
  DraftPeer, TargetPeer   the two interfaces the round calls: in-process engines
                   (model_service/local.py) or gRPC stubs (coordinator/peers.py)

and the to/from-protobuf pairs, written once. Every layer between the round and a service (the
gRPC peers, failover, the lockstep gate, the in-process peers, the servicers) passes the call
objects on whole: a new field is added here and where it is used, not in each layer.

A Proposal's q travels as bytes: for token i,
`support_sizes[i]` (id, probability) pairs, ids int32 and probabilities float32, little-endian,
concatenated in `support_ids` / `support_probs` (specdec.proto, DraftProposal). Features travel
as `rows` x `width` values of `dtype` (float16, or bfloat16 where a value is beyond float16's
range), row-major, little-endian: row r is position start + r (specdec.proto, Features).
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field, fields, replace
from typing import Protocol

import numpy as np

from specdec.v1 import specdec_pb2 as pb

from .errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off
    seed: int = 0
    # the target's log-probabilities of each committed token (Verdict.logprobs): None = none; n = with
    # the n most likely tokens' beside it (0..MAX_TOP_LOGPROBS). What is sampled does not change
    logprobs: int | None = None
    # the target's logits before sampling (OpenAI's and vLLM's fields): a token in the prompt or the
    # output so far has its logit divided by repetition_penalty where positive, multiplied where not
    # (vLLM's and transformers'); then minus frequency_penalty times each token's count in the output so
    # far (VerifyCall.output_from on), minus presence_penalty for a token in it at all, plus
    # logit_bias[token] last (vLLM adds it first); p, and so what is sampled, is that distribution's
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias), ids ascending
    repetition_penalty: float = 1.0  # 1: off
    # vLLM's: the first min_tokens output tokens are none of the model's end-of-sequence tokens nor
    # stop_token_ids: their logits are -inf there
    min_tokens: int = 0
    # the request's stop token ids (the output ends after one): the target's decode steps stop there too
    stop_token_ids: tuple[int, ...] = ()
    # vLLM's min_p: at temperature, before top-k and top-p (vLLM's order), a token stays only where its
    # probability is at least min_p times the most likely one's; 0 = off. A draft samples by it too
    min_p: float = 0.0

    @property
    def shapes_logits(self) -> bool:
        """Whether penalties, a bias or min_tokens change the target's logits."""
        return bool(self.frequency_penalty or self.presence_penalty or self.logit_bias or
                    self.repetition_penalty != 1.0 or self.min_tokens)

    def drafting(self) -> "SamplingParams":
        """What a draft samples by: these without what only the target reads (logprobs, penalties, bias:
        up to 1,024 entries that would go on every draft call for nothing)."""
        if self.logprobs is None and not self.shapes_logits and not self.stop_token_ids:
            return self
        return replace(self, logprobs=None, frequency_penalty=0.0, presence_penalty=0.0, logit_bias=(),
                       repetition_penalty=1.0, min_tokens=0, stop_token_ids=())

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Raise InvalidRequest naming the first field out of range; return self. In range means as the
        wire carries it too (SamplingParams in specdec.proto: float temperature and top_p, int32 top_k,
        uint64 seed): a value the services would read as another (1e39 as inf, a top_p of 1e-300 as 0)
        is refused here, in the client's terms, not by a service in its own."""
        t = self.temperature
        if not math.isfinite(t) or t < 0 or float32(t) == math.inf:  # also NaN
            raise InvalidRequest(f"temperature must be a finite number >= 0 (a 32-bit float), not {t}", "temperature")
        if not 0 <= self.top_k <= INT32_MAX:
            raise InvalidRequest(f"top_k must lie in [0, {INT32_MAX}], not {self.top_k}", "top_k")
        if not 0.0 < self.top_p <= 1.0 or float32(self.top_p) == 0.0:  # also NaN
            raise InvalidRequest(f"top_p must lie in (0, 1] (and be above 0 as a 32-bit float), not {self.top_p}",
                                 "top_p")
        if not 0.0 <= self.min_p <= 1.0:  # also NaN
            raise InvalidRequest(f"min_p must lie in [0, 1] (0: off), not {self.min_p}", "min_p")
        if not 0 <= self.seed < 2**64:
            raise InvalidRequest(f"seed must lie in [0, 2^64), not {self.seed}", "seed")
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top logprobs must lie in [0, {MAX_TOP_LOGPROBS}], not {self.logprobs}", "logprobs")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -MAX_PENALTY <= value <= MAX_PENALTY):  # also NaN
                raise InvalidRequest(f"{name} must lie in [-{MAX_PENALTY}, {MAX_PENALTY}], not {value}", name)
        r = self.repetition_penalty
        # (compared as the wire's 32-bit float carries it: 0.01 arrives as 0.0099999998)
        if not (math.isfinite(r) and float32(MIN_REPETITION_PENALTY) <= float32(r) <= float32(MAX_REPETITION_PENALTY)):
            raise InvalidRequest(f"repetition_penalty must lie in [{MIN_REPETITION_PENALTY:g},"
                                 f" {MAX_REPETITION_PENALTY:g}] (1: off), not {r}", "repetition_penalty")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidRequest(f"logit_bias holds {len(self.logit_bias)} tokens; at most {MAX_LOGIT_BIAS}",
                                 "logit_bias")
        ids = [token for token, _ in self.logit_bias]
        if ids != sorted(set(ids)):
            raise InvalidRequest("logit_bias must name each token once, ids ascending", "logit_bias")
        for token, bias in self.logit_bias:
            if not 0 <= token <= INT32_MAX:
                raise InvalidRequest(f"logit_bias names token {token}: ids lie in [0, {INT32_MAX}]", "logit_bias")
            if not (math.isfinite(bias) and -MAX_LOGIT_BIAS_VALUE <= bias <= MAX_LOGIT_BIAS_VALUE):
                raise InvalidRequest(f"logit_bias of token {token} must lie in [-{MAX_LOGIT_BIAS_VALUE},"
                                     f" {MAX_LOGIT_BIAS_VALUE}], not {bias}", "logit_bias")
        if not 0 <= self.min_tokens <= INT32_MAX:
            raise InvalidRequest(f"min_tokens must lie in [0, {INT32_MAX}], not {self.min_tokens}", "min_tokens")
        if len(self.stop_token_ids) > MAX_LOGIT_BIAS or not all(0 <= t <= INT32_MAX for t in self.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids: at most {MAX_LOGIT_BIAS} ids in [0, {INT32_MAX}]", "stop_token_ids")
        return self


INT32_MAX = 2**31 - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's top_logprobs bound
MAX_PENALTY = 2.0  # OpenAI's bound on frequency_penalty and presence_penalty
MAX_LOGIT_BIAS = 1024  # tokens one request's logit_bias may name
MAX_LOGIT_BIAS_VALUE = 100.0  # OpenAI's bound on a bias
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0  # (a logit of 30 / 1e-38 is inf)


def float32(x: float) -> float:
    """x as a 32-bit float holds it (what a protobuf float field carries), inf past its range."""
    try:
        return struct.unpack("f", struct.pack("f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "grammar", "choice")
MAX_CONSTRAINT_BYTES = 256 * 1024  # a constraint's text, at most (a larger one is refused, not compiled)


@dataclass(frozen=True)
class Constraint:
    """A structured-output constraint (specdec.proto's Constraint): `kind` one of CONSTRAINT_KINDS,
    `text` the schema / regex / grammar, or the choices as a JSON list ("" for json_object).
    `output_from`: the index in the session's tokens where the constrained output begins (the
    prompt's length), so that a session started again with prompt + output follows it too."""

    kind: str
    text: str = ""
    output_from: int = 0

    def validate(self) -> "Constraint":
        """Raise InvalidRequest where the kind is unknown or the text too large; return self.
        (Whether it compiles is the grammar engine's to say: model_service/grammar.py.)"""
        if self.kind not in CONSTRAINT_KINDS:
            raise InvalidRequest(f"unknown constraint kind {self.kind!r}: one of {', '.join(CONSTRAINT_KINDS)}")
        if len(self.text.encode()) > MAX_CONSTRAINT_BYTES:
            raise InvalidRequest(f"the {self.kind} constraint has {len(self.text.encode()):,} bytes; at most"
                                 f" {MAX_CONSTRAINT_BYTES:,}")
        if self.output_from < 0:
            raise InvalidRequest(f"constraint output_from must be >= 0, not {self.output_from}")
        return self

    def at(self, output_from: int) -> "Constraint":
        return Constraint(self.kind, self.text, output_from)


@dataclass
class Proposal:
    """K draft tokens and the sparse q each was sampled from (wire layout: the module docstring)."""

    tokens: list[int] = field(default_factory=list)
    support_sizes: list[int] = field(default_factory=list)
    support_ids: bytes = b""
    support_probs: bytes = b""

    def slice(self, start: int, stop: int | None = None) -> "Proposal":
        """Tokens [start:stop] with their q (ids and probabilities are 4 bytes each on the wire)."""
        stop = len(self.tokens) if stop is None else min(stop, len(self.tokens))
        a, b = 4 * sum(self.support_sizes[:start]), 4 * sum(self.support_sizes[:stop])
        return Proposal(self.tokens[start:stop], self.support_sizes[start:stop], self.support_ids[a:b],
                        self.support_probs[a:b])


FEATURE_DTYPES = ("float16", "bfloat16")


@dataclass
class Features:
    """The target's hidden states for positions start .. start + rows - 1 of a session, each row
    its feature layers' states side by side (`width` values), packed (module docstring)."""

    start: int
    rows: int
    width: int
    dtype: str = "float16"
    data: bytes = b""

    @property
    def end(self) -> int:
        return self.start + self.rows

    @property
    def row_bytes(self) -> int:
        return self.width * 2  # both dtypes are 2 bytes a value

    def check(self) -> "Features":
        """Raise InvalidRequest unless the fields agree with each other; return self."""
        if self.dtype not in FEATURE_DTYPES:
            raise InvalidRequest(f"features dtype must be one of {', '.join(FEATURE_DTYPES)}, not {self.dtype!r}")
        if len(self.data) != self.rows * self.row_bytes:
            raise InvalidRequest(f"features hold {len(self.data)} bytes, not rows x width x 2 = "
                                 f"{self.rows} x {self.width} x 2")
        return self

    def since(self, position: int) -> "Features":
        """The rows from `position` on (none where it is past the end)."""
        skip = min(max(0, position - self.start), self.rows)
        return Features(self.start + skip, self.rows - skip, self.width, self.dtype, self.data[skip * self.row_bytes:])

    def last(self, rows: int) -> "Features":
        """The last `rows` rows."""
        return self.since(self.end - rows)

    def as_bfloat16(self) -> "Features":
        """The same rows as bfloat16 (rounded to nearest even): what float16 and bfloat16 parts join as."""
        if self.dtype == "bfloat16":
            return self
        bits = np.frombuffer(self.data, dtype="<f2").astype("<f4").view("<u4").astype(np.uint64)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return Features(self.start, self.rows, self.width, "bfloat16", bits.astype("<u2").tobytes())

    @staticmethod
    def join(parts: "list[Features]") -> "Features | None":
        """Parts that overlap or follow each other as one (a later part's rows replace an earlier
        one's); a part after a gap replaces what came before it."""
        parts = [p for p in parts if p.rows]
        if not parts:
            return None
        out = parts[0]
        for part in parts[1:]:
            if part.width != out.width:
                raise ValueError(f"features do not join: rows {out.start}..{out.end} then {part.start}..{part.end}"
                                 f" (widths {out.width}, {part.width})")
            if part.start > out.end:  # a gap: the rows before it no longer lead up to these
                out = part
                continue
            if part.end < out.start:  # older rows than those held, with a gap: nothing to add
                continue
            if part.dtype != out.dtype:  # one dtype a message: bfloat16 keeps the range of both
                out, part = out.as_bfloat16(), part.as_bfloat16()
            start = min(out.start, part.start)
            head = out.data[: max(0, part.start - out.start) * out.row_bytes]
            tail = out.since(part.end).data if out.end > part.end else b""
            out = Features(start, max(out.end, part.end) - start, out.width, out.dtype, head + part.data + tail)
        return out


@dataclass
class ProposeCall:
    """One session's propose call (model_service/drafting.py's contract): the delta (roll back the
    last `rollback` proposals, append the committed tokens), then up to k tokens."""

    session_id: str
    start: bool          # a new session: `append` is its prompt, `rollback` 0
    rollback: int
    append: list[int]
    k: int
    params: SamplingParams
    p_min: float = 0.0   # stop drafting at a token whose top probability is below this
    features: Features | None = None  # the target's rows new since the last call (feature-reading drafts)
    constraint: Constraint | None = None  # on start: the structured output the session follows (the draft masks q)
    trace: str = ""      # W3C traceparent of the caller's span (runtime/tracing.py; empty: untraced)


@dataclass
class VerifyCall:
    """One session's verify call: append the committed tokens, then score the proposal in one pass."""

    session_id: str
    start: bool          # a new session: `append` is its prompt
    append: list[int]
    proposal: Proposal
    params: SamplingParams
    steps: int = 1       # with no proposal: tokens to decode in this call (VerifyRequest.decode_steps)
    feature_layers: tuple[int, ...] = ()  # on start: the layers whose hidden states each answer returns
    constraint: Constraint | None = None  # on start: the structured output the session follows (p is masked)
    trace: str = ""      # as ProposeCall.trace
    drop_features: bool = False  # the session's answers carry no more feature rows from this call on
    lookup: int = 0      # with no proposal and steps > 1: each pass also verifies up to this many tokens the
    #                      target copies from the session's context (prompt lookup; VerifyRequest.lookup_tokens)
    output_from: int = 0  # on start: where the output begins in `append` (params' penalties count the tokens from it)
    # on start: score `append`'s tokens after the first with this many most likely tokens' beside each
    # (Verdict.prompt_logprobs; 0..MAX_TOP_LOGPROBS); None: not
    prompt_logprobs: int | None = None


@dataclass
class Cost:
    """What one peer call cost: time inside the service, and bytes on the wire (0 in one process);
    and the model pass it shared with other sessions' calls (batched serving)."""

    service_ms: float = 0.0
    wire_bytes: int = 0
    batch_size: int = 1     # sessions served by that pass
    batch_tokens: int = 0   # tokens it fed (target: each session's uncached tokens, a prompt included)
    pass_ms: float = 0.0    # its time on the model


@dataclass
class Logprobs:
    """For consecutive committed tokens: each one's log-probability under the target's distribution at
    its position (log-softmax of the model's logits, a constraint's mask applied, before temperature,
    top-k and top-p: the model's own figures, as vLLM reports by default), and the `top` most likely
    tokens there, most likely first (top_ids / top_values: `top` entries a token, in its order; a
    masked-out token's value is -inf)."""

    top: int = 0
    values: list[float] = field(default_factory=list)
    top_ids: list[int] = field(default_factory=list)
    top_values: list[float] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.values)

    def slice(self, start: int, stop: int | None = None) -> "Logprobs":
        stop = len(self.values) if stop is None else min(stop, len(self.values))
        start = min(start, stop)
        t = self.top
        return Logprobs(t, self.values[start:stop], self.top_ids[t * start : t * stop],
                        self.top_values[t * start : t * stop])

    def tops(self, i: int) -> list[tuple[int, float]]:
        """Token i's most likely tokens: (id, log-probability), most likely first."""
        t = self.top
        return list(zip(self.top_ids[t * i : t * (i + 1)], self.top_values[t * i : t * (i + 1)]))

    @staticmethod
    def join(parts: "list[Logprobs | None]") -> "Logprobs | None":
        """Consecutive parts as one (None where there are none)."""
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        if len({p.top for p in parts}) > 1:
            raise ValueError(f"logprobs do not join: top {[p.top for p in parts]}")
        return Logprobs(parts[0].top, [v for p in parts for v in p.values], [i for p in parts for i in p.top_ids],
                        [v for p in parts for v in p.top_values])

    def fault(self, tokens: int, top: int) -> str | None:
        """Why these do not answer a call that committed `tokens` tokens and asked for `top` (None: they do;
        a vocabulary smaller than `top` gives fewer)."""
        if len(self.values) != tokens or not 0 <= self.top <= top or len(self.top_ids) != self.top * tokens or \
                len(self.top_values) != self.top * tokens:
            return (f"logprobs for {len(self.values)} tokens with {len(self.top_ids)} top ids and"
                    f" {len(self.top_values)} top values (top {self.top}), for {tokens} tokens and top {top}")
        return None


@dataclass
class Verdict:
    accepted: int  # draft tokens accepted, a prefix of the proposal
    token: int     # recovered (accepted < K) or bonus (accepted == K) token
    decoded: list[int] = field(default_factory=list)  # tokens after `token` the target decoded on its own
    features: Features | None = None  # a session with feature layers: the rows this call fed and committed
    copied: int = 0  # of `token` and `decoded`, those the target copied from the context and accepted (lookup)
    # params.logprobs set: those of the committed tokens (the accepted draft tokens, `token`, `decoded`)
    logprobs: Logprobs | None = None
    # a start's call.prompt_logprobs set: those of its append[1:], each under the position before it
    prompt_logprobs: Logprobs | None = None
    cached: int = 0  # a start: append's first tokens the service took cached, not computed (prefix reuse)

    @property
    def committed(self) -> int:
        """Tokens the call committed: the accepted draft tokens, `token` and `decoded`."""
        return self.accepted + 1 + len(self.decoded)

    def logprobs_fault(self, top: int) -> str | None:
        """Why this verdict does not answer a call whose params asked for logprobs with `top` (None: it does)."""
        if self.logprobs is None:
            return "it sent no logprobs (a service older than this coordinator?)"
        return self.logprobs.fault(self.committed, top)

    def prompt_logprobs_fault(self, call: VerifyCall) -> str | None:
        """Why this verdict does not answer `call`'s prompt_logprobs (None: it does, or the call asked none)."""
        if not call.start or call.prompt_logprobs is None:
            return None
        if self.prompt_logprobs is None:
            return "it sent no prompt logprobs (a service older than this coordinator?)"
        return self.prompt_logprobs.fault(len(call.append) - 1, call.prompt_logprobs)


@dataclass(frozen=True)
class PassCost:
    """A model pass's time: ms = fixed + per_token * max(0, tokens - free_rows) + per_session *
    sessions, + multi_row where the pass feeds more than one token in all: a one-token pass
    multiplies each weight by a vector, which on CPU can stream the weights faster than any product
    over a few rows, so a linear fit alone would price a round's first draft token far below what
    it costs. free_rows: the tokens a pass carries before its products, not its weight reads, set
    its time (SmolLM2 float32 on 2 cores: one session's pass of 5 tokens costs what one of 1 does,
    while 16 sessions of 8 cost ~1.3 ms a token more); a linear fit over both would charge a verify
    of K + 1 tokens for rows it gets free, and adaptive K would draft too little."""

    fixed: float = 0.0
    per_token: float = 0.0
    per_session: float = 0.0
    multi_row: float = 0.0
    free_rows: float = 0.0  # tokens (over all sessions) a pass carries at its fixed cost: per_token applies past them

    def __call__(self, tokens: float, sessions: float) -> float:
        return (self.fixed + self.per_token * max(0.0, tokens - self.free_rows) + self.per_session * sessions
                + (self.multi_row if tokens > 1 else 0.0))

    def info(self) -> dict[str, float]:
        """As ModelInfo's pass_ms_* fields (pass_cost_from_info reads them back)."""
        return {f"pass_ms_{f.name}": getattr(self, f.name) for f in fields(self)}

    @property
    def costs_nothing(self) -> bool:
        """A method with no model (the n-gram draft): it reports no pass costs."""
        return self.fixed == self.per_token == self.per_session == 0.0


class DraftPeer(Protocol):
    async def propose(self, call: ProposeCall) -> tuple[Proposal, Cost]: ...

    async def release(self, session_id: str) -> None: ...


class TargetPeer(Protocol):
    async def verify(self, call: VerifyCall) -> tuple[Verdict, Cost]:
        """call.steps > 1 (no proposal only): the target decodes up to that many tokens on its own in
        this one call (Verdict.decoded holds those after the first), a pass each, stopping after an EOS."""

    async def release(self, session_id: str) -> None: ...


# ------------------------------------------------------------------ protobuf


def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                             seed=params.seed, logprobs=0 if params.logprobs is None else 1 + params.logprobs,
                             frequency_penalty=params.frequency_penalty, presence_penalty=params.presence_penalty,
                             logit_bias=dict(params.logit_bias),
                             repetition_penalty=0.0 if params.repetition_penalty == 1.0 else params.repetition_penalty,
                             min_tokens=params.min_tokens, stop_token_ids=params.stop_token_ids, min_p=params.min_p)


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(msg.temperature, msg.top_k, msg.top_p, msg.seed, msg.logprobs - 1 if msg.logprobs else None,
                          msg.frequency_penalty, msg.presence_penalty, tuple(sorted(msg.logit_bias.items())),
                          msg.repetition_penalty or 1.0, msg.min_tokens, tuple(msg.stop_token_ids), msg.min_p)


def logprobs_to_proto(logprobs: Logprobs | None) -> pb.Logprobs | None:
    if logprobs is None:
        return None
    return pb.Logprobs(top=logprobs.top, values=logprobs.values, top_ids=logprobs.top_ids,
                       top_values=logprobs.top_values)


def logprobs_from_proto(msg: pb.Logprobs) -> Logprobs:
    return Logprobs(msg.top, list(msg.values), list(msg.top_ids), list(msg.top_values))


def proposal_to_proto(proposal: Proposal) -> pb.DraftProposal:
    return pb.DraftProposal(tokens=proposal.tokens, support_sizes=proposal.support_sizes,
                            support_ids=proposal.support_ids, support_probs=proposal.support_probs)


def proposal_from_proto(msg: pb.DraftProposal) -> Proposal:
    return Proposal(list(msg.tokens), list(msg.support_sizes), msg.support_ids, msg.support_probs)


def features_to_proto(features: Features | None) -> pb.Features | None:
    if features is None:
        return None
    return pb.Features(start=features.start, rows=features.rows, width=features.width, dtype=features.dtype,
                       data=features.data)


def features_from_proto(msg: pb.Features) -> Features:
    return Features(msg.start, msg.rows, msg.width, msg.dtype, msg.data)


def constraint_to_proto(constraint: Constraint | None) -> pb.Constraint | None:
    if constraint is None:
        return None
    msg = pb.Constraint(output_from=constraint.output_from)
    if constraint.kind == "json_object":
        msg.json_object = True
    elif constraint.kind == "choice":
        msg.choice.choices.extend(json.loads(constraint.text))
    else:
        setattr(msg, constraint.kind, constraint.text)
    return msg


def constraint_from_proto(msg: pb.Constraint) -> Constraint | None:
    """None where the message sets no kind (a request without a constraint)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        if not msg.json_object:
            return None
        text = ""
    elif kind == "choice":
        text = json.dumps(list(msg.choice.choices))
    else:
        text = getattr(msg, kind)
    return Constraint(kind, text, msg.output_from)


def propose_call_to_proto(call: ProposeCall, turn: tuple[int, int] = (0, 0)) -> pb.ProposeRequest:
    """`turn`: the lockstep turn (id, calls) the call was let through in ((0, 0): not gated)."""
    return pb.ProposeRequest(session_id=call.session_id, start=call.start, rollback=call.rollback, append=call.append,
                             num_tokens=call.k, sampling=params_to_proto(call.params), p_min=call.p_min,
                             turn_id=turn[0], turn_size=turn[1], features=features_to_proto(call.features),
                             constraint=constraint_to_proto(call.constraint), traceparent=call.trace)


def propose_call_from_proto(msg: pb.ProposeRequest) -> ProposeCall:
    return ProposeCall(msg.session_id, msg.start, msg.rollback, list(msg.append), msg.num_tokens,
                       params_from_proto(msg.sampling), msg.p_min,
                       features_from_proto(msg.features) if msg.HasField("features") else None,
                       constraint_from_proto(msg.constraint) if msg.HasField("constraint") else None, msg.traceparent)


def verify_call_to_proto(call: VerifyCall, turn: tuple[int, int] = (0, 0)) -> pb.VerifyRequest:
    return pb.VerifyRequest(session_id=call.session_id, start=call.start, append=call.append,
                            proposal=proposal_to_proto(call.proposal), sampling=params_to_proto(call.params),
                            turn_id=turn[0], turn_size=turn[1], decode_steps=call.steps if call.steps > 1 else 0,
                            feature_layers=call.feature_layers, constraint=constraint_to_proto(call.constraint),
                            traceparent=call.trace, drop_features=call.drop_features,
                            lookup_tokens=call.lookup if call.steps > 1 else 0, output_from=call.output_from,
                            prompt_logprobs=0 if call.prompt_logprobs is None else 1 + call.prompt_logprobs)


def verify_call_from_proto(msg: pb.VerifyRequest) -> VerifyCall:
    return VerifyCall(msg.session_id, msg.start, list(msg.append), proposal_from_proto(msg.proposal),
                      params_from_proto(msg.sampling), max(1, msg.decode_steps), tuple(msg.feature_layers),
                      constraint_from_proto(msg.constraint) if msg.HasField("constraint") else None, msg.traceparent,
                      msg.drop_features, msg.lookup_tokens, msg.output_from,
                      msg.prompt_logprobs - 1 if msg.prompt_logprobs else None)


def verdict_to_proto(verdict: Verdict, cost: Cost) -> pb.VerifyResponse:
    return pb.VerifyResponse(accepted=verdict.accepted, token=verdict.token, service_ms=cost.service_ms,
                             batch_size=cost.batch_size, batch_tokens=cost.batch_tokens, pass_ms=cost.pass_ms,
                             decoded=verdict.decoded, features=features_to_proto(verdict.features),
                             copied=verdict.copied, logprobs=logprobs_to_proto(verdict.logprobs),
                             prompt_logprobs=logprobs_to_proto(verdict.prompt_logprobs),
                             cached_tokens=verdict.cached)


def verdict_from_proto(msg: pb.VerifyResponse) -> Verdict:
    return Verdict(msg.accepted, msg.token, list(msg.decoded),
                   features_from_proto(msg.features) if msg.HasField("features") else None, msg.copied,
                   logprobs_from_proto(msg.logprobs) if msg.HasField("logprobs") else None,
                   logprobs_from_proto(msg.prompt_logprobs) if msg.HasField("prompt_logprobs") else None,
                   msg.cached_tokens)


def pass_cost_from_info(info: pb.ModelInfo) -> PassCost:
    return PassCost(**{f.name: getattr(info, f"pass_ms_{f.name}") for f in fields(PassCost)})
