"""Every bad input gets a clear status and message, and harms no other request."""

from __future__ import annotations

import time

import grpc
import pytest

from coordinator.launch import LocalStack
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

INVALID = grpc.StatusCode.INVALID_ARGUMENT
NAN = float("nan")

BAD_REQUESTS = {
    "empty prompt": dict(),
    "prompt and ids": dict(prompt="a", prompt_token_ids=[1]),
    "prompt beyond context": dict(prompt_token_ids=[5] * 600),
    "prompt fills context": dict(prompt_token_ids=[5] * 512),
    "prompt text beyond context": dict(prompt="def f(x):\n" * 400),
    "prompt text of megabytes": dict(prompt="x = 1\n" * 200_000),
    "max_new_tokens zero": dict(prompt="a", max_new_tokens=0),
    "max_new_tokens negative": dict(prompt="a", max_new_tokens=-3),
    "max_new_tokens beyond context": dict(prompt_token_ids=[5] * 10, max_new_tokens=503),
    "temperature negative": dict(prompt="a", temperature=-0.5),
    "temperature nan": dict(prompt="a", temperature=NAN),
    "temperature inf": dict(prompt="a", temperature=float("inf")),
    "top_p zero": dict(prompt="a", top_p=0.0),
    "top_p above one": dict(prompt="a", top_p=1.5),
    "top_p nan": dict(prompt="a", top_p=NAN),
    "top_k negative": dict(prompt="a", top_k=-1),
    "token id outside vocabulary": dict(prompt_token_ids=[1, 10**6]),
    "negative token id": dict(prompt_token_ids=[-1]),
    "K too large": dict(prompt="a", num_speculative_tokens=17),
    "K negative": dict(prompt="a", num_speculative_tokens=-1),
    "too many stop strings": dict(prompt="a", stop=["x"] * 17),
    "draft_p_min above one": dict(prompt="a", draft_p_min=1.5),
    "draft_p_min negative": dict(prompt="a", draft_p_min=-0.1),
    "draft_p_min nan": dict(prompt="a", draft_p_min=NAN),
}


@pytest.mark.parametrize("name", list(BAD_REQUESTS))
def test_bad_request_is_invalid_argument(client, name):
    request = pb.GenerateRequest(**BAD_REQUESTS[name])
    for call in (client.Generate, lambda r: list(client.GenerateStream(r))):
        with pytest.raises(grpc.RpcError) as err:
            call(request)
        assert err.value.code() == INVALID, (name, err.value.details())
        assert err.value.details()
    # the server is unharmed
    ok = client.Generate(pb.GenerateRequest(prompt="a", max_new_tokens=4, temperature=0.0))
    assert len(ok.token_ids) >= 1


def test_a_prompt_text_that_cannot_fit_is_refused_untokenized(client):
    """Megabytes of text take seconds to encode: a text with more characters than the context's
    tokens can span is refused by its length; a shorter one is encoded (off the event loop) and
    refused by its token count."""
    for text, says in (("x = 1\n" * 200_000, "characters"), ("def f(x):\n" * 400, "tokens; the context holds")):
        with pytest.raises(grpc.RpcError) as err:
            client.Generate(pb.GenerateRequest(prompt=text, max_new_tokens=4))
        assert err.value.code() == INVALID and says in err.value.details(), err.value.details()


def test_max_new_tokens_up_to_the_context_is_fine(client):
    reply = client.Generate(pb.GenerateRequest(prompt_token_ids=[5] * 500, max_new_tokens=12, temperature=0.0,
                                               num_speculative_tokens=8))
    assert 1 <= len(reply.token_ids) <= 12


def peer_stubs(stack):
    return (pb_grpc.DraftStub(grpc.insecure_channel(stack.draft_addr)),
            pb_grpc.TargetStub(grpc.insecure_channel(stack.target_addr)))


def proposal(tokens, sizes=None, ids=None, probs=None):
    import numpy as np

    sizes = [1] * len(tokens) if sizes is None else sizes
    ids = np.array(tokens if ids is None else ids, "<i4").tobytes()
    probs = np.array([1.0] * len(tokens) if probs is None else probs, "<f4").tobytes()
    return pb.DraftProposal(tokens=tokens, support_sizes=sizes, support_ids=ids, support_probs=probs)


