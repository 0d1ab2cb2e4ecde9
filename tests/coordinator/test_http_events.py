"""The HTTP API's event stream over several choices (coordinator/http.py OpenAIApi.events), with
generations faked: each choice's rounds come through, a choice that fails ends the stream with an
error event and [DONE] (a CancelledError from below included: it hung the stream), and the other
choices' generations are closed."""

from __future__ import annotations

import asyncio
import json

import pytest

from coordinator.generation import Chunk, Finish, Summary
from coordinator.http import CHAT, OpenAIApi, chat_choice
from speculative.errors import InvalidRequest
from speculative.round import Stats


def summary() -> Summary:
    return Summary(Stats(generated_tokens=3), 4, True, 1, 3, 1.0)


async def generation(name: str, rounds: int, closed: list[str], fail: BaseException | None = None):
    """A choice's chunks: `rounds` of text (the third raising `fail`), then the last with its summary."""
    try:
        for i in range(rounds):
            await asyncio.sleep(0)  # (the other choices' turn)
            if fail is not None and i == 2:
                raise fail
            yield Chunk([1], f"{name}{i} ")
        yield Chunk([], "", Finish.EOS, summary())
    finally:
        closed.append(name)


def events(streams: list) -> list:
    async def run():
        firsts = [await anext(stream) for stream in streams]
        api = OpenAIApi.__new__(OpenAIApi)
        sent = api.events(firsts, streams, CHAT, {"id": "x"}, True, [chat_choice] * len(streams))
        return [e async for e in sent]

    out = asyncio.run(asyncio.wait_for(run(), timeout=60))
    return [e.removeprefix("data: ").strip() for e in out]


def test_each_choices_rounds_come_through_and_the_usage_counts_them_all():
    closed = []
    sent = events([generation("a", 3, closed), generation("b", 4, closed)])
    assert sent[-1] == "[DONE]"
    parsed = [json.loads(e) for e in sent[:-1]]
    texts = {0: "", 1: ""}
    for e in parsed[:-1]:
        for choice in e["choices"]:
            texts[choice["index"]] += choice["delta"].get("content") or ""
    assert texts == {0: "a0 a1 a2 ", 1: "b0 b1 b2 b3 "}
    assert parsed[-1]["usage"]["completion_tokens"] == 6 and sorted(closed) == ["a", "b"]


@pytest.mark.parametrize("fail,status", [(InvalidRequest("boom"), "invalid_argument"),
                                         (asyncio.CancelledError(), "unavailable")])
def test_a_choice_that_fails_ends_the_stream_with_an_error_and_closes_the_others(fail, status):
    closed = []
    sent = events([generation("a", 50, closed), generation("b", 5, closed, fail=fail)])
    assert sent[-1] == "[DONE]"
    error = json.loads(sent[-2])["error"]
    assert error["code"] == status, error
    assert sorted(closed) == ["a", "b"]


def test_the_usage_says_the_prompt_tokens_taken_cached_once_a_prompt():
    from coordinator.http import together, usage

    def made(prompt: int, cached: int) -> Summary:
        return Summary(Stats(generated_tokens=2, cached_prompt_tokens=cached), 4, True, 1, prompt, 1.0)

    assert usage(made(30, 24))["prompt_tokens_details"] == {"cached_tokens": 24}
    assert usage(made(30, 0))["prompt_tokens_details"] == {"cached_tokens": 0}
    # two prompts x n = 2: each prompt's first choice counts, as its prompt tokens do
    both = together([made(30, 24), made(30, 24), made(50, 0), made(50, 40)], 2)
    assert usage(both) == {"prompt_tokens": 80, "completion_tokens": 8, "total_tokens": 88,
                           "prompt_tokens_details": {"cached_tokens": 24}}


@pytest.mark.parametrize("started", [False, True])
def test_a_request_cancelled_past_the_shutdown_grace_is_a_503_where_nothing_was_sent(started):
    """uvicorn cancels the requests left when a stop's grace runs out: one that has sent nothing gets OpenAI's
    error object, 503 (uvicorn would send a bare 500); a response under way that is not a stream is cut (the
    cancel goes on)."""
    from coordinator.http import AnswerPastGrace

    async def application(scope, receive, send):
        if started:
            await send({"type": "http.response.start", "status": 200, "headers": []})
        raise asyncio.CancelledError

    async def go():
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.disconnect"}

        try:
            await AnswerPastGrace(application)({"type": "http", "method": "POST", "path": "/v1/completions",
                                                "headers": []}, receive, send)
        except asyncio.CancelledError:
            return None
        return sent

    sent = asyncio.run(go())
    if started:
        assert sent is None
        return
    assert sent[0]["status"] == 503
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body["error"]["code"] == "unavailable" and "stopping" in body["error"]["message"]


@pytest.mark.parametrize("spec", ["2.3", "2.4"])  # (uvicorn's h11 server: 2.3, where starlette reads disconnects)
@pytest.mark.parametrize("kind", ["chat", "responses"])
def test_a_stream_cut_past_the_shutdown_grace_ends_with_its_error_event(kind, spec):
    """A stream under way when the grace runs out ends with its own error event (a chat's or a completion's then
    [DONE]; a Responses stream's numbered after the events it sent) and a complete body, instead of a connection
    closed mid-body and a traceback logged (uvicorn's, for the cancel the middleware let through)."""
    import itertools

    from coordinator.http import AnswerPastGrace, EventStream, event
    from coordinator.responses import cut_at, sse_event

    number = itertools.count()

    async def source():
        yield event({"choices": []}) if kind == "chat" else sse_event("response.created", next(number))
        await asyncio.Event().wait()  # (a generation that goes on until the server cuts it)

    cut = None if kind == "chat" else cut_at(lambda: next(number))

    async def go():
        sent, first = [], asyncio.Event()

        async def send(message):
            sent.append(message)
            if message.get("body"):
                first.set()

        async def receive():
            await asyncio.Event().wait()  # (the client reads on)

        scope = {"type": "http", "method": "POST", "path": "/v1/x", "headers": [], "asgi": {"spec_version": spec}}
        serving = asyncio.ensure_future(AnswerPastGrace(EventStream(source(), cut=cut))(scope, receive, send))
        await first.wait()
        serving.cancel()  # (as uvicorn does when the grace runs out)
        await serving  # (answered: not raised to uvicorn)
        return sent

    sent = asyncio.run(go())
    assert sent[-1]["more_body"] is False
    body = b"".join(m.get("body", b"") for m in sent[1:]).decode()
    if kind == "chat":
        error = json.loads(body.split("data: ")[-2])["error"]
        assert body.endswith("data: [DONE]\n\n")
    else:
        last = body.split("\n\n")[-2]
        assert last.startswith("event: error\n")
        error = json.loads(last.split("data: ")[1])
        assert error["sequence_number"] == 1 and error["type"] == "error"
    assert error["code"] == "unavailable" and "shutdown grace" in error["message"]
