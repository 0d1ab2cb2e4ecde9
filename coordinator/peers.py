"""The draft and target services as DraftPeer / TargetPeer, over gRPC."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from typing import Any, NamedTuple

import grpc

from runtime import tracing
from runtime.transport import CHANNEL_OPTIONS, open_channel
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.protocol import (Cost, Proposal, ProposeCall, Verdict, VerifyCall, propose_call_to_proto,
                                  proposal_from_proto, verdict_from_proto, verify_call_to_proto)


CODES = {code.value[0]: code for code in grpc.StatusCode}  # a batched call's status (an int) -> its code
# a service that went away is dialled again at least every half second (gRPC's default backs off to
# two minutes): one that is back serves again at once, not after the backoff
RECONNECT = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 500)]
log = logging.getLogger("specdec.peers")
# tests/faults only: a Unix socket told each moment of every per-round call (see `moment`)
FAULT_HOOK = os.environ.get("SPECDEC_FAULT_HOOK")


async def moment(peer: "Peer", point: str, start: bool) -> None:
    """Tell the fault hook that a per-round call to `peer` is at `point` (write: about to be sent;
    read: sent, its answer awaited; done: answered) and wait for its go-ahead: the fault matrix
    (tests/faults) strikes a service at an exact moment of a round, not after a sleep."""
    try:
        reader, writer = await asyncio.open_unix_connection(FAULT_HOOK)
    except OSError:  # no hook (its test has ended, or it listens only while armed): go on
        return
    try:
        writer.write(f"{peer.name} {peer.address} {point} {int(start)}\n".encode())
        await reader.readline()
    except OSError:  # the hook stopped listening before it answered: go on
        pass
    finally:
        writer.close()


async def held(deadline: asyncio.Timeout, peer: "Peer", point: str, start: bool) -> None:
    """`moment` within a call, the time it holds the call left out of the call's deadline."""
    loop = asyncio.get_running_loop()
    left = deadline.when() - loop.time()
    deadline.reschedule(None)
    await moment(peer, point, start)
    deadline.reschedule(loop.time() + left)


class TurnMethods(NamedTuple):
    """A per-round call's RPCs: as one of a batch, and alone (see Peer.turn_call)."""

    batch: Any
    batch_type: type
    unary: Any
    streaming: Any


# gRPC core's own details for a call whose connection the service dropped mid-call (it was killed
# or restarted): core reports INTERNAL, though the service never answered, so the call failed as
# one to an unavailable service does (seen when a lone target restarts during a prefill)
# seconds a per-round call is given beyond the call timeout for each token it feeds: thousands of prompt tokens
# take tens of seconds on a few CPU cores (an 8,170-token prompt's int4 prefill 30-62 s on 2 busy cores, past the
# default 60 s: the replica was taken out and the session started again elsewhere)
FEED_SECONDS = 0.02

DROPPED = ("Internal error from Core", "Received RST_STREAM", "GOAWAY received")


