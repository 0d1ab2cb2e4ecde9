"""OpenAI's Responses API, `POST /v1/responses`, over the chat path (coordinator/http.py).

A request's `input` (a string, or a list of items: messages with text content, earlier
`function_call`s and their `function_call_output`s) and `instructions` become a chat's messages;
`max_output_tokens`, `temperature`, `top_p`, `text.format` (text, json_object, json_schema: the
structured output), function `tools`, `tool_choice` and `parallel_tool_calls` become the chat's
fields, and the specdec and vLLM extras the chat reads (`top_k`, `min_p`, `seed`, `stop`, `stop_token_ids`,
`min_tokens`, penalties, `num_speculative_tokens`, ...) are read as the chat reads them. The answer
is a `response` object whose `output` holds a `message` item (its `output_text`) and a
`function_call` item per tool call; `status` is `incomplete` (`max_output_tokens`) where the output
ran to its limit. Streamed (`"stream": true`): the Responses events (`response.created`, ...,
`response.output_text.delta` per round that brought text, ..., `response.completed` or
`response.incomplete`; a failure after the first is an `error` event); with tools in play the items
come as the chat's stream gives them (ToolReply): text as it comes, a named function's arguments as
they come, other calls each once whole.

Kept responses (`store`, true unless the request says false; `--store-responses` most, about
`--store-responses-mb` of them, the oldest dropped first, in this coordinator's memory; a streamed one from
its first event, with its output so far): `GET /v1/responses/{id}` answers one again, `DELETE`
forgets it, `GET /v1/responses/{id}/input_items` lists its input items, and a request naming it as
`previous_response_id` continues its conversation: its input and output, and its predecessors', come
before the new input (its `instructions` do not carry over, as OpenAI's do not). An id this
coordinator does not keep (never stored, forgotten, another replica's) is 404 (400 as previous_response_id, as
OpenAI's). `background` (stored): the response comes back queued and generates on (poll GET; POST
/v1/responses/{id}/cancel stops it); with `stream` its events come as they are made and are kept with it, its
generation going on if its client hangs up: `GET /v1/responses/{id}?stream=true&starting_after=N` streams them
again after sequence number N (all without it), and those to come as they come. Not supported (400):
other item and tool types (images, files, built-in tools). `truncation: "auto"` drops the conversation's first
messages where it would not leave the output its room in the context. `top_logprobs` (0-20) or `include:
["message.output_text.logprobs"]` give each output_text token's log-probability (the chat's entries:
token, logprob, bytes, top_logprobs) on the part and on each delta; not where tools are in play.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import re
import time
import uuid
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from speculative.protocol import MAX_TOP_LOGPROBS

from .generation import Chunk, InvalidRequest, Summary, prompt_ids
from .http import (CHAT, CORE_ERRORS, FINISH, STORE_BYTES, ApiError, Body, ChatBody, ChatMessage, EventStream,
                   OpenAIApi, Reply, ToolReply, chat_request, core_error, parse, seen, specdec_fields, specdec_headers,
                   unless_hung_up, usage)
from .logprobs import ChoiceLogprobs

# a chat's field -> the Responses API's, in refusals
FIELDS = {"messages": "input", "max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
          "response_format": "text"}
LOGPROBS = "message.output_text.logprobs"  # (what `include` names for them)
# what else OpenAI's `include` may name: of items this API does not make (read, and nothing to add), so that a
# client asking for them always (reasoning.encrypted_content, say) is served; any other value is 400
INCLUDES = {LOGPROBS, "reasoning.encrypted_content", "file_search_call.results", "web_search_call.results",
            "web_search_call.action.sources", "message.input_image.image_url", "computer_call_output.output.image_url",
            "code_interpreter_call.outputs"}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")
log = logging.getLogger("specdec.coordinator")
ENDED = ("completed", "incomplete")  # the statuses of a response a previous_response_id may continue
ITEM_FIELDS = {"message": ("role", "content"), "function_call": ("call_id", "name", "arguments"),
               "function_call_output": ("call_id", "output")}  # (what with_ids keeps of each)
ITEM_IDS = {"message": "msg", "function_call": "fc", "function_call_output": "fco"}  # (their ids' prefixes)


class ResponsesBody(Body):
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    text: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    truncation: str | None = None
    user: str | None = None
    background: bool | None = None


def refused(error: Exception, body: ResponsesBody) -> ApiError:
    """A chat path's refusal in this API's terms: the field as this API names it."""
    made = error if isinstance(error, ApiError) else core_error(error, "max_output_tokens")
    param, message = made.param, str(made)
    if made.status == 400 and param is None and "constraint" in message:  # (its structured output's or tools')
        param = "tools" if body.tools else "text" if format_of(body) is not None else None
    if param in FIELDS:
        message = message.replace(param, FIELDS[param])
    return ApiError(made.status, message, FIELDS.get(param, param), made.code)


def format_of(body: ResponsesBody) -> dict | None:
    """text.format as the chat's response_format (None: plain text)."""
    fmt = (body.text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        if "schema" not in fmt:
            raise ApiError(400, "text.format: a json_schema format needs its schema", "text")
        return {"type": "json_schema", "json_schema": {"name": fmt.get("name", "output"), "schema": fmt["schema"],
                                                      "strict": fmt.get("strict")}}
    raise ApiError(400, f"text.format.type must be text, json_object or json_schema, not {kind!r}", "text")


def text_of(content: Any, where: str) -> str:
    """An input message's content: a string, or a list of text parts (joined by newlines)."""
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS
                                         and isinstance(p.get("text"), str) for p in content):
        return "\n".join(p["text"] for p in content)
    raise ApiError(400, f"{where}.content: a string or a list of text parts (input_text, output_text); other"
                        " parts are not supported", "input")


