"""The draft and target services as DraftPeer / TargetPeer, over gRPC."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path

import grpc

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.lockstep import TURN
from speculative.round import Cost, Proposal, Verdict
from speculative.sampling import SamplingParams
from speculative.serving import CHANNEL_OPTIONS
from speculative.transport import open_channel


CODES = {code.value[0]: code for code in grpc.StatusCode}  # a batched call's status (an int) -> its code


class PeerError(Exception):
    """A call to a model service failed; carries the status to give the client."""

    def __init__(self, peer: "Peer", code: grpc.StatusCode, details: str):
        self.code = code
        if code == grpc.StatusCode.UNAVAILABLE:
            message = f"{peer.name} service at {peer.address} is unavailable: {details}"
        else:
            message = f"{peer.name} service at {peer.address}: {details}"
        super().__init__(message)


def sampling_proto(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(
        temperature=params.temperature, top_k=params.top_k, top_p=params.top_p, seed=params.seed
    )


class Peer:
    """A channel to one model service, with the calls both kinds share.

    Per-round calls go over one bidirectional stream per session (`streaming`,
    the default: about half the cost of a unary call here, and the service
    releases the session when the stream ends) or as unary calls.

    With `credentials` the channel is TLS. The service's certificate must then name `server_name`
    when given: the host name `address` (an IP) was resolved from, e.g. a headless Service's.
    """

    name: str  # draft / target
    stub_class: type

    def __init__(self, address: str, timeout: float = 60.0, streaming: bool = True,
                 credentials: grpc.ChannelCredentials | None = None, server_name: str | None = None):
        self.address = address
        self.timeout = timeout  # per call
        self.streaming = streaming
        options = CHANNEL_OPTIONS
        if credentials is not None and server_name:
            options = [*options, ("grpc.ssl_target_name_override", server_name)]
        self.channel = open_channel(address, credentials, options, aio=True)
        self.stub = self.stub_class(self.channel)
        self.info: pb.ModelInfo | None = None
        self.streams: dict[str, grpc.aio.StreamStreamCall] = {}
        self.latency = None  # a prometheus Histogram of per-round call seconds, when metrics are on
        self.batch_turns = True  # a lockstep turn's calls go to the service as one batch RPC (see turn_call);
        # a turn of one call goes as any other call
        self.turns: dict[int, tuple[list, asyncio.Future]] = {}  # turn id -> (its calls so far, their replies)
        self.sending: set[asyncio.Task] = set()

    async def call(self, method, request, timeout: float | None = None):
        try:
            return await method(request, timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as e:
            raise PeerError(self, e.code(), e.details() or "") from None

    async def step(self, unary, streaming, session_id: str, request):
        """One per-round call for a session: on its stream, or unary."""
        if self.latency is None:
            return await self._step(unary, streaming, session_id, request)
        start = time.perf_counter()
        try:
            return await self._step(unary, streaming, session_id, request)
        finally:
            self.latency.observe(time.perf_counter() - start)

    async def _step(self, unary, streaming, session_id: str, request):
        if not self.streaming:
            return await self.call(unary, request)
        stream = self.streams.get(session_id)
        if stream is None:
            stream = self.streams[session_id] = streaming()
        try:
            await stream.write(request)
            reply = await asyncio.wait_for(stream.read(), self.timeout)
        except grpc.aio.AioRpcError as e:
            self.streams.pop(session_id, None)
            raise PeerError(self, e.code(), e.details() or "") from None
        except asyncio.TimeoutError:
            self.streams.pop(session_id, None)
            stream.cancel()
            raise PeerError(self, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in {self.timeout:.0f} s") from None
        if reply is grpc.aio.EOF:  # the service ended the stream: its status says why
            self.streams.pop(session_id, None)
            raise PeerError(self, await stream.code(), await stream.details() or "stream ended")
        return reply

    async def turn_call(self, batch_method, batch_type, request, turn: tuple[int, int]):
        """One call of lockstep `turn` (id, calls), sent with the turn's other calls to this service
        in one batch RPC: a batch goes once all the turn's calls are in, or at the event loop's next
        pass (the gate lets a turn's callers go together; the rest went to other replicas).
        One unary RPC for the turn instead of a message per call saves ~0.45 ms of CPU per call."""
        start = time.perf_counter()
        turn_id, size = turn
        pending = self.turns.get(turn_id)
        if pending is None:
            loop = asyncio.get_running_loop()
            pending = self.turns[turn_id] = ([], loop.create_future())
            loop.call_soon(self._send_turn, turn_id, batch_method, batch_type)
        requests, future = pending
        index = len(requests)
        requests.append(request)
        if len(requests) >= size:
            self._send_turn(turn_id, batch_method, batch_type)
        try:
            replies, statuses = await asyncio.shield(future)
        finally:
            if self.latency is not None:
                self.latency.observe(time.perf_counter() - start)
        status = statuses[index]
        if status.code:
            raise PeerError(self, CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message)
        return replies[index]

    def _send_turn(self, turn_id: int, batch_method, batch_type) -> None:
        pending = self.turns.pop(turn_id, None)
        if pending is None:  # sent already
            return
        requests, future = pending
        task = asyncio.ensure_future(self._send_batch(batch_method, batch_type(calls=requests), len(requests), future))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def _send_batch(self, batch_method, request, calls: int, future: asyncio.Future) -> None:
        # retrieved here, so that a batch whose callers all gave up logs no unretrieved exception
        future.add_done_callback(lambda f: f.cancelled() or f.exception())
        try:
            reply = await batch_method(request, timeout=self.timeout)
        except grpc.aio.AioRpcError as e:
            future.set_exception(PeerError(self, e.code(), e.details() or ""))
            return
        except BaseException as e:
            future.set_exception(e if isinstance(e, Exception) else PeerError(self, grpc.StatusCode.CANCELLED,
                                                                              "the batch was cancelled"))
            raise
        if len(reply.replies) != calls or len(reply.statuses) != calls:
            future.set_exception(PeerError(self, grpc.StatusCode.INTERNAL, f"a batch of {calls} calls got"
                                           f" {len(reply.replies)} replies and {len(reply.statuses)} statuses"))
            return
        future.set_result((reply.replies, reply.statuses))

    async def fetch_tokenizer(self, directory: str | Path | None = None) -> Path:
        """Copy the service's tokenizer files into a local directory (AutoTokenizer-loadable)."""
        out = Path(directory or tempfile.mkdtemp(prefix=f"specdec-{self.name}-tokenizer-"))
        files: dict[str, bytearray] = {}
        try:
            async for piece in self.stub.GetTokenizer(pb.TokenizerRequest(), timeout=self.timeout):
                files.setdefault(piece.name, bytearray()).extend(piece.data)
        except grpc.aio.AioRpcError as e:
            raise PeerError(self, e.code(), e.details() or "") from None
        for name, data in files.items():
            (out / Path(name).name).write_bytes(bytes(data))
        return out

    async def release(self, session_id: str) -> None:
        stream = self.streams.pop(session_id, None)
        if stream is not None:  # ending the stream releases its session
            await stream.done_writing()
            return
        await self.call(self.stub.Release, pb.ReleaseRequest(session_id=session_id), timeout=10.0)

    async def close(self) -> None:
        await self.channel.close()


class GrpcDraft(Peer):
    name = "draft"
    stub_class = pb_grpc.DraftStub

    async def propose(
        self, session_id: str, start: bool, rollback: int, append: list[int], k: int, params: SamplingParams,
        p_min: float = 0.0,
    ) -> tuple[Proposal, Cost]:
        turn = TURN.get()
        request = pb.ProposeRequest(session_id=session_id, start=start, rollback=rollback, append=append,
                                    num_tokens=k, sampling=sampling_proto(params), p_min=p_min,
                                    turn_id=turn[0], turn_size=turn[1])
        if turn[1] > 1 and self.batch_turns:
            reply = await self.turn_call(self.stub.ProposeBatch, pb.ProposeBatchRequest, request, turn)
        else:
            reply = await self.step(self.stub.Propose, self.stub.ProposeStream, session_id, request)
        p = reply.proposal
        proposal = Proposal(list(p.tokens), list(p.support_sizes), p.support_ids, p.support_probs)
        return proposal, Cost(reply.service_ms, request.ByteSize() + reply.ByteSize(), reply.batch_size,
                              len(proposal.tokens), reply.pass_ms)


class GrpcTarget(Peer):
    name = "target"
    stub_class = pb_grpc.TargetStub

    async def verify(
        self, session_id: str, start: bool, append: list[int], proposal: Proposal, params: SamplingParams
    ) -> tuple[Verdict, Cost]:
        turn = TURN.get()
        request = pb.VerifyRequest(
            session_id=session_id, start=start, append=append,
            proposal=pb.DraftProposal(tokens=proposal.tokens, support_sizes=proposal.support_sizes,
                                      support_ids=proposal.support_ids, support_probs=proposal.support_probs),
            sampling=sampling_proto(params), turn_id=turn[0], turn_size=turn[1],
        )
        if turn[1] > 1 and self.batch_turns:
            reply = await self.turn_call(self.stub.VerifyBatch, pb.VerifyBatchRequest, request, turn)
        else:
            reply = await self.step(self.stub.Verify, self.stub.VerifyStream, session_id, request)
        return Verdict(reply.accepted, reply.token), Cost(reply.service_ms, request.ByteSize() + reply.ByteSize(),
                                                          reply.batch_size, reply.batch_tokens, reply.pass_ms)


def check_compatible(draft: pb.ModelInfo, target: pb.ModelInfo) -> None:
    """Refuse a pair whose tokenizers or vocabularies differ: draft token ids would mean other tokens."""
    problems = []
    if draft.vocab_size != target.vocab_size:
        problems.append(f"vocabulary sizes differ ({draft.vocab_size} vs {target.vocab_size})")
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        problems.append(
            f"tokenizers differ (fingerprints {draft.tokenizer_fingerprint[:12]} vs {target.tokenizer_fingerprint[:12]})"
        )
    if problems:
        raise ValueError(
            f"draft model {draft.model_name!r} and target model {target.model_name!r} cannot be paired: "
            + "; ".join(problems)
        )
