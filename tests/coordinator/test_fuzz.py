"""Property-based fuzzing (hypothesis) of the public request and of the internal Draft / Target
messages, over real gRPC: every input gets a result or a clear status — never INTERNAL or
UNKNOWN, never a hang — and afterwards every process is alive and a normal request is exact.
Each test checks that after its own fuzzing (`survived`), so none depends on the order they run in."""

from __future__ import annotations

import math

import grpc
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

# what a bad input may get; anything else (INTERNAL, UNKNOWN, DEADLINE_EXCEEDED: a hang) fails
CLEAR = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.ALREADY_EXISTS,
         grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.FAILED_PRECONDITION}
CALL_TIMEOUT = 30.0
FUZZ = settings(max_examples=120, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

INT32 = st.integers(-(2**31), 2**31 - 1)
FLOATS = st.one_of(st.floats(allow_nan=True, allow_infinity=True, width=32),
                   st.sampled_from([0.0, 1.0, 0.5, 1e-9, -0.0]))
TOKENS = st.lists(st.one_of(st.integers(0, 400), INT32), max_size=40)
TEXT = st.text(max_size=200)


def optional(strategy):
    return st.one_of(st.none(), strategy)


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    fields = {}
    if draw(st.booleans()):
        fields["prompt"] = draw(TEXT)
    if draw(st.booleans()):
        fields["prompt_token_ids"] = draw(TOKENS)
    for name, strategy in (("max_new_tokens", st.one_of(st.integers(-5, 40), INT32)), ("temperature", FLOATS),
                           ("top_p", FLOATS), ("top_k", st.one_of(st.integers(-2, 50), INT32)),
                           ("seed", st.integers(0, 2**64 - 1)),
                           ("num_speculative_tokens", st.one_of(st.integers(-2, 20), INT32)),
                           ("draft_p_min", FLOATS)):
        value = draw(optional(strategy))
        if value is not None:
            fields[name] = value
    fields["stop"] = draw(st.lists(st.text(max_size=8), max_size=20))
    return pb.GenerateRequest(**fields)


CODES = {code.value[0]: code for code in grpc.StatusCode}


def check_status(err: grpc.RpcError, request) -> None:
    assert err.code() in CLEAR, (err.code(), err.details(), request)
    assert err.details(), request


def survived(stack, client, reference) -> None:
    """No process died, no input took a replica out of the pool, and output is still exact."""
    assert all(proc.poll() is None for proc in stack.procs.values())
    log = stack.logs["coordinator"].read_text()
    # no input took a replica out of the pool (an INTERNAL would; a draft late on a loaded machine may)
    assert not [line for line in log.splitlines() if "failed a call" in line and "calls in a row" not in line]
    assert all(r.state == "serving" for r in client.GetInfo(pb.GetInfoRequest()).replicas)
    reply = client.Generate(pb.GenerateRequest(prompt="def f(x):", max_new_tokens=24, temperature=0.0,
                                               num_speculative_tokens=3))
    assert list(reply.token_ids) == reference("def f(x):", 24)


@given(request=generate_requests(), stream=st.booleans())
@FUZZ
def fuzz_public_requests(client, request, stream):
    try:
        if stream:
            chunks = list(client.GenerateStream(request, timeout=CALL_TIMEOUT))
            tokens = [t for c in chunks for t in c.token_ids]
            assert chunks and chunks[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
        else:
            reply = client.Generate(request, timeout=CALL_TIMEOUT)
            tokens = list(reply.token_ids)
            assert reply.stats.generated_tokens == len(tokens)
        assert all(t >= 0 for t in tokens)
    except grpc.RpcError as err:
        check_status(err, request)


def test_public_requests_get_a_result_or_a_clear_status(stack, client, reference):
    fuzz_public_requests(client)
    survived(stack, client, reference)


@st.composite
def proposals(draw) -> pb.DraftProposal:
    """Well-formed (support sums to 1) or not: random sizes, ids, probabilities, byte lengths."""
    tokens = draw(st.lists(st.one_of(st.integers(0, 400), INT32), max_size=10))
    if draw(st.booleans()):  # consistent: each token its own support of 1 (or a few ids)
        sizes = [draw(st.integers(1, 3)) for _ in tokens]
        ids = [t if j == 0 else draw(st.integers(0, 400)) for t, n in zip(tokens, sizes) for j in range(n)]
        probs = [1.0 / n for n in sizes for _ in range(n)]
    else:
        sizes = draw(st.lists(st.integers(-3, 5), max_size=12))
        ids = draw(st.lists(st.one_of(st.integers(0, 400), INT32), max_size=30))
        probs = draw(st.lists(FLOATS, max_size=30))
    raw_ids = np.array(ids, "<i4").tobytes()
    raw_probs = np.array(probs, "<f4").tobytes()
    if draw(st.booleans()):  # byte strings of any length, not whole int32 / float32 entries
        raw_ids = raw_ids[: draw(st.integers(0, len(raw_ids)))] + draw(st.binary(max_size=3))
        raw_probs = draw(st.binary(max_size=64)) if draw(st.booleans()) else raw_probs
    return pb.DraftProposal(tokens=tokens, support_sizes=sizes, support_ids=raw_ids, support_probs=raw_probs)


SAMPLING = st.builds(pb.SamplingParams, temperature=FLOATS, top_k=st.one_of(st.integers(-2, 50), INT32),
                     top_p=FLOATS, seed=st.integers(0, 2**64 - 1))
SESSIONS = st.sampled_from(["fuzz-a", "fuzz-b", "", "fuzz-\u00e9\u0000x"]) | st.text(max_size=20)


@given(calls=st.lists(st.tuples(
    st.sampled_from(["propose", "verify", "release"]), SESSIONS, st.booleans(), TOKENS,
    st.one_of(st.integers(0, 20), st.integers(0, 2**32 - 1)), SAMPLING, proposals(), FLOATS, st.booleans()),
    min_size=1, max_size=6))
@FUZZ
def fuzz_internal_messages(stack, calls):
    with grpc.insecure_channel(stack.draft_addr) as d, grpc.insecure_channel(stack.target_addr) as t:
        draft, target = pb_grpc.DraftStub(d), pb_grpc.TargetStub(t)
        touched = set()

        def answer(batched, call, batch_call, batch_type, request):
            if not batched:
                return call(request, timeout=CALL_TIMEOUT)
            reply = batch_call(batch_type(calls=[request]), timeout=CALL_TIMEOUT)
            status = reply.statuses[0]
            if status.code:
                assert CODES[status.code] in CLEAR and status.message, (status, request)
                return None
            return reply.replies[0]

        for kind, session, start, tokens, number, sampling, proposal, p_min, batched in calls:
            touched.add(session)
            try:
                if kind == "propose":
                    request = pb.ProposeRequest(session_id=session, start=start, append=tokens, num_tokens=number,
                                                rollback=number % 7, sampling=sampling,
                                                p_min=p_min if math.isfinite(p_min) else 0.0)
                    reply = answer(batched, draft.Propose, draft.ProposeBatch, pb.ProposeBatchRequest, request)
                    assert reply is None or len(reply.proposal.tokens) <= number
                elif kind == "verify":
                    request = pb.VerifyRequest(session_id=session, start=start, append=tokens, proposal=proposal,
                                               sampling=sampling)
                    reply = answer(batched, target.Verify, target.VerifyBatch, pb.VerifyBatchRequest, request)
                    assert reply is None or reply.accepted <= len(proposal.tokens)
                else:
                    request = pb.ReleaseRequest(session_id=session)
                    draft.Release(request, timeout=CALL_TIMEOUT)
                    target.Release(request, timeout=CALL_TIMEOUT)
            except grpc.RpcError as err:
                check_status(err, request)
        for session in touched:  # leave no session behind for the other tests
            draft.Release(pb.ReleaseRequest(session_id=session), timeout=CALL_TIMEOUT)
            target.Release(pb.ReleaseRequest(session_id=session), timeout=CALL_TIMEOUT)


def test_internal_messages_get_a_result_or_a_clear_status(stack, client, reference):
    """Propose / Verify, alone or as a batch RPC of one call (whose status is in its reply)."""
    fuzz_internal_messages(stack)
    survived(stack, client, reference)


@given(data=st.binary(max_size=256))
@FUZZ
def fuzz_undecodable_bytes(stack, data):
    for addr, method in ((stack.addr, "/specdec.v1.Generation/Generate"),
                         (stack.target_addr, "/specdec.v1.Target/Verify"),
                         (stack.target_addr, "/specdec.v1.Target/VerifyBatch"),
                         (stack.draft_addr, "/specdec.v1.Draft/Propose"),
                         (stack.draft_addr, "/specdec.v1.Draft/ProposeBatch")):
        with grpc.insecure_channel(addr) as channel:
            call = channel.unary_unary(method)  # bytes in, bytes out
            try:
                call(data, timeout=CALL_TIMEOUT)
            except grpc.RpcError as err:  # bytes protobuf cannot parse: INVALID_ARGUMENT (runtime/interceptors.py)
                check_status(err, (method, data))


def test_undecodable_bytes_are_refused_cleanly(stack, client, reference):
    """Arbitrary bytes as a request: what protobuf cannot parse is INVALID_ARGUMENT; what it can
    parse is a (strange) request like any other."""
    fuzz_undecodable_bytes(stack)
    survived(stack, client, reference)