def input_items(body: ResponsesBody) -> list[dict]:
    """The request's input as items (a string: one user message)."""
    return [{"type": "message", "role": "user", "content": body.input}] if isinstance(body.input, str) else body.input


def messages_of(body: ResponsesBody) -> list[ChatMessage]:
    """The input as a chat's messages: earlier function calls as an assistant's tool calls (consecutive
    ones one message), their outputs as tool messages."""
    messages = []
    for i, item in enumerate(input_items(body)):
        where, kind = f"input[{i}]", item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
            if role is None:
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer, not"
                                    f" {item.get('role')!r}", "input")
            messages.append(ChatMessage(role=role, content=text_of(item.get("content"), where)))
        elif kind == "function_call":
            fields = [item.get(name) for name in ("call_id", "name", "arguments")]
            if not all(isinstance(value, str) for value in fields):
                raise ApiError(400, f"{where}: a function_call has call_id, name and arguments, strings", "input")
            call = {"id": fields[0], "type": "function", "function": {"name": fields[1], "arguments": fields[2]}}
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # (its text and calls: one turn, as the chat's)
                last.tool_calls = [*(last.tool_calls or []), call]
            else:
                messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
        elif kind == "function_call_output":
            output = item.get("output")
            if not isinstance(item.get("call_id"), str) or not isinstance(output, str | list):
                raise ApiError(400, f"{where}: a function_call_output has call_id and output, strings", "input")
            messages.append(ChatMessage(role="tool", tool_call_id=item["call_id"],
                                        content=output if isinstance(output, str) else text_of(output, where)))
        else:
            raise ApiError(400, f"{where}.type {kind!r} is not supported (message, function_call,"
                                " function_call_output)", "input", "unsupported_parameter")
    return messages


def answered(before: list[ChatMessage], given: list[ChatMessage]) -> None:
    """400 where the input does not answer a call the previous response ended with (a function_call_output for
    each), or answers a call no message before it made."""
    last = before[-1] if before else None
    waiting = [call["id"] for call in (last.tool_calls or [])] if last is not None and last.role == "assistant" else []
    outputs = {message.tool_call_id for message in given if message.role == "tool"}
    made = set()  # (an answer to a call never made first: it names the mistake, where a call then goes unanswered)
    for message in [*before, *given]:
        made.update(call["id"] for call in message.tool_calls or [])
        if message.role == "tool" and message.tool_call_id not in made:
            raise ApiError(400, f"input: a function_call_output answers {message.tool_call_id!r}, a call no"
                                " function_call before it made", "input")
    missing = [call for call in waiting if call not in outputs]
    if missing:
        raise ApiError(400, f"input: no function_call_output for the previous response's call {missing[0]!r}",
                       "input")


def chat_tools(body: ResponsesBody) -> tuple[list[dict] | None, str | dict | None]:
    """The function tools and tool_choice in the chat's form ({"type": "function", "function": {...}})."""
    tools = []
    for i, tool in enumerate(body.tools or []):
        if tool.get("type") != "function":
            raise ApiError(400, f"tools[{i}].type {tool.get('type')!r} is not supported: function tools only",
                           "tools", "unsupported_parameter")
        tools.append({"type": "function", "function": {k: v for k, v in tool.items() if k != "type"}})
    choice = body.tool_choice
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise ApiError(400, 'tool_choice: "none", "auto", "required" or {"type": "function", "name": ...}',
                           "tool_choice")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    return tools or None, choice


