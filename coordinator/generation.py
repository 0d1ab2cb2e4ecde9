"""The coordinator's generation core: a request in, a stream of chunks out, free of any transport.

    coordinator = Coordinator(draft_pool, target_pool, Limits(), CoordinatorMetrics())
    await coordinator.connect(timeout=300)
    async for chunk in coordinator.generate(GenerationRequest(prompt="def f(x):", max_new_tokens=32)):
        print(chunk.text, end="")

Front doors translate to and from these words and nothing more: the gRPC servicer (server.py), an
HTTP one. What they share lives here: checking a request, the speculative rounds over the two
pools (failover, the lockstep gate), stop strings, the metrics. Errors are plain exceptions whose
messages go to the client as they are:

  InvalidRequest  the request itself is wrong                           (gRPC: INVALID_ARGUMENT)
  NotPossible     a valid request this deployment cannot serve           (FAILED_PRECONDITION)
  NotReady        the coordinator is still connecting to its services    (UNAVAILABLE)
  PeerError       a model service failed (coordinator/peers.py)          (the status it carries)

Deadlines are the caller's: it cancels the iterator (or the task iterating it) when it gives up.
`deadline` only tells the metrics a cancellation at or past it from one before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import random
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

from opentelemetry import trace
from opentelemetry.context import Context
from transformers import AutoTokenizer

from runtime import tracing

from specdec.v1 import specdec_pb2 as pb

from speculative import constraints
from speculative.errors import InvalidRequest
from speculative.protocol import MAX_TOP_LOGPROBS, Constraint, Logprobs, SamplingParams, float32, pass_cost_from_info
from speculative.prediction import Prediction
from speculative.round import FixedK, KPolicy, PromptScores, Stats
from speculative.round import generate as speculative_rounds

from .adaptive import DEFAULT_ALPHA, AcceptanceK, AdaptiveK, CostModel
from .failover import FailoverDraft, FailoverTarget
from .lockstep import GatedDraft, GatedTarget, PhaseGate
from .metrics import CoordinatorMetrics, TokenClock
from .peers import PeerError, check_compatible, pairing_problem, share_cpus
from .pool import DRAFT_WAIT, Pool
from .text import TextStream

log = logging.getLogger("specdec.coordinator")

MAX_STOP_STRINGS = 16
MAX_STOP_TOKEN_IDS = 64
ADAPTIVE_MAX_K = 8  # Limits.default_speculative_tokens for a draft model
PROMPT_SLACK = 4  # see check_length


@dataclass
class Limits:
    default_max_new_tokens: int = 256
    # K where a request does not say (adaptive: the most K may grow to); None: ADAPTIVE_MAX_K for a
    # draft whose tokens cost time, every K the services take for one whose cost nothing (see connect)
    default_speculative_tokens: int | None = None
    max_speculative_tokens: int = 16
    adaptive: bool = True  # requests without num_speculative_tokens get adaptive K
    draft_p_min: float = 0.0
    predraft: bool = False  # draft the next round while the target verifies this one
    lockstep_ms: float = 0.0  # > 0: calls reach the models in turns (coordinator/lockstep.py), held this long at most
    # a round that drafts nothing asks the target for up to this many tokens in one call (one pass
    # each): the round trips of a plain decode are paid once per call, not per token (>= 1; 1: off)
    decode_steps: int = 8
    # ... and each of those passes also verifies up to this many tokens the target copies from the
    # context (prompt lookup in the target, VerifyCall.lookup; 0: off)
    target_lookup: int = 4


def patient(plan: "Plan", gated: bool) -> bool:
    """Whether a request waits for a late draft call (failover.PATIENT_BOUND): one that replays from its
    seed, whose draws depend on the proposals (sampled, under a replaying policy: a fixed K, a seeded
    one's AcceptanceK), unless the lockstep gate runs its calls (one call held there holds every
    request's turns)."""
    return plan.policy.replays and not plan.params.greedy and not gated


class NotPossible(ValueError):
    """A valid request this deployment cannot serve (messages without a chat template)."""


class NotReady(RuntimeError):
    """The coordinator has not yet found its model services."""


# ------------------------------------------------------------------ words


@dataclass
class Message:
    """One turn of a conversation: role system, user, assistant (or another the chat template knows)."""

    role: str
    content: str


@dataclass
class GenerationRequest:
    """A request as specdec.proto's GenerateRequest defines it; None: the server's default.

    Exactly one of `prompt`, `prompt_token_ids` and `messages` (a conversation, through the target's
    chat template with the assistant's turn opened)."""

    prompt: str = ""
    prompt_token_ids: list[int] = field(default_factory=list)
    messages: list[Message] = field(default_factory=list)
    max_new_tokens: int | None = None  # default: Limits.default_max_new_tokens (to_context: up to the context)
    to_context: bool = False  # without max_new_tokens, generate up to the context's end (OpenAI's chat), not 256
    temperature: float | None = None   # 0 = greedy; default 1
    top_p: float | None = None         # default 1 (off)
    top_k: int | None = None           # default 0 (off)
    min_p: float | None = None         # default 0 (off): tokens under min_p x the top's probability are cut
    seed: int | None = None            # default: a random one, reported in the summary
    stop: list[str] = field(default_factory=list)  # stop strings (not included in the text)
    num_speculative_tokens: int | None = None      # a fixed K; default: the server's (adaptive or not)
    draft_p_min: float | None = None
    ignore_eos: bool = False  # go on past end-of-sequence tokens (benchmarks; vLLM's ignore_eos)
    constraint: Constraint | None = None  # structured output (JSON schema, regex, grammar, choice)
    logprobs: int | None = None  # each token's log-probability under the target and the n most likely (Chunk.logprobs)
    frequency_penalty: float | None = None  # default 0: the target's logits (SamplingParams)
    presence_penalty: float | None = None   # default 0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    repetition_penalty: float | None = None  # default 1 (off)
    # the prompt scored: each of its tokens after the first, under the target, with the n most likely beside
    # it (the first Chunk's prompt); with it max_new_tokens may be 0 (nothing generated)
    prompt_logprobs: int | None = None
    prediction: str = ""  # the output expected (OpenAI's predicted outputs: speculative/prediction.py)...
    prediction_token_ids: list[int] = field(default_factory=list)  # ... or its token ids
    stop_token_ids: list[int] = field(default_factory=list)  # the output ends after any of these too (Finish.STOP)
    min_tokens: int | None = None  # the first this many output tokens are none of the ends (EOS, stop_token_ids)


class Finish(enum.Enum):
    LENGTH = "length"  # max_new_tokens (or the context) reached
    STOP = "stop"      # a stop string was produced
    EOS = "eos"        # the model produced an end-of-sequence token


@dataclass
class Summary:
    """How a finished request ran: its rounds' counts and what it was given."""

    stats: Stats
    num_speculative_tokens: int  # K; adaptive: its ceiling
    adaptive: bool
    seed: int
    prompt_tokens: int
    wall_ms: float


@dataclass
class Chunk:
    """Tokens new since the last chunk and their text; the last chunk alone has `finish` and `summary`."""

    token_ids: list[int]
    text: str
    finish: Finish | None = None
    summary: Summary | None = None
    logprobs: Logprobs | None = None  # the request's logprobs set: those of token_ids (an ending EOS's too)
    prompt: ScoredPrompt | None = None  # the request's prompt_logprobs set: on the first chunk
    ended: bool = False  # the last of token_ids is the EOS or stop token id that ended the generation (no text)


@dataclass
class ScoredPrompt:
    """A request's prompt as the target read it, and the logprobs of its tokens after the first (the
    request's prompt_logprobs: each under the target at the position before it, with the n most likely)."""

    token_ids: list[int]
    logprobs: Logprobs


@dataclass(frozen=True)
class Models:
    """What `connect` learned of the draft and target: all that a request is checked against."""

    tokenizer: Any              # the target's
    vocab_size: int
    eos_token_ids: frozenset[int]
    max_context: int            # what a request's prompt and new tokens may fill: the target's context, or
    #                             its --max-kv-tokens where less (no session of it may hold more)
    max_k: int                  # the largest K a request may ask for
    default_k: int              # K (adaptive: its ceiling) where a request does not say
    max_draft_call: int         # the most tokens one call asks the draft for (a pre-draft asks K + 1)
    max_token_chars: int        # prompt_bound(tokenizer)
    costs: CostModel            # the pair's pass costs, adaptive K's model, shared by all requests
    name: str = ""              # the target's model name: what clients call the model
    decode_steps: int = 1       # the most tokens a round that drafts nothing asks the target for
    feature_layers: tuple[int, ...] = ()  # the target layers the draft reads (an EAGLE head), if any
    draft_context: int = 0      # the draft's, where shorter than max_context: drafting stops there (0: as max_context)
    kv_capped: bool = False     # max_context is the target's --max-kv-tokens, under its context
    drafts: bool = True         # a draft replica was ready: False, requests decode with the target alone

    @property
    def context(self) -> str:
        """max_context in a refusal's words: the target's context, or its cap."""
        if self.kv_capped:
            return f"the target's cap of {self.max_context} tokens a session (its --max-kv-tokens)"
        return f"the context of {self.max_context} tokens"

    @property
    def holds(self) -> str:
        if self.kv_capped:
            return f"the target holds at most {self.max_context} tokens a session (its --max-kv-tokens)"
        return f"the context holds {self.max_context}"


@dataclass
class Plan:
    """A checked request, its defaults filled in."""

    prompt: list[int]
    max_new_tokens: int
    params: SamplingParams
    policy: KPolicy
    p_min: float
    stop: list[str]
    constraint: Constraint | None = None
    lookup: int = 0  # tokens a pass of a round that drafts nothing may copy (a constrained session: what it forces)
    prompt_logprobs: int | None = None  # the prompt scored (GenerationRequest.prompt_logprobs)
    prediction: list[int] = field(default_factory=list)  # the output expected, tokenized (GenerationRequest.prediction)


# ------------------------------------------------------------------ checking a request


def prompt_bound(tokenizer) -> int:
    """The most characters of text one token can stand for, where the tokenizer bounds it: a BPE
    token covers no more than its own string (its bytes, in byte-level BPE), unless unknown
    characters are fused into one token. 0 where there is no such bound (WordPiece's unknown
    token covers a whole word, Unigram can fuse unknown runs, slow tokenizers are not inspected)."""
    from tokenizers.models import BPE

    backend = getattr(tokenizer, "backend_tokenizer", None)
    model = getattr(backend, "model", None)
    if not isinstance(model, BPE) or (model.fuse_unk and model.unk_token is not None):
        return 0
    return max(map(len, tokenizer.get_vocab()), default=1)


def least(*limits: int) -> int:
    """The smallest of the limits, 0 meaning none (a service that does not report one)."""
    return min(limit for limit in limits if limit)


def check_length(chars: int, what: str, models: Models, param: str = "prompt") -> None:
    """A text that cannot fit is refused untokenized: a prompt of a few MB takes seconds to encode.
    (PROMPT_SLACK: a normalizer may shorten the text before it is split; a chat template adds text)"""
    fits = PROMPT_SLACK * models.max_token_chars * models.max_context
    if models.max_token_chars and chars > fits:
        raise InvalidRequest(
            f"{what} has {chars} characters, more than {models.context} can hold (no token of this tokenizer"
            f" spans more than {models.max_token_chars} characters)", param)


async def prompt_ids(request: GenerationRequest, models: Models) -> list[int]:
    given = [name for name, there in (("prompt", bool(request.prompt)),
                                      ("prompt_token_ids", bool(request.prompt_token_ids)),
                                      ("messages", bool(request.messages))) if there]
    if len(given) > 1:
        raise InvalidRequest(f"give exactly one of prompt, prompt_token_ids and messages, not {' and '.join(given)}",
                             given[1])
    if not given:
        raise InvalidRequest("the prompt is empty: give prompt text, prompt_token_ids or messages", "prompt")
    if request.prompt_token_ids:
        ids = list(request.prompt_token_ids)
        bad = [t for t in ids if not 0 <= t < models.vocab_size]
        if bad:
            raise InvalidRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {models.vocab_size})",
                                 "prompt_token_ids")
        return ids
    if request.messages:
        return await chat_ids(request.messages, models)
    check_length(len(request.prompt), "the prompt", models)
    # off the event loop: encoding a long prompt must not hold up the other requests' rounds
    ids = await asyncio.to_thread(lambda: models.tokenizer(request.prompt)["input_ids"])
    if not ids:
        raise InvalidRequest("the prompt encodes to no tokens", "prompt")
    return ids


