"""specdec.v1.Generation: validate a request, run speculative rounds, stream the text."""

from __future__ import annotations

import asyncio
import contextlib
import math
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
from transformers import AutoTokenizer

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.adaptive import AcceptanceK, AdaptiveK, CostModel, FixedK, PassCost
from speculative.lockstep import GatedDraft, GatedTarget, PhaseGate
from speculative.metrics import CoordinatorMetrics, TokenClock
from speculative.round import Stats, generate
from speculative.sampling import SamplingParams

from .failover import FailoverDraft, FailoverTarget
from .peers import PeerError, check_compatible
from .pool import Pool
from .text import TextStream

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
MAX_STOP_STRINGS = 16
PROMPT_SLACK = 4  # see _prompt_ids


@dataclass
class Limits:
    default_max_new_tokens: int = 256
    default_speculative_tokens: int = 8  # adaptive: the most K may grow to
    max_speculative_tokens: int = 16
    adaptive: bool = True  # requests without num_speculative_tokens get adaptive K
    draft_p_min: float = 0.0
    predraft: bool = False  # draft the next round while the target verifies this one
    lockstep_ms: float = 0.0  # > 0: calls reach the models in turns (speculative/lockstep.py), held this long at most


class BadRequest(ValueError):
    """INVALID_ARGUMENT: the request itself is wrong."""


class NotPossible(ValueError):
    """FAILED_PRECONDITION: a valid request this deployment cannot serve (messages without a chat template)."""


def stats_proto(stats: Stats, k: int, seed: int, prompt_tokens: int, wall_ms: float,
                adaptive: bool = False) -> pb.GenerationStats:
    return pb.GenerationStats(
        rounds=stats.rounds,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted=stats.mean_accepted,
        accepted_per_position=stats.accepted_per_position,
        wall_ms=wall_ms,
        draft_ms=stats.draft_ms,
        target_ms=stats.target_ms,
        prompt_tokens=prompt_tokens,
        generated_tokens=stats.generated_tokens,
        num_speculative_tokens=k,
        seed=seed,
        draft_calls=stats.draft_calls,
        wire_bytes=stats.wire_bytes,
        rejected_rounds=stats.rejected_rounds,
        alpha=stats.alpha,
        mean_verify_batch=stats.mean_verify_batch,
        adaptive=adaptive,
        predrafts=stats.predrafts,
        predraft_hits=stats.predraft_hits,
    )


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


def pass_cost(info: pb.ModelInfo) -> PassCost:
    return PassCost(info.pass_ms_fixed, info.pass_ms_per_token, info.pass_ms_per_session)