def chat_body(body: ResponsesBody, messages: list[ChatMessage]) -> ChatBody:
    """The chat that answers `body`, over `messages` (its conversation before the instructions)."""
    if not any(m.role != "system" for m in messages):
        raise ApiError(400, "input: give at least one message", "input")
    if body.instructions:
        messages = [ChatMessage(role="system", content=body.instructions), *messages]
    if body.truncation not in (None, "disabled", "auto"):
        raise ApiError(400, f"truncation must be auto or disabled, not {body.truncation!r}", "truncation")
    if body.n not in (None, 1):
        raise ApiError(400, f"n={body.n!r} is not supported", "n", "unsupported_parameter")
    if body.max_output_tokens is not None and body.max_output_tokens <= 0:
        raise ApiError(400, f"max_output_tokens must be > 0, not {body.max_output_tokens}", "max_output_tokens")
    top = body.top_logprobs
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"top_logprobs must be between 0 and {MAX_TOP_LOGPROBS}, not {top}", "top_logprobs")
    for i, name in enumerate(body.include or []):
        if name not in INCLUDES:
            raise ApiError(400, f"include[{i}]: {name!r} is not one of {', '.join(sorted(INCLUDES))}", "include")
    scored = bool(top) or LOGPROBS in (body.include or [])
    tools, choice = chat_tools(body)
    shared = {name: getattr(body, name) for name in Body.model_fields
              if name not in ("max_tokens", "n", "stream", "stream_options", "response_format")}
    return ChatBody(**shared, messages=messages, max_completion_tokens=body.max_output_tokens,
                    response_format=format_of(body), tools=tools, tool_choice=choice,
                    parallel_tool_calls=body.parallel_tool_calls, logprobs=scored or None,
                    top_logprobs=top if scored else None)