def test_model_services_refuse_bad_messages(stack):
    draft, target = peer_stubs(stack)
    greedy = pb.SamplingParams(temperature=0.0, top_p=1.0)
    target.Verify(pb.VerifyRequest(session_id="bad-input", start=True, append=[1, 2, 3], sampling=greedy))
    cases = {
        grpc.StatusCode.NOT_FOUND: [pb.VerifyRequest(session_id="no-such-session", sampling=greedy)],
        grpc.StatusCode.ALREADY_EXISTS: [pb.VerifyRequest(session_id="bad-input", start=True, append=[1],
                                                          sampling=greedy)],
        INVALID: [
            pb.VerifyRequest(session_id="bad-input", proposal=proposal([10**6]), sampling=greedy),
            pb.VerifyRequest(session_id="bad-input", proposal=proposal([4], probs=[-1.0]), sampling=greedy),
            pb.VerifyRequest(session_id="bad-input", proposal=proposal([4], probs=[NAN]), sampling=greedy),
            pb.VerifyRequest(session_id="bad-input", proposal=proposal([4, 5], ids=[4, 5], probs=[0.5, 0.2],
                                                                       sizes=[2, 0]), sampling=greedy),
            pb.VerifyRequest(session_id="bad-input", proposal=proposal([4], sizes=[1], ids=[4], probs=[0.6]),
                             sampling=greedy),
            pb.VerifyRequest(session_id="bad-input", proposal=proposal([4, 5], sizes=[1]), sampling=greedy),
            pb.VerifyRequest(session_id="bad-input", proposal=proposal([4], ids=[4, 5], probs=[0.5, 0.5], sizes=[1]),
                             sampling=greedy),
            pb.VerifyRequest(session_id="bad-input", sampling=pb.SamplingParams(temperature=NAN, top_p=1.0)),
            pb.VerifyRequest(session_id="bad-input", sampling=pb.SamplingParams(temperature=1.0, top_p=0.0)),
            pb.VerifyRequest(session_id="new", start=True, append=[], sampling=greedy),
            # an id is echoed in messages, and gRPC metadata holds 8 KiB: 1 MiB would become a transport error
            pb.VerifyRequest(session_id="x" * (1 << 20), start=True, append=[1], sampling=greedy),
            pb.VerifyRequest(session_id="x" * (1 << 20), sampling=greedy),
        ],
    }
    for code, requests in cases.items():
        for request in requests:
            with pytest.raises(grpc.RpcError) as err:
                target.Verify(request)
            assert err.value.code() == code, (request, err.value.details())
    with pytest.raises(grpc.RpcError) as err:
        draft.Propose(pb.ProposeRequest(session_id="no-such-session", num_tokens=2, sampling=greedy))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        draft.Propose(pb.ProposeRequest(session_id="d", start=True, append=[1, 10**6], num_tokens=2, sampling=greedy))
    assert err.value.code() == INVALID and "vocabulary" in err.value.details()
    # the session survived all of it
    reply = target.Verify(pb.VerifyRequest(session_id="bad-input", proposal=proposal([4]), sampling=greedy))
    assert reply.accepted in (0, 1)
    assert target.Release(pb.ReleaseRequest(session_id="bad-input")).released
    assert not target.Release(pb.ReleaseRequest(session_id="bad-input")).released


def wait_released(call, request, timeout: float = 20.0, every: float = 0.1) -> None:
    """Send `request` (a session's next call, which adds a token to it: at most timeout / every of
    them, well inside the context) until it is NOT_FOUND: its session was released."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            call(request)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.NOT_FOUND, err.details()
            return
        assert time.monotonic() < deadline, f"{request.session_id} was never released"
        time.sleep(every)


def test_a_failed_stream_call_leaves_another_client_s_session_alone(stack):
    """A stream releases the sessions it used when it ends, not those its failed calls named:
    a start refused as ALREADY_EXISTS names another client's session."""
    draft, target = peer_stubs(stack)
    greedy = pb.SamplingParams(temperature=0.0, top_p=1.0)

    def propose(session_id, **kw):
        return pb.ProposeRequest(session_id=session_id, num_tokens=2, sampling=greedy, **kw)

    def verify(session_id, **kw):
        return pb.VerifyRequest(session_id=session_id, sampling=greedy, **kw)

    for stub, call, stream, request, next_call in (
            (draft, draft.Propose, draft.ProposeStream, propose, dict(rollback=2, append=[4])),
            (target, target.Verify, target.VerifyStream, verify, dict(append=[4]))):
        call(request("victim", start=True, append=[1, 2, 3]))
        with pytest.raises(grpc.RpcError) as err:  # the stream starts its own session, then the victim's
            list(stream(iter([request("stream-own", start=True, append=[1, 2, 3]),
                              request("victim", start=True, append=[1, 2, 3])])))
        assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
        # the stream's release runs after it ends, one model-thread job for all its sessions:
        # once its own session is gone, a wrong release of the victim's has happened too
        wait_released(call, request("stream-own", **next_call))
        call(request("victim", **next_call))  # the session is still there
        assert stub.Release(pb.ReleaseRequest(session_id="victim")).released


def test_unreachable_peer_is_unavailable_naming_its_address(pair):
    draft, target = pair
    with LocalStack(draft, target) as stack:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.addr))
        assert stub.Generate(pb.GenerateRequest(prompt="a", max_new_tokens=4)).token_ids
        stack.procs["target"].kill()
        stack.procs["target"].wait()
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(pb.GenerateRequest(prompt="a", max_new_tokens=4), timeout=30)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert stack.target_addr in err.value.details() and "target" in err.value.details()


