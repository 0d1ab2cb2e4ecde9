"""specdec.v1.Target: protobuf in -> TargetEngine.verify_many (batched across sessions) -> protobuf out."""

from __future__ import annotations

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from model_service.servicer import ModelServicer
from speculative.protocol import VerifyCall, verdict_to_proto, verify_call_from_proto

SERVICE_NAME = pb.DESCRIPTOR.services_by_name["Target"].full_name


class TargetServicer(ModelServicer, pb_grpc.TargetServicer):
    def run_many(self, calls: list[VerifyCall]) -> list:
        # decoding on and a long prompt's parts give way to waiting calls
        return self.engine.verify_many(calls, self.thread.waiting, in_parts=True)

    async def Verify(self, request: pb.VerifyRequest, context) -> pb.VerifyResponse:
        await self.ready(context)
        call = verify_call_from_proto(request)
        return verdict_to_proto(*await self.call(context, "verify", request.session_id, call,
                                                 (request.turn_id, request.turn_size)))

    async def VerifyStream(self, requests, context):
        async for reply in self.stream(requests, context, self.Verify):
            yield reply

    async def VerifyBatch(self, request: pb.VerifyBatchRequest, context) -> pb.VerifyBatchResponse:
        replies, statuses = await self.batch(context, "verify", request.calls, verify_call_from_proto, verdict_to_proto,
                                             pb.VerifyResponse())
        return pb.VerifyBatchResponse(replies=replies, statuses=statuses)
