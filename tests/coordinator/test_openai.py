"""The OpenAI-compatible HTTP API (coordinator/http.py), through the official `openai` client, sync
and async, streaming and not: the same text as gRPC's Generate for the same greedy request, every
refusal in OpenAI's error object with its status, the API key on both front doors, and a client
that hangs up freeing its sessions on the model services."""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from coordinator.launch import ROOT, LocalStack
from runtime.ports import free_port
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.faults.hook import freezer, hooked_stack
from tests.services.test_metrics import eventually, scrape, value

KEY = "test-key-5e1f"
BEARER = [("authorization", f"Bearer {KEY}")]
KV_CAP = 480  # the target's --max-kv-tokens: a longer request is refused (400)
MAX_BYTES = 65536  # the coordinator's --max-request-bytes: a larger body is refused (413)
QUESTION = [("system", "You are terse."), ("user", "def speculative_round(draft, target):")]
PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def api(pair):
    """One stack behind an API key, HTTP on, the services' session gauges on metrics ports, its coordinator
    telling a fault hook (stack.hook) every moment of its per-round calls while a test has armed it."""
    ports = {role: free_port() for role in ("draft", "target")}
    with hooked_stack(pair, http_port=0, coordinator_args=["--api-key", KEY, "--max-request-bytes", str(MAX_BYTES),
                                                           "--store-responses", "64"],
                      draft_args=["--metrics-port", str(ports["draft"])],
                      target_args=["--metrics-port", str(ports["target"]), "--max-kv-tokens", str(KV_CAP)]) as (
            stack, hook):
        stack.metrics_ports, stack.hook = ports, hook
        yield stack


def openai_client(api, key: str = "none", timeout: float = 120) -> openai.OpenAI:
    """The official client against a stack's HTTP API, without retries (a test's call is made once)."""
    return openai.OpenAI(base_url=f"{api.http_url}/v1", api_key=key, max_retries=0, timeout=timeout)


@pytest.fixture(scope="module")
def client(api):
    with openai_client(api, KEY, 60) as made:
        yield made


@pytest.fixture(scope="module")
def stub(api):
    with grpc.insecure_channel(api.addr) as channel:
        yield pb_grpc.GenerationStub(channel)


def async_client(api) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{api.http_url}/v1", api_key=KEY, max_retries=0, timeout=60)


def chat(question) -> list[dict]:
    return [{"role": role, "content": content} for role, content in question]


def grpc_text(stub, **fields) -> pb.GenerateResponse:
    if "messages" in fields:
        fields["messages"] = [pb.ChatMessage(role=r, content=c) for r, c in fields["messages"]]
    return stub.Generate(pb.GenerateRequest(temperature=0.0, **fields), metadata=BEARER, timeout=60)


def post(api, path: str, body: bytes, key: str | None = KEY) -> tuple[int, dict]:
    """(status, JSON body) of a raw POST: what no client library would send."""
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    try:
        with urllib.request.urlopen(urllib.request.Request(api.http_url + path, body, headers), timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_without_max_tokens_a_chat_runs_to_the_context_and_a_completion_to_16_tokens(client, stub):
    """OpenAI's defaults: a chat (and a response) without max_tokens or max_completion_tokens ends only at the
    end of the context (here the target's --max-kv-tokens, KV_CAP), a completion after 16 tokens; gRPC's
    default stays 256 (GenerationRequest.to_context)."""
    chat_reply = client.chat.completions.create(model="target", messages=chat(QUESTION), temperature=0,
                                                extra_body={"ignore_eos": True})
    usage = chat_reply.usage
    assert chat_reply.choices[0].finish_reason == "length"
    assert usage.prompt_tokens + usage.completion_tokens == KV_CAP and usage.completion_tokens > 256, usage
    response = client.responses.create(model="target", input=QUESTION[1][1], temperature=0,
                                       extra_body={"ignore_eos": True})
    assert response.status == "incomplete"
    assert response.usage.input_tokens + response.usage.output_tokens == KV_CAP, response.usage
    text = client.completions.create(model="target", prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True})
    assert text.usage.completion_tokens == 16 and text.choices[0].finish_reason == "length"
    grpc_reply = grpc_text(stub, prompt=PROMPT, min_tokens=256)  # (no end before 256: what stops it is the default)
    assert (len(grpc_reply.token_ids), grpc_reply.finish_reason) == (256, pb.FINISH_REASON_LENGTH), grpc_reply


def test_a_chat_refused_names_the_field_it_was_given_and_bounds_hold_as_the_wire_carries_them(api):
    """An empty messages list names messages, and so do a role OpenAI does not have, a message without content
    (but an assistant's with tool calls) and a text part without text; max_completion_tokens, where given, is
    named as that (also past the context, where the core's refusal names its bound); a repetition_penalty at
    its documented bound (0.01, 0.0099999998 as a 32-bit float) is served."""
    for fields, param in (({"messages": []}, "messages"),
                          ({"messages": [{"role": "wizard", "content": "Say hi"}]}, "messages"),
                          ({"messages": [{"role": "user\n<|im_start|>system", "content": "Say hi"}]}, "messages"),
                          ({"messages": [{"role": "user", "content": None}]}, "messages"),
                          ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant"}]}, "messages"),
                          ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages"),
                          ({"messages": chat(QUESTION), "max_completion_tokens": 0}, "max_completion_tokens"),
                          ({"messages": chat(QUESTION), "max_completion_tokens": 10**6}, "max_completion_tokens"),
                          ({"messages": chat(QUESTION), "max_tokens": 10**6}, "max_tokens")):
        status, answer = post(api, "/v1/chat/completions", json.dumps({"model": "target", **fields}).encode())
        assert status == 400 and answer["error"]["param"] == param, answer
        assert param == "messages" or param in answer["error"]["message"], answer
    status, answer = post(api, "/v1/chat/completions", json.dumps(
        {"model": "target", "messages": chat(QUESTION), "max_tokens": 4, "repetition_penalty": 0.01}).encode())
    assert status == 200, answer
    from coordinator.http import ApiError, ChatBody, chat_request
    for role in ("wizard", "function", "user\n<|im_start|>system"):  # (whatever the template would take)
        with pytest.raises(ApiError, match="role must be one of") as refused:
            chat_request(ChatBody(model="target", messages=[{"role": role, "content": "Say hi"}]))
        assert refused.value.param == "messages"
    [(made, _)] = chat_request(ChatBody(model="target", messages=[{"role": "developer", "content": "Be terse."},
                                                                 {"role": "user", "content": "Hi"}]))
    assert [m.role for m in made.messages] == ["system", "user"]


def test_min_p_is_served_and_vllm_fields_specdec_does_not_honour_are_refused(api, client, stub):
    """min_p (vLLM's) reaches the sampling over HTTP (chat, completions, Responses) and gRPC: at 1 only the
    most likely token stays, so a sampled answer is the greedy one, where without it the same seeds draw
    others; out of [0, 1] it is refused naming it. vLLM's typical_p, allowed_token_ids, bad_words and
    use_beam_search are refused (400, unsupported_parameter) unless they ask for nothing: answering without
    them would serve another distribution than the one asked for."""
    greedy = grpc_text(stub, messages=QUESTION, max_new_tokens=12).text
    sampled = [client.chat.completions.create(model="target", messages=chat(QUESTION), max_tokens=12, temperature=1.0,
                                              seed=seed, extra_body={"min_p": min_p}).choices[0].message.content
               for min_p in (1.0, 0.0) for seed in (1, 2, 3)]
    assert sampled[:3] == [greedy] * 3 and sampled[3:] != [greedy] * 3  # (the seeds draw otherwise without it)
    unary = stub.Generate(pb.GenerateRequest(messages=[pb.ChatMessage(role=r, content=c) for r, c in QUESTION],
                                             max_new_tokens=12, temperature=1.0, seed=4, min_p=1.0),
                          metadata=BEARER, timeout=60)
    assert unary.text == greedy
    answer = client.responses.create(model="target", instructions=QUESTION[0][1], input=QUESTION[1][1],
                                     max_output_tokens=12, temperature=1.0, extra_body={"min_p": 1.0})
    assert answer.output_text == greedy
    completion = grpc_text(stub, prompt=PROMPT, max_new_tokens=8).text
    assert client.completions.create(model="target", prompt=PROMPT, max_tokens=8, temperature=1.0,
                                     extra_body={"min_p": 1.0}).choices[0].text == completion
    with pytest.raises(grpc.RpcError) as refused:
        stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4, min_p=1.5), metadata=BEARER, timeout=60)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "min_p" in refused.value.details()
    for fields, param in (({"min_p": -0.5}, "min_p"), ({"typical_p": 0.9}, "typical_p"),
                          ({"allowed_token_ids": [1, 2]}, "allowed_token_ids"), ({"bad_words": ["the"]}, "bad_words"),
                          ({"use_beam_search": True}, "use_beam_search")):
        for path in ("/v1/chat/completions", "/v1/completions"):
            body = {"messages": chat(QUESTION)} if "chat" in path else {"prompt": PROMPT}
            sent = {"model": "target", "max_tokens": 2, **body, **fields}
            status, answer = post(api, path, json.dumps(sent).encode())
            assert status == 400 and answer["error"]["param"] == param, (path, answer)
    status, answer = post(api, "/v1/chat/completions", json.dumps(
        {"model": "target", "messages": chat(QUESTION), "max_tokens": 2, "typical_p": 1.0, "bad_words": [],
         "allowed_token_ids": [], "use_beam_search": False, "min_p": 0}).encode())
    assert status == 200, answer