def test_coordinator_refuses_a_mismatched_pair(pair, other_tokenizer_model):
    _, target = pair
    stack = LocalStack(other_tokenizer_model, target)
    with pytest.raises(RuntimeError) as err:
        stack.start(timeout=120)
    message = str(err.value)
    assert "cannot be paired" in message and "'model'" in message and "'target'" in message
    assert "tokenizers differ" in message


def test_a_batch_answers_each_call_alone(stack):
    """ProposeBatch / VerifyBatch: the good calls are served together in one pass and answer what
    the same calls alone answer; a bad call gets its own status; a batch naming a session twice
    is refused whole."""
    draft, target = peer_stubs(stack)
    greedy = pb.SamplingParams(temperature=0.0, top_p=1.0)
    prompts = {"a": [3, 1, 4, 1, 5], "b": [9, 2, 6]}

    def propose(session_id, **kw):
        return pb.ProposeRequest(session_id=session_id, num_tokens=3, sampling=greedy, **kw)

    alone = {name: draft.Propose(propose(f"alone-{name}", start=True, append=prompt))
             for name, prompt in prompts.items()}
    batch = draft.ProposeBatch(pb.ProposeBatchRequest(calls=[
        propose("batch-a", start=True, append=prompts["a"]),
        propose("no-such-session"),
        propose("batch-b", start=True, append=prompts["b"]),
    ]))
    assert [s.code for s in batch.statuses] == [0, grpc.StatusCode.NOT_FOUND.value[0], 0]
    assert "no-such-session" in batch.statuses[1].message
    assert list(batch.replies[0].proposal.tokens) == list(alone["a"].proposal.tokens)
    assert list(batch.replies[2].proposal.tokens) == list(alone["b"].proposal.tokens)
    assert batch.replies[0].batch_size == batch.replies[2].batch_size == 2  # one pass for the two

    def verify(session_id, name, **kw):
        p = alone[name].proposal
        return pb.VerifyRequest(session_id=session_id, start=True, append=prompts[name], sampling=greedy,
                                proposal=proposal(list(p.tokens)), **kw)

    one = {name: target.Verify(verify(f"alone-{name}", name)) for name in prompts}
    batch = target.VerifyBatch(pb.VerifyBatchRequest(calls=[
        verify("batch-a", "a"),
        verify("batch-b", "b"),
        pb.VerifyRequest(session_id="batch-c", start=True, append=[1], proposal=proposal([10**6]), sampling=greedy),
    ]))
    assert [s.code for s in batch.statuses] == [0, 0, INVALID.value[0]]
    assert "vocabulary" in batch.statuses[2].message
    for reply, name in zip(batch.replies, prompts):
        assert (reply.accepted, reply.token) == (one[name].accepted, one[name].token)
        assert reply.batch_size == 2
    assert batch.replies[2] == pb.VerifyResponse()

    for stub, request in ((draft.ProposeBatch, pb.ProposeBatchRequest(calls=[propose("x"), propose("x")])),
                          (target.VerifyBatch, pb.VerifyBatchRequest(calls=[pb.VerifyRequest(session_id="y")] * 2))):
        with pytest.raises(grpc.RpcError) as err:
            stub(request)
        assert err.value.code() == INVALID and "one call per session" in err.value.details()
    assert len(draft.ProposeBatch(pb.ProposeBatchRequest()).replies) == 0
    # more calls than --max-batch (32): a pass of 32 and one of the rest, all answered
    many = draft.ProposeBatch(pb.ProposeBatchRequest(calls=[propose(f"many-{i}", start=True, append=[i + 1, 2])
                                                            for i in range(40)]))
    assert [s.code for s in many.statuses] == [0] * 40
    assert sorted(r.batch_size for r in many.replies) == [8] * 8 + [32] * 32
    for i in range(40):
        assert draft.Release(pb.ReleaseRequest(session_id=f"many-{i}")).released
    for session_id in ("alone-a", "alone-b", "batch-a", "batch-b"):
        assert draft.Release(pb.ReleaseRequest(session_id=session_id)).released
        assert target.Release(pb.ReleaseRequest(session_id=session_id)).released
    assert not target.Release(pb.ReleaseRequest(session_id="batch-c")).released  # its bad call left nothing


def test_the_prompt_bound_only_where_the_tokenizer_bounds_a_token(pair):
    """A BPE token stands for no more characters than its own string; WordPiece's unknown token
    stands for a whole word, and BPE fusing unknown characters for a run of them: no bound there."""
    from tokenizers import Tokenizer, models
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from coordinator.server import prompt_bound

    bpe = AutoTokenizer.from_pretrained(pair[1])
    assert prompt_bound(bpe) == max(map(len, bpe.get_vocab())) > 1
    vocab = {"[UNK]": 0, "a": 1, "b": 2, "ab": 3}
    wordpiece = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordPiece(vocab, unk_token="[UNK]")))
    fused = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(
        models.BPE(vocab, [("a", "b")], unk_token="[UNK]", fuse_unk=True)))
    assert prompt_bound(wordpiece) == 0 and prompt_bound(fused) == 0