async def truncated(api: OpenAIApi, body: ResponsesBody, conversation: list[ChatMessage]) -> list[ChatMessage]:
    """truncation auto: the conversation from its first message on that leaves the output its room in the context
    (max_output_tokens, else one token), its first messages dropped but its system (developer) ones; never starting
    at a tool's output. All of it where it fits, the last message alone where nothing does (then refused)."""
    models = api.coordinator.ready()
    need = body.max_output_tokens or 1

    def kept_from(start: int) -> list[ChatMessage]:
        return [*(m for m in conversation[:start] if m.role == "system"), *conversation[start:]]

    async def fits(start: int) -> bool:
        [(generation, _)] = chat_request(chat_body(body, kept_from(start)))
        try:
            return len(await prompt_ids(generation, models)) + need <= models.max_context
        except InvalidRequest:  # (refused before it is tokenized: more messages or characters than the context holds)
            return False

    starts = [i for i, message in enumerate(conversation) if message.role not in ("tool", "system")]
    if not starts or await fits(0):
        return conversation
    low, high = 0, len(starts) - 1  # the first start that fits, by halves (a shorter conversation never needs more)
    while low < high:
        middle = (low + high) // 2
        if await fits(starts[middle]):
            high = middle
        else:
            low = middle + 1
    return kept_from(starts[low])


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_usage(summary: Summary) -> dict:
    counts = usage(summary)
    return {"input_tokens": counts["prompt_tokens"],
            "input_tokens_details": {"cached_tokens": counts["prompt_tokens_details"]["cached_tokens"],
                                     "cache_write_tokens": 0},
            "output_tokens": counts["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": counts["total_tokens"]}


def message_item(text: str, status: str, item_id: str | None = None) -> dict:
    return {"type": "message", "id": item_id or new_id("msg"), "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def output_of(choice: dict) -> list[dict]:
    """A chat choice's message as output items: its text (where it has some, or no calls), then its calls."""
    message = choice["message"]
    calls = message.get("tool_calls") or []
    items = [message_item(message.get("content") or "", "completed")] if message.get("content") or not calls else []
    items += [{"type": "function_call", "id": new_id("fc"), "call_id": call["id"], "name": call["function"]["name"],
               "arguments": call["function"]["arguments"], "status": "completed"} for call in calls]
    items[-1]["status"] = status_of(choice["finish_reason"])  # (the last, cut at max_output_tokens: incomplete)
    return items


@dataclass
class Kept:
    """A kept response: its object as answered, its input items (each with an id), and the conversation a
    request naming it as previous_response_id continues (its predecessors', its input and its output)."""

    response: dict
    items: list[dict]
    conversation: list[ChatMessage]
    task: asyncio.Task | None = None  # a background response's generation, while it runs
    size: int = 0  # bytes it holds, about: its object's and its items' JSON, and its events (Store.weigh)
    events: list[str] | None = None  # a background response created with stream: its events so far, in order
    grew: asyncio.Event | None = None  # set (and replaced) at each event and at the end: what followers wait on

    def emit(self, event: str | None = None) -> None:
        """A background stream's next event (None: its end, its task gone), for whoever follows it (follow)."""
        if event is not None:
            self.events.append(event)
        self.grew.set()
        self.grew = asyncio.Event()


class Store:
    """The responses this coordinator keeps, at most `most` and about `most_bytes` of them (the oldest dropped
    first; the newest kept whatever its size)."""

    def __init__(self, most: int, most_bytes: int = STORE_BYTES):
        self.most, self.most_bytes = most, most_bytes
        self.kept: OrderedDict[str, Kept] = OrderedDict()
        self.bytes = 0

    def add(self, kept: Kept) -> None:
        self.kept[kept.response["id"]] = kept
        self.weigh(kept)

    def weigh(self, kept: Kept) -> None:
        """Count the kept response's bytes as they are now (it has ended, or just been kept), dropping the oldest
        past the bounds."""
        size = len(json.dumps(kept.response)) + len(json.dumps(kept.items)) + sum(map(len, kept.events or ()))
        if kept.response["id"] in self.kept:
            self.bytes += size - kept.size
        kept.size = size
        self.evict()

    def grew(self, kept: Kept, size: int) -> None:
        """A kept background stream's new event of `size` bytes, counted as it comes."""
        if kept.response["id"] in self.kept:
            kept.size += size
            self.bytes += size
            self.evict()

    def evict(self) -> None:
        while len(self.kept) > self.most or self.bytes > self.most_bytes and len(self.kept) > 1:
            _, dropped = self.kept.popitem(last=False)
            self.bytes -= dropped.size
            if dropped.task is not None:  # (a background response still running: nobody could read it)
                dropped.task.cancel()

    def get(self, response_id: str, param: str | None = None) -> Kept:
        """-> the kept response, else 404 (`param`: the field that named it, previous_response_id: then 400, as
        OpenAI's)."""
        kept = self.kept.get(response_id)
        if kept is None:
            whose = "previous response" if param else "response"
            raise ApiError(400 if param else 404, f"no {whose} with id {response_id!r} is kept here (never stored,"
                                                  f" deleted, dropped for newer ones past --store-responses, or kept"
                                                  f" by another coordinator)", param,
                           "previous_response_not_found" if param else "not_found")
        if param and kept.response["status"] not in ENDED:  # (a background one: its conversation has no output)
            raise ApiError(400, f"the previous response {response_id!r} is {kept.response['status']}: continue one"
                                " that has completed", param)
        return kept

    async def close(self) -> None:
        """The background responses still generating cancelled, their sessions released (the server stopping: what
        they would make is kept nowhere once it has stopped)."""
        tasks = [kept.task for kept in self.kept.values() if kept.task is not None]
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def forget(self, response_id: str) -> None:
        """Drop it (a background one's generation cancelled)."""
        kept = self.get(response_id)
        del self.kept[response_id]
        self.bytes -= kept.size
        if kept.task is not None:
            kept.task.cancel()


def with_ids(items: list[dict]) -> list[dict]:
    """Input items as kept: their fields that a conversation reads (no more: a client's other fields are not worth
    memory), each with an id (its own where it is a string not given before), a message's content as text parts
    (input_text, an assistant's output_text) and its status."""
    out, seen_ids = [], set()
    for item in items:
        kind = item.get("type", "message")
        made = {"type": kind, **{name: item[name] for name in ITEM_FIELDS.get(kind, ()) if name in item}}
        given = item.get("id")
        made["id"] = given if isinstance(given, str) and given and given not in seen_ids else \
            new_id(ITEM_IDS.get(kind, "item"))
        seen_ids.add(made["id"])
        if kind == "message":
            content = made.get("content")
            part = "output_text" if made.get("role") == "assistant" else "input_text"
            parts = [{"type": part, "text": content}] if isinstance(content, str) else content
            made["content"] = [{"type": p.get("type", part), "text": p.get("text")} for p in parts]
            made["status"] = "completed"
        elif kind == "function_call_output" and isinstance(made.get("output"), list):
            made["output"] = [{"type": p.get("type"), "text": p.get("text")} for p in made["output"]]
        out.append(made)
    return out


def said(output: list[dict]) -> ChatMessage:
    """A response's output items as the assistant's turn of a chat: its text and its calls."""
    text = "".join(part["text"] for item in output if item["type"] == "message" for part in item["content"])
    calls = [{"id": item["call_id"], "type": "function",
              "function": {"name": item["name"], "arguments": item["arguments"]}}
             for item in output if item["type"] == "function_call"]
    return ChatMessage(role="assistant", content=text if text or not calls else None, tool_calls=calls or None)


class Answer:
    """One response: its fixed fields (`head`), the object at each state, and (`end`) the object it ends
    at, kept where the request is stored (`store`: where, else None)."""

    def __init__(self, body: ResponsesBody, model: str, store: Store | None = None,
                 conversation: list[ChatMessage] = ()):
        """conversation: the chat's messages before the instructions (the previous response's and the input's)."""
        fmt = (body.text or {}).get("format") or {"type": "text"}
        self.store = store if store is not None and store.most > 0 and body.store is not False else None
        self.items, self.conversation = input_items(body), list(conversation)
        self.kept: Kept | None = None
        self.body = body
        self.head = {
            "id": new_id("resp"), "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice or "auto", "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {"format": fmt}, "metadata": body.metadata or {}, "store": self.store is not None,
            "previous_response_id": body.previous_response_id, "truncation": body.truncation or "disabled",
            "user": body.user, "reasoning": None, "background": bool(body.background),
        }

    def at(self, status: str, output: list[dict], summary: Summary | None = None, error: dict | None = None) -> dict:
        return {**self.head, "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "output": output, "usage": response_usage(summary) if summary else None,
                **({"specdec": specdec_fields(summary)} if summary else {})}

    def keep(self, status: str, output: list[dict] | None = None) -> Kept:
        """The response kept at `status` before it ends (a background one's: queued; a streamed one's
        in_progress, with its output as it grows: `output`, the stream's own list)."""
        self.kept = Kept(self.at(status, [] if output is None else output), with_ids(self.items), self.conversation)
        self.store.add(self.kept)
        return self.kept

    def end(self, status: str, output: list[dict], summary: Summary) -> dict:
        """The response's last object, kept where it is stored."""
        response = self.at(status, output, summary)
        if self.store is not None:
            kept = self.kept or self.keep(status)
            kept.response, kept.conversation = response, [*self.conversation, said(output)]
            self.store.weigh(kept)
        return response

    def stop(self, status: str, error: Exception | None = None) -> None:
        """A kept response that has not ended: ended at `status` (failed with `error`, a refusal; cancelled)."""
        if self.kept is not None and self.kept.response["status"] in ("queued", "in_progress"):
            made = None if error is None else refused(error, self.body) if isinstance(error, (ApiError, *CORE_ERRORS)) \
                else ApiError(500, f"internal error: {type(error).__name__}", None, "server_error")
            self.kept.response = self.at(status, [], error=None if made is None else {
                "code": made.code or "server_error", "message": str(made)})


def status_of(finish: str) -> str:
    """A response's status by its finish_reason: incomplete where the output ran to max_output_tokens."""
    return "incomplete" if finish == "length" else "completed"


def entries(scorer: ChoiceLogprobs | None, chunk: Chunk) -> list[dict]:
    """The logprobs entries of a chunk's tokens (its text's: an ending token's left out, as the chat's)."""
    tokens, scores = seen(chunk, CHAT)
    made = scorer(tokens, scores) if scorer is not None and scores is not None else None
    return made["content"] if made else []


async def whole(chunks: AsyncIterator[Chunk], reply: Reply, answer: Answer,
                scorer: ChoiceLogprobs | None = None) -> tuple[dict, Summary]:
    """The answer once its generation has ended: (its last object, kept where stored; the summary)."""
    pieces, scored = [], []
    async with contextlib.aclosing(chunks):
        async for chunk in chunks:
            pieces.append(chunk.text)
            scored += entries(scorer, chunk)
    finish = FINISH[chunk.finish]
    output = output_of(reply("".join(pieces), finish, False, True)[0])
    if scorer is not None and output[0]["type"] == "message":
        output[0]["content"][0]["logprobs"] = scored
    return answer.end(status_of(finish), output, chunk.summary), chunk.summary


async def unary(chunks: AsyncIterator[Chunk], reply: Reply, answer: Answer,
                scorer: ChoiceLogprobs | None = None) -> Response:
    response, summary = await whole(chunks, reply, answer, scorer)
    return JSONResponse(response, headers=specdec_headers(summary))


async def background(chunks: AsyncIterator[Chunk], reply: Reply, answer: Answer, kept: Kept,
                     scorer: ChoiceLogprobs | None = None) -> None:
    """A background response's generation: its kept object in_progress, then its last (whole), or failed with the
    error a request would have been refused with; cancelled (POST .../cancel, DELETE): cancelled."""
    kept.response = answer.at("in_progress", [])
    try:
        await whole(chunks, reply, answer, scorer)
    except (ApiError, *CORE_ERRORS) as e:
        answer.stop("failed", e)
    except Exception as e:  # (a fault of its own: logged, and failed)
        log.exception("background response %s failed", answer.head["id"])
        answer.stop("failed", e)
    finally:
        answer.stop("cancelled")
        kept.task = None


def begin_stream(chunks: AsyncIterator[Chunk], reply: Reply, answer: Answer, body: ResponsesBody,
                 scorer: ChoiceLogprobs | None = None) -> Kept:
    """A background response created with stream, kept queued, its generation started (streamed). -> the kept
    response its followers read"""
    kept = answer.keep("queued")
    kept.events, kept.grew = [], asyncio.Event()
    kept.task = asyncio.create_task(streamed(chunks, reply, answer, kept, body, scorer))

    def ended(_: asyncio.Task) -> None:  # (also where it was cancelled before it began)
        answer.stop("cancelled")
        kept.task = None
        kept.emit()
        if answer.store is not None and kept.response["id"] in answer.store.kept:
            answer.store.weigh(kept)

    kept.task.add_done_callback(ended)
    return kept


async def streamed(chunks: AsyncIterator[Chunk], reply: Reply, answer: Answer, kept: Kept, body: ResponsesBody,
                   scorer: ChoiceLogprobs | None = None) -> None:
    """A background stream's generation: its events (events) kept as they come, counted in the store's bound,
    whoever follows them (follow: its creator's stream, GET ?stream=true) and whether anyone does: a follower
    hanging up stops nothing. A fault of its own ends it with an error event (failed); cancelled (POST
    .../cancel, DELETE, dropped, the server stopping) it reads cancelled; either way its followers' streams
    end (begin_stream's `ended`)."""
    try:
        async for event in events(None, chunks, reply, answer, body, scorer):
            kept.emit(event)
            answer.store.grew(kept, len(event))
    except asyncio.CancelledError:
        pass  # (the task ends here: its followers see the end)
    except Exception as e:  # (events() has failed the response)
        log.exception("background response %s failed", answer.head["id"])
        kept.emit(sse_event("error", len(kept.events), code="server_error", param=None,
                            message=f"internal error: {type(e).__name__}"))


async def follow(kept: Kept, after: int) -> AsyncIterator[str]:
    """A background stream's events after sequence number `after` (-1: all), those to come as they come, to
    its end."""
    at = after + 1
    while True:
        while at < len(kept.events):
            yield kept.events[at]
            at += 1
        if kept.task is None:  # (ended: begin_stream's `ended`)
            return
        await kept.grew.wait()


class Items:
    """A streamed answer's output items, made from its chat reply's streamed deltas (chat_choice's text;
    ToolReply's text as it comes and its calls, a named function's arguments as they come, others' once
    whole): a message item opened at the first text, a function_call item at each new call, each item
    closed (its .done events) when the next opens or the answer ends. -> the events' (type, fields)"""

    def __init__(self):
        self.output: list[dict] = []
        self.open: dict | None = None
        self.calls: dict[int, dict] = {}  # the chat's tool call index -> its item

    def feed(self, delta: dict, scored: list[dict] = ()) -> list[tuple[str, dict]]:
        """`scored`: the logprobs entries of the text the delta brings."""
        out = []
        if delta.get("content"):
            if self.open is None or self.open["type"] != "message":
                out += self._close("completed") + self._begin(message_item("", "in_progress"))
            item, text = self.open, delta["content"]
            item["content"][0]["text"] += text
            item["content"][0]["logprobs"] += scored
            out.append(("response.output_text.delta", {**self._at(item), "content_index": 0, "delta": text,
                                                        "logprobs": list(scored)}))
        for entry in delta.get("tool_calls") or []:
            function = entry.get("function") or {}
            item = self.calls.get(entry["index"])
            if item is None:
                item = {"type": "function_call", "id": new_id("fc"), "call_id": entry.get("id") or new_id("call"),
                        "name": function.get("name", ""), "arguments": "", "status": "in_progress"}
                self.calls[entry["index"]] = item
                out += self._close("completed") + self._begin(item)
            if function.get("arguments"):
                item["arguments"] += function["arguments"]
                out.append(("response.function_call_arguments.delta", {**self._at(item),
                                                                        "delta": function["arguments"]}))
        return out

    def end(self, status: str, scored: list[dict] = ()) -> list[tuple[str, dict]]:
        """The last item closed with the answer's status (an answer with none: an empty message); `scored`: the
        entries of its last tokens, which brought no text (as the unary answer lists them)."""
        out = [] if self.output else self._begin(message_item("", "in_progress"))
        if scored and self.open is not None and self.open["type"] == "message":
            self.open["content"][0]["logprobs"] += scored
        return out + self._close(status)

    def _at(self, item: dict) -> dict:
        return {"item_id": item["id"], "output_index": self.output.index(item)}

    def _begin(self, item: dict) -> list[tuple[str, dict]]:
        self.output.append(item)
        self.open = item
        shown = {**item, "content": []} if item["type"] == "message" else item
        out = [("response.output_item.added", {"output_index": len(self.output) - 1, "item": dict(shown)})]
        if item["type"] == "message":
            out.append(("response.content_part.added", {**self._at(item), "content_index": 0,
                                                         "part": {**item["content"][0], "text": ""}}))
        return out

    def _close(self, status: str) -> list[tuple[str, dict]]:
        item, self.open = self.open, None
        if item is None:
            return []
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            out = [("response.output_text.done", {**self._at(item), "content_index": 0, "text": part["text"],
                                                  "logprobs": part["logprobs"]}),
                   ("response.content_part.done", {**self._at(item), "content_index": 0, "part": part})]
        else:
            out = [("response.function_call_arguments.done", {**self._at(item), "name": item["name"],
                                                              "arguments": item["arguments"]})]
        return out + [("response.output_item.done", {"output_index": self.output.index(item), "item": item})]


def sse_event(kind: str, number: int, **data: Any) -> str:
    """A Responses API event as server-sent, numbered `number` (its sequence_number)."""
    payload = json.dumps({"type": kind, "sequence_number": number, **data}, separators=(",", ":"))
    return f"event: {kind}\ndata: {payload}\n\n"


def cut_at(number: Callable[[], int]) -> Callable[[ApiError], str]:
    """A Responses stream's `cut` (EventStream): its error event, numbered number()."""
    return lambda error: sse_event("error", number(), code=error.code, message=str(error), param=None)


async def events(first: Chunk | None, chunks: AsyncIterator[Chunk], reply: Reply, answer: Answer,
                 body: ResponsesBody, scorer: ChoiceLogprobs | None = None,
                 number: Iterator[int] | None = None) -> AsyncIterator[str]:
    """The Responses API's events, numbered (by `number`, given where the stream's cut numbers its error event
    after them): the items as the rounds bring them (Items). first: the generation's first chunk, taken already
    (None: taken here, after response.created: a background stream's, whose refusal is an error event)."""
    number = number or itertools.count()

    def sse(kind: str, **data: Any) -> str:
        return sse_event(kind, next(number), **data)

    items = Items()  # (GET reads a kept one in progress with its output so far: these items, as they grow)
    if answer.kept is not None:  # (a background one: kept queued)
        answer.kept.response = answer.at("in_progress", items.output)
    elif answer.store is not None:  # (kept from its first event on)
        answer.keep("in_progress", items.output)
    async with contextlib.aclosing(chunks):
        try:
            yield sse("response.created", response=answer.at("queued" if body.background else "in_progress", []))
            if body.background:
                yield sse("response.queued", response=answer.at("queued", []))
            yield sse("response.in_progress", response=answer.at("in_progress", []))
            chunk, opened = first if first is not None else await anext(chunks), False
            held: list[dict] = []  # the entries of tokens whose text is held back (TextStream): sent with its text
            while True:
                finish = None if chunk.finish is None else FINISH[chunk.finish]
                scored = held + entries(scorer, chunk)
                for choice in reply(chunk.text, finish, True, not opened):
                    for kind, data in items.feed(choice["delta"], scored):
                        yield sse(kind, **data)
                held = [] if chunk.text else scored
                opened = True
                if chunk.summary is not None:
                    break
                chunk = await anext(chunks)
            status = status_of(finish)
            for kind, data in items.end(status, held):
                yield sse(kind, **data)
            yield sse(f"response.{status}", response=answer.end(status, items.output, chunk.summary))
        except (ApiError, *CORE_ERRORS) as e:
            error = refused(e, body)
            answer.stop("failed", error)
            yield sse("error", code=error.code, message=str(error), param=error.param)
        except asyncio.CancelledError:
            if asyncio.current_task().cancelling():  # (this stream is being closed: nobody reads on)
                raise
            # a model service's call cancelled under it (the server stopping), as the chat's stream says it: failed
            error = ApiError(503, "a model service call was cancelled (the server is stopping?)", None, "unavailable")
            answer.stop("failed", error)
            yield sse("error", code=error.code, message=str(error), param=None)
        except Exception as e:  # (a fault of its own: the stream breaks, the kept response failed)
            answer.stop("failed", e)
            raise
        finally:  # (its client gone, or the server stopping)
            answer.stop("cancelled")


def routes(api: OpenAIApi, most: int, most_bytes: int = STORE_BYTES) -> list[Route]:
    """POST /responses, and GET and DELETE /responses/{id}, POST /responses/{id}/cancel and GET
    /responses/{id}/input_items over the responses kept (Store: `most`, about `most_bytes`)."""
    store = Store(most, most_bytes)
    api.closing.append(store.close)
    if api.coordinator.metrics is not None:
        api.coordinator.metrics.kept_responses.set_function(lambda: len(store.kept))
        api.coordinator.metrics.kept_response_bytes.set_function(lambda: store.bytes)

    async def create(request: Request) -> Response:
        body = await parse(request, ResponsesBody, api.max_request_bytes)
        model = api.model_name(body.model)
        try:
            before = store.get(body.previous_response_id, "previous_response_id").conversation \
                if body.previous_response_id is not None else []
            given = messages_of(body)
            answered(before, given)
            conversation = [*before, *given]
            if body.truncation == "auto":
                conversation = await truncated(api, body, conversation)
            [(generation, reply)] = chat_request(chat_body(body, conversation))
        except (ApiError, *CORE_ERRORS) as e:
            raise refused(e, body) from e
        answer = Answer(body, model, store, conversation)
        if body.background:
            if answer.store is None:
                raise ApiError(400, "background: a background response is stored (not with store false, nor where"
                                    " --store-responses is 0)", "background")
            try:  # (refused now, as the request would be, not failed later)
                await api.coordinator.check(generation)
            except CORE_ERRORS as e:
                raise refused(e, body) from e
        # (the output_text's tokens' logprobs; not a tool reply's, whose text is read into calls)
        scorer = api.scorers(CHAT, 1)[0] if generation.logprobs is not None and not isinstance(reply, ToolReply) \
            else None
        chunks = api.coordinator.generate(generation, "/v1/responses",
                                          traceparent=request.headers.get("traceparent", ""))
        if body.background:  # (checked with the body: stored)
            if body.stream:
                kept = begin_stream(chunks, reply, answer, body, scorer)
                return EventStream(follow(kept, -1), cut=cut_at(lambda: len(kept.events)))
            kept = answer.keep("queued")
            kept.task = asyncio.create_task(background(chunks, reply, answer, kept, scorer))
            return JSONResponse(kept.response)
        try:
            if not body.stream:
                return await unless_hung_up(request, unary(chunks, reply, answer, scorer))
            try:  # the first round before the response starts: a refusal gets its own status
                first = await unless_hung_up(request, anext(chunks))
            except BaseException:
                await chunks.aclose()
                raise
        except CORE_ERRORS as e:
            raise refused(e, body) from e
        number = itertools.count()
        return EventStream(events(first, chunks, reply, answer, body, scorer, number),
                           cut=cut_at(lambda: next(number)))

    async def retrieve(request: Request) -> Response:
        """The kept response; `stream=true`: a background stream's events after sequence number `starting_after`
        (default: all), those to come as they come."""
        kept = store.get(request.path_params["response_id"])
        query = request.query_params
        stream = query.get("stream", "false").lower()
        if stream not in ("true", "false"):
            raise ApiError(400, f"stream must be true or false, not {query['stream']!r}", "stream")
        if stream == "false":
            return JSONResponse(kept.response)
        if kept.events is None:
            raise ApiError(400, "stream: only a response created with background and stream true can be streamed"
                                " again (GET it without stream)", "stream")
        after = query.get("starting_after", "-1")
        if not re.fullmatch(r"-?[0-9]+", after) or int(after) < -1:
            raise ApiError(400, f"starting_after must be an event's sequence number (a whole number from 0), not"
                                f" {after!r}", "starting_after")
        return EventStream(follow(kept, int(after)), cut=cut_at(lambda: len(kept.events)))

    async def cancel(request: Request) -> Response:
        """A background response's generation stopped (status cancelled); one that has ended is as it ended."""
        kept = store.get(request.path_params["response_id"])
        if not kept.response["background"]:
            raise ApiError(400, "only a background response can be cancelled", "response_id")
        task = kept.task
        if task is not None:
            task.cancel()
            await asyncio.wait({task})
        return JSONResponse(kept.response)

    async def delete(request: Request) -> Response:
        response_id = request.path_params["response_id"]
        store.forget(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def listed(request: Request) -> Response:
        """The kept response's input items, `order` desc (the default: the last first) or asc, `limit` (1-100,
        default 20) of them after the one whose id is `after`, or just before the one whose id is `before`."""
        items = store.get(request.path_params["response_id"]).items
        query = request.query_params
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, not {order!r}", "order")
        try:
            limit = int(query.get("limit", "20"))
        except ValueError:
            limit = 0
        if not 1 <= limit <= 100:
            raise ApiError(400, f"limit must be a whole number between 1 and 100, not {query.get('limit')!r}",
                           "limit")
        items = items[::-1] if order == "desc" else items
        ids = [item["id"] for item in items]
        for name in ("after", "before"):
            if query.get(name) is not None and query[name] not in ids:
                raise ApiError(400, f"{name}: no input item {query[name]!r} in this response", name)
        if query.get("before") is not None:  # (the `limit` items just before it, in this order)
            items = items[:ids.index(query["before"])]
            page = items[-limit:]
            return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                                 "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})
        if query.get("after") is not None:
            items = items[ids.index(query["after"]) + 1:]
        page = items[:limit]
        return JSONResponse({"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
                             "last_id": page[-1]["id"] if page else None, "has_more": len(items) > limit})

    return [Route("/responses", create, methods=["POST"]),
            Route("/responses/{response_id}", retrieve, methods=["GET"]),
            Route("/responses/{response_id}", delete, methods=["DELETE"]),
            Route("/responses/{response_id}/cancel", cancel, methods=["POST"]),
            Route("/responses/{response_id}/input_items", listed, methods=["GET"])]