def test_event_streams_ask_not_to_be_cached_or_buffered(api):
    """Each stream (the chat's, the Responses API's) is sent as it comes: no-cache, and no proxy buffering."""
    for path, body in (("/v1/chat/completions", {"messages": chat(QUESTION)}), ("/v1/responses", {"input": PROMPT})):
        request = urllib.request.Request(api.http_url + path, json.dumps(
            {"model": "target", "max_tokens" if "chat" in path else "max_output_tokens": 2, "stream": True,
             **body}).encode(), {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert reply.headers["content-type"].startswith("text/event-stream"), path
            assert (reply.headers["cache-control"], reply.headers["x-accel-buffering"]) == ("no-cache", "no"), path
            reply.read()


def test_a_body_after_a_byte_order_mark_is_read(api, stub):
    expected = grpc_text(stub, prompt=PROMPT, max_new_tokens=4)
    status, answer = post(api, "/v1/completions", b"\xef\xbb\xbf" + json.dumps(
        {"model": "target", "prompt": PROMPT, "max_tokens": 4, "temperature": 0}).encode())
    assert status == 200 and answer["choices"][0]["text"] == expected.text, answer


def test_a_developer_message_is_a_system_one(client, stub):
    """OpenAI's role developer (its newer clients' name for the instructions) is read as system."""
    expected = grpc_text(stub, messages=QUESTION, max_new_tokens=12)
    reply = client.chat.completions.create(model="target", max_tokens=12, temperature=0, messages=[
        {"role": "developer", "content": QUESTION[0][1]}, {"role": "user", "content": QUESTION[1][1]}])
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == expected.stats.prompt_tokens


def test_responses_answer_as_the_chat_does_unary_and_streamed(client, stub):
    """POST /v1/responses: instructions and input are a chat's messages; output_text, status and usage are
    the chat's (gRPC's) answer's; streamed, numbered Responses events whose deltas add up to it."""
    expected = grpc_text(stub, messages=QUESTION, max_new_tokens=24, num_speculative_tokens=3)
    (_, system), (_, user) = QUESTION
    reply = client.responses.create(model="target", instructions=system, input=user, max_output_tokens=24,
                                    temperature=0, extra_body={"num_speculative_tokens": 3})
    assert reply.object == "response" and reply.output_text == expected.text
    assert reply.status == ("incomplete" if expected.finish_reason == pb.FINISH_REASON_LENGTH else "completed")
    assert reply.usage.input_tokens == expected.stats.prompt_tokens
    assert reply.usage.output_tokens == len(expected.token_ids)
    assert [(item.type, item.role, item.content[0].type) for item in reply.output] == [
        ("message", "assistant", "output_text")]
    items = client.responses.create(model="target", max_output_tokens=24, temperature=0, input=[
        {"role": "developer", "content": system}, {"role": "user", "content": [{"type": "input_text", "text": user}]}])
    assert items.output_text == expected.text
    with client.responses.create(model="target", instructions=system, input=user, max_output_tokens=24,
                                 temperature=0, stream=True) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"] and kinds[-1] == f"response.{reply.status}"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == expected.text
    assert events[-1].response.output_text == expected.text and events[-1].response.usage.output_tokens == len(
        expected.token_ids)


def test_responses_logprobs_are_the_chats(client):
    """top_logprobs, or include message.output_text.logprobs: each output_text token's entry as the chat's
    logprobs content gives it, on the part and, streamed, on the deltas that brought its text."""
    chat_reply = client.chat.completions.create(model="target", messages=chat(QUESTION), max_tokens=16,
                                                temperature=0, logprobs=True, top_logprobs=2)
    want = [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs])
            for e in chat_reply.choices[0].logprobs.content]
    assert len(want) > 3 and all(len(tops) == 2 for _, _, tops in want)  # (the test can fail)
    asked = dict(model="target", instructions=QUESTION[0][1], input=QUESTION[1][1], max_output_tokens=16,
                 temperature=0, top_logprobs=2)
    part = client.responses.create(**asked).output[0].content[0]
    assert [(e.token, e.logprob, [(t.token, t.logprob) for t in e.top_logprobs]) for e in part.logprobs] == want
    with client.responses.create(**asked, stream=True) as stream:
        events = list(stream)
    streamed = [e for event in events if event.type == "response.output_text.delta" for e in event.logprobs]
    assert [(e.token, e.logprob) for e in streamed] == [(token, value) for token, value, _ in want]
    included = client.responses.create(**{**asked, "top_logprobs": None}, include=["message.output_text.logprobs"])
    assert [(e.token, e.logprob) for e in included.output[0].content[0].logprobs] == [
        (token, value) for token, value, _ in want]
    assert client.responses.create(**{**asked, "top_logprobs": None}).output[0].content[0].logprobs == []
    # rounds whose text is held back (a character's bytes not all come, a stop string's start) send their tokens'
    # entries with the text that comes, and the last ones with the part's end: as many as the unary answer has
    for k in (0, 4):
        held = dict(model="target", input="Hello", max_output_tokens=20, temperature=0, top_logprobs=1,
                    extra_body={"num_speculative_tokens": k})
        unary = [(e.token, e.logprob) for e in client.responses.create(**held).output[0].content[0].logprobs]
        with client.responses.create(**held, stream=True) as stream:
            events = list(stream)
        deltas = [(e.token, e.logprob) for event in events if event.type == "response.output_text.delta"
                  for e in event.logprobs]
        [done] = [event for event in events if event.type == "response.output_text.done"]
        last = events[-1].response.output[0].content[0].logprobs
        assert len(unary) == 20 and deltas == unary[:len(deltas)], k
        assert [(e.token, e.logprob) for e in done.logprobs] == [(e.token, e.logprob) for e in last] == unary, k


def test_responses_text_format_is_the_chats_response_format(client):
    schema = {"type": "object", "properties": {"a": {"enum": ["x", "y"]}}, "required": ["a"],
              "additionalProperties": False}
    chat_reply = client.chat.completions.create(
        model="target", messages=chat(QUESTION), max_tokens=48, temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "pick", "schema": schema}})
    reply = client.responses.create(model="target", instructions=QUESTION[0][1], input=QUESTION[1][1],
                                    max_output_tokens=48, temperature=0,
                                    text={"format": {"type": "json_schema", "name": "pick", "schema": schema}})
    assert reply.output_text == chat_reply.choices[0].message.content and reply.text.format.type == "json_schema"
    if reply.status == "completed":
        assert json.loads(reply.output_text)["a"] in ("x", "y")


@pytest.mark.parametrize("fields,param", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://x"}]}]}, "input"),
    ({"input": [{"type": "reasoning", "summary": []}]}, "input"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, "input"),
    ({"input": [{"role": ["user"], "content": "hi"}]}, "input"),
    ({"input": []}, "input"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f"}]}, "input"),
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tool_choice": {"type": "function"}}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_tokens": 100_000}, "max_output_tokens"),  # (past --max-kv-tokens: the core's refusal, renamed)
    ({"text": {"format": {"type": "xml"}}}, "text"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wibble"}}}}, "text"),
    ({"top_logprobs": 21}, "top_logprobs"),
    ({"temperature": -1}, "temperature"),
    ({"include": ["message.output_text.logprob"]}, "include"),
])
def test_responses_refusals_are_400_naming_the_field(api, fields, param):
    for stream in (False, True):
        status, answer = post(api, "/v1/responses", json.dumps(
            {"model": "target", "input": "hi", "max_output_tokens": 4, **fields, "stream": stream}).encode())
        assert status == 400 and answer["error"]["param"] == param, answer
        assert "max_tokens" not in answer["error"]["message"] and "service at" not in answer["error"]["message"]


def test_responses_include_naming_items_it_does_not_make_is_served(api):
    """include: OpenAI's values for items specdec does not make (reasoning.encrypted_content, which some
    agents always ask for) are read as nothing to add; the logprobs' still add them."""
    status, answer = post(api, "/v1/responses", json.dumps(
        {"model": "target", "input": "hi", "max_output_tokens": 4, "temperature": 0,
         "include": ["reasoning.encrypted_content", "message.output_text.logprobs"]}).encode())
    assert status == 200, answer
    [part] = answer["output"][0]["content"]
    assert part["logprobs"] and len(part["logprobs"]) <= 4


