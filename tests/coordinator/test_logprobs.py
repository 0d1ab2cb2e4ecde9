"""Log-probabilities (speculative/protocol.py Logprobs, coordinator/logprobs.py): each generated token's
is the target's at its position whatever the speculation (a draft's K, a K = 0 decode, copies), the
model's own log-softmax before temperature; OpenAI's chat and completions objects carry them, unary
and streamed, and bad values are 400 naming the field."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from coordinator.generation import ScoredPrompt
from coordinator.launch import LocalStack
from coordinator.logprobs import NEVER, ChoiceLogprobs, TokenText
from model_service.engines import DraftEngine, TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from speculative.errors import InvalidRequest
from speculative.protocol import (Logprobs, SamplingParams, Verdict, verdict_from_proto, verdict_to_proto,
                                  Cost, params_from_proto, params_to_proto)
from speculative.round import FixedK, Stats, generate
from tests.coordinator.test_openai import openai_client, post

PROMPT = "def fibonacci(n):"


def reference(target_dir, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """The target's log-softmax at each generated token's position, by transformers in one pass."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : len(prompt) + len(tokens) - 1]
    return torch.log_softmax(logits.float(), -1)


def run(pair, k: int | FixedK, params: SamplingParams, max_new: int = 24, lookup: int = 0,
        draft_dir=None, prompt: str = PROMPT) -> tuple[list[int], Logprobs, list, Stats]:
    target_dir = pair[1]
    target = LocalTarget(TargetEngine(ModelRunner(target_dir)))
    draft = LocalDraft(DraftEngine(ModelRunner(draft_dir or pair[0])))
    prompt = AutoTokenizer.from_pretrained(target_dir).encode(prompt)
    stats = Stats()

    async def go():
        out, scored = [], []
        async for new in generate(draft, target, prompt, max_new_tokens=max_new, k=k, params=params, max_context=512,
                                  logprobs=scored, lookup=lookup, stats=stats):
            out += new
        return out, scored

    out, scored = asyncio.run(go())
    assert [len(s) for s in scored] == [len(s) for s in scored if s]  # (each round's, none empty)
    return out, Logprobs.join(scored), prompt, stats


# a prompt that repeats itself: a call decoding steps copies from it (lookup)
REPEATS = "a b c d e f g h a b c d e f g h a b c d e f g h a b c d"


@pytest.mark.parametrize("case", ["decode steps", "draft tokens accepted", "copies"])
def test_each_tokens_logprob_is_the_targets_own_whatever_the_speculation(pair, case):
    params = SamplingParams(0.0, logprobs=5)
    if case == "decode steps":  # K = 0, 6 tokens a call
        out, scores, prompt, stats = run(pair, FixedK(0, steps=6), params)
        assert stats.rounds < 24
    elif case == "draft tokens accepted":  # the target drafting for itself: every draft token accepted
        out, scores, prompt, stats = run(pair, 3, params, draft_dir=pair[1])
        assert stats.accepted_tokens > 12
    else:
        out, scores, prompt, stats = run(pair, FixedK(0, steps=8), params, lookup=4, prompt=REPEATS)
        assert stats.copied_tokens > 0
    assert len(scores) == len(out) == 24 and scores.top == 5
    want = reference(pair[1], prompt, out)
    got = torch.tensor(scores.values)
    assert torch.allclose(got, want[torch.arange(len(out)), torch.tensor(out)], atol=1e-4), (got, want)
    for i, token in enumerate(out):
        ids, values = zip(*scores.tops(i))
        assert ids[0] == token  # greedy: the most likely
        assert list(values) == sorted(values, reverse=True)
        assert torch.allclose(torch.tensor(values), want[i].topk(5).values, atol=1e-4)


@pytest.mark.parametrize("k", [0, 4])
def test_sampled_logprobs_are_the_models_before_temperature(pair, k):
    params = SamplingParams(1.7, top_k=8, seed=3, logprobs=0)
    out, scores, prompt, _ = run(pair, k, params)
    assert scores.top == 0 and not scores.top_ids and len(scores) == len(out)
    want = reference(pair[1], prompt, out)  # the model's log-softmax: no temperature, no top-k
    assert torch.allclose(torch.tensor(scores.values), want[torch.arange(len(out)), torch.tensor(out)], atol=1e-4)


