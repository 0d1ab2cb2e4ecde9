"""specdec.v1.Target: protobuf in -> TargetEngine.verify_many (batched across sessions) -> protobuf out."""

from __future__ import annotations

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from model_service.engines import VerifyCall
from model_service.servicer import ModelServicer
from speculative.protocol import params_from_proto, proposal_from_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Target"].full_name


class TargetServicer(ModelServicer, pb_grpc.TargetServicer):
    def run_many(self, calls: list[VerifyCall]) -> list:
        return self.engine.verify_many(calls, self.thread.waiting)  # decoding on gives way to waiting calls

    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        await self.ready(context)
        return self._reply(*await self.call(context, "verify", request.session_id, self._call(request),
                                            (request.turn_id, request.turn_size)))

    async def VerifyStream(self, requests, context):
        async for reply in self.stream(requests, context, self.Verify):
            yield reply

    async def VerifyBatch(self, request: pb.VerifyBatchRequest, context) -> pb.VerifyBatchResponse:
        replies, statuses = await self.batch(context, "verify", request.calls, self._call, self._reply,
                                             pb.VerifyResponse())
        return pb.VerifyBatchResponse(replies=replies, statuses=statuses)

    @staticmethod
    def _call(request: pb.VerifyRequest) -> VerifyCall:
        return VerifyCall(request.session_id, request.start, list(request.append),
                          proposal_from_proto(request.proposal), params_from_proto(request.sampling),
                          max(1, request.decode_steps))

    @staticmethod
    def _reply(verdict, cost) -> pb.VerifyResponse:
        return pb.VerifyResponse(accepted=verdict.accepted, token=verdict.token, service_ms=cost.service_ms,
                                 batch_size=cost.batch_size, batch_tokens=cost.batch_tokens, pass_ms=cost.pass_ms,
                                 decoded=verdict.decoded)
