"""specdec.v1.Draft: protobuf in -> the drafting method's propose_many (batched across sessions; any method of
model_service/drafting.py) -> protobuf out."""

from __future__ import annotations

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from model_service.servicer import ModelServicer
from speculative.protocol import ProposeCall, propose_call_from_proto, proposal_to_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Draft"].full_name


class DraftServicer(ModelServicer, pb_grpc.DraftServicer):
    def run_many(self, calls: list[ProposeCall]) -> list:
        return self.engine.propose_many(calls)

    async def Propose(self, request: pb.ProposeRequest, context) -> pb.ProposeResponse:
        await self.ready(context)
        call = propose_call_from_proto(request)
        return self._reply(*await self.call(context, "propose", request.session_id, call,
                                            (request.turn_id, request.turn_size)))

    async def ProposeStream(self, requests, context):
        async for reply in self.stream(requests, context, self.Propose):
            yield reply

    async def ProposeBatch(self, request: pb.ProposeBatchRequest, context) -> pb.ProposeBatchResponse:
        replies, statuses = await self.batch(context, "propose", request.calls, propose_call_from_proto, self._reply,
                                             pb.ProposeResponse())
        return pb.ProposeBatchResponse(replies=replies, statuses=statuses)

    @staticmethod
    def _reply(proposal, cost) -> pb.ProposeResponse:
        return pb.ProposeResponse(
            proposal=proposal_to_proto(proposal), service_ms=cost.service_ms, batch_size=cost.batch_size, pass_ms=cost.pass_ms,
        )