def test_no_logprobs_unless_asked(pair):
    draft_dir, target_dir = pair
    target = LocalTarget(TargetEngine(ModelRunner(target_dir)))
    draft = LocalDraft(DraftEngine(ModelRunner(draft_dir)))

    async def go():
        scored = []
        async for _ in generate(draft, target, [1, 2, 3], max_new_tokens=6, k=2, params=SamplingParams(0.0),
                                max_context=512, logprobs=scored):
            pass
        return scored

    assert asyncio.run(go()) == []


def test_logprobs_cross_the_wire_and_refuse_what_does_not_add_up():
    params = SamplingParams(0.5, 3, 0.75, 7, logprobs=2)
    assert params_from_proto(params_to_proto(params)) == params
    assert params_from_proto(params_to_proto(SamplingParams(logprobs=0))).logprobs == 0
    assert params_from_proto(params_to_proto(SamplingParams())).logprobs is None
    scores = Logprobs(2, [-0.5, -1.25], [4, 5, 6, 7], [-0.5, -2.0, -1.25, float("-inf")])
    back = verdict_from_proto(verdict_to_proto(Verdict(1, 6, logprobs=scores), Cost()))
    assert back.logprobs == scores and back.committed == 2 and back.logprobs_fault(2) is None
    assert back.logprobs_fault(3) is None  # (a vocabulary smaller than asked gives fewer)
    assert scores.slice(1) == Logprobs(2, [-1.25], [6, 7], [-1.25, float("-inf")])
    assert Logprobs.join([scores.slice(0, 1), None, scores.slice(1)]) == scores
    assert "older" in Verdict(1, 6).logprobs_fault(2)  # a target that does not know the field
    assert Verdict(2, 6, logprobs=scores).logprobs_fault(2)  # three tokens committed, two scored
    assert Verdict(1, 6, logprobs=scores).logprobs_fault(1)  # more than asked
    assert Verdict(0, 6, logprobs=Logprobs(2, [-0.5], [4], [-0.5])).logprobs_fault(2)
    for bad in (-1, 21):
        with pytest.raises(InvalidRequest, match="top logprobs"):
            SamplingParams(logprobs=bad).validate()


class Pieces:
    """A byte-level tokenizer of five tokens: 'a', ' b', the two bytes of 'é' apart, and a special one."""

    all_special_ids = [4]

    def decode(self, ids, skip_special_tokens=False):
        return {0: "a", 1: " b", 2: "\ufffd", 3: "\ufffd", 4: "<end>"}[ids[0]]

    def convert_ids_to_tokens(self, token):
        return {0: "a", 1: "Ġb", 2: "Ã", 3: "©", 4: "<end>"}[token]


def test_openai_objects_for_chat_and_completions():
    texts = TokenText(Pieces())
    scores = Logprobs(1, [-0.25, float("-inf"), -3.0], [0, 0, 2], [-0.25, -0.5, -3.0])
    chat = ChoiceLogprobs(texts, chat=True)([0, 1, 2], scores)
    assert chat["refusal"] is None and [c["token"] for c in chat["content"]] == ["a", " b", "\ufffd"]
    assert [c["bytes"] for c in chat["content"]] == [[97], [32, 98], [0xC3]]  # the byte the token carries
    assert [c["logprob"] for c in chat["content"]] == [-0.25, NEVER, -3.0]
    assert chat["content"][1]["top_logprobs"] == [{"token": "a", "logprob": -0.5, "bytes": [97]}]
    masked = ChoiceLogprobs(texts, chat=True)([0], Logprobs(2, [-0.1], [0, 1], [-0.1, float("-inf")]))
    assert [t["token"] for t in masked["content"][0]["top_logprobs"]] == ["a"]  # a forbidden token is no candidate
    json.dumps(chat, allow_nan=False)
    view = ChoiceLogprobs(texts, chat=False)
    first, second = view([0, 1], scores.slice(0, 2)), view([2], scores.slice(2))
    assert first["tokens"] == ["a", " b"] and first["text_offset"] == [0, 1] and second["text_offset"] == [3]
    # "a bé" then "a": é's second byte starts where é does; the special token takes no room in the text
    rest = view([3, 4, 0], Logprobs(0, [-1.0, -1.0, -1.0]))
    assert rest["text_offset"] == [3, 4, 4] and rest["tokens"] == ["\ufffd", "<end>", "a"]
    # é's first byte, then not its second: U+FFFD, then the next token's text after it ("a bé" "a" "\ufffd" " b")
    assert view([2, 1], Logprobs(0, [-1.0, -1.0]))["text_offset"] == [5, 6]
    assert [c["bytes"] for c in ChoiceLogprobs(texts, chat=True)([3], Logprobs(0, [-1.0]))["content"]] == [[0xA9]]
    assert first["top_logprobs"] == [{"a": -0.25}, {"a": -0.5, " b": NEVER}]  # the sampled token beside the top
    assert list(first["top_logprobs"][1]) == ["a", " b"]  # most likely first
    assert first["token_logprobs"] == [-0.25, NEVER]
    assert ChoiceLogprobs(texts, chat=True)([0], None) is None