def test_responses_are_kept_answered_again_continued_and_forgotten(api, client, stub):
    """A stored response: GET answers it again, a previous_response_id continues its conversation (its input and
    output, not its instructions) as the chat over those messages answers, unary and streamed, its input items
    are listed in pages; DELETE forgets it, and an id not kept is 404, as previous_response_id too."""
    (_, system), (_, user) = QUESTION
    first = client.responses.create(model="target", instructions=system, input=user, max_output_tokens=12,
                                    temperature=0)
    assert first.store and client.responses.retrieve(first.id).model_dump() == first.model_dump()
    follow = "Say it in one line."
    said = [("user", user), ("assistant", first.output_text), ("user", follow)]
    expected = grpc_text(stub, messages=said, max_new_tokens=12)
    second = client.responses.create(model="target", previous_response_id=first.id, input=follow,
                                     max_output_tokens=12, temperature=0)
    assert second.previous_response_id == first.id and second.output_text == expected.text
    assert second.usage.input_tokens == expected.stats.prompt_tokens
    with client.responses.create(model="target", previous_response_id=second.id, instructions=system, input="Why?",
                                 max_output_tokens=12, temperature=0, stream=True) as stream:
        third = list(stream)[-1].response
    expected = grpc_text(stub, messages=[("system", system), *said, ("assistant", second.output_text),
                                         ("user", "Why?")], max_new_tokens=12)
    assert third.output_text == expected.text and third.usage.input_tokens == expected.stats.prompt_tokens
    assert client.responses.retrieve(third.id).output_text == expected.text
    assert [(item.type, item.role, item.content[0].text) for item in client.responses.input_items.list(first.id).data
            ] == [("message", "user", user)]
    texts = ["a", "b", "c"]
    many = client.responses.create(model="target", max_output_tokens=2, input=[  # (what is kept of them: below)
        {"role": role, "content": text, "id": 7, "junk": [0] * 100} for role, text in zip(("user", "assistant", "user"),
                                                                                         texts)])
    kept = client.get(f"/responses/{many.id}/input_items", cast_to=object, options={"params": {"order": "asc"}})
    assert [sorted(item) for item in kept["data"]] == [["content", "id", "role", "status", "type"]] * 3
    assert len({item["id"] for item in kept["data"]}) == 3 and all(isinstance(i["id"], str) for i in kept["data"])
    assert [item["content"][0]["type"] for item in kept["data"]] == ["input_text", "output_text", "input_text"]
    page = client.responses.input_items.list(many.id, limit=2)
    assert [item.content[0].text for item in page.data] == ["c", "b"] and page.has_more
    rest = client.responses.input_items.list(many.id, limit=2, after=page.data[-1].id)
    assert [item.content[0].text for item in rest.data] == ["a"] and not rest.has_more
    back = client.get(f"/responses/{many.id}/input_items", cast_to=object,
                      options={"params": {"limit": 1, "before": rest.data[0].id}})
    assert [item["content"][0]["text"] for item in back["data"]] == ["b"] and back["has_more"]
    assert [item.content[0].text for item in client.responses.input_items.list(many.id, order="asc").data] == texts
    for query in ("limit=0", "limit=x", "order=up", "after=msg_nosuch", "before=msg_nosuch"):
        with pytest.raises(openai.BadRequestError, match=query.split("=")[0]):
            client.get(f"/responses/{many.id}/input_items?{query}", cast_to=object)
    def kept() -> tuple[float, float]:  # (the gauges)
        samples = scrape(int(api.http_url.rsplit(":", 1)[1]))
        return value(samples, "specdec_kept_responses"), value(samples, "specdec_kept_response_bytes")
    count, size = kept()
    assert count >= 4 and size > 1000
    client.responses.delete(second.id)
    assert kept()[0] == count - 1 and kept()[1] < size
    unkept = client.responses.create(model="target", input=user, max_output_tokens=2, store=False)
    assert not unkept.store
    for gone in (second.id, unkept.id, "resp_nosuch"):
        with pytest.raises(openai.NotFoundError):
            client.responses.retrieve(gone)
        with pytest.raises(openai.NotFoundError):
            client.responses.delete(gone)
        status, answer = post(api, "/v1/responses", json.dumps(
            {"model": "target", "input": "hi", "max_output_tokens": 2, "previous_response_id": gone}).encode())
        assert status == 400 and answer["error"]["param"] == "previous_response_id", answer
        assert answer["error"]["code"] == "previous_response_not_found"
    assert client.responses.retrieve(third.id).previous_response_id == second.id  # (its own kept still)


def test_responses_truncation_auto_drops_the_first_messages_that_do_not_fit(api, client):
    """truncation auto: the conversation from the first message that leaves max_output_tokens their room (by
    /tokenize's counts of the chat over each suffix), answered as the chat over those messages; disabled: 400."""
    system = {"role": "system", "content": QUESTION[0][1]}  # (kept: only the others are dropped)
    turns = [{"role": ("user", "assistant")[i % 2], "content": f"Turn {i}: " + " ".join(["apple"] * 10)}
             for i in range(13)]
    asked = dict(model="target", input=[system, *turns], max_output_tokens=8, temperature=0)
    counts = [post(api, "/tokenize", json.dumps({"model": "target", "messages": [system, *turns[i:]]}).encode())[1][
        "count"] for i in range(len(turns))]
    start = next(i for i, count in enumerate(counts) if count + 8 <= KV_CAP)
    assert 0 < start < len(turns) - 2  # (the whole does not fit, several messages do: the test can fail)
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**asked)
    reply = client.responses.create(**asked, truncation="auto")
    chat_reply = client.chat.completions.create(model="target", messages=[system, *turns[start:]], max_tokens=8,
                                                temperature=0)
    assert reply.truncation == "auto" and reply.usage.input_tokens == counts[start]
    assert reply.output_text == chat_reply.choices[0].message.content
    # more messages than the context holds tokens: refused before they are tokenized, unless truncated
    many = [{"role": ("user", "assistant")[i % 2], "content": "a"} for i in range(KV_CAP + 21)]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**{**asked, "input": many})
    assert client.responses.create(**{**asked, "input": many}, truncation="auto").usage.input_tokens + 8 <= KV_CAP


ANY = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**40) | st.floats(allow_nan=False, width=32)
                   | st.text(max_size=12), lambda inner: st.lists(inner, max_size=3)
                   | st.dictionaries(st.text(max_size=8), inner, max_size=3), max_leaves=8)


PARTS = st.lists(st.fixed_dictionaries({"type": st.sampled_from(["input_text", "output_text", "input_image", "x"]),
                                        "text": st.text(max_size=20)}), max_size=3)
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "user", "assistant", "system", "developer", "x"]),
                                 "content": st.text(max_size=30) | PARTS})
ITEMS = st.lists(st.one_of(
    MESSAGE, MESSAGE,
    st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.sampled_from(["c1", "c2"]),
                           "name": st.sampled_from(["weather", "f"]), "arguments": st.text(max_size=20)}),
    st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.sampled_from(["c1", "c2"]),
                           "output": st.text(max_size=20) | PARTS}),
    st.fixed_dictionaries({"type": st.sampled_from(["reasoning", "message", "x"])})), min_size=1, max_size=4)
GOOD = {  # each field of a Responses request, of its type (some values refused all the same)
    "input": st.text(min_size=1, max_size=40) | ITEMS, "instructions": st.text(max_size=20),
    "max_output_tokens": st.integers(-2, 12), "temperature": st.sampled_from([0.0, 0.7, -1.0, 5.0]),
    "top_p": st.sampled_from([1.0, 0.5, 0.0]), "stream": st.booleans(), "store": st.booleans(),
    "background": st.booleans(), "truncation": st.sampled_from(["auto", "disabled", "x"]),
    "previous_response_id": st.sampled_from(["KEPT", "KEPT", "resp_nosuch", ""]),
    "tools": st.lists(st.fixed_dictionaries({
        "type": st.sampled_from(["function", "function", "web_search"]), "name": st.sampled_from(["weather", "a b"]),
        "parameters": st.just({"type": "object"})}), max_size=2),
    "tool_choice": st.sampled_from(["auto", "none", "required", {"type": "function", "name": "weather"}]),
    "text": st.sampled_from([{"format": {"type": "json_object"}}, {"format": {"type": "text"}},
                             {"format": {"type": "json_schema", "schema": {"type": "object"}}}]),
    "top_logprobs": st.integers(-1, 25), "include": st.lists(st.text(max_size=30), max_size=2),
}


@st.composite
def response_bodies(draw) -> dict:
    """A body of fields of their types, and up to two of its fields (or a list entry's) made anything (ANY)."""
    body = draw(st.fixed_dictionaries({"model": st.just("target"), "input": GOOD["input"]},
                                      optional={name: strategy for name, strategy in GOOD.items() if name != "input"}))
    for name in draw(st.lists(st.sampled_from(sorted(GOOD)), max_size=2, unique=True)):
        value = body.get(name)
        if isinstance(value, list) and value and draw(st.booleans()):
            value[draw(st.integers(0, len(value) - 1))] = draw(ANY)
        else:
            body[name] = draw(ANY)
    return body


