"""specdec.v1.Draft: protobuf in -> DraftEngine.propose -> protobuf out."""

from __future__ import annotations

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.serving import ModelServicer, params_from_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Draft"].full_name


class DraftServicer(ModelServicer, pb_grpc.DraftServicer):
    async def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        engine = await self.ready(context)
        proposal, ms = await self.call(
            context, engine.propose, request.session_id, request.start, request.rollback,
            list(request.append), request.num_tokens, params_from_proto(request.sampling),
        )
        return pb.ProposeResponse(
            proposal=pb.DraftProposal(
                tokens=proposal.tokens, support_sizes=proposal.support_sizes,
                support_ids=proposal.support_ids, support_probs=proposal.support_probs,
            ),
            service_ms=ms,
        )

    async def ProposeStream(self, requests, context):
        async for reply in self.stream(requests, context, self.Propose):
            yield reply