def test_an_echoed_prompt_that_ends_inside_a_character_offsets_the_completion_after_its_own_replacement():
    """The echo is the prompt's text decoded apart from the completion's: "a" and é's first byte read
    "a\ufffd", then the completion's first token (é's second byte) its own "\ufffd", at offset 2."""
    view = ChoiceLogprobs(TokenText(Pieces()), chat=False)
    prompt = ScoredPrompt([0, 2], Logprobs(0, [-1.0]))
    both = view([3], Logprobs(0, [-2.0]), prompt)
    assert both["tokens"] == ["a", "\ufffd", "\ufffd"] and both["text_offset"] == [0, 1, 2]
    assert both["token_logprobs"] == [None, -1.0, -2.0]


class Spaced:
    """A SentencePiece-style tokenizer (Llama 2, Mistral): its decoder drops the space that starts the
    first token it decodes, so '▁world' alone decodes to 'world'."""

    all_special_ids = []

    def decode(self, ids, skip_special_tokens=False):
        return {0: "world", 1: "!", 2: "\ufffd"}[ids[0]]

    def convert_ids_to_tokens(self, token):
        return {0: "\u2581world", 1: "!", 2: "<0xC3>"}[token]


def test_a_sentencepiece_tokens_text_keeps_the_space_it_starts_with():
    texts = TokenText(Spaced())
    assert texts(0) == (" world", [32, 119, 111, 114, 108, 100]) and texts(1) == ("!", [33])
    assert texts(2) == ("\ufffd", [0xC3])  # a byte fallback's byte, no space
    view = ChoiceLogprobs(texts, chat=False)([0, 1], Logprobs(0, [-1.0, -1.0]))
    assert view["tokens"] == [" world", "!"] and view["text_offset"] == [0, 6]


def test_an_echoed_sentencepiece_prompt_offsets_its_words_where_the_echo_has_them():
    """Echoed, a SentencePiece prompt reads as its decoder gives it, without its first word's space ("world!"):
    the first token takes no room for it, so "!" and the completion after are not one character late."""
    view = ChoiceLogprobs(TokenText(Spaced()), chat=False)
    view.said = "world!"
    both = view([0], Logprobs(0, [-2.0]), ScoredPrompt([0, 1], Logprobs(0, [-1.0])))
    assert both["tokens"] == [" world", "!", " world"] and both["text_offset"] == [0, 5, 6]  # "world! world"


@pytest.fixture(scope="module")
def api(pair, request):
    stack = LocalStack(*pair, http_port=0).start()
    request.addfinalizer(stack.stop)
    return stack


@pytest.fixture(scope="module")
def client(api):
    with openai_client(api) as made:
        yield made


MESSAGES = [{"role": "user", "content": "def speculative_round(draft, target):"}]