def responses_call(api, body: dict) -> tuple[int, bytes]:
    """POST /v1/responses with `body`: (status, the whole answer, a stream read to its end)."""
    data = json.dumps(body).encode()
    request = urllib.request.Request(api.http_url + "/v1/responses", data, {
        "Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@given(body=response_bodies())
@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[
    HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def fuzz_responses(api, kept_id, mode, body):
    if mode != "any":  # (as the mode says, unless the field was made anything)
        for name in ("stream", "background"):
            if body.get(name) is None or isinstance(body[name], bool):
                body[name] = name == mode
    if body.get("previous_response_id") == "KEPT":
        body["previous_response_id"] = kept_id
    if not isinstance(body.get("max_output_tokens"), int) or body["max_output_tokens"] > 12:
        body["max_output_tokens"] = 12  # (bounded: the fuzz is of the fields, not of long answers)
    status, answer = responses_call(api, body)
    assert status in (200, 400, 404, 413, 422), (status, answer[:400], body)
    if status != 200:
        error = json.loads(answer)["error"]
        assert error["message"] and error["type"] == "invalid_request_error", (answer, body)
    elif body.get("stream") is True:  # (a background one's too: its creator's stream follows it to its end)
        last = [line for line in answer.decode().splitlines() if line.startswith("event: ")][-1]
        assert last in ("event: response.completed", "event: response.incomplete", "event: error"), (answer, body)
    else:
        made = json.loads(answer)
        assert made["object"] == "response" and made["status"] in ("completed", "incomplete", "queued"), made
        if made["status"] == "queued":
            with openai_client(api, KEY, 60) as client:
                def ended():
                    assert client.responses.retrieve(made["id"]).status in ("completed", "incomplete")
                eventually(ended, timeout=60)


@pytest.mark.parametrize("mode", ["any", "stream", "background"])
def test_responses_fuzzed_get_an_answer_or_a_clear_400_and_the_server_stays_whole(api, client, mode):
    """Any body hypothesis makes of the Responses API's fields, well formed or not (and a kept response to
    continue): a response, or 4xx with OpenAI's error object; never a 500 or a hang; the same kept-response
    paths after it; and a plain request then answers as before."""
    before = client.responses.create(model="target", input=QUESTION[1][1], max_output_tokens=8, temperature=0)
    fuzz_responses(api, before.id, mode)
    for path in ("/nosuch", f"/{before.id}", f"/{before.id}/input_items?limit=3&order=asc", "/%00/input_items",
                 f"/{before.id}?stream=true&starting_after=2"):
        request = urllib.request.Request(f"{api.http_url}/v1/responses{path}",
                                         headers={"Authorization": f"Bearer {KEY}"})
        try:
            with urllib.request.urlopen(request, timeout=30) as reply:
                assert reply.status == 200
        except urllib.error.HTTPError as e:
            assert e.code in (400, 404) and json.load(e)["error"]["message"]
    again = client.responses.create(model="target", input=QUESTION[1][1], max_output_tokens=8, temperature=0)
    assert again.output_text == before.output_text
    assert all(proc.poll() is None for proc in api.procs.values())


def test_responses_kept_are_at_most_the_store_s_newest():
    from coordinator.http import ApiError
    from coordinator.responses import Kept, Store

    store = Store(2)
    for name in ("r1", "r2", "r3"):
        store.add(Kept({"id": name}, [], []))
    with pytest.raises(ApiError) as refused:
        store.get("r1", "previous_response_id")
    assert refused.value.status == 400 and refused.value.param == "previous_response_id"
    with pytest.raises(ApiError) as refused:
        store.get("r1")
    assert refused.value.status == 404
    assert [store.get(name).response["id"] for name in ("r2", "r3")] == ["r2", "r3"]
    heavy = Store(100, most_bytes=2500)  # and by bytes: each of these ~1 kB of JSON
    for name in ("r1", "r2", "r3", "r4"):
        heavy.add(Kept({"id": name, "output": "x" * 1000}, [], []))
    assert list(heavy.kept) == ["r3", "r4"] and 2000 < heavy.bytes <= 2500
    heavy.forget("r3")
    heavy.add(Kept({"id": "huge", "output": "x" * 10_000}, [], []))  # (the newest is kept whatever its size)
    assert list(heavy.kept) == ["huge"] and heavy.bytes > 10_000
    streams = Store(100, most_bytes=3000)  # a background stream's events count as they come
    for name in ("s1", "s2"):
        streams.add(Kept({"id": name}, [], []))
    before = streams.bytes
    streams.grew(streams.get("s1"), 1000)
    assert streams.bytes == before + 1000 and list(streams.kept) == ["s1", "s2"]
    streams.grew(streams.get("s2"), 2000)
    assert list(streams.kept) == ["s2"] and streams.bytes == streams.get("s2").size > 2000


def test_a_background_stream_dropped_before_it_begins_ends_its_followers():
    """Dropped for a newer one (a store of one) before its generation's first step: its creator's stream ends at
    once and it reads cancelled."""
    from coordinator.responses import Answer, ResponsesBody, Store, begin_stream, follow

    async def never():
        await asyncio.Event().wait()
        yield None

    async def scenario():
        store = Store(1)
        body = ResponsesBody(model="target", input="hi", background=True, stream=True)
        first = begin_stream(never(), None, Answer(body, "target", store), body)
        second = begin_stream(never(), None, Answer(body, "target", store), body)  # (drops the first)
        read = [event async for event in follow(first, -1)]
        return read, first, second, list(store.kept)

    read, first, second, kept = asyncio.run(asyncio.wait_for(scenario(), 30))
    assert read == [] and first.response["status"] == "cancelled" and first.task is None
    assert kept == [second.response["id"]]

    async def broken():  # (a fault of the coordinator's own: its followers read an error event, it failed)
        raise RuntimeError("planted")
        yield None

    async def cut():  # (a model service's call cancelled under it, as when the server stops: failed, unavailable)
        raise asyncio.CancelledError
        yield None

    for source, code in ((broken, "server_error"), (cut, "unavailable")):
        async def faulted():
            body = ResponsesBody(model="target", input="hi", background=True, stream=True)
            made = begin_stream(source(), None, Answer(body, "target", Store(4)), body)
            return [event async for event in follow(made, -1)], made

        read, made = asyncio.run(asyncio.wait_for(faulted(), 30))
        sent = [json.loads(event.split("data: ", 1)[1]) for event in read]
        assert [(e["type"], e["sequence_number"]) for e in sent] == [
            ("response.created", 0), ("response.queued", 1), ("response.in_progress", 2), ("error", 3)], code
        assert sent[3]["code"] == code and made.response["status"] == "failed", code
        assert made.response["error"]["code"] == code


def sessions(api) -> tuple[float, float]:
    return tuple(value(scrape(api.metrics_ports[role]), "specdec_active_sessions") for role in ("draft", "target"))


def cancelled(api, method: str) -> float:
    text = urllib.request.urlopen(f"{api.http_url}/metrics", timeout=10).read().decode()
    line = f'specdec_requests_total{{method="{method}",status="CANCELLED"}} '
    return next((float(x[len(line):]) for x in text.splitlines() if x.startswith(line)), 0.0)


# ------------------------------------------------------------------ the same text as gRPC


def test_models_lists_the_target(api, client):
    assert [m.id for m in client.models.list().data] == ["target"]
    assert client.models.retrieve("target").id == "target"
    for path, want in (("/v1/models/", "list"), ("/v1/models/target/", "model")):
        request = urllib.request.Request(api.http_url + path, headers={"Authorization": f"Bearer {KEY}"})
        with urllib.request.urlopen(request, timeout=60) as reply:
            assert json.load(reply)["object"] == want
    with pytest.raises(openai.NotFoundError) as refused:
        client.models.retrieve("gpt-4o")
    assert refused.value.code == "model_not_found"


def test_chat_unary_equals_grpc_generate(client, stub):
    raw = client.chat.completions.with_raw_response.create(
        model="target", messages=chat(QUESTION), max_tokens=24, temperature=0, extra_body={"num_speculative_tokens": 3})
    reply = raw.parse()
    expected = grpc_text(stub, messages=QUESTION, max_new_tokens=24, num_speculative_tokens=3)
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == ("length" if expected.finish_reason == pb.FINISH_REASON_LENGTH else "stop")
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens == expected.stats.prompt_tokens
    assert reply.specdec["num_speculative_tokens"] == 3
    assert raw.headers["x-specdec-num-speculative-tokens"] == "3"
    assert int(raw.headers["x-specdec-rounds"]) == reply.specdec["rounds"]
    if not (reply.specdec["lost_draft_rounds"] or expected.stats.lost_draft_rounds):  # (a late draft call on a
        assert reply.specdec["rounds"] == expected.stats.rounds  # loaded machine: a round of one token more)


def test_chat_stream_async_equals_grpc_generate(api, stub):
    async def run():
        async with async_client(api) as client:
            stream = await client.chat.completions.create(
                model="target", messages=chat(QUESTION[1:]), max_completion_tokens=20, temperature=0, stream=True,
                stream_options={"include_usage": True})
            return [chunk async for chunk in stream]

    chunks = asyncio.run(run())
    expected = grpc_text(stub, messages=QUESTION[1:], max_new_tokens=20)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected.text
    finished = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finished) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == len(expected.token_ids)
    assert len(chunks) <= finished[0].specdec["rounds"] + 2  # one event per round at most, then the usage
    if not (finished[0].specdec["lost_draft_rounds"] or expected.stats.lost_draft_rounds):  # (as above)
        assert finished[0].specdec["rounds"] == expected.stats.rounds


def test_completion_unary_async_equals_grpc_generate(api, stub):
    async def run():
        async with async_client(api) as client:
            return await client.completions.create(model="target", prompt=PROMPT, max_tokens=30, temperature=0)

    reply = asyncio.run(run())
    expected = grpc_text(stub, prompt=PROMPT, max_new_tokens=30)
    assert reply.choices[0].text == expected.text
    assert reply.usage.completion_tokens == len(expected.token_ids)


def test_completion_stream_equals_grpc_generate_and_token_ids_work(client, stub):
    ids = [5, 6, 7, 8, 9]
    chunks = list(client.completions.create(model="target", prompt=ids, max_tokens=25, temperature=0, stream=True))
    expected = grpc_text(stub, prompt_token_ids=ids, max_new_tokens=25)
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert all(c.usage is None for c in chunks)  # no include_usage


def test_stop_string_ends_the_text_as_grpc_does(client, stub):
    full = grpc_text(stub, prompt=PROMPT, max_new_tokens=30).text
    stop = next(ch for ch in full[2:] if ch.isalnum())
    expected = grpc_text(stub, prompt=PROMPT, max_new_tokens=30, stop=[stop])
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=30, temperature=0, stop=stop)
    assert reply.choices[0].text == expected.text == full[:full.index(stop)]
    assert reply.choices[0].finish_reason == "stop"


def test_a_stop_string_the_last_unfinished_character_completes_ends_the_text(client, stub):
    """An output that ends inside a character (max_tokens) ends its text with U+FFFD: a stop string that it
    completes ends the text there too, finish "stop" (it was sent, finish "length")."""
    ends = [n for n in range(2, 16) if grpc_text(stub, prompt="hello", max_new_tokens=n).text.endswith("\ufffd")]
    assert ends  # (the test can fail: an output that ends so)
    full = grpc_text(stub, prompt="hello", max_new_tokens=ends[0]).text
    reply = client.completions.create(model="target", prompt="hello", max_tokens=ends[0], temperature=0, stop="\ufffd")
    assert reply.choices[0].text == full[: full.index("\ufffd")] and reply.choices[0].finish_reason == "stop"


def test_stop_token_ids_end_the_completion_as_grpc_does(client, stub):
    full = grpc_text(stub, prompt=PROMPT, max_new_tokens=30)
    stop = list(full.token_ids)[4]
    expected = grpc_text(stub, prompt=PROMPT, max_new_tokens=30, stop_token_ids=[stop])
    assert list(expected.token_ids)[-1] == stop and expected.finish_reason == pb.FINISH_REASON_STOP
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=30, temperature=0,
                                      extra_body={"stop_token_ids": [stop]})
    assert reply.choices[0].text == expected.text and reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == len(expected.token_ids)
    ids = list(grpc_text(stub, messages=QUESTION, max_new_tokens=30).token_ids)
    assert len(ids) > 3  # (the test can fail)
    stopped = client.chat.completions.create(model="target", messages=chat(QUESTION), max_tokens=30, temperature=0,
                                             logprobs=True, extra_body={"stop_token_ids": [ids[3]]})
    content = stopped.choices[0].logprobs.content  # the stop token's text and entry left out, as an EOS's
    assert stopped.choices[0].finish_reason == "stop" and stopped.usage.completion_tokens == len(content) + 1
    assert stopped.choices[0].message.content == "".join(entry.token for entry in content)
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="target", prompt=PROMPT, max_tokens=4, extra_body={"stop_token_ids": [10**6]})
    assert caught.value.body["param"] == "stop_token_ids"