class GenerationServicer(pb_grpc.GenerationServicer):
    """Serves once `connect` has found a replica of both pools ready and compatible."""

    def __init__(self, draft: Pool, target: Pool, limits: Limits, metrics: CoordinatorMetrics | None = None):
        self.draft = draft
        self.target = target
        self.limits = limits
        self.tokenizer = None
        self.metrics = metrics
        self.gate = PhaseGate(limits.lockstep_ms / 1e3) if limits.lockstep_ms > 0 else None
        if metrics is not None:
            draft.latency, target.latency = metrics.propose, metrics.verify
            if self.gate is not None:
                self.gate.on_turn = metrics.lockstep_turn

    async def connect(self, timeout: float) -> None:
        """Wait for a replica of each pool, refuse an incompatible pair, load the target's tokenizer."""
        draft_info, target_info = await asyncio.gather(self.draft.start(timeout), self.target.start(timeout))
        check_compatible(draft_info, target_info)
        tokenizer_dir = await self.target.healthy()[0].peer.fetch_tokenizer()
        tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, tokenizer_dir, local_files_only=True)
        self.costs = CostModel(pass_cost(target_info), pass_cost(draft_info))
        self.max_context = min(draft_info.max_context, target_info.max_context)
        # the largest K: this coordinator's, or less where the services take fewer tokens a call
        own = self.limits.max_speculative_tokens
        self.max_k = least(own, draft_info.max_tokens_per_call, target_info.max_tokens_per_call)
        self.default_k = min(self.limits.default_speculative_tokens, self.max_k)
        self.max_draft_call = least(own, draft_info.max_tokens_per_call)  # a pre-draft asks the draft alone
        self.vocab_size = target_info.vocab_size
        self.eos_token_ids = frozenset(target_info.eos_token_ids)
        self.max_token_chars = prompt_bound(tokenizer)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        if backend is not None:  # settings a call would otherwise reset on the shared tokenizer, while others encode
            backend.no_truncation()
            backend.no_padding()
        self.tokenizer = tokenizer

    async def _ready(self, context) -> None:
        if self.tokenizer is None:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "the coordinator is still connecting to its model services")

    # ----------------------------------------------------------- validation

    async def _prompt_ids(self, request: pb.GenerateRequest) -> list[int]:
        given = [name for name, there in (("prompt", bool(request.prompt)),
                                          ("prompt_token_ids", bool(request.prompt_token_ids)),
                                          ("messages", bool(request.messages))) if there]
        if len(given) > 1:
            raise BadRequest(f"give exactly one of prompt, prompt_token_ids and messages, not {' and '.join(given)}")
        if not given:
            raise BadRequest("the prompt is empty: give prompt text, prompt_token_ids or messages")
        if request.prompt_token_ids:
            ids = list(request.prompt_token_ids)
            bad = [t for t in ids if not 0 <= t < self.vocab_size]
            if bad:
                raise BadRequest(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
            return ids
        if request.messages:
            return await self._chat_ids(request.messages)
        self._check_length(len(request.prompt), "the prompt")
        # off the event loop: encoding a long prompt must not hold up the other requests' rounds
        ids = await asyncio.to_thread(lambda: self.tokenizer(request.prompt)["input_ids"])
        if not ids:
            raise BadRequest("the prompt encodes to no tokens")
        return ids

    def _check_length(self, chars: int, what: str) -> None:
        """A text that cannot fit is refused untokenized: a prompt of a few MB takes seconds to encode.
        (PROMPT_SLACK: a normalizer may shorten the text before it is split; a chat template adds text)"""
        fits = PROMPT_SLACK * self.max_token_chars * self.max_context
        if self.max_token_chars and chars > fits:
            raise BadRequest(
                f"{what} has {chars} characters, more than the context of {self.max_context} "
                f"tokens can hold (no token of this tokenizer spans more than {self.max_token_chars} characters)")

    async def _chat_ids(self, messages) -> list[int]:
        """The conversation through the target's chat template, the assistant's turn opened."""
        if not self.tokenizer.chat_template:
            raise NotPossible("the target model has no chat template: send `prompt` or `prompt_token_ids`,"
                              " not `messages`")
        for i, m in enumerate(messages):
            if not m.role:
                raise BadRequest(f"messages[{i}] has no role (system, user or assistant)")
        self._check_length(sum(len(m.content) for m in messages), "the conversation")
        conversation = [{"role": m.role, "content": m.content} for m in messages]

        def encode() -> list[int]:
            return list(self.tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])

        try:
            return await asyncio.to_thread(encode)
        except Exception as e:  # the template's own refusals (jinja's raise_exception: roles out of order...)
            raise BadRequest(f"the chat template refused the messages: {e}") from e

    async def _resolve(self, request: pb.GenerateRequest):
        prompt = await self._prompt_ids(request)
        room = self.max_context - len(prompt)
        if room <= 0:
            raise BadRequest(
                f"the prompt has {len(prompt)} tokens; the context holds {self.max_context}, leaving no room to generate"
            )
        max_new = request.max_new_tokens if request.HasField("max_new_tokens") else min(
            self.limits.default_max_new_tokens, room)
        if max_new <= 0:
            raise BadRequest(f"max_new_tokens must be > 0, not {max_new}")
        if max_new > room:
            raise BadRequest(
                f"max_new_tokens={max_new} goes beyond the context: the prompt has {len(prompt)} tokens "
                f"and the context holds {self.max_context}, so at most {room} new tokens"
            )
        temperature = request.temperature if request.HasField("temperature") else 1.0
        if not math.isfinite(temperature) or temperature < 0:
            raise BadRequest(f"temperature must be a finite number >= 0, not {temperature}")
        top_p = request.top_p if request.HasField("top_p") else 1.0
        if not 0.0 < top_p <= 1.0:
            raise BadRequest(f"top_p must lie in (0, 1], not {top_p}")
        top_k = request.top_k if request.HasField("top_k") else 0
        if top_k < 0:
            raise BadRequest(f"top_k must be >= 0, not {top_k}")
        adaptive = self.limits.adaptive and not request.HasField("num_speculative_tokens")
        k = (request.num_speculative_tokens if request.HasField("num_speculative_tokens")
             else self.default_k)
        if not 0 <= k <= self.max_k:
            raise BadRequest(f"num_speculative_tokens must lie in [0, {self.max_k}], not {k}")
        p_min = request.draft_p_min if request.HasField("draft_p_min") else self.limits.draft_p_min
        if not 0.0 <= p_min <= 1.0:  # also NaN
            raise BadRequest(f"draft_p_min must lie in [0, 1], not {p_min}")
        if len(request.stop) > MAX_STOP_STRINGS:
            raise BadRequest(f"at most {MAX_STOP_STRINGS} stop strings, got {len(request.stop)}")
        seed = request.seed if request.HasField("seed") else random.getrandbits(63)
        if not adaptive:
            policy = FixedK(k)
        elif temperature > 0 and request.HasField("seed"):
            policy = AcceptanceK(k, self.costs)  # reads no timings: the seed reproduces the output under any load
        else:
            policy = AdaptiveK(self.costs, k)
        return prompt, max_new, SamplingParams(temperature, top_k, top_p, seed), policy, p_min, list(request.stop)

    # ----------------------------------------------------------- generation

    async def _chunks(self, request: pb.GenerateRequest, context, method: str) -> AsyncIterator[pb.GenerateChunk]:
        metrics, start, stats = self.metrics, time.perf_counter(), Stats()
        if metrics is None:
            async for chunk in self._generate(request, context, TokenClock(None), stats):
                yield chunk
            return
        status = grpc.StatusCode.UNKNOWN
        metrics.active.inc()
        try:
            async for chunk in self._generate(request, context, TokenClock(metrics), stats):
                if chunk.HasField("stats"):
                    status = grpc.StatusCode.OK
                yield chunk
        except asyncio.CancelledError:
            remaining = context.time_remaining()
            expired = remaining is not None and remaining <= 0
            status = grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
            raise
        except Exception:
            status = context.code() or grpc.StatusCode.INTERNAL  # set by context.abort
            raise
        finally:
            metrics.add_stats(stats)  # the rounds it ran, whether it finished or not
            metrics.active.dec()
            metrics.requests.labels(method, status.name).inc()
            metrics.request_latency.observe(time.perf_counter() - start)

    async def _generate(self, request: pb.GenerateRequest, context, clock: TokenClock,
                        stats: Stats) -> AsyncIterator[pb.GenerateChunk]:
        """The request's chunks; `stats` (empty) gathers its rounds as they run."""
        start = time.perf_counter()
        await self._ready(context)
        try:
            prompt, max_new, params, policy, p_min, stop = await self._resolve(request)
        except BadRequest as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except NotPossible as e:
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(e))
        text = TextStream(self.tokenizer, stop)
        finish = pb.FINISH_REASON_LENGTH
        # one replica of each pool at a time, moving to another if it fails (coordinator/failover.py)
        failover_draft, failover_target = FailoverDraft(self.draft), FailoverTarget(self.target)
        draft, target = failover_draft, failover_target
        if self.gate is not None:
            draft, target = GatedDraft(draft, self.gate), GatedTarget(target, self.gate)
            self.gate.joined()
        rounds = generate(
            draft, target, prompt, max_new_tokens=max_new, k=policy, params=params,
            eos_token_ids=self.eos_token_ids, max_context=self.max_context, stats=stats,
            session_id=uuid.uuid4().hex, p_min=p_min, predraft=self.limits.predraft,
            max_call_tokens=self.max_draft_call,
        )
        self.costs.in_flight += 1
        try:
            async with contextlib.aclosing(rounds):
                async for new in rounds:
                    ids = []
                    for token in new:
                        ids.append(token)
                        text.add(token)
                        if text.stopped:
                            finish = pb.FINISH_REASON_STOP
                            stats.generated_tokens -= len(new) - len(ids)  # the round's tokens after the stop
                            break
                    else:
                        if new and new[-1] in self.eos_token_ids:
                            finish = pb.FINISH_REASON_EOS
                    clock.tokens(len(ids))
                    yield pb.GenerateChunk(text=text.take(), token_ids=ids)
                    if finish == pb.FINISH_REASON_STOP:
                        break
        except PeerError as e:
            await context.abort(e.code, str(e))
        finally:
            self.costs.in_flight -= 1
            if self.gate is not None:
                self.gate.left()
            failover_draft.close()
            failover_target.close()
        wall_ms = (time.perf_counter() - start) * 1e3
        yield pb.GenerateChunk(
            text=text.take(final=True), finish_reason=finish,
            stats=stats_proto(stats, policy.k, params.seed, len(prompt), wall_ms, policy.adaptive),
        )

    async def GenerateStream(self, request: pb.GenerateRequest, context):
        async for chunk in self._chunks(request, context, "GenerateStream"):
            yield chunk

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        response = pb.GenerateResponse()
        pieces = []
        async for chunk in self._chunks(request, context, "Generate"):
            pieces.append(chunk.text)
            response.token_ids.extend(chunk.token_ids)
            if chunk.HasField("stats"):
                response.finish_reason = chunk.finish_reason
                response.stats.CopyFrom(chunk.stats)
        response.text = "".join(pieces)
        return response

    async def GetInfo(self, request, context) -> pb.ServerInfo:
        await self._ready(context)
        return pb.ServerInfo(
            draft=self.draft.reference, target=self.target.reference, max_context=self.max_context,
            default_max_new_tokens=self.limits.default_max_new_tokens,
            max_speculative_tokens=self.max_k,
            default_speculative_tokens=self.default_k,
            adaptive_speculation=self.limits.adaptive,
            replicas=self.draft.describe() + self.target.describe(),
        )