def test_chat_logprobs_cover_the_content_and_match_with_speculation_off(client):
    fields = dict(model="target", messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True, top_logprobs=3)
    on = client.chat.completions.create(**fields, extra_body={"num_speculative_tokens": 4})
    off = client.chat.completions.create(**fields, extra_body={"num_speculative_tokens": 0})
    content = on.choices[0].logprobs.content
    assert len(content) == on.usage.completion_tokens - (on.choices[0].finish_reason == "stop")
    # (a random model's tokens split characters: their bytes, not their texts, add up to the content)
    assert bytes(b for c in content for b in c.bytes).decode("utf-8", "replace") == on.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token and c.logprob <= 0
        assert abs(c.top_logprobs[0].logprob - c.logprob) < 1e-6
    assert [c.token for c in off.choices[0].logprobs.content] == [c.token for c in content]
    assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(off.choices[0].logprobs.content, content))
    plain = client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_streamed_logprobs_add_up_to_the_unary_ones(api, client):
    fields = dict(model="target", messages=MESSAGES, max_tokens=16, temperature=0, logprobs=True, top_logprobs=2,
                  n=2)
    whole = client.chat.completions.create(**fields)

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{api.http_url}/v1", api_key="none", max_retries=0,
                                      timeout=120) as streaming:
            got = {0: [], 1: []}
            async for event in await streaming.chat.completions.create(**fields, stream=True):
                for choice in event.choices:
                    if choice.logprobs is not None:
                        got[choice.index] += choice.logprobs.content
            return got

    got = asyncio.run(go())
    for i in (0, 1):
        want = whole.choices[i].logprobs.content
        assert [c.token for c in got[i]] == [c.token for c in want]
        assert all(abs(a.logprob - b.logprob) < 1e-4 for a, b in zip(got[i], want))


def test_completion_logprobs(client):
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=12, temperature=0.8, seed=2,
                                      logprobs=2, extra_body={"ignore_eos": True})
    lp, text = reply.choices[0].logprobs, reply.choices[0].text
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 12
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    whole = [(token, at) for token, at in zip(lp.tokens, lp.text_offset) if "\ufffd" not in token]
    assert all(text[at : at + len(token)] == token for token, at in whole) and whole
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == value and 1 <= len(top) <= 3 and value <= 0


def test_constrained_logprobs_end_before_the_end_of_sequence_and_list_only_allowed_tokens(client):
    reply = client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=40, temperature=0,
                                           logprobs=True, top_logprobs=5,
                                           extra_body={"guided_choice": ["alpha beta gamma", "delta"]})
    choice = reply.choices[0]
    assert choice.finish_reason == "stop" and choice.message.content in ("alpha beta gamma", "delta")
    content = choice.logprobs.content
    assert len(content) == reply.usage.completion_tokens - 1  # (the end-of-sequence token has none)
    assert "".join(c.token for c in content) == choice.message.content
    assert any(len(c.top_logprobs) < 5 for c in content)  # forced positions: the one allowed token
    assert all(t.logprob > NEVER for c in content for t in c.top_logprobs)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
])
def test_bad_logprobs_are_400_naming_the_field(api, path, body, param):
    base = {"model": "target", "max_tokens": 2}
    base.update({"messages": MESSAGES} if "chat" in path else {"prompt": PROMPT})
    status, reply = post(api, path, json.dumps({**base, **body}).encode(), key=None)
    assert status == 400 and reply["error"]["param"] == param, reply


def test_grpc_generate_and_stream_carry_the_same_logprobs(api):
    import grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=10, temperature=0.0, logprobs=2)
    with grpc.insecure_channel(api.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        whole = stub.Generate(request, timeout=120)
        chunks = list(stub.GenerateStream(request, timeout=120))
        plain = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=3), timeout=120)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=3, logprobs=21), timeout=120)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "logprobs" in refused.value.details()
    assert not plain.HasField("logprobs")
    assert whole.logprobs.top == 2 and len(whole.logprobs.values) == len(whole.token_ids)  # (an ending EOS's too)
    assert list(whole.logprobs.top_ids[::2]) == list(whole.token_ids)  # greedy: the top
    streamed = [v for c in chunks for v in c.logprobs.values]
    assert streamed == list(whole.logprobs.values)