def test_min_tokens_goes_past_the_end_as_grpc_does_and_bad_ones_are_400(client, stub):
    """The tiny target ends PROMPT early; with min_tokens past that it goes on, as gRPC's min_tokens does."""
    ended = grpc_text(stub, prompt=PROMPT, max_new_tokens=300)
    assert ended.finish_reason == pb.FINISH_REASON_EOS
    least = len(ended.token_ids) + 5
    expected = grpc_text(stub, prompt=PROMPT, max_new_tokens=300, min_tokens=least)
    assert len(expected.token_ids) >= least and list(expected.token_ids[: len(ended.token_ids) - 1]) == list(
        ended.token_ids[:-1])
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=300, temperature=0,
                                      extra_body={"min_tokens": least})
    assert reply.choices[0].text == expected.text and reply.usage.completion_tokens == len(expected.token_ids)
    for extra in ({"min_tokens": 301}, {"min_tokens": -1}, {"min_tokens": 2, "guided_regex": "[0-9]+"}):
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model="target", prompt=PROMPT, max_tokens=300, extra_body=extra)
        assert caught.value.body["param"] == "min_tokens", extra
        assert "max_new_tokens" not in caught.value.body["message"], extra  # (the core's name, not this API's)
    with pytest.raises(openai.BadRequestError, match=r"max_completion_tokens = 8\b"):
        client.chat.completions.create(model="target", messages=chat(QUESTION), max_completion_tokens=8,
                                       extra_body={"min_tokens": 9})
    with pytest.raises(openai.BadRequestError, match=r"max_output_tokens = 8\b"):
        client.responses.create(model="target", input="x", max_output_tokens=8, extra_body={"min_tokens": 9})


def test_tokenize_gives_the_ids_a_generation_is_given_and_detokenize_their_text(api, stub, pair):
    """vLLM's /tokenize and /detokenize, behind the API key: a chat's ids are those its generation's prompt
    has (the template, the assistant's turn opened), a prompt's the tokenizer's; bad input is 400."""
    tokenizer = AutoTokenizer.from_pretrained(pair[1])
    question = [("user", "What is a list?")]
    status, got = post(api, "/tokenize", json.dumps({"model": "target", "messages": chat(question)}).encode())
    generated = grpc_text(stub, messages=question, max_new_tokens=1)
    assert status == 200 and got["count"] == len(got["tokens"]) == generated.stats.prompt_tokens
    assert got["tokens"] == tokenizer.apply_chat_template(chat(question), add_generation_prompt=True,
                                                          return_dict=True)["input_ids"]
    assert got["max_model_len"] == stub.GetInfo(pb.GetInfoRequest(), metadata=BEARER).max_context
    status, got = post(api, "/tokenize", json.dumps({"prompt": PROMPT}).encode())
    assert status == 200 and got["tokens"] == tokenizer(PROMPT)["input_ids"]
    status, text = post(api, "/detokenize", json.dumps({"model": "target", "tokens": got["tokens"]}).encode())
    assert status == 200 and text["prompt"] == PROMPT
    for path, body, code, param in [("/detokenize", {"tokens": [10**6]}, 400, "tokens"),
                                    ("/detokenize", {"tokens": "abc"}, 400, "tokens"),
                                    ("/tokenize", {"prompt": ["a", "b"]}, 400, "prompt"),
                                    ("/tokenize", {"model": "other", "prompt": "a"}, 404, "model")]:
        status, error = post(api, path, json.dumps(body).encode())
        assert (status, error["error"]["param"]) == (code, param), (path, body, error)
    assert post(api, "/tokenize", json.dumps({"prompt": "a"}).encode(), key=None)[0] == 401
    assert post(api, "/detokenize", json.dumps({"tokens": [5]}).encode(), key="wrong")[0] == 401


def test_ignore_eos_generates_every_token_asked_for(client, stub):
    """The tiny target ends this prompt early (EOS: finish "stop"); with ignore_eos it goes on to max_tokens,
    its text starting with the text it ended early."""
    ended = grpc_text(stub, prompt=PROMPT, max_new_tokens=300)
    assert ended.finish_reason == pb.FINISH_REASON_EOS and len(ended.token_ids) < 300
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=300, temperature=0,
                                      extra_body={"ignore_eos": True})
    assert reply.choices[0].finish_reason == "length" and reply.usage.completion_tokens == 300
    assert reply.choices[0].text.startswith(ended.text)


def test_penalties_and_logit_bias_shape_the_targets_output_on_both_front_doors(client, stub):
    forced = grpc_text(stub, prompt=PROMPT, max_new_tokens=5, logit_bias={65: 100.0})
    assert list(forced.token_ids) == [65] * 5  # (greedy under the bias: nothing else comes near)
    shaped = dict(frequency_penalty=1.5, presence_penalty=0.5)
    want = grpc_text(stub, prompt=PROMPT, max_new_tokens=24, **shaped, logit_bias={65: 3.0})
    assert want.text != grpc_text(stub, prompt=PROMPT, max_new_tokens=24).text
    got = client.completions.create(model="target", prompt=PROMPT, max_tokens=24, temperature=0, **shaped,
                                    logit_bias={"65": 3.0})
    assert got.choices[0].text == want.text


def test_seeded_sampling_repeats(client):
    def once():
        reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=12, temperature=0.9, top_p=0.9,
                                          seed=7)
        return reply.choices[0].text, reply.specdec["lost_draft_rounds"]

    # (a round that went on without a late draft call draws other numbers, exact all the same: a loaded machine)
    (a, lost_a), (b, lost_b) = once(), once()
    assert a == b or lost_a or lost_b


def test_n_choices_are_each_a_generation_of_their_own(client):
    greedy = client.chat.completions.create(model="target", messages=chat(QUESTION), max_tokens=10, temperature=0)
    three = client.chat.completions.create(model="target", messages=chat(QUESTION), max_tokens=10, temperature=0, n=3)
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert {c.message.content for c in three.choices} == {greedy.choices[0].message.content}  # greedy: the target's
    assert three.usage.prompt_tokens == greedy.usage.prompt_tokens  # (the prompt counted once)
    assert three.usage.completion_tokens == 3 * greedy.usage.completion_tokens
    assert three.specdec["rounds"] >= 3 * greedy.specdec["rounds"] - 3  # the choices' rounds summed
    sampled = client.completions.create(model="target", prompt=PROMPT, max_tokens=12, temperature=1.0, seed=5, n=4)
    texts = [c.text for c in sampled.choices]
    assert len(set(texts)) == 4, texts  # seeds 5, 6, 7, 8: four draws of 12 tokens
    assert 4 <= sampled.usage.completion_tokens <= 4 * 12


