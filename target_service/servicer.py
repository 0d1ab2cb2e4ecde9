"""specdec.v1.Target: protobuf in -> TargetEngine.verify -> protobuf out."""

from __future__ import annotations

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.round import Proposal
from speculative.serving import ModelServicer, params_from_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Target"].full_name


class TargetServicer(ModelServicer, pb_grpc.TargetServicer):
    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        engine = await self.ready(context)
        p = request.proposal
        proposal = Proposal(list(p.tokens), list(p.support_sizes), p.support_ids, p.support_probs)
        verdict, ms = await self.call(
            context, engine.verify, request.session_id, request.start, list(request.append), proposal,
            params_from_proto(request.sampling),
        )
        return pb.VerifyResponse(accepted=verdict.accepted, token=verdict.token, service_ms=ms)

    async def VerifyStream(self, requests, context):
        async for reply in self.stream(requests, context, self.Verify):
            yield reply