class PeerError(Exception):
    """A call to a model service failed; carries the status to give the client."""

    def __init__(self, peer: "Peer", code: grpc.StatusCode, details: str):
        if code == grpc.StatusCode.INTERNAL and any(words in details for words in DROPPED):
            code = grpc.StatusCode.UNAVAILABLE
        self.code, self.details = code, details
        if code == grpc.StatusCode.UNAVAILABLE:
            message = f"{peer.name} service at {peer.address} is unavailable: {details}"
        elif code == grpc.StatusCode.INVALID_ARGUMENT and details:  # the request's fault: no help in an address
            message = details
        else:
            message = f"{peer.name} service at {peer.address}: {details}"
        super().__init__(message)


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
        options = [*CHANNEL_OPTIONS, *RECONNECT]
        if credentials is not None and server_name:
            options = [*options, ("grpc.ssl_target_name_override", server_name)]
        self.channel = open_channel(address, credentials, options, aio=True)
        self.stub = self.stub_class(self.channel)
        self.info: pb.ModelInfo | None = None
        self.streams: dict[str, grpc.aio.StreamStreamCall] = {}
        self.latency = None  # a prometheus Histogram of per-round call seconds, when metrics are on
        self.batch_turns = True  # a lockstep turn's calls go to the service as one batch RPC (see turn_call)
        self.turns: dict[int, tuple[list, asyncio.Future]] = {}  # turn id -> (its calls so far, their outcomes)
        self.batched: dict[str, asyncio.Future] = {}  # session id -> the outcomes of the batch its call is in
        self.sending: set[asyncio.Task] = set()

    async def call(self, method, request, timeout: float | None = None):
        try:
            return await method(request, timeout=timeout or self.timeout)
        except grpc.aio.AioRpcError as e:
            raise self.failed(e) from None
        except Exception as e:  # noqa: BLE001 - not a status from the service (its channel closed...)
            raise self.broken(e) from None

    def deadline(self, *requests) -> float:
        """A per-round call's deadline: the call timeout, and FEED_SECONDS more for each token the requests feed
        (a long prompt's prefill is work, not a hung service)."""
        return self.timeout + FEED_SECONDS * sum(len(getattr(request, "append", ())) for request in requests)

    def failed(self, error: grpc.aio.AioRpcError) -> PeerError:
        """An RPC error of a call to this service, as the PeerError naming it."""
        return PeerError(self, error.code(), error.details() or "")

    def broken(self, error: Exception) -> PeerError:
        """A call that ended in an exception other than an RPC error, as the PeerError naming this service."""
        return PeerError(self, grpc.StatusCode.UNAVAILABLE, f"its call broke ({type(error).__name__}: {error})")

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
            return await self._unary(unary, request)
        limit = self.deadline(request)
        stream = self.streams.get(session_id)
        if stream is None:
            stream = self.streams[session_id] = streaming()
        try:
            if FAULT_HOOK:
                await moment(self, "write", request.start)
            # not asyncio.wait_for: on Python 3.11 it returns a read that completes as its caller is
            # cancelled and drops the cancel (CPython gh-86296), so a client's deadline could go
            # unnoticed and its generation run to the end
            async with asyncio.timeout(limit) as deadline:
                await stream.write(request)
                if FAULT_HOOK:
                    await held(deadline, self, "read", request.start)
                reply = await stream.read()
        except grpc.aio.AioRpcError as e:
            self.streams.pop(session_id, None)
            raise self.failed(e) from None
        except asyncio.TimeoutError:
            self.streams.pop(session_id, None)
            stream.cancel()
            raise PeerError(self, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in {limit:g} s") from None
        except asyncio.CancelledError:  # its answer, should one come, would be taken for the next call's
            self.streams.pop(session_id, None)
            stream.cancel()
            raise
        except Exception as e:  # noqa: BLE001 - the call ended under us: a write on a stream whose RPC has
            # finished (the service died between two rounds) raises InvalidStateError, not an RPC error
            self.streams.pop(session_id, None)
            stream.cancel()
            error = self.broken(e)
            if stream.done():
                ended = await stream.code()
                if ended not in (None, grpc.StatusCode.OK):
                    error = PeerError(self, ended, (await stream.details()) or str(error))
            raise error from None
        if reply is grpc.aio.EOF:  # the service ended the stream: its status says why
            self.streams.pop(session_id, None)
            raise PeerError(self, await stream.code(), await stream.details() or "stream ended")
        if FAULT_HOOK:
            await moment(self, "done", request.start)
        return reply

    async def _unary(self, unary, request):
        """A per-round call as a unary RPC."""
        limit = self.deadline(request)
        if not FAULT_HOOK:
            return await self.call(unary, request, limit)
        await moment(self, "write", request.start)
        try:
            async with asyncio.timeout(limit) as deadline:  # (a gRPC deadline would count the hook's wait)
                call = unary(request)
                await held(deadline, self, "read", request.start)
                reply = await call
        except grpc.aio.AioRpcError as e:
            raise self.failed(e) from None
        except asyncio.TimeoutError:
            raise PeerError(self, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in {limit:g} s") from None
        except Exception as e:  # noqa: BLE001 - as in `call`
            raise self.broken(e) from None
        await moment(self, "done", request.start)
        return reply

    async def round_call(self, methods: TurnMethods, request, turn: tuple[int, int]):
        """A per-round call: with the rest of its lockstep turn (see turn_call), or alone (see step)."""
        if turn[1] > 1 and self.batch_turns:
            return await self.turn_call(methods, request, turn)
        return await self.step(methods.unary, methods.streaming, request.session_id, request)

    async def turn_call(self, methods: TurnMethods, request, turn: tuple[int, int]):
        """One call of lockstep `turn` (id, calls), sent with the turn's other calls to this service
        in one batch RPC: a batch goes once all the turn's calls are in, or at the event loop's next
        pass (the gate lets a turn's callers go together; the rest went to other replicas). A batch
        of one call goes as any other call. One unary RPC for the turn instead of a message per
        call saves CPU time on both ends (docs/architecture.md, Lockstep)."""
        start = time.perf_counter()
        turn_id, size = turn
        pending = self.turns.get(turn_id)
        if pending is None:
            loop = asyncio.get_running_loop()
            pending = self.turns[turn_id] = ([], loop.create_future())
            loop.call_soon(self._send_turn, turn_id, methods)
        requests, future = pending
        index = len(requests)
        requests.append(request)
        # a release waits for the batch: a caller that gives up leaves its call in it
        self.batched[request.session_id] = future
        if len(requests) >= size:
            self._send_turn(turn_id, methods)
        try:
            outcome = (await asyncio.shield(future))[index]
        finally:
            if self.latency is not None:
                self.latency.observe(time.perf_counter() - start)
        if isinstance(outcome, BaseException):
            stream = self.streams.pop(request.session_id, None)  # from a turn of one: the session moves on
            if stream is not None:
                stream.cancel()
            raise outcome
        return outcome

    def _send_turn(self, turn_id: int, methods: TurnMethods) -> None:
        pending = self.turns.pop(turn_id, None)
        if pending is None:  # sent already
            return
        task = asyncio.ensure_future(self._send_batch(methods, *pending))
        self.sending.add(task)
        task.add_done_callback(self.sending.discard)

    async def _send_batch(self, methods: TurnMethods, requests: list, future: asyncio.Future) -> None:
        """Send a turn's calls; `future` gets each call's reply or PeerError, in order."""
        for request in requests:
            future.add_done_callback(lambda f, session_id=request.session_id: self._unbatch(session_id, f))
        try:
            future.set_result(await self._outcomes(methods, requests))
        except asyncio.CancelledError:
            future.set_exception(PeerError(self, grpc.StatusCode.CANCELLED, "the batch was cancelled"))
            future.exception()  # retrieved: its callers may have gone
            raise

    def _unbatch(self, session_id: str, future: asyncio.Future) -> None:
        if self.batched.get(session_id) is future:
            del self.batched[session_id]

    async def _outcomes(self, methods: TurnMethods, requests: list) -> list:
        if len(requests) == 1 or not self.batch_turns:
            return list(await asyncio.gather(
                *(self._step(methods.unary, methods.streaming, r.session_id, r) for r in requests),
                return_exceptions=True))
        start, limit = any(r.start for r in requests), self.deadline(*requests)
        try:
            if not FAULT_HOOK:
                reply = await methods.batch(methods.batch_type(calls=requests), timeout=limit)
            else:
                await moment(self, "write", start)
                async with asyncio.timeout(limit) as deadline:  # as in _unary
                    call = methods.batch(methods.batch_type(calls=requests))
                    await held(deadline, self, "read", start)
                    reply = await call
        except asyncio.TimeoutError:
            error = PeerError(self, grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer in {limit:g} s")
            return [error] * len(requests)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # a service from before batch RPCs
                log.warning("%s service at %s has no batch RPCs: a lockstep turn's calls go one by one",
                            self.name, self.address)
                self.batch_turns = False
                return await self._outcomes(methods, requests)
            return [self.failed(e)] * len(requests)
        except Exception as e:  # noqa: BLE001 - the channel closed...: not a status from the service
            return [self.broken(e)] * len(requests)
        if FAULT_HOOK:
            await moment(self, "done", start)
        if len(reply.replies) != len(requests) or len(reply.statuses) != len(requests):
            return [PeerError(self, grpc.StatusCode.INTERNAL, f"a batch of {len(requests)} calls got"
                              f" {len(reply.replies)} replies and {len(reply.statuses)} statuses")] * len(requests)
        return [PeerError(self, CODES.get(status.code, grpc.StatusCode.UNKNOWN), status.message) if status.code
                else answer for answer, status in zip(reply.replies, reply.statuses)]

    async def fetch_tokenizer(self, directory: str | Path) -> Path:
        """Copy the service's tokenizer files into a local directory (AutoTokenizer-loadable)."""
        out = Path(directory)
        files: dict[str, bytearray] = {}
        try:
            async for piece in self.stub.GetTokenizer(pb.TokenizerRequest(), timeout=self.timeout):
                files.setdefault(piece.name, bytearray()).extend(piece.data)
        except grpc.aio.AioRpcError as e:
            raise self.failed(e) from None
        except Exception as e:  # noqa: BLE001 - as in `call`
            raise self.broken(e) from None
        for name, data in files.items():
            (out / Path(name).name).write_bytes(bytes(data))
        return out

    async def release(self, session_id: str) -> None:
        batch = self.batched.get(session_id)
        if batch is not None:  # its call is on its way: release after it, not before
            await asyncio.wait([batch])
        stream = self.streams.pop(session_id, None)
        if stream is not None:  # ending the stream releases its session
            try:
                await stream.done_writing()
            except Exception as e:  # noqa: BLE001 - its RPC has ended already (and the session with it)
                log.debug("%s: ending the stream of %s at %s: %s", self.name, session_id, self.address, e)
                stream.cancel()  # not left half-open: the service releases a cancelled stream's sessions too
            return
        await self.call(self.stub.Release, pb.ReleaseRequest(session_id=session_id), timeout=10.0)

    async def close(self) -> None:
        await self.channel.close()


class GrpcDraft(Peer):
    name = "draft"
    stub_class = pb_grpc.DraftStub

    async def propose(self, call: ProposeCall, *, turn: tuple[int, int] = (0, 0)) -> tuple[Proposal, Cost]:
        """`turn`: the lockstep turn (id, calls) the call was let through in ((0, 0): not gated)."""
        with tracing.client_span("propose", call, **{"specdec.replica": self.address, "specdec.session": call.session_id,
                                                     "specdec.k": call.k}) as (span, call):
            request = propose_call_to_proto(call, turn)
            reply = await self.round_call(TurnMethods(self.stub.ProposeBatch, pb.ProposeBatchRequest,
                                                      self.stub.Propose, self.stub.ProposeStream), request, turn)
            proposal = proposal_from_proto(reply.proposal)
            span.set_attribute("specdec.proposed", len(proposal.tokens))
        return proposal, Cost(reply.service_ms, request.ByteSize() + reply.ByteSize(), reply.batch_size,
                              len(proposal.tokens), reply.pass_ms)


class GrpcTarget(Peer):
    name = "target"
    stub_class = pb_grpc.TargetStub

    async def verify(self, call: VerifyCall, *, turn: tuple[int, int] = (0, 0)) -> tuple[Verdict, Cost]:
        """`turn`: as GrpcDraft.propose's."""
        with tracing.client_span("verify", call, **{"specdec.replica": self.address, "specdec.session": call.session_id,
                                                    "specdec.proposed": len(call.proposal.tokens)}) as (span, call):
            request = verify_call_to_proto(call, turn)
            reply = await self.round_call(TurnMethods(self.stub.VerifyBatch, pb.VerifyBatchRequest, self.stub.Verify,
                                                      self.stub.VerifyStream), request, turn)
            span.set_attribute("specdec.accepted", reply.accepted)
        cost = Cost(reply.service_ms, request.ByteSize() + reply.ByteSize(), reply.batch_size, reply.batch_tokens,
                    reply.pass_ms)
        verdict = verdict_from_proto(reply)
        if call.params.logprobs is not None and (fault := verdict.logprobs_fault(call.params.logprobs)) is not None:
            raise PeerError(self, grpc.StatusCode.FAILED_PRECONDITION, f"asked for logprobs, {fault}")
        if (fault := verdict.prompt_logprobs_fault(call)) is not None:
            raise PeerError(self, grpc.StatusCode.FAILED_PRECONDITION, f"asked for the prompt's logprobs, {fault}")
        return verdict, cost


def check_compatible(draft: pb.ModelInfo, target: pb.ModelInfo) -> None:
    """Refuse a pair whose tokenizers or vocabularies differ: draft token ids would mean other tokens."""
    problems = []
    if draft.vocab_size != target.vocab_size:
        problems.append(f"vocabulary sizes differ ({draft.vocab_size} vs {target.vocab_size})")
    if draft.tokenizer_fingerprint != target.tokenizer_fingerprint:
        problems.append(
            f"tokenizers differ (fingerprints {draft.tokenizer_fingerprint[:12]} vs {target.tokenizer_fingerprint[:12]})"
        )
    if draft.feature_layers:  # a draft that reads the target's hidden states (an EAGLE head)
        layers = list(draft.feature_layers)
        if not target.num_hidden_layers or not target.hidden_size:
            problems.append("the draft reads the target's hidden states; this target does not say its layers (an older"
                            " service)")
        elif max(layers) >= target.num_hidden_layers:
            problems.append(f"the draft reads target layers {layers}, the target has {target.num_hidden_layers}")
        elif draft.feature_width != len(layers) * target.hidden_size:
            problems.append(f"the draft reads {draft.feature_width} feature values a position, the target's"
                            f" {len(layers)} layers give {len(layers) * target.hidden_size} (hidden size"
                            f" {target.hidden_size}): the head was made for another target")
    if problems:
        raise ValueError(
            f"draft model {draft.model_name!r} and target model {target.model_name!r} cannot be paired: "
            + "; ".join(problems)
        )


def pairing_problem(draft: pb.ModelInfo, target: pb.ModelInfo) -> str:
    """Why `draft` cannot pair with `target` (check_compatible's words), or "" where it can."""
    try:
        check_compatible(draft, target)
    except ValueError as e:
        return str(e)
    return ""


def share_cpus(draft: pb.ModelInfo, target: pb.ModelInfo) -> bool:
    """Whether the two services compute on the same cores: one machine (host_id), both on CPU, CPUs
    in common. Then the draft's work takes CPU time from the target's, whatever the pipelining."""
    return (bool(draft.host_id) and draft.host_id == target.host_id and draft.device == target.device == "cpu"
            and not set(draft.cpus).isdisjoint(target.cpus))