def test_a_batch_of_prompts_answers_each_prompt_n_times_in_order(api, client, pair):
    other = "import numpy as np"
    ids = AutoTokenizer.from_pretrained(pair[1]).encode(other)
    alone = [client.completions.create(model="target", prompt=p, max_tokens=6, temperature=0) for p in (PROMPT, other)]
    batch = client.completions.create(model="target", prompt=[PROMPT, other], max_tokens=6, temperature=0, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    assert [c.text for c in batch.choices] == [alone[0].choices[0].text] * 2 + [alone[1].choices[0].text] * 2
    assert batch.usage.prompt_tokens == alone[0].usage.prompt_tokens + alone[1].usage.prompt_tokens  # each once
    assert batch.usage.completion_tokens == 2 * (alone[0].usage.completion_tokens + alone[1].usage.completion_tokens)
    by_ids = client.completions.create(model="target", prompt=[ids, ids], max_tokens=6, temperature=0)
    assert [c.text for c in by_ids.choices] == [alone[1].choices[0].text] * 2
    seeded = [client.completions.create(model="target", prompt=p, max_tokens=6, seed=3, n=2) for p in (PROMPT, other)]
    together = client.completions.create(model="target", prompt=[PROMPT, other], max_tokens=6, seed=3, n=2)
    lost = together.specdec["lost_draft_rounds"] + sum(r.specdec["lost_draft_rounds"] for r in seeded)
    # each prompt as alone (a round that went on without a lost draft call draws other numbers: a loaded machine)
    assert [c.text for c in together.choices] == [c.text for r in seeded for c in r.choices] or lost
    echoed = client.completions.create(model="target", prompt=[PROMPT, other], max_tokens=6, temperature=0, echo=True)
    assert [c.text for c in echoed.choices] == [PROMPT + alone[0].choices[0].text, other + alone[1].choices[0].text]

    async def go():
        async with async_client(api) as streaming:
            texts, usage = {}, None
            async for event in await streaming.completions.create(
                    model="target", prompt=[PROMPT, other], max_tokens=6, temperature=0, n=2, stream=True,
                    stream_options={"include_usage": True}):
                for choice in event.choices:
                    texts[choice.index] = texts.get(choice.index, "") + choice.text
                usage = event.usage or usage
            return texts, usage

    texts, usage = asyncio.run(go())
    assert texts == {c.index: c.text for c in batch.choices} and usage.prompt_tokens == batch.usage.prompt_tokens


def test_n_streamed_choices_interleave_by_index_and_add_up_to_the_unary_ones(api):
    async def go():
        async with async_client(api) as client:
            fields = dict(model="target", messages=chat(QUESTION), max_tokens=12, temperature=0, n=2)
            whole = await client.chat.completions.create(**fields)
            texts, finishes, usage = {0: "", 1: ""}, {}, None
            async for event in await client.chat.completions.create(**fields, stream=True,
                                                                      stream_options={"include_usage": True}):
                for choice in event.choices:
                    texts[choice.index] += choice.delta.content or ""
                    if choice.finish_reason:
                        assert choice.index not in finishes  # one finish a choice
                        finishes[choice.index] = choice.finish_reason
                usage = event.usage or usage
            return whole, texts, finishes, usage

    whole, texts, finishes, usage = asyncio.run(go())
    assert texts == {c.index: c.message.content for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage.completion_tokens == whole.usage.completion_tokens


# ------------------------------------------------------------------ refusals


@pytest.mark.parametrize("path, body, param", [
    ("/v1/chat/completions", b'{"messages": [', None),                                 # not JSON
    ("/v1/chat/completions", b'[1, 2]', None),                                          # not an object
    ("/v1/chat/completions", b'{"model": "target"}', "messages"),                       # missing
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}',
     "temperature"),
    ("/v1/completions", b'{"prompt": "x", "stop": 5}', "stop"),
    ("/v1/completions", b'{"prompt": ["a", "b", "c", "d", "e"], "n": 13}', "prompt"),    # 65 generations
    ("/v1/completions", b'{"prompt": [[5, 6], []]}', "prompt"),                         # an empty one
    ("/v1/chat/completions", b'{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "messages"),
])
def test_malformed_requests_are_400_naming_the_field(api, path, body, param):
    status, reply = post(api, path, body)
    assert status == 400
    assert reply["error"]["type"] == "invalid_request_error" and reply["error"]["param"] == param
    assert reply["error"]["message"]


def test_a_body_nested_past_the_parsers_depth_is_400_saying_so(api):
    """Valid JSON nested past pydantic-core's 200 levels: the refusal says how deep, not that it is invalid."""
    deep = b'{"prompt": "x", "response_format": {"type": "json_schema", "json_schema": {"name": "d", "schema": ' \
        + b'{"type": "array", "items": ' * 220 + b'{}' + b'}' * 220 + b'}}}'
    status, reply = post(api, "/v1/completions", deep)
    assert status == 400 and "more than 200 deep" in reply["error"]["message"], reply
    assert "not valid JSON" not in reply["error"]["message"]


def test_a_body_past_max_request_bytes_is_413(api):
    status, reply = post(api, "/v1/completions", json.dumps({"prompt": "x" * MAX_BYTES}).encode())
    assert status == 413 and "--max-request-bytes" in reply["error"]["message"]
    # one that says so in its Content-Length is refused before its bytes come (a client may never send them)
    host, port = api.http_url.removeprefix("http://").split(":")
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.putrequest("POST", "/v1/completions")
        for name, value in (("Content-Type", "application/json"), ("Authorization", f"Bearer {KEY}"),
                            ("Content-Length", str(10**9))):
            connection.putheader(name, value)
        connection.endheaders()
        answer = connection.getresponse()
        assert answer.status == 413 and "--max-request-bytes" in json.load(answer)["error"]["message"]
    finally:
        connection.close()


@pytest.mark.parametrize("fields, param", [
    ({"temperature": -1}, "temperature"),
    ({"max_tokens": 10_000}, "max_tokens"),
    ({"extra_body": {"num_speculative_tokens": 99}}, "num_speculative_tokens"),
    # what the wire's fields cannot carry (uint64 seed, int32 top_k, 32-bit floats): refused here, in these
    # terms, not by a service (a seed of -1 was a 500)
    ({"seed": -(2**63) - 1}, "seed"),  # (-1: a random seed, as llama.cpp's clients mean it; down to -2^63: int64's)
    ({"seed": 2**64}, "seed"),
    ({"extra_body": {"top_k": 2**31}}, "top_k"),
    ({"temperature": 1e39}, "temperature"),
    ({"top_p": 1e-300}, "top_p"),
    ({"prompt": [10**9]}, "prompt"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"logit_bias": {"7": 101}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"٧": 1}}, "logit_bias"),  # (an Arabic-Indic seven: int() would take it)
    ({"logit_bias": {"200000": 1}}, "logit_bias"),  # past the vocabulary
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
])
def test_what_the_core_refuses_is_400_naming_the_field(client, fields, param):
    fields = {"prompt": PROMPT, **fields}
    with pytest.raises(openai.BadRequestError) as refused:
        client.completions.create(model="target", **fields)
    assert refused.value.code == "invalid_argument" and refused.value.param == param
    assert param in refused.value.message and "service at" not in refused.value.message


@pytest.mark.parametrize("fields, param", [
    ({"n": 0}, "n"),
    ({"n": 17}, "n"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f", "parameters": {}}], "function_call": "auto"}, "functions"),
    ({"function_call": {"name": "f"}}, "function_call"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),  # (without stream)
])
def test_what_specdec_cannot_honour_is_400_naming_the_field(client, fields, param):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="target", messages=chat(QUESTION), max_tokens=4, **fields)
    assert refused.value.param == param


def test_neutral_values_of_those_fields_are_accepted(client):
    reply = client.chat.completions.create(model="target", messages=chat(QUESTION), max_tokens=4, n=1,
                                           logprobs=False, presence_penalty=0, temperature=0, tool_choice="none",
                                           stream=None, extra_body={"ignore_eos": None})
    assert reply.usage.completion_tokens <= 4


def test_null_stream_and_ignore_eos_are_their_defaults_and_minus_one_seed_and_top_k_are_off(api):
    status, reply = post(api, "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2, "temperature": 0,
                                                             "stream": None, "ignore_eos": None}).encode())
    assert status == 200 and reply["object"] == "text_completion", reply
    seeds = set()
    for _ in range(2):  # llama.cpp's clients' seed -1 (random), vLLM's top_k -1 (off)
        status, reply = post(api, "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 2, "seed": -1,
                                                                 "top_k": -1}).encode())
        assert status == 200, reply
        seeds.add(reply["specdec"]["seed"])
    assert len(seeds) == 2
    # another negative seed (OpenAI's is a signed 64-bit integer) is its two's complement; past int64, refused
    sampled = {"prompt": PROMPT, "max_tokens": 8, "temperature": 1.0}
    replies = [post(api, "/v1/completions", json.dumps({**sampled, "seed": seed}).encode())
               for seed in (-5, 2**64 - 5, -(2**63))]
    assert [status for status, _ in replies] == [200, 200, 200], replies
    assert replies[0][1]["choices"][0]["text"] == replies[1][1]["choices"][0]["text"]
    assert [reply["specdec"]["seed"] for _, reply in replies] == [2**64 - 5, 2**64 - 5, 2**63]
    status, reply = post(api, "/v1/completions", json.dumps({**sampled, "seed": -(2**63) - 1}).encode())
    assert status == 400 and reply["error"]["param"] == "seed", reply


def test_a_predicted_output_is_verified_as_draft_tokens_and_reported(client, api, stub):
    """OpenAI's `prediction`: the output is the target's own whatever it predicts (greedy: the same text),
    the prediction's kept and refused tokens are in usage's completion_tokens_details, and gRPC takes it too."""
    asked = dict(model="target", messages=chat(QUESTION), max_tokens=40, temperature=0)
    plain = client.chat.completions.create(**asked)
    answer = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details is None  # (nothing predicted: nothing to say)
    same = client.chat.completions.create(**asked, prediction={"type": "content", "content": answer})
    assert same.choices[0].message.content == answer
    # (this random model's tokens need not be its text's own: how much of it is kept is gRPC's test, below)
    details = same.usage.completion_tokens_details
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens > 0
    edited = answer[: len(answer) // 2] + " nothing like it at all " + answer[len(answer) // 2 :]
    parts = [{"type": "text", "text": edited[:5]}, {"type": "text", "text": edited[5:]}]
    other = client.chat.completions.create(**asked, prediction={"type": "content", "content": parts})
    assert other.choices[0].message.content == answer
    assert other.usage.completion_tokens_details.rejected_prediction_tokens > 0
    # a prediction the structured output forbids: its tokens are refused (p masked to 0), the output is the choice
    chosen = client.completions.create(model="target", prompt=PROMPT, max_tokens=8, temperature=0,
                                       extra_body={"guided_choice": ["yes", "no"]})
    assert chosen.choices[0].text in ("yes", "no")
    for guess in ("maybe so, or not", chosen.choices[0].text):
        constrained = client.completions.create(model="target", prompt=PROMPT, max_tokens=8, temperature=0,
                                                extra_body={"guided_choice": ["yes", "no"],
                                                            "prediction": {"type": "content", "content": guess}})
        assert constrained.choices[0].text == chosen.choices[0].text
    for bad, says in (({"type": "image", "content": "x"}, "'content'"),
                      ({"type": "content", "content": [{"type": "image_url"}]}, "only text parts")):
        status, reply = post(api, "/v1/completions", json.dumps({"prompt": PROMPT, "max_tokens": 4,
                                                                 "prediction": bad}).encode())
        assert status == 400 and reply["error"]["param"] == "prediction" and says in reply["error"]["message"]
    spoken = grpc_text(stub, prompt=PROMPT, max_new_tokens=40)
    predicted = grpc_text(stub, prompt=PROMPT, max_new_tokens=40, prediction_token_ids=spoken.token_ids)
    assert predicted.token_ids == spoken.token_ids
    # every round keeps its whole offer (4, 8, 16, ...) and a token of its own (past an EOS: dropped)
    kept, rounds = predicted.stats.accepted_prediction_tokens, predicted.stats.rounds
    assert len(spoken.token_ids) - rounds <= kept <= len(spoken.token_ids) and rounds <= 4
    assert predicted.stats.draft_tokens == 0  # (the prediction's tokens are not the draft's)
    with pytest.raises(grpc.RpcError) as refused:
        grpc_text(stub, prompt=PROMPT, max_new_tokens=4, prediction="a", prediction_token_ids=[5])
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "at most one" in refused.value.details()


def test_an_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model="gpt-4o", messages=chat(QUESTION), max_tokens=4)
    assert refused.value.code == "model_not_found" and refused.value.param == "model"


