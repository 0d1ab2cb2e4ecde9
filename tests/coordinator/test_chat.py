"""Chat requests: `messages` go through the target tokenizer's chat template, greedy output is the
target's own on the templated ids, and what cannot be templated is refused with a named status."""

from __future__ import annotations

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from coordinator.client import build_request, main as client_main
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

CONVERSATION = [("system", "You are terse."), ("user", "def speculative_round(draft, target):")]


def chat_reference(target_dir, conversation, n: int) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    ids = tokenizer.apply_chat_template([{"role": r, "content": c} for r, c in conversation],
                                        add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
    with torch.inference_mode():
        out = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False)
    return out[0, len(ids):].tolist()


def messages(conversation) -> list[pb.ChatMessage]:
    return [pb.ChatMessage(role=r, content=c) for r, c in conversation]


@pytest.mark.parametrize("k", [0, 4])
def test_chat_greedy_equals_target_alone_on_the_template(client, pair, k):
    _, target_dir = pair
    reply = client.Generate(pb.GenerateRequest(messages=messages(CONVERSATION), max_new_tokens=32,
                                               temperature=0.0, num_speculative_tokens=k))
    expected = chat_reference(target_dir, CONVERSATION, 32)
    eos = AutoTokenizer.from_pretrained(target_dir).eos_token_id
    if eos in expected:  # the end of turn ends the answer
        expected = expected[: expected.index(eos) + 1]
        assert reply.finish_reason == pb.FINISH_REASON_EOS
    assert list(reply.token_ids) == expected
    template_ids = AutoTokenizer.from_pretrained(target_dir).apply_chat_template(
        [{"role": r, "content": c} for r, c in CONVERSATION], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]
    assert reply.stats.prompt_tokens == len(template_ids)


def test_chat_stream_matches_unary(client):
    request = pb.GenerateRequest(messages=messages(CONVERSATION[1:]), max_new_tokens=24, temperature=0.0)
    unary = client.Generate(request)
    chunks = list(client.GenerateStream(request))
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert "".join(c.text for c in chunks) == unary.text


@pytest.mark.parametrize("request_, words", [
    (pb.GenerateRequest(prompt="x", messages=[pb.ChatMessage(role="user", content="hi")]), "prompt and messages"),
    (pb.GenerateRequest(prompt_token_ids=[1], messages=[pb.ChatMessage(role="user", content="hi")]),
     "prompt_token_ids and messages"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(content="hi")]), "messages[0] has no role"),
    (pb.GenerateRequest(messages=[pb.ChatMessage(role="wizard", content="hi")]), "unknown role wizard"),
])
def test_bad_messages_are_invalid_argument(client, request_, words):
    with pytest.raises(grpc.RpcError) as e:
        client.Generate(request_, timeout=30)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert words in e.value.details()


def test_messages_without_a_chat_template_are_failed_precondition(small_vocab_stack):
    with grpc.insecure_channel(small_vocab_stack.addr) as channel:
        with pytest.raises(grpc.RpcError) as e:
            pb_grpc.GenerationStub(channel).Generate(
                pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content="abc")]), timeout=30)
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "no chat template" in e.value.details()


def test_client_chat_flags_build_messages(stack, capsys):
    import argparse

    args = argparse.Namespace(prompt="hello", chat=False, system="Be brief.", stop=None, max_new_tokens=None,
                              temperature=None, top_p=None, top_k=None, min_p=None, seed=None,
                              num_speculative_tokens=None,
                              draft_p_min=None)
    request = build_request(args)
    assert [(m.role, m.content) for m in request.messages] == [("system", "Be brief."), ("user", "hello")]
    assert not request.prompt
    assert client_main(["--addr", stack.addr, "--chat", "-k", "2", "--temperature", "0", "--max-new-tokens", "8",
                        "hello"]) == 0
    assert capsys.readouterr().out.strip() != ""
    # a value past its field's range, or a deadline grpc would fail at once: refused as argparse refuses (exit 2,
    # the flag named), not a traceback, not DEADLINE_EXCEEDED
    for flags, named in ((["--seed", "-1"], "--seed -1"), (["--max-new-tokens", str(2**31)], "--max-new-tokens"),
                         (["--timeout", "inf"], "--timeout"), (["--timeout", "0"], "--timeout")):
        with pytest.raises(SystemExit) as refused:
            client_main(["--addr", stack.addr, *flags, "hello"])
        assert refused.value.code == 2 and named in capsys.readouterr().err, flags