async def chat_ids(messages: list[Message], models: Models) -> list[int]:
    """The conversation through the target's chat template, the assistant's turn opened."""
    tokenizer = models.tokenizer
    if not tokenizer.chat_template:
        raise NotPossible("the target model has no chat template: send `prompt` or `prompt_token_ids`,"
                          " not `messages`")
    if len(messages) > models.max_context:
        # (a template marks each message with a token or more: many short ones fit no context, and
        # rendering 100,000 of them held a core for seconds)
        raise InvalidRequest(f"{len(messages)} messages cannot fit in {models.context}",
                             "messages")
    for i, m in enumerate(messages):
        if not m.role:
            raise InvalidRequest(f"messages[{i}] has no role (system, user or assistant)", "messages")
    check_length(sum(len(m.role) + len(m.content) for m in messages), "the conversation", models, "messages")
    conversation = [{"role": m.role, "content": m.content} for m in messages]

    def encode() -> list[int]:
        return list(tokenizer.apply_chat_template(
            conversation, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])

    try:
        return await asyncio.to_thread(encode)
    except Exception as e:  # the template's own refusals (jinja's raise_exception: roles out of order...)
        raise InvalidRequest(f"the chat template refused the messages: {e}", "messages") from e


async def resolve(request: GenerationRequest, models: Models, limits: Limits) -> Plan:
    """Check the request against the models and the limits, in field order; fill in the defaults."""
    prompt = await prompt_ids(request, models)
    room = models.max_context - len(prompt)
    scoring = request.prompt_logprobs is not None
    if scoring and not 0 <= request.prompt_logprobs <= MAX_TOP_LOGPROBS:
        raise InvalidRequest(f"prompt_logprobs must lie in [0, {MAX_TOP_LOGPROBS}], not {request.prompt_logprobs}",
                             "prompt_logprobs")
    if room < 0 or room == 0 and not (scoring and request.max_new_tokens == 0):  # (a scored prompt may fill it)
        raise InvalidRequest(
            f"the prompt has {len(prompt)} tokens; {models.holds}, leaving no room to generate",
            "messages" if request.messages else "prompt_token_ids" if request.prompt_token_ids else "prompt")
    max_new = request.max_new_tokens
    if max_new is None:
        max_new = room if request.to_context else min(limits.default_max_new_tokens, room)
    if max_new < 0 or max_new == 0 and not scoring:
        raise InvalidRequest(f"max_new_tokens must be > 0 (0 only where the prompt is scored: gRPC's prompt_logprobs,"
                             f" completions' echo), not {max_new}", "max_new_tokens")
    if max_new > room:
        raise InvalidRequest(
            f"max_new_tokens={max_new} goes beyond the context: the prompt has {len(prompt)} tokens "
            f"and {models.holds}, so at most {room} new tokens", "max_new_tokens"
        )
    if request.min_tokens is not None and not 0 <= request.min_tokens <= max_new:
        raise InvalidRequest(f"min_tokens must lie in [0, max_new_tokens = {max_new}], not {request.min_tokens}",
                             "min_tokens")
    if request.min_tokens and request.constraint is not None:
        raise InvalidRequest("min_tokens cannot go with a structured-output constraint: the output ends where the"
                             " constraint is complete", "min_tokens")
    seeded = request.seed is not None
    temperature = 1.0 if request.temperature is None else request.temperature
    if temperature > 0 and float32(temperature) == 0.0:
        temperature = 0.0  # greedy, as the services read it (a float on the wire)
    if len(request.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise InvalidRequest(f"at most {MAX_STOP_TOKEN_IDS} stop token ids, got {len(request.stop_token_ids)}",
                             "stop_token_ids")
    if bad := [t for t in request.stop_token_ids if not 0 <= t < models.vocab_size]:
        raise InvalidRequest(f"stop token id {bad[0]} is outside the vocabulary [0, {models.vocab_size})",
                             "stop_token_ids")
    params = SamplingParams(
        temperature=temperature,
        top_k=0 if request.top_k is None else request.top_k,
        top_p=1.0 if request.top_p is None else request.top_p,
        min_p=0.0 if request.min_p is None else request.min_p,
        seed=request.seed if seeded else random.getrandbits(63),
        logprobs=request.logprobs,
        frequency_penalty=request.frequency_penalty or 0.0, presence_penalty=request.presence_penalty or 0.0,
        logit_bias=tuple(sorted((request.logit_bias or {}).items())),
        repetition_penalty=1.0 if request.repetition_penalty is None else request.repetition_penalty,
        min_tokens=request.min_tokens or 0,
        stop_token_ids=tuple(sorted(set(request.stop_token_ids))),
    ).validate()
    outside = [token for token, _ in params.logit_bias if token >= models.vocab_size]
    if outside:
        raise InvalidRequest(f"logit_bias names token {outside[0]}, outside the vocabulary [0, {models.vocab_size})",
                             "logit_bias")
    if params.shapes_logits:  # as the services read them (32-bit floats on the wire), in one process too
        params = replace(params, frequency_penalty=float32(params.frequency_penalty),
                         presence_penalty=float32(params.presence_penalty),
                         repetition_penalty=float32(params.repetition_penalty),
                         logit_bias=tuple((token, float32(bias)) for token, bias in params.logit_bias))
    if params.min_p:
        params = replace(params, min_p=float32(params.min_p))
    adaptive = limits.adaptive and request.num_speculative_tokens is None
    k = models.default_k if request.num_speculative_tokens is None else request.num_speculative_tokens
    if not 0 <= k <= models.max_k:
        raise InvalidRequest(f"num_speculative_tokens must lie in [0, {models.max_k}], not {k}",
                             "num_speculative_tokens")
    p_min = limits.draft_p_min if request.draft_p_min is None else request.draft_p_min
    if not 0.0 <= p_min <= 1.0:  # also NaN
        raise InvalidRequest(f"draft_p_min must lie in [0, 1], not {p_min}", "draft_p_min")
    if len(request.stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}", "stop")
    steps = 1 if limits.lockstep_ms > 0 else models.decode_steps  # a lockstep turn is one pass
    lookup = limits.target_lookup  # (a constrained session copies what its grammar forces: TargetEngine)
    if not models.drafts:  # no draft yet: K 0, under the policy the request would have (patient or not alike)
        k = 0
    if not adaptive:
        policy = FixedK(k, models.costs.decode_steps(steps))
    elif params.temperature > 0 and seeded:
        # its K reads no timings: the seed reproduces the output under any load (a K = 0 round's steps are
        # read from them once, as FixedK's: they change the round trips, not the tokens)
        policy = AcceptanceK(k, models.costs, models.costs.decode_steps(steps))
    else:
        # (its price of a K = 0 pass replays n-gram copies; a constrained session's forced ones come on top)
        policy = AdaptiveK(models.costs, k, steps, lookup if steps > 1 else 0, prompt, params.temperature > 0)
    if request.constraint is not None:
        if request.ignore_eos:
            raise InvalidRequest("ignore_eos cannot go with a structured-output constraint: the output ends where the"
                                 " constraint is complete", "ignore_eos")
        await asyncio.to_thread(constraints.check, request.constraint)  # the compiler's reason, before any service
    prediction = list(request.prediction_token_ids)
    if request.prediction and prediction:
        raise InvalidRequest("give at most one of prediction and prediction_token_ids", "prediction_token_ids")
    bad = [t for t in prediction if not 0 <= t < models.vocab_size]
    if bad:
        raise InvalidRequest(f"prediction token id {bad[0]} is outside the vocabulary [0, {models.vocab_size})",
                             "prediction_token_ids")
    if request.prediction:
        check_length(len(request.prediction), "the prediction", models, "prediction")
        prediction = await asyncio.to_thread(
            lambda: models.tokenizer(request.prediction, add_special_tokens=False)["input_ids"])
    if len(prediction) > models.max_context:
        raise InvalidRequest(f"the prediction has {len(prediction)} tokens, more than {models.context}", "prediction")
    return Plan(prompt, max_new, params, policy, p_min, list(request.stop), request.constraint, lookup,
                request.prompt_logprobs, prediction)


def outcome(error: BaseException, deadline: float | None = None) -> str:
    """How a request that raised `error` ended, for the metrics' status label: the name of the
    canonical status code (google.rpc.Code) a front door answers it with."""
    if isinstance(error, (asyncio.CancelledError, GeneratorExit)):  # the caller gave up
        return "DEADLINE_EXCEEDED" if deadline is not None and time.monotonic() >= deadline else "CANCELLED"
    if isinstance(error, InvalidRequest):
        return "INVALID_ARGUMENT"
    if isinstance(error, NotPossible):
        return "FAILED_PRECONDITION"
    if isinstance(error, NotReady):
        return "UNAVAILABLE"
    if isinstance(error, PeerError):
        return error.code.name  # the model service's status, passed on
    return "INTERNAL"


# ------------------------------------------------------------------ generating


class Coordinator:
    """Serves once `connect` has found a replica of both pools ready and compatible."""

    def __init__(self, draft: Pool, target: Pool, limits: Limits, metrics: CoordinatorMetrics | None = None):
        self.draft = draft
        self.target = target
        self.limits = limits
        self.metrics = metrics
        self.models: Models | None = None  # set by connect (and again by _drafted)
        self._drafting: asyncio.Future | None = None  # the draft pool's start, where connect went on without it
        self.running = 0  # generations begun and not yet ended (their releases begun)
        self._none_running = asyncio.Event()
        self._none_running.set()
        self.gate = PhaseGate(limits.lockstep_ms / 1e3) if limits.lockstep_ms > 0 else None
        if metrics is not None:
            draft.latency, target.latency = metrics.propose, metrics.verify
            draft.late = metrics.late_drafts
            if self.gate is not None:
                self.gate.on_turn = metrics.lockstep_turn

    async def connect(self, timeout: float, draft_wait: float = DRAFT_WAIT) -> None:
        """Wait for a replica of each pool, refuse an incompatible pair, load the target's tokenizer.
        The target must come within `timeout` s; the draft within `draft_wait` s more: a coordinator
        whose draft pool is empty or down (scaled to zero, crashing) serves without drafting, and
        drafts from when one of its replicas is ready (`_drafted`)."""
        drafting = asyncio.ensure_future(self.draft.start(math.inf))
        try:
            target_info = await self.target.start(timeout)
            # (the files only while they load: a coordinator started again and again leaves no copies behind)
            with tempfile.TemporaryDirectory(prefix="specdec-target-tokenizer-") as tokenizer_dir:
                await self.target.healthy()[0].peer.fetch_tokenizer(tokenizer_dir)
                tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, tokenizer_dir, local_files_only=True)
            await asyncio.wait([drafting], timeout=None if math.isinf(draft_wait) else draft_wait)
        except BaseException:
            drafting.cancel()
            raise
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # settings a call would otherwise reset on the shared tokenizer, while others encode
            backend.no_truncation()
            backend.no_padding()
        if drafting.done():
            draft_info = drafting.result()
            check_compatible(draft_info, target_info)  # (a pair that cannot be is refused at start-up)
        else:
            draft_info = None
            self._drafting = drafting
            # a draft replica found from now on pairs with this target, or is refused (not made the pool's
            # model, which would refuse one that pairs), and the coordinator serves on; it looks less often
            self.draft.accept = lambda info: pairing_problem(info, target_info)
            self.draft.backoff = True
            drafting.add_done_callback(self._drafted)
            log.warning("no draft replica is ready %.0f s after the target (%s): serving without drafting until one"
                        " is", draft_wait, self.draft.address)
        self.models = self._models(draft_info, target_info, tokenizer)
        if self.metrics is not None:
            self.metrics.drafting.set(self.models.drafts)

    def _drafted(self, drafting: asyncio.Future) -> None:
        """A draft replica came after `connect`: requests from now on draft (those under way go on without)."""
        self._drafting = None
        if drafting.cancelled():
            return
        if (error := drafting.exception()) is not None:
            log.error("the draft pool failed to start: serving without drafting (%s)", error)
            return
        draft_info, target_info = drafting.result(), self.target.reference
        try:
            check_compatible(draft_info, target_info)
        except ValueError as e:
            log.error("%s: serving without drafting", e)
            return
        self.models = self._models(draft_info, target_info, self.models.tokenizer)
        if self.metrics is not None:
            self.metrics.drafting.set(1)
        log.info("draft %s at %s is ready: requests draft from now on", draft_info.model_name,
                 ", ".join(self.draft.replicas))

    def _models(self, draft_info: pb.ModelInfo | None, target_info: pb.ModelInfo, tokenizer) -> Models:
        """What requests are checked against, for this pair (`draft_info` None: no draft, no drafting)."""
        drafts = draft_info is not None
        draft_info = draft_info or pb.ModelInfo()
        # the largest K: this coordinator's, or less where the services take fewer tokens a call
        own = self.limits.max_speculative_tokens
        max_k = least(own, draft_info.max_tokens_per_call, target_info.max_tokens_per_call)
        draft_cost = pass_cost_from_info(draft_info)
        shared = drafts and share_cpus(draft_info, target_info)
        if shared:
            log.info("the draft and the target share CPUs (host %s): adaptive K prices a round as the sum of"
                     " their work", draft_info.host_id[:8])
        default_k = self.limits.default_speculative_tokens
        if default_k is None:
            # a draft that costs nothing per token (the n-gram method) may propose as far as the
            # services allow: its copies come in runs, all accepted or none, and a long run's extra
            # verify tokens cost the target little (SmolLM2 fp32: K = 8 -> 16, +5.5 ms on a 45 ms pass)
            default_k = max_k if drafts and draft_cost.costs_nothing else ADAPTIVE_MAX_K
        return Models(
            tokenizer=tokenizer,
            vocab_size=target_info.vocab_size,
            eos_token_ids=frozenset(target_info.eos_token_ids),
            max_context=least(target_info.max_context, target_info.max_kv_tokens),
            kv_capped=0 < target_info.max_kv_tokens < target_info.max_context,
            max_k=max_k,
            default_k=min(default_k, max_k),
            max_draft_call=least(own, draft_info.max_tokens_per_call),  # a pre-draft asks the draft alone
            decode_steps=least(self.limits.decode_steps, target_info.max_tokens_per_call),
            max_token_chars=prompt_bound(tokenizer),
            # until rounds are seen, adaptive K assumes the acceptance the draft's card measured
            costs=CostModel(pass_cost_from_info(target_info), draft_cost,
                            alpha=draft_info.acceptance_prior or DEFAULT_ALPHA, shared_cpus=shared),
            name=target_info.model_name,
            feature_layers=tuple(draft_info.feature_layers),
            draft_context=least(draft_info.max_context, draft_info.max_kv_tokens, target_info.max_context,
                                target_info.max_kv_tokens),
            drafts=drafts,
        )

    def ready(self) -> Models:
        """What `connect` learned; NotReady until it has."""
        if self.models is None:
            raise NotReady("the coordinator is still connecting to its model services")
        return self.models

    def serving(self) -> str:
        """Why a request would be refused now ("" if it would not): connecting, or no target replica healthy (a
        coordinator whose draft pool is down serves without drafting)."""
        if self.models is None:
            return "the coordinator is still connecting to its model services"
        return "" if self.target.healthy() else f"target pool: {self.target.none_serving()}"

    async def readiness(self) -> AsyncIterator[bool]:
        """Whether a request would be served (`serving`), now and at each change: the readiness its front doors
        report (the gRPC health of its named services, HTTP /health), apart from whether the process is alive."""
        last = None
        while True:
            self.target.changed.clear()
            now = not self.serving()
            if now != last:
                yield now
                last = now
            await self.target.changed.wait()

    async def close(self, wait: float) -> None:
        """Close the pools once every generation has ended (up to `wait` s: a stopping server's cancelled
        ones end at once, having begun their sessions' releases) and those releases are answered (Pool.close)."""
        began = time.monotonic()
        try:
            await asyncio.wait_for(self._none_running.wait(), wait)
        except TimeoutError:
            log.warning("%d generations still running as the coordinator stops", self.running)
        left = max(0.0, wait - (time.monotonic() - began))
        if self._drafting is not None:
            self._drafting.cancel()
        await asyncio.gather(self.draft.close(left), self.target.close(left))

    async def check(self, request: GenerationRequest) -> None:
        """Refuse the request as generate would before its first round (InvalidRequest, NotPossible, NotReady):
        for a caller that answers before the generation starts (a background response)."""
        await resolve(request, self.ready(), self.limits)

    async def generate(self, request: GenerationRequest, method: str = "Generate",
                       deadline: float | None = None, traceparent: str = "") -> AsyncIterator[Chunk]:
        """The request's chunks, one per speculative round, then the last with its finish and summary.

        `method` names the request in the metrics (the front door's word for it); `deadline`
        (time.monotonic()) is when its caller gives up, if it does; `traceparent`: the caller's W3C
        trace context (gRPC metadata, an HTTP header), the parent of the request's span if given."""
        metrics, start, stats = self.metrics, time.perf_counter(), Stats()
        status = "UNKNOWN"
        self.running += 1
        self._none_running.clear()
        if metrics is not None:
            metrics.active.inc()
        # not the current span: a generator's context is its consumer's between yields; rounds name it
        span = tracing.tracer.start_span("generate", tracing.parent_of(traceparent), trace.SpanKind.SERVER, {
            "specdec.method": method, "specdec.max_new_tokens": request.max_new_tokens or 0})
        try:
            async with contextlib.aclosing(self._chunks(request, TokenClock(metrics), stats,
                                                        trace.set_span_in_context(span))) as chunks:
                async for chunk in chunks:
                    if chunk.summary is not None:
                        status = "OK"
                    yield chunk
        except BaseException as e:
            if status != "OK":
                status = outcome(e, deadline)
            raise
        finally:
            self.running -= 1
            if not self.running:
                self._none_running.set()
            if span.is_recording():
                span.set_attributes({"specdec.status": status, "specdec.generated_tokens": stats.generated_tokens,
                                     "specdec.rounds": stats.rounds, "specdec.draft_tokens": stats.draft_tokens,
                                     "specdec.accepted_tokens": stats.accepted_tokens})
                if status != "OK":
                    span.set_status(trace.Status(trace.StatusCode.ERROR, status))
            span.end()
            if metrics is not None:
                metrics.add_stats(stats)  # the rounds it ran, whether it finished or not
                metrics.active.dec()
                metrics.requests.labels(method, status).inc()
                metrics.request_latency.observe(time.perf_counter() - start)

    async def _chunks(self, request: GenerationRequest, clock: TokenClock, stats: Stats,
                      trace_context: Context | None = None) -> AsyncIterator[Chunk]:
        """`generate`'s chunks; `stats` (empty) gathers the rounds as they run; `trace_context`: the
        request's span."""
        start = time.perf_counter()
        models = self.ready()
        plan = await resolve(request, models, self.limits)
        # (the prompt's tail: its first token's space)
        text = TextStream(models.tokenizer, plan.stop, plan.prompt, plan.params.min_tokens)
        finish = Finish.LENGTH
        # one replica of each pool at a time, moving to another if it fails (coordinator/failover.py)
        failover_draft = FailoverDraft(self.draft, patient=patient(plan, self.gate is not None))
        # (under the lockstep gate a request waiting for a full target's room would hold the target's turn; a
        # request that replays from its seed would draw afresh in the session started again)
        failover_target = FailoverTarget(self.target, wait_for_room=self.gate is None and not patient(plan, False))
        failover_draft.prompt = failover_target.prompt = plan.prompt  # (a replica holding its prefix is preferred)
        generated: list[int] = []  # noted with the prompt at the end (pool.PrefixAffinity)
        draft, target = failover_draft, failover_target
        if self.gate is not None:
            draft, target = GatedDraft(draft, self.gate), GatedTarget(target, self.gate)
            self.gate.joined()
        ends = frozenset() if request.ignore_eos else models.eos_token_ids
        eos = ends | frozenset(request.stop_token_ids)  # (what ends the rounds)
        scored: list[Logprobs] | None = [] if plan.params.logprobs is not None else None  # each round's, in turn
        scored_prompt = PromptScores(plan.prompt_logprobs) if plan.prompt_logprobs is not None else None

        def prompt() -> ScoredPrompt | None:  # the first chunk's (once)
            nonlocal scored_prompt
            if scored_prompt is None:
                return None
            made, scored_prompt = ScoredPrompt(plan.prompt, scored_prompt.logprobs), None
            return made
        rounds = speculative_rounds(
            draft, target, plan.prompt, max_new_tokens=plan.max_new_tokens, k=plan.policy, params=plan.params,
            eos_token_ids=eos, max_context=models.max_context, draft_context=models.draft_context or None, stats=stats,
            session_id=uuid.uuid4().hex, p_min=plan.p_min, predraft=self.limits.predraft,
            max_call_tokens=models.max_draft_call, feature_layers=models.feature_layers, constraint=plan.constraint,
            trace_context=trace_context, lookup=plan.lookup, logprobs=scored, prompt_scores=scored_prompt,
            prediction=Prediction(plan.prediction, models.max_k) if plan.prediction else None,
        )
        models.costs.in_flight += 1
        try:
            async with contextlib.aclosing(rounds):
                async for new in rounds:
                    ids = []
                    for token in new:
                        ids.append(token)
                        if token in eos:  # (the round's last) it ends the output, its text not in it (vLLM's)
                            finish = Finish.EOS if token in ends else Finish.STOP
                            break
                        text.add(token)
                        if text.stopped:
                            finish = Finish.STOP
                            stats.generated_tokens -= len(new) - len(ids)  # the round's tokens after the stop
                            break
                    clock.tokens(len(ids))
                    generated += ids
                    scores = scored.pop(0).slice(0, len(ids)) if scored else None
                    yield Chunk(token_ids=ids, text=text.take(), logprobs=scores, prompt=prompt(),
                                ended=bool(ids) and ids[-1] in eos)
                    if finish is Finish.STOP:
                        break
        finally:
            models.costs.in_flight -= 1
            if self.gate is not None:
                self.gate.left()
            held = [*plan.prompt, *generated]
            for failover in (failover_draft, failover_target):
                failover.noted(held)
                failover.close()
        wall_ms = (time.perf_counter() - start) * 1e3
        summary = Summary(stats, plan.policy.k, plan.policy.adaptive, plan.params.seed, len(plan.prompt), wall_ms)
        last = text.take(final=True)
        if text.stopped:  # (a stop string that the last, unfinished character completes: it ends the text)
            finish = Finish.STOP
        yield Chunk(token_ids=[], text=last, finish=finish, summary=summary, prompt=prompt())