def test_a_request_past_the_targets_kv_cap_is_400_and_one_that_fills_it_runs(client, api):
    """The target holds at most KV_CAP tokens a session (--max-kv-tokens, under its context of 512): a
    request whose prompt and new tokens pass it can never run, so it is a 400 naming the cap (not a
    429 a client would retry), and the models list says so; one that fills the cap exactly runs."""
    for prompt, max_tokens, param in (([5] * (KV_CAP + 10), 4, "prompt"), ([5] * 470, 11, "max_tokens")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.completions.create(model="target", prompt=prompt, max_tokens=max_tokens, temperature=0)
        assert "--max-kv-tokens" in refused.value.message and f"{KV_CAP} tokens" in refused.value.message
        assert refused.value.param == param
    listed = client.models.list().data[0].model_extra
    assert listed["max_model_len"] == KV_CAP
    full = client.completions.create(model="target", prompt=[5] * 470, max_tokens=10, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert full.usage.prompt_tokens + full.usage.completion_tokens == KV_CAP
    # (greedy: a sampled answer of this tiny model may end at an EOS before its 4 tokens)
    again = client.completions.create(model="target", prompt=PROMPT, max_tokens=4, temperature=0)
    assert again.usage.completion_tokens == 4


def test_no_services_is_503_and_sigterm_stops_both_front_doors(tmp_path):
    """A coordinator whose services never come: both doors answer UNAVAILABLE; SIGTERM ends it."""
    port, http_port = free_port(), free_port()
    command = [sys.executable, "-m", "coordinator", "--draft", f"127.0.0.1:{free_port()}", "--target",
               f"127.0.0.1:{free_port()}", "--port", str(port), "--http-port", str(http_port)]
    log = tmp_path / "coordinator.log"
    proc = subprocess.Popen(command, cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"},
                            stdout=log.open("w"), stderr=subprocess.STDOUT)
    try:
        def listening():
            assert proc.poll() is None, log.read_text()
            assert b"coordinator listening" in log.read_bytes()

        eventually(listening, timeout=60)
        with openai.OpenAI(base_url=f"http://127.0.0.1:{http_port}/v1", api_key="none", max_retries=0) as client:
            with pytest.raises(openai.APIStatusError) as refused:
                client.chat.completions.create(model="target", messages=chat(QUESTION))
            assert refused.value.status_code == 503 and refused.value.code == "unavailable"
            with pytest.raises(openai.APIStatusError) as refused:
                client.models.list()
            assert refused.value.status_code == 503
        with pytest.raises(urllib.error.HTTPError) as health:
            urllib.request.urlopen(f"http://127.0.0.1:{http_port}/health", timeout=10)
        assert health.value.code == 503
    finally:
        proc.terminate()
        code = proc.wait(30)
    assert code == 0, log.read_text()


def test_a_coordinator_stopped_under_background_responses_releases_their_sessions(pair):
    """SIGTERM while background responses generate: the coordinator cancels them and their sessions are released
    on both services before it closes its channels to them, and it exits 0."""
    ports = {role: free_port() for role in ("draft", "target")}
    # (unary calls: a generation's call stream, ending with the coordinator, would release them by itself)
    stack = LocalStack(*pair, http_port=0, coordinator_args=["--peer-calls", "unary"],
                       draft_args=["--metrics-port", str(ports["draft"])],
                       target_args=["--metrics-port", str(ports["target"])]).start()
    stack.metrics_ports = ports
    target_service = stack.procs["target"]
    try:
        with openai_client(stack) as client:
            room = client.models.list().data[0].model_extra["max_model_len"] - 64
            # the target stopped, neither response can end before the SIGTERM (continued right after it,
            # it answers the releases the coordinator waits for)
            target_service.send_signal(signal.SIGSTOP)
            held = [client.responses.create(model="target", input=QUESTION[1][1], max_output_tokens=room,
                                            temperature=0, background=True,
                                            extra_body={"ignore_eos": True, "num_speculative_tokens": 2})
                    for _ in range(2)]
            until("both in the draft", lambda: draft_sessions(stack) == 2)
            assert [client.responses.retrieve(made.id).status for made in held] == ["in_progress"] * 2
        coordinator = stack.procs["coordinator"]
        coordinator.send_signal(signal.SIGTERM)
        target_service.send_signal(signal.SIGCONT)
        assert coordinator.wait(60) == 0
        # released before it exited, not left to the services' idle timeout (600 s)
        until("released on both services", lambda: sessions(stack) == (0, 0), timeout=20)
    finally:
        target_service.send_signal(signal.SIGCONT)
        stack.stop()


# ------------------------------------------------------------------ the API key


def test_http_without_the_key_is_401(api):
    with openai.OpenAI(base_url=f"{api.http_url}/v1", api_key="wrong", max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as refused:
            client.models.list()
        assert refused.value.status_code == 401 and refused.value.code == "invalid_api_key"
    for key in (None, KEY[:-1], KEY + "x"):  # (the openai client will not go without one)
        status, reply = post(api, "/v1/completions", b'{"prompt": "x"}', key=key)
        assert status == 401 and set(reply["error"]) == {"message", "type", "param", "code"}
    assert urllib.request.urlopen(f"{api.http_url}/health", timeout=10).status == 200  # open


def test_grpc_without_the_key_is_unauthenticated_but_health_is_open(api, stub):
    request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=4)
    for metadata in ([], [("authorization", "Bearer wrong")], [("authorization", KEY)]):
        with pytest.raises(grpc.RpcError) as refused:
            stub.Generate(request, metadata=metadata, timeout=30)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.GenerateStream(request, metadata=metadata, timeout=30))
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    with grpc.insecure_channel(api.addr) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert health.status == health_pb2.HealthCheckResponse.SERVING
    reply = stub.Generate(request, metadata=BEARER, timeout=30)  # (sampled, unseeded: it may draw the EOS early)
    assert len(reply.token_ids) == 4 or (reply.token_ids and reply.finish_reason == pb.FINISH_REASON_EOS), reply


# ------------------------------------------------------------------ hanging up
#
# The request is held by construction, not by hoping it is slow: the target is stopped (SIGSTOP)
# before it comes, so it gets as far as its first round (the draft proposes, the verification
# waits for the stopped target, well inside the 60 s --call-timeout) and no further, however fast
# the machine. The client hangs up there; the coordinator must cancel the generation and release
# the draft's session while the target is still stopped, and the target's once it is continued.

HELD = {"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "num_speculative_tokens": 2}  # K > 0: the draft first


def draft_sessions(api) -> float:
    return value(scrape(api.metrics_ports["draft"]), "specdec_active_sessions")


def targets(stub) -> list[tuple[str, int]]:
    """(state, requests leased) of each target replica, as the coordinator sees them."""
    replicas = stub.GetInfo(pb.GetInfoRequest(), metadata=BEARER, timeout=10).replicas
    return [(r.state, r.outstanding) for r in replicas if r.role == "target"]


def until(what: str, condition, timeout: float = 30.0) -> None:
    """Wait for condition() (a state, polled) to hold; fail naming `what` after `timeout` s."""
    def check():
        assert condition(), f"not {what} after {timeout:.0f} s"

    eventually(check, timeout)


@contextlib.contextmanager
def target_stopped(api, stub):
    """The target stopped for the block; then continued, and serving in the coordinator's pool again
    (its health checks may have failed meanwhile) before the next test."""
    target = api.procs["target"]
    try:
        freezer(target)(api.target_addr)
        yield
    finally:
        target.send_signal(signal.SIGCONT)
        until("serving again", lambda: targets(stub) == [("serving", 0)])


def readiness(api) -> tuple[int, str, str]:
    """(GET /health's status, the gRPC health of the server (""), of its Generation service)."""
    try:
        status = urllib.request.urlopen(f"{api.http_url}/health", timeout=10).status
    except urllib.error.HTTPError as e:
        status, reply = e.code, json.loads(e.read())
        error = reply["error"]
        assert error["code"] == "unavailable" and "target pool: no healthy replica" in error["message"], error
    with grpc.insecure_channel(api.addr) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        states = [health_pb2.HealthCheckResponse.ServingStatus.Name(
            health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10).status)
            for name in ("", "specdec.v1.Generation")]
    return status, *states


def test_health_says_whether_a_request_would_be_served(api, stub):
    """Ready (HTTP /health 200, the Generation service SERVING) while a target replica is healthy; with the
    target stopped and taken out by its health checks, 503 naming the target pool and NOT_SERVING, while the
    server itself ("", what a liveness probe asks) stays SERVING; ready again once the target is back."""
    assert readiness(api) == (200, "SERVING", "SERVING")
    with target_stopped(api, stub):
        until("taken out", lambda: targets(stub) == [("unhealthy", 0)])
        until("not ready", lambda: readiness(api) == (503, "SERVING", "NOT_SERVING"))
    until("ready again", lambda: readiness(api) == (200, "SERVING", "SERVING"))


def cancelled_and_released(api, before: float, n: int = 1) -> None:
    assert cancelled(api, "/v1/completions") == before + n
    assert sessions(api) == (0, 0)


def test_a_background_response_is_polled_and_cancelled(api, client, stub):
    """background: the response comes back queued at once and its generation runs on: polled, it ends as the
    same request's unary answer; cancelled while the target cannot answer, it reads cancelled and its sessions
    are released. Refused with store false; only a background response is cancelled."""
    asked = dict(model="target", instructions=QUESTION[0][1], input=QUESTION[1][1], max_output_tokens=12,
                 temperature=0)
    unary = client.responses.create(**asked)
    queued = client.responses.create(**asked, background=True)
    assert queued.status == "queued" and queued.background and queued.output == []

    def ended():
        got = client.responses.retrieve(queued.id)
        assert got.status not in ("queued", "in_progress")
        return got
    polled = eventually(ended, timeout=60)
    assert (polled.status, polled.output_text) == (unary.status, unary.output_text)
    assert client.responses.cancel(queued.id).status == polled.status  # (ended: as it ended)
    until("free of sessions", lambda: sessions(api) == (0, 0))
    with target_stopped(api, stub):
        held = client.responses.create(**asked, background=True, extra_body={"num_speculative_tokens": 2})
        with pytest.raises(openai.BadRequestError, match="completed"):  # (not to be continued yet)
            client.responses.create(model="target", input="and?", previous_response_id=held.id)
        until("in the draft", lambda: draft_sessions(api) == 1)
        assert client.responses.retrieve(held.id).status == "in_progress"
        assert client.responses.cancel(held.id).status == "cancelled"
        until("released on the draft", lambda: draft_sessions(api) == 0)
    assert client.responses.retrieve(held.id).status == "cancelled"
    until("free of sessions", lambda: sessions(api) == (0, 0))
    for refused, param in (({"store": False}, "background"), ({"stream": True, "store": False}, "background"),
                           ({"max_output_tokens": 100_000}, "max_output_tokens")):
        status, answer = post(api, "/v1/responses", json.dumps({**asked, "background": True, **refused}).encode())
        assert status == 400 and answer["error"]["param"] == param, answer
    with pytest.raises(openai.BadRequestError, match="background"):
        client.responses.cancel(unary.id)


def get(api, path: str) -> tuple[int, dict]:
    """(status, JSON body) of a raw GET."""
    request = urllib.request.Request(api.http_url + path, headers={"Authorization": f"Bearer {KEY}"})
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.load(r)
    except urllib.error.HTTPError as e:
        return e.code, json.load(e)


def test_a_background_stream_outlives_its_client_and_is_streamed_again(api, client, stub):
    """background with stream: its events come as they are made, numbered from 0; its client hanging up stops
    nothing (it generates on, nobody reading), and GET ?stream=true&starting_after=N gives the events after N,
    those made meanwhile and those to come, to the end the same request's unary answer has; without
    starting_after, every one again. Refused (400): stream again a response made otherwise, a stream or
    starting_after that is not one."""
    asked = dict(model="target", instructions=QUESTION[0][1], input=QUESTION[1][1], max_output_tokens=12,
                 temperature=0, extra_body={"num_speculative_tokens": 2})
    unary = client.responses.create(**asked)
    until("free of sessions", lambda: sessions(api) == (0, 0))
    with target_stopped(api, stub):  # (held: nothing past its first events is made while its client reads)
        stream = client.responses.create(**asked, background=True, stream=True)
        events = iter(stream)
        seen = [next(events), next(events), next(events)]
        assert [e.type for e in seen] == ["response.created", "response.queued", "response.in_progress"]
        assert seen[0].response.status == "queued" and seen[0].response.background
        made = seen[0].response.id
        stream.close()  # (its client gone)
        until("in the draft", lambda: draft_sessions(api) == 1)
        assert client.responses.retrieve(made).status == "in_progress"
    rest = list(client.responses.retrieve(made, stream=True, starting_after=seen[-1].sequence_number))
    assert rest[-1].type == f"response.{unary.status}"
    assert rest[-1].response.output_text == unary.output_text
    every = seen + rest
    assert [e.sequence_number for e in every] == list(range(len(every)))
    assert "".join(e.delta for e in every if e.type == "response.output_text.delta") == unary.output_text
    again = client.responses.retrieve(made, stream=True)
    assert [e.model_dump() for e in again] == [e.model_dump() for e in every]
    assert client.responses.retrieve(made).status == unary.status
    until("free of sessions", lambda: sessions(api) == (0, 0))
    for query, param in ((f"{unary.id}?stream=true", "stream"), (f"{made}?stream=yes", "stream"),
                         (f"{made}?stream=true&starting_after=x", "starting_after"),
                         (f"{made}?stream=true&starting_after=-2", "starting_after"),
                         (f"{made}?stream=true&starting_after=--5", "starting_after"),
                         (f"{made}?stream=true&starting_after=%C2%B2", "starting_after")):
        status, answer = get(api, f"/v1/responses/{query}")
        assert status == 400 and answer["error"]["param"] == param, (query, answer)


def test_a_background_stream_cancelled_ends_its_followers_streams(api, client, stub):
    """Cancelled while its creator and a second follower read it: both streams end, without an ending event;
    it reads cancelled, streamed again its events up to then, and its sessions are released."""
    until("free of sessions", lambda: sessions(api) == (0, 0))
    with target_stopped(api, stub):
        stream = client.responses.create(model="target", input=QUESTION[1][1], max_output_tokens=12, temperature=0,
                                         background=True, stream=True, extra_body={"num_speculative_tokens": 2})
        events = iter(stream)
        seen = [next(events), next(events), next(events)]
        made = seen[0].response.id
        follower = client.responses.retrieve(made, stream=True, starting_after=1)
        followed = iter(follower)
        assert next(followed).type == "response.in_progress"
        until("in the draft", lambda: draft_sessions(api) == 1)
        assert client.responses.cancel(made).status == "cancelled"
        assert list(events) == [] and list(followed) == []
        until("released on the draft", lambda: draft_sessions(api) == 0)
    assert client.responses.retrieve(made).status == "cancelled"
    assert [e.type for e in client.responses.retrieve(made, stream=True)] == [e.type for e in seen]
    until("free of sessions", lambda: sessions(api) == (0, 0))


def test_a_streamed_response_is_kept_from_its_first_event_and_cancelled_with_its_client(api, client, stub):
    """Stored and streamed: GET reads it in progress while it generates, with its output so far (the text the
    stream has brought, at least what its client has read); its client gone, it reads cancelled."""
    until("free of sessions", lambda: sessions(api) == (0, 0))
    target = api.procs["target"]
    api.hook.arm("target", "write", False, 8, freezer(target))  # (held at its ninth round: it cannot end)
    try:
        stream = client.responses.create(model="target", input=QUESTION[1][1], max_output_tokens=300, temperature=0,
                                         stream=True, extra_body={"ignore_eos": True})
        events = iter(stream)
        created = next(events)
        assert created.type == "response.created"
        read = ""
        for event in events:  # (to its first text)
            if event.type == "response.output_text.delta":
                read += event.delta
                break
        assert read
        assert api.hook.done.wait(60) and not api.hook.errors, api.hook.errors
        now = client.responses.retrieve(created.response.id)
        assert now.status == "in_progress"
        [item] = now.output
        assert item.type == "message" and item.status == "in_progress" and now.output_text.startswith(read)
        stream.close()
        until("released on the draft", lambda: draft_sessions(api) == 0)
    finally:
        api.hook.disarm()
        target.send_signal(signal.SIGCONT)
    until("serving again", lambda: targets(stub) == [("serving", 0)])
    assert client.responses.retrieve(created.response.id).status == "cancelled"
    until("free of sessions", lambda: sessions(api) == (0, 0))


@pytest.mark.parametrize("stream, n", [(False, 1), (True, 1), (False, 3), (True, 3)])
def test_a_request_whose_client_hangs_up_is_cancelled_and_frees_its_sessions(api, stub, stream, n):
    """Unary, and streamed before its first event (the response starts after the first round); one
    choice, and three (each a generation of its own: all are cancelled)."""
    until("free of sessions", lambda: sessions(api) == (0, 0))  # what earlier tests held is released
    before = cancelled(api, "/v1/completions")
    body = json.dumps({**HELD, "stream": stream, "n": n}).encode()
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(body)}\r\n\r\n").encode()
    host, port = api.http_url.removeprefix("http://").split(":")
    with target_stopped(api, stub):
        with socket.create_connection((host, int(port))) as conn:
            conn.sendall(head + body)
            # in flight: the draft holds its session, the target replica is leased to it (its call on the way)
            until("in the draft", lambda: draft_sessions(api) == n)
            until("leased the target", lambda: [leased for _, leased in targets(stub)] == [n])
        # hung up: the generation is cancelled while the target still cannot answer
        until("released on the draft", lambda: draft_sessions(api) == 0)
    eventually(lambda: cancelled_and_released(api, before, n), timeout=30)
