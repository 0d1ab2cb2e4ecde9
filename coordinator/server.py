"""specdec.v1.Generation over gRPC: protobuf in -> the generation core (generation.py) -> protobuf out."""

from __future__ import annotations

import contextlib
import time
from collections.abc import AsyncIterator

import grpc

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.errors import InvalidRequest, status_details
from speculative.protocol import Logprobs, constraint_from_proto, logprobs_to_proto

from .generation import Chunk, Coordinator, Finish, GenerationRequest, Message, NotPossible, NotReady, Summary
from .generation import prompt_bound as prompt_bound  # (re-exported: tests import it from here)
from .peers import PeerError

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Generation"].full_name
FINISH = {Finish.LENGTH: pb.FINISH_REASON_LENGTH, Finish.STOP: pb.FINISH_REASON_STOP, Finish.EOS: pb.FINISH_REASON_EOS}


def request_from_proto(r: pb.GenerateRequest) -> GenerationRequest:
    def optional(name: str):
        return getattr(r, name) if r.HasField(name) else None

    return GenerationRequest(
        prompt=r.prompt, prompt_token_ids=list(r.prompt_token_ids),
        messages=[Message(m.role, m.content) for m in r.messages],
        max_new_tokens=optional("max_new_tokens"), temperature=optional("temperature"), top_p=optional("top_p"),
        top_k=optional("top_k"), min_p=optional("min_p"), seed=optional("seed"), stop=list(r.stop),
        num_speculative_tokens=optional("num_speculative_tokens"), draft_p_min=optional("draft_p_min"),
        constraint=constraint_from_proto(r.constraint) if r.HasField("constraint") else None,
        logprobs=optional("logprobs"), frequency_penalty=optional("frequency_penalty"),
        presence_penalty=optional("presence_penalty"), logit_bias=dict(r.logit_bias) or None,
        repetition_penalty=optional("repetition_penalty"), prompt_logprobs=optional("prompt_logprobs"),
        prediction=r.prediction, prediction_token_ids=list(r.prediction_token_ids),
        stop_token_ids=list(r.stop_token_ids), min_tokens=optional("min_tokens"),
    )


def stats_proto(summary: Summary) -> pb.GenerationStats:
    stats = summary.stats
    return pb.GenerationStats(
        rounds=stats.rounds,
        draft_tokens=stats.draft_tokens,
        accepted_tokens=stats.accepted_tokens,
        acceptance_rate=stats.acceptance_rate,
        mean_accepted=stats.mean_accepted,
        accepted_per_position=stats.accepted_per_position,
        wall_ms=summary.wall_ms,
        draft_ms=stats.draft_ms,
        target_ms=stats.target_ms,
        prompt_tokens=summary.prompt_tokens,
        generated_tokens=stats.generated_tokens,
        num_speculative_tokens=summary.num_speculative_tokens,
        seed=summary.seed,
        draft_calls=stats.draft_calls,
        wire_bytes=stats.wire_bytes,
        rejected_rounds=stats.rejected_rounds,
        alpha=stats.alpha,
        mean_verify_batch=stats.mean_verify_batch,
        adaptive=summary.adaptive,
        predrafts=stats.predrafts,
        predraft_hits=stats.predraft_hits,
        feature_bytes=stats.feature_bytes,
        lost_draft_rounds=stats.lost_draft_rounds,
        draft_pass_ms=stats.draft_pass_ms,
        target_pass_ms=stats.target_pass_ms,
        copied_tokens=stats.copied_tokens,
        prediction_tokens=stats.prediction_tokens,
        accepted_prediction_tokens=stats.accepted_prediction_tokens,
        cached_prompt_tokens=stats.cached_prompt_tokens,
    )


def chunk_proto(chunk: Chunk) -> pb.GenerateChunk:
    made = pb.GenerateChunk(text=chunk.text, token_ids=chunk.token_ids, logprobs=logprobs_to_proto(chunk.logprobs))
    if chunk.summary is not None:
        made.finish_reason = FINISH[chunk.finish]
        made.stats.CopyFrom(stats_proto(chunk.summary))
    add_prompt(made, chunk)
    return made


def add_prompt(message: pb.GenerateChunk | pb.GenerateResponse, chunk: Chunk) -> None:
    """The scored prompt a chunk carries (its request's prompt_logprobs), onto a response or chunk."""
    if chunk.prompt is not None:
        message.prompt_token_ids.extend(chunk.prompt.token_ids)
        message.prompt_logprobs.CopyFrom(logprobs_to_proto(chunk.prompt.logprobs))


def status_code(error: InvalidRequest | NotPossible | NotReady | PeerError) -> grpc.StatusCode:
    """The status a refusal of the core is answered with."""
    if isinstance(error, PeerError):
        return error.code
    if isinstance(error, NotPossible):
        return grpc.StatusCode.FAILED_PRECONDITION
    if isinstance(error, NotReady):
        return grpc.StatusCode.UNAVAILABLE
    return grpc.StatusCode.INVALID_ARGUMENT  # InvalidRequest


class GenerationServicer(pb_grpc.GenerationServicer):
    def __init__(self, coordinator: Coordinator):
        self.coordinator = coordinator

    async def _chunks(self, request: pb.GenerateRequest, context, method: str) -> AsyncIterator[Chunk]:
        remaining = context.time_remaining()
        deadline = None if remaining is None else time.monotonic() + remaining
        metadata = dict(context.invocation_metadata() or ())
        chunks = self.coordinator.generate(request_from_proto(request), method, deadline,
                                           traceparent=metadata.get("traceparent", ""))
        try:
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    yield chunk
        except (InvalidRequest, NotPossible, NotReady, PeerError) as e:
            await context.abort(status_code(e), status_details(str(e)))

    async def GenerateStream(self, request: pb.GenerateRequest, context):
        async for chunk in self._chunks(request, context, "GenerateStream"):
            yield chunk_proto(chunk)

    async def Generate(self, request: pb.GenerateRequest, context) -> pb.GenerateResponse:
        response = pb.GenerateResponse()
        pieces, scores = [], []
        async for chunk in self._chunks(request, context, "Generate"):
            pieces.append(chunk.text)
            scores.append(chunk.logprobs)
            response.token_ids.extend(chunk.token_ids)
            add_prompt(response, chunk)
            if chunk.summary is not None:
                response.finish_reason = FINISH[chunk.finish]
                response.stats.CopyFrom(stats_proto(chunk.summary))
        response.text = "".join(pieces)
        if request.HasField("logprobs"):
            response.logprobs.CopyFrom(logprobs_to_proto(Logprobs.join(scores) or Logprobs(request.logprobs)))
        return response

    async def GetInfo(self, request, context) -> pb.ServerInfo:
        coordinator = self.coordinator
        try:
            models = coordinator.ready()
        except NotReady as e:
            await context.abort(status_code(e), status_details(str(e)))
        return pb.ServerInfo(
            draft=coordinator.draft.reference if models.drafts else None, target=coordinator.target.reference,
            max_context=models.max_context,
            default_max_new_tokens=coordinator.limits.default_max_new_tokens,
            max_speculative_tokens=models.max_k,
            default_speculative_tokens=models.default_k,
            adaptive_speculation=coordinator.limits.adaptive,
            replicas=coordinator.draft.describe() + coordinator.target.describe(),
            acceptance=models.costs.alpha,
        )
