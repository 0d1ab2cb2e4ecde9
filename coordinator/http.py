"""The OpenAI-compatible HTTP API beside gRPC (--http-port): JSON in -> the generation core
(generation.py) -> JSON or server-sent events out. Any OpenAI client can talk to specdec:

    curl -N http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "target", "messages": [{"role": "user", "content": "Hi"}], "stream": true}'

Endpoints: GET /v1/models and /v1/models/{model}; POST /v1/chat/completions and POST
/v1/completions, unary or with `stream: true` (one event per speculative round, then `data:
[DONE]`; `stream_options.include_usage` adds a last event with the usage); POST /v1/responses (OpenAI's
Responses API over the chat path: responses.py); POST /tokenize and
/detokenize (vLLM's: a chat's or a prompt's token ids, tokens' text). GET /health (200 while
a request would be served: the coordinator has found its services and a target replica is healthy; else 503
saying why) and GET /metrics (the coordinator's Prometheus
metrics) need no API key.

What OpenAI's API has no word for goes in an extra field, `specdec` (rounds, acceptance, K, seed;
in a stream on the event with the finish_reason), and, unary, in x-specdec-* headers. Extra body
fields read: num_speculative_tokens, draft_p_min, top_k, min_p, ignore_eos (as vLLM's: generate past
end-of-sequence), stop_token_ids (as vLLM's: the output ends after any of them too), min_tokens (as vLLM's);
vLLM's typical_p, allowed_token_ids, bad_words and use_beam_search are refused (400) unless they ask for nothing.
Structured output (model_service/grammar.py): `response_format` (OpenAI's json_object and json_schema,
which the official client's `chat.completions.parse` sends for a pydantic model) and vLLM's
`guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` and `structured_outputs`; one of
them, else 400 (vLLM's JSON whitespace settings too: json_layout); one that does not compile is 400 with
the compiler's reason. `tools` and `tool_choice` (tools.py): any model's tool calls, by structured
output; a JSON schema beside them shapes the direct answer. `n` (at most MAX_CHOICES) runs that many
generations side by side (a seeded request's choices seeded seed, seed + 1, ...; streamed, their rounds'
events interleave, each choice with its index); completions' `prompt` may be a batch (a list of texts or
of token-id lists), each prompt's n choices in turn (index prompt x n + choice; each prompt's seeded as
the prompt alone would be), at most MAX_GENERATIONS in all. Completions' `echo` puts the prompt before
the completion, with its tokens' logprobs where `logprobs` is asked (the target scores the prompt: then
max_tokens may be 0).
A field specdec cannot honour (best_of, suffix, the older functions API) is refused, naming it; a
field it does not know is ignored. Where max_tokens is not given, /v1/completions generates 16 tokens
and /v1/chat/completions up to the end of the context, as OpenAI's do.

Errors are OpenAI's error object, with the HTTP status of the core's canonical code
(generation.outcome): 400 a bad request, 401 no API key, 404 an unknown model, 413 a body past
--max-request-bytes, 429 a model service out of capacity, 503 no services (yet). A client that
hangs up cancels its generation, and the model services release its sessions.

uvicorn runs in the coordinator's own event loop (`HttpServer`), beside the gRPC server.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import re
import socket
import ssl
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.applications import Starlette
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Mount, Route

from runtime.auth import bearer_ok
from runtime.transport import MAX_REQUEST_BYTES
from speculative.errors import InvalidRequest
from speculative.protocol import MAX_TOP_LOGPROBS, Constraint, Logprobs
from speculative.round import Stats

from .generation import (Chunk, Coordinator, Finish, GenerationRequest, Message, NotPossible, NotReady, ScoredPrompt,
                         Summary, outcome, prompt_ids)
from .logprobs import ChoiceLogprobs, TokenText
from .peers import PeerError
from .tools import ToolUse, call_of, conversation

T = TypeVar("T")
log = logging.getLogger("specdec.coordinator")
CUT = "specdec.cut"  # the scope's key for a stream's `cut` (EventStream): how it ends where the server cuts it
CORE_ERRORS = (InvalidRequest, NotPossible, NotReady, PeerError)
# the HTTP status of a canonical code, as grpc-gateway maps them; any other: 500
HTTP_STATUS = {"INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
               "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "RESOURCE_EXHAUSTED": 429, "CANCELLED": 499,
               "UNIMPLEMENTED": 501, "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504}
FINISH = {Finish.LENGTH: "length", Finish.STOP: "stop", Finish.EOS: "stop"}
COMPLETION_MAX_TOKENS = 16  # /v1/completions' default, as OpenAI's
MAX_CHOICES = 16  # the most choices (`n`) one request may ask for: each is a generation of its own
MAX_GENERATIONS = 64  # the most generations (a batch's prompts x n) one request may start
STORE_RESPONSES = 1000  # the most Responses API responses kept (--store-responses)
STORE_BYTES = 256 << 20  # ... and about the most bytes of them (--store-responses-mb)


# ------------------------------------------------------------------ errors


class ApiError(Exception):
    """A refusal, answered with OpenAI's error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.param, self.code = status, param, code

    def body(self) -> dict:
        kind = "invalid_request_error" if self.status < 429 else "rate_limit_error" if self.status == 429 else \
            "server_error"
        return {"error": {"message": str(self), "type": kind, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), self.status)


# GenerationRequest's fields as the OpenAI API names them, where it names them otherwise (max_new_tokens: the
# name the request gave it, core_error's `max_tokens`)
HTTP_FIELDS = {"prompt_token_ids": "prompt"}


def core_error(error: Exception, max_tokens: str = "max_tokens") -> ApiError:
    """A refusal of the generation core (InvalidRequest, NotPossible, NotReady, PeerError), naming
    the field at fault (`param`) as this API does where the core names one (`max_tokens`: the name the
    request gave the output's bound, a chat's max_completion_tokens where it did)."""
    code = outcome(error)
    message, param = str(error), getattr(error, "param", None)
    message = message.replace("max_new_tokens", max_tokens)  # (the core's name: this API's clients know its own)
    if param == "max_new_tokens":
        param = max_tokens
    param = HTTP_FIELDS.get(param, param)
    return ApiError(HTTP_STATUS.get(code, 500), message, param, code.lower())


# ------------------------------------------------------------------ requests


class Lenient(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)  # OpenAI's SDKs send fields of their own


class StreamOptions(Lenient):
    include_usage: bool = False


class ContentPart(Lenient):
    type: str
    text: str | None = None


class PredictedContent(Lenient):
    """OpenAI's `prediction`: the output expected (predicted outputs)."""

    type: str
    content: str | list[ContentPart]


CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")  # (OpenAI's; `function`'s API is refused)


class ChatMessage(Lenient):
    role: str
    content: str | list[ContentPart] | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls (tools.py)
    tool_call_id: str | None = None  # a tool result's (role tool)


class Body(Lenient):
    """What both endpoints read."""

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool | None = False  # (null: OpenAI's default, false)
    stream_options: StreamOptions | None = None
    # specdec's own (vLLM reads top_k too)
    top_k: int | None = None
    min_p: float | None = None  # (vLLM's)
    num_speculative_tokens: int | None = None
    draft_p_min: float | None = None
    ignore_eos: bool | None = False
    stop_token_ids: list[int] | None = None  # (vLLM's)
    min_tokens: int | None = None  # (vLLM's)
    # structured output (one of): OpenAI's response_format, vLLM's guided_* and structured_outputs
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None  # (vLLM's: the whitespace a JSON constraint allows between tokens)
    structured_outputs: dict[str, Any] | None = None
    n: int | None = None  # choices (MAX_CHOICES)
    # the target's logits before sampling (SamplingParams: OpenAI's ranges)
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias
    repetition_penalty: float | None = None  # (vLLM's)
    prediction: PredictedContent | None = None  # (OpenAI's predicted outputs: GenerationRequest.prediction)
    # vLLM's, not honoured (UNSUPPORTED): read so that a request asking for them is refused, not answered without
    typical_p: float | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    use_beam_search: bool | None = None


class DetokenizeBody(Lenient):
    model: str | None = None
    tokens: list[int]


class ChatBody(Body):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None  # (tools.py)
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None  # (the functions API before tools)
    function_call: str | dict[str, Any] | None = None


class CompletionBody(Body):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = None
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None


# fields specdec cannot honour: the values (besides absent) it accepts, those that ask for nothing, and what to
# use instead: answering without one would serve something other than what was asked
UNSUPPORTED = {
    "best_of": ((1,), "specdec answers without best_of"), "suffix": (("",), "specdec answers without suffix"),
    "functions": (([],), "use tools"), "function_call": (("none", "auto"), "use tool_choice"),
    "typical_p": ((1.0, 1), "use top_p or min_p"),
    "allowed_token_ids": (([],), "use logit_bias or a structured output"), "bad_words": (([],), "use logit_bias"),
    "use_beam_search": ((False,), "specdec samples, or decodes greedily"),
}

B = TypeVar("B", bound=Body)


async def read(request: Request, limit: int) -> bytes:
    """The request's body, refused (413) past `limit` bytes, as gRPC refuses a message past it: at once where
    its Content-Length says so (not after waiting for bytes that may never come)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise ApiError(413, f"the request has more than {limit} bytes (--max-request-bytes)", code="request_too_large")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise ApiError(413, f"the request has more than {limit} bytes (--max-request-bytes)",
                           code="request_too_large")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse(request: Request, kind: type[B], limit: int, raw: bytes | None = None) -> B:
    """The body as `kind` (`raw`: its bytes, read already), or the 400 naming what is wrong."""
    try:
        raw = raw if raw is not None else await read(request, limit)
        # (a UTF-8 byte order mark, which some clients put first: JSON's RFC lets a parser ignore it)
        body = kind.model_validate_json(raw.removeprefix(b"\xef\xbb\xbf"))
    except ValidationError as e:
        error = e.errors()[0]
        if error["type"] == "json_invalid":
            if "recursion limit" in error["msg"]:  # (pydantic-core's parser: a valid body, nested too deep for it)
                raise ApiError(400, "the body nests arrays and objects more than 200 deep, past what this server"
                                    f" parses ({error['msg'].removeprefix('Invalid JSON: ')})") from None
            raise ApiError(400, f"the body is not valid JSON: {error['msg']}") from None
        path = ".".join(map(str, error["loc"]))
        if error["loc"] and error["loc"][0] == "prompt":  # (pydantic names the union's first branch's fault)
            raise ApiError(400, "prompt must be a string, a list of strings, a list of token ids or a list of"
                                " lists of token ids", "prompt") from None
        raise ApiError(400, f"{path}: {error['msg']}" if path else error["msg"],
                       str(error["loc"][0]) if error["loc"] else None) from None
    for name, (neutral, instead) in UNSUPPORTED.items():
        value = getattr(body, name, None)
        if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
            raise ApiError(400, f"{name}={value!r} is not supported ({instead})", name, "unsupported_parameter")
    if not isinstance(body, Body):
        return body
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options is only allowed when stream is true", "stream_options")
    if body.n is not None and not 1 <= body.n <= MAX_CHOICES:
        raise ApiError(400, f"n must be between 1 and {MAX_CHOICES}, not {body.n}", "n")
    top = body.top_logprobs if isinstance(body, ChatBody) else body.logprobs if isinstance(body, CompletionBody) \
        else None
    name = "top_logprobs" if isinstance(body, ChatBody) else "logprobs"
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise ApiError(400, f"{name} must be between 0 and {MAX_TOP_LOGPROBS}, not {top}", name)
    if isinstance(body, ChatBody) and top and not body.logprobs:
        raise ApiError(400, "top_logprobs needs logprobs: true", "top_logprobs")
    return body


def logit_bias_of(body: Body) -> dict[int, float] | None:
    """OpenAI's logit_bias (token ids as the JSON object's keys) by id."""
    if not body.logit_bias:
        return None
    if not all(re.fullmatch(r"-?[0-9]+", key) for key in body.logit_bias):
        raise ApiError(400, "logit_bias: keys must be token ids (integers as strings)", "logit_bias",
                       "invalid_argument")
    bias = {int(key): value for key, value in body.logit_bias.items()}
    if len(bias) != len(body.logit_bias):
        raise ApiError(400, "logit_bias names a token twice", "logit_bias", "invalid_argument")
    return bias


def logprobs_asked(body: Body) -> int | None:
    """The most likely tokens a request wants beside each token's logprob; None: no logprobs."""
    if isinstance(body, ChatBody):
        return (body.top_logprobs or 0) if body.logprobs else None
    return body.logprobs if isinstance(body, CompletionBody) else None


def seed_of(seed: int | None) -> int | None:
    """A request's seed as the core takes it, in [0, 2^64): -1 none (a random one), any other signed 64-bit one
    its two's complement (what lies outside both is left for the core to refuse)."""
    if seed == -1:
        return None
    return seed + 2**64 if seed is not None and -(2**63) <= seed < 0 else seed


def generation_request(body: Body, max_new_tokens: int | None, **prompt) -> GenerationRequest:
    """(seed -1: a random one, as llama.cpp's clients mean it; another negative one, which OpenAI's signed 64-bit
    seed allows, as its two's complement; top_k -1: off, as vLLM reads it)"""
    return GenerationRequest(
        **prompt, max_new_tokens=max_new_tokens, temperature=body.temperature, top_p=body.top_p,
        top_k=0 if body.top_k == -1 else body.top_k, min_p=body.min_p, seed=seed_of(body.seed),
        stop=[body.stop] if isinstance(body.stop, str) else list(body.stop or []),
        num_speculative_tokens=body.num_speculative_tokens, draft_p_min=body.draft_p_min,
        ignore_eos=bool(body.ignore_eos), stop_token_ids=list(body.stop_token_ids or []), min_tokens=body.min_tokens,
        constraint=constraint_of(body), logprobs=logprobs_asked(body), frequency_penalty=body.frequency_penalty,
        presence_penalty=body.presence_penalty, logit_bias=logit_bias_of(body),
        repetition_penalty=body.repetition_penalty, prediction=prediction_of(body),
    )


def prediction_of(body: Body) -> str:
    """The predicted output's text: OpenAI's {"type": "content", "content": a text or text parts}."""
    given = body.prediction
    if given is None:
        return ""
    if given.type != "content":
        raise ApiError(400, f"prediction.type must be 'content', not {given.type!r}", "prediction")
    if isinstance(given.content, str):
        return given.content
    if any(part.type != "text" or part.text is None for part in given.content):
        raise ApiError(400, "prediction.content: only text parts are supported", "prediction")
    return "".join(part.text for part in given.content)


def _schema_text(value: Any, param: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, dict | bool):
        return json.dumps(value)
    raise ApiError(400, f"{param}: a JSON schema is an object", param)


def constraint_of(body: Body) -> Constraint | None:
    """The body's structured-output constraint, from whichever field gives it (at most one):
    response_format (OpenAI: text, json_object, json_schema), vLLM's guided_json / guided_regex /
    guided_choice / guided_grammar, or its structured_outputs object (json, regex, choice, grammar)."""
    found: list[tuple[str, Constraint]] = []
    fmt = body.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            found.append(("response_format", Constraint("json_object")))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            if not isinstance(spec, dict) or "schema" not in spec:
                raise ApiError(400, "response_format.json_schema.schema: a json_schema response format needs its schema",
                               "response_format")
            found.append(("response_format", Constraint("json_schema", _schema_text(spec["schema"], "response_format"))))
        elif kind != "text":
            raise ApiError(400, f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                           "response_format")
    for name, kind in (("guided_json", "json_schema"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, name)
        if value is not None:
            text = json.dumps(value) if kind == "choice" else _schema_text(value, name) if kind == "json_schema" else value
            found.append((name, Constraint(kind, text)))
    for key, value in (body.structured_outputs or {}).items():
        kind = STRUCTURED_OUTPUTS.get(key)
        if value is None or key in JSON_LAYOUT or (key == "json_object" and value is False):
            continue
        if kind == "json_object":
            if value is not True:
                raise ApiError(400, "structured_outputs.json_object: true or false", "structured_outputs")
            found.append(("structured_outputs.json_object", Constraint("json_object")))
            continue
        if kind is None:
            *known, last = [*STRUCTURED_OUTPUTS, *JSON_LAYOUT]
            raise ApiError(400, f"structured_outputs.{key} is not supported ({', '.join(known)} or {last})",
                           "structured_outputs", "unsupported_parameter")
        if kind == "choice" and not (isinstance(value, list) and all(isinstance(c, str) for c in value)):
            raise ApiError(400, "structured_outputs.choice: a list of strings", "structured_outputs")
        if kind in ("regex", "grammar") and not isinstance(value, str):
            raise ApiError(400, f"structured_outputs.{key}: a string", "structured_outputs")
        text = json.dumps(value) if kind == "choice" else _schema_text(value, "structured_outputs") \
            if kind == "json_schema" else value
        found.append((f"structured_outputs.{key}", Constraint(kind, text)))
    if len(found) > 1:
        raise ApiError(400, f"give one structured-output constraint, not {' and '.join(n for n, _ in found)}",
                       found[1][0])
    return json_layout(body, found[0][1] if found else None)


# vLLM's structured_outputs keys that name a constraint, and its kind
STRUCTURED_OUTPUTS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar",
                      "json_object": "json_object"}
# vLLM's structured_outputs keys that set a JSON constraint's whitespace, as llguidance's x-guidance options
JSON_LAYOUT = {"whitespace_pattern": "whitespace_pattern", "disable_any_whitespace": "whitespace_flexible"}


def json_layout(body: Body, constraint: Constraint | None) -> Constraint | None:
    """`constraint` with the whitespace the body allows its JSON (vLLM's guided_whitespace_pattern, and
    structured_outputs' whitespace_pattern and disable_any_whitespace: JSON without free whitespace, the
    remedy for a small model that pads its JSON with newlines to max_tokens), as llguidance reads it in
    the schema (x-guidance)."""
    given = dict(body.structured_outputs or {})
    if body.guided_whitespace_pattern is not None:
        given["whitespace_pattern"] = body.guided_whitespace_pattern
    options = {}
    for key, option in JSON_LAYOUT.items():
        value = given.get(key)
        if value is None or value is False:
            continue
        if not isinstance(value, str if key == "whitespace_pattern" else bool):
            raise ApiError(400, f"{key} must be a {'string' if key == 'whitespace_pattern' else 'boolean'}",
                           "structured_outputs")
        options[option] = value if key == "whitespace_pattern" else False
    if not options or constraint is None:  # (nothing to shape: a tool call's JSON has no free whitespace anyway)
        return constraint
    if constraint.kind not in ("json_schema", "json_object"):
        raise ApiError(400, f"guided_whitespace_pattern, whitespace_pattern and disable_any_whitespace shape a JSON"
                            f" constraint, not a {constraint.kind} one", constraint_field(body))
    schema = json.loads(constraint.text) if constraint.kind == "json_schema" else {"type": "object"}
    if isinstance(schema, bool):  # (true: any JSON value; false: none)
        schema = {} if schema else {"not": {}}
    schema["x-guidance"] = {**schema.get("x-guidance", {}), **options}
    return Constraint("json_schema", json.dumps(schema))


def constraint_field(body: Body) -> str | None:
    """The field a body's structured-output constraint came from (constraint_of's), which a refusal of the
    constraint names."""
    if (body.response_format or {}).get("type") in ("json_object", "json_schema"):
        return "response_format"
    for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar"):
        if getattr(body, name) is not None:
            return name
    if any(value is not None for value in (body.structured_outputs or {}).values()):
        return "structured_outputs"
    return None


def chat_request(body: ChatBody) -> list[tuple[GenerationRequest, Reply]]:
    use = ToolUse.of(body.tools, body.tool_choice, body.parallel_tool_calls)
    if not body.messages:
        raise ApiError(400, "messages: give at least one message", "messages")
    if body.max_completion_tokens is not None and body.max_completion_tokens <= 0:
        raise ApiError(400, f"max_completion_tokens must be > 0, not {body.max_completion_tokens}",
                       "max_completion_tokens")
    for i, m in enumerate(body.messages):
        if m.role not in CHAT_ROLES:  # (a typo would be written into the prompt as a turn of its own)
            raise ApiError(400, f"messages[{i}].role must be one of {', '.join(CHAT_ROLES)}, not {m.role!r}",
                           "messages")
        if m.role == "developer":  # (OpenAI's newer name for the system's instructions; templates know system)
            m.role = "system"
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise ApiError(400, f"messages[{i}].content: a {m.role} message needs its content (an assistant's may"
                                " be null where it has tool_calls)", "messages")
        parts = [ContentPart(type="text", text=m.content)] if isinstance(m.content, str) else m.content or []
        if any(p.type != "text" for p in parts):
            raise ApiError(400, f"messages[{i}].content: only text parts are supported", "messages")
        if any(p.text is None for p in parts):
            raise ApiError(400, f"messages[{i}].content: a text part needs its text", "messages")
        m.content = "\n".join(p.text or "" for p in parts)
    messages = [Message(role, text) for role, text in conversation(body.messages, use)]
    most = body.max_tokens if body.max_completion_tokens is None else body.max_completion_tokens
    request = generation_request(body, most, messages=messages)
    request.to_context = most is None  # (OpenAI's chat: without a limit, up to the end of the context)
    if use is None:
        return [(request, chat_choice)]
    if request.constraint is not None:  # (the direct answer's shape: an agent's final output)
        use = use.answering(request.constraint)
    request.constraint = use.constraint()
    return [(request, ToolReply(use))]


def batch_of(body: CompletionBody) -> list:
    """A completion's prompts: `prompt` is one (text or token ids) or a batch of them (a list of either)."""
    prompt = body.prompt
    return prompt if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list) else [prompt]


def completion_request(body: CompletionBody) -> list[tuple[GenerationRequest, Reply]]:
    """A request per prompt (batch_of)."""
    batch = batch_of(body)
    most = COMPLETION_MAX_TOKENS if body.max_tokens is None else body.max_tokens
    made = []
    for prompt in batch:
        given = {"prompt" if isinstance(prompt, str) else "prompt_token_ids": prompt}
        request = generation_request(body, most, **given)
        if body.echo:  # the prompt's tokens scored too where logprobs are asked (and where nothing is generated)
            request.prompt_logprobs = body.logprobs if body.logprobs is not None or most != 0 else 0
        made.append((request, text_choice))
    return made


def seen(chunk: Chunk, endpoint: Endpoint) -> tuple[list[int], Logprobs | None]:
    """A chunk's tokens and logprobs as its choice's logprobs show them: a chat's content leaves out the
    end-of-sequence token that ended it (the message has no place for it, as OpenAI's); completions list
    it, as OpenAI's legacy completions did and evaluation harnesses read it (lm-evaluation-harness takes
    a scored continuation's logprobs as all but the last, the generated token)."""
    if endpoint is CHAT and chunk.ended:
        kept = len(chunk.token_ids) - 1
        return chunk.token_ids[:kept], None if chunk.logprobs is None else chunk.logprobs.slice(0, kept)
    return chunk.token_ids, chunk.logprobs


async def echoing(chunks: AsyncIterator[Chunk], prompt: Callable[[], str]) -> AsyncIterator[Chunk]:
    """A completion's chunks with its prompt's text before the first one's (`echo`): the text made
    once that chunk has come, the core having taken the prompt (a token id that no tokenizer can
    decode is the core's 400 first, not the tokenizer's exception)."""
    async with contextlib.aclosing(chunks):
        first = True
        async for chunk in chunks:
            yield replace(chunk, text=prompt() + chunk.text) if first else chunk
            first = False


async def of_prompt(chunks: AsyncIterator[Chunk], index: int) -> AsyncIterator[Chunk]:
    """A choice of a batch's prompt `index`: the core's refusal of that prompt names it."""
    async with contextlib.aclosing(chunks):
        try:
            async for chunk in chunks:
                yield chunk
        except InvalidRequest as e:
            raise InvalidRequest(f"prompt[{index}]: {e}", e.param) from None


def prompt_text(tokenizer: Any, generation: GenerationRequest) -> str:
    """An echoed prompt's text: as sent, or its token ids decoded as a completion's text reads."""
    return generation.prompt or tokenizer.decode(generation.prompt_token_ids, skip_special_tokens=True)


# ------------------------------------------------------------------ responses


async def all_of(works: list[Awaitable[T]]) -> list[T]:
    """Each work's result, in order; the first to fail cancels the others (a choice's generation
    failing, or the handler cancelled), and its error is raised."""
    tasks = [asyncio.ensure_future(work) for work in works]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
    finally:
        for task in tasks:
            task.cancel()  # (a no-op on those done)
        await asyncio.gather(*tasks, return_exceptions=True)
    for task in tasks:
        if not task.cancelled() and task.exception() is not None:
            raise task.exception()
    return [task.result() for task in tasks]


def together(summaries: list[Summary], n: int = 1) -> Summary:
    """A request's summary over its choices (n > 1, a batch of prompts; in choice order, each prompt's n
    together): their rounds' counts summed, the first's seed and K, the longest wall time; each prompt
    counted once, as OpenAI's usage counts it."""
    if len(summaries) == 1:
        return summaries[0]
    stats = Stats()
    for summary in summaries:
        stats.merge(summary.stats)
    stats.cached_prompt_tokens = sum(s.stats.cached_prompt_tokens for s in summaries[::n])  # (as the prompts)
    first = summaries[0]
    return Summary(stats, first.num_speculative_tokens, first.adaptive, first.seed,
                   sum(s.prompt_tokens for s in summaries[::n]), max(s.wall_ms for s in summaries))


def usage(summary: Summary) -> dict:
    s = summary.stats
    made = s.generated_tokens
    counts = {"prompt_tokens": summary.prompt_tokens, "completion_tokens": made,
              "total_tokens": summary.prompt_tokens + made,
              # (OpenAI's: the prompt's tokens a prefix cache held; here those the target took cached)
              "prompt_tokens_details": {"cached_tokens": min(s.cached_prompt_tokens, summary.prompt_tokens)}}
    if s.prediction_tokens:  # (OpenAI's: the prediction's tokens the output kept, and those it did not)
        counts["completion_tokens_details"] = {
            "accepted_prediction_tokens": s.accepted_prediction_tokens,
            "rejected_prediction_tokens": s.prediction_tokens - s.accepted_prediction_tokens}
    return counts


def specdec_fields(summary: Summary) -> dict:
    """What speculation did for the request: the response's `specdec` field."""
    s = summary.stats
    return {"rounds": s.rounds, "draft_tokens": s.draft_tokens, "accepted_tokens": s.accepted_tokens,
            "acceptance_rate": s.acceptance_rate, "alpha": s.alpha, "mean_accepted": s.mean_accepted,
            "accepted_per_position": s.accepted_per_position,
            "num_speculative_tokens": summary.num_speculative_tokens, "adaptive": summary.adaptive,
            "seed": summary.seed, "wall_ms": summary.wall_ms, "draft_ms": s.draft_ms, "target_ms": s.target_ms,
            "lost_draft_rounds": s.lost_draft_rounds, "copied_tokens": s.copied_tokens,
            "cached_prompt_tokens": s.cached_prompt_tokens,
            "prediction_tokens": s.prediction_tokens, "accepted_prediction_tokens": s.accepted_prediction_tokens}


def specdec_headers(summary: Summary) -> dict[str, str]:
    s = summary.stats
    return {"x-specdec-rounds": str(s.rounds), "x-specdec-acceptance-rate": f"{s.acceptance_rate:.4f}",
            "x-specdec-num-speculative-tokens": str(summary.num_speculative_tokens),
            "x-specdec-adaptive": str(summary.adaptive).lower(), "x-specdec-seed": str(summary.seed)}


def chat_choice(text: str, finish: str | None, stream: bool, first: bool) -> list[dict]:
    if not stream:
        return [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                 "finish_reason": finish}]
    delta = {"role": "assistant", "content": text} if first else {"content": text} if text else {}
    return [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]


def text_choice(text: str, finish: str | None, stream: bool, first: bool) -> list[dict]:
    return [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]


class ToolReply:
    """chat_choice for a request whose tools are in use: its answer read back into tool calls
    (tools.py). Streamed, a named function's arguments go out as they come; under auto and required,
    a response's text as it comes and each call once its arguments are whole; the finish_reason in
    an event of its own after them."""

    def __init__(self, use: ToolUse):
        self.use, self.held = use, []
        self.said, self.called = 0, 0  # characters of content and calls sent so far

    def __call__(self, text: str, finish: str | None, stream: bool, first: bool) -> list[dict]:
        if not stream:
            content, calls, finish = self.use.read(text, finish)
            message = {"role": "assistant", "content": content, **({"tool_calls": calls} if calls else {})}
            return [{"index": 0, "message": message, "logprobs": None, "finish_reason": finish}]
        delta: dict[str, Any] = {"role": "assistant", "content": None} if first else {}
        if self.use.mode == "function":
            if first:
                delta["tool_calls"] = [{"index": 0, **call_of(self.use.named, text)}]
            elif text:
                delta["tool_calls"] = [{"index": 0, "function": {"arguments": text}}]
        else:
            self.held.append(text)
            answer = "".join(self.held)
            if finish is None:
                said, calls = self.use.so_far(answer)
            else:
                content, made, finish = self.use.read(answer, finish)
                said, calls = content or "", [(c["function"]["name"], c["function"]["arguments"]) for c in made]
            if len(said) > self.said:
                delta["content"], self.said = said[self.said :], len(said)
            if len(calls) > self.called:
                delta["tool_calls"] = [{"index": i, **call_of(name, arguments)}
                                       for i, (name, arguments) in enumerate(calls[self.called :], self.called)]
                self.called = len(calls)
        events = [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}] if delta else []
        if finish is not None:
            events.append({"index": 0, "delta": {}, "logprobs": None, "finish_reason": finish})
        return events


# (text, finish_reason, stream, first event) -> the choices to send for it: unary one; streamed one an
# event, none (nothing to send for this round) or more
Reply = Callable[[str, str | None, bool, bool], list[dict]]


@dataclass(frozen=True)
class Endpoint:
    """How one endpoint words its answers."""

    path: str
    body: type[Body]
    request: Callable[[Any], list[tuple[GenerationRequest, Reply]]]  # a request a prompt, and how its choices read
    object: str         # a unary response's
    chunk_object: str   # a stream event's
    id_prefix: str


CHAT = Endpoint("/chat/completions", ChatBody, chat_request, "chat.completion", "chat.completion.chunk", "chatcmpl")
COMPLETIONS = Endpoint("/completions", CompletionBody, completion_request, "text_completion", "text_completion",
                       "cmpl")


class EventStream(StreamingResponse):
    """Server-sent events whose source is closed however the response ends, the client hanging up
    included: the generation behind it stops then. `cut`: the events that end it with an error where the
    server cuts it (AnswerPastGrace); by default a chat's or a completion's, an error event and [DONE]."""

    media_type = "text/event-stream"

    def __init__(self, content, headers: dict[str, str] | None = None, cut: Callable[[ApiError], str] | None = None,
                 **kwargs) -> None:
        # (every event as it comes: not cached, not held back by a buffering proxy such as nginx)
        super().__init__(content, headers={"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})},
                         **kwargs)
        self.cut = cut or (lambda error: event(error.body()) + event("[DONE]"))

    async def __call__(self, scope, receive, send) -> None:
        scope[CUT] = self.cut
        await super().__call__(scope, receive, send)

    async def stream_response(self, send) -> None:
        async with contextlib.aclosing(self.body_iterator):
            await super().stream_response(send)


def event(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, separators=(',', ':'))}\n\n"


async def hung_up(request: Request) -> None:
    """Returns when the client disconnects (its request's body already read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def unless_hung_up(request: Request, work: Awaitable[T]) -> T:
    """`work`'s result; ClientDisconnect, `work` cancelled, if the client hangs up first."""
    task, hangup = asyncio.ensure_future(work), asyncio.ensure_future(hung_up(request))
    try:
        await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:  # (also when this handler is cancelled: the server stopping)
        hangup.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait({task})
    if task.cancelled():
        raise ClientDisconnect()
    return task.result()


# ------------------------------------------------------------------ the application


class OpenAIApi:
    """The endpoints, over one Coordinator."""

    def __init__(self, coordinator: Coordinator, max_request_bytes: int, api_key: str | None = None):
        self.coordinator, self.max_request_bytes, self.api_key = coordinator, max_request_bytes, api_key
        self.created = int(time.time())
        self.texts: TokenText | None = None  # the tokenizer's tokens as logprobs show them
        self.closing: list[Callable[[], Awaitable[None]]] = []  # what to wind down once the server has stopped

    def model_name(self, asked: str | None) -> str:
        name = self.coordinator.ready().name
        if asked is not None and asked != name:
            raise ApiError(404, f"the model {asked!r} does not exist: this server serves {name!r}", "model",
                           "model_not_found")
        return name

    def model_card(self) -> dict:
        models = self.coordinator.ready()
        return {"id": models.name, "object": "model", "created": self.created, "owned_by": "specdec",
                "max_model_len": models.max_context}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self.model_card()]})

    async def model(self, request: Request) -> Response:
        """GET /v1/models/{model}: the served model's card (OpenAI's models.retrieve), else 404; with
        no name (/v1/models/), the list."""
        name = request.path_params["model"].removesuffix("/")
        if not name:
            return await self.models(request)
        self.model_name(name)
        return JSONResponse(self.model_card())

    async def health(self, request: Request) -> Response:
        """200 while a request would be served; else 503 saying why (connecting, no healthy target replica)."""
        why = self.coordinator.serving()
        if why:
            raise ApiError(503, why, code="unavailable")
        return JSONResponse({"status": "ok"})

    def keyed(self, request: Request) -> None:
        """401 where the server has an API key and the request does not bear it (/v1 checks it in RequireApiKey)."""
        if self.api_key and not bearer_ok(request.headers.get("authorization"), self.api_key):
            raise key_refused()

    async def tokenize(self, request: Request) -> Response:
        """POST /tokenize (vLLM's): the token ids a chat (`messages`, tools and all, through the chat template
        with the assistant's turn opened) or a completion's `prompt` (one) would be given to the model."""
        self.keyed(request)
        raw = await read(request, self.max_request_bytes)
        try:
            chat = "messages" in json.loads(raw)
        except (ValueError, TypeError):  # (parse says what is wrong)
            chat = False
        endpoint = CHAT if chat else COMPLETIONS
        body = await parse(request, endpoint.body, self.max_request_bytes, raw)
        model = self.model_name(body.model)
        if isinstance(body, CompletionBody) and len(batch_of(body)) != 1:
            raise ApiError(400, "tokenize takes one prompt", "prompt")
        models = self.coordinator.ready()
        ids = await prompt_ids(endpoint.request(body)[0][0], models)
        return JSONResponse({"model": model, "count": len(ids), "max_model_len": models.max_context, "tokens": ids})

    async def detokenize(self, request: Request) -> Response:
        """POST /detokenize (vLLM's): `tokens` -> their text (`prompt`), special tokens included."""
        self.keyed(request)
        body = await parse(request, DetokenizeBody, self.max_request_bytes)
        model = self.model_name(body.model)
        models = self.coordinator.ready()
        if bad := [t for t in body.tokens if not 0 <= t < models.vocab_size]:
            raise ApiError(400, f"token id {bad[0]} is outside the vocabulary [0, {models.vocab_size})", "tokens")
        text = await asyncio.to_thread(models.tokenizer.decode, body.tokens)
        return JSONResponse({"model": model, "prompt": text})

    async def metrics(self, request: Request) -> Response:
        return Response(generate_latest(self.coordinator.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    def route(self, endpoint: Endpoint) -> Route:
        async def handle(request: Request) -> Response:
            body = await parse(request, endpoint.body, self.max_request_bytes)
            model = self.model_name(body.model)
            n, prompts = body.n or 1, len(batch_of(body)) if isinstance(body, CompletionBody) else 1
            if prompts * n > MAX_GENERATIONS:  # (before a request is made of any)
                raise ApiError(400, f"{prompts} prompts x n = {n} are {prompts * n} generations; at most"
                                    f" {MAX_GENERATIONS} a request", "prompt" if prompts > 1 else "n")
            made = [endpoint.request(body) for _ in range(n)]  # (each its own reply: tools.py's)
            choices = [each[p] for p in range(prompts) for each in made]  # a prompt's n, then the next's
            for i, (generation, _) in enumerate(choices):  # a seeded request's choices: seed, seed + 1, ... a prompt
                if generation.seed is not None and i % n:  # (the first as sent: the core checks its range)
                    generation.seed = (generation.seed + i % n) % 2**64
            streams = [self.coordinator.generate(generation, f"/v1{endpoint.path}",
                                                 traceparent=request.headers.get("traceparent", ""))
                       for generation, _ in choices]
            if prompts > 1:
                streams = [of_prompt(chunks, i // n) for i, chunks in enumerate(streams)]
            if endpoint is COMPLETIONS and body.echo:
                tokenizer = self.coordinator.ready().tokenizer
                streams = [echoing(chunks, functools.partial(prompt_text, tokenizer, generation))
                           for chunks, (generation, _) in zip(streams, choices)]
            replies = [reply for _, reply in choices]
            scorers = self.scorers(endpoint, len(choices)) if logprobs_asked(body) is not None else None
            if scorers and endpoint is COMPLETIONS and body.echo:
                for scorer, (generation, _) in zip(scorers, choices):
                    scorer.said = prompt_text(self.coordinator.ready().tokenizer, generation)
            head = {"id": f"{endpoint.id_prefix}-{uuid.uuid4().hex}", "created": int(time.time()), "model": model}
            try:
                if not body.stream:
                    return await unless_hung_up(request, self.unary(streams, endpoint, head, replies, scorers, n))
                # each choice's first round before the response starts: a refusal gets its own status, not a 200
                # stream
                try:
                    firsts = await unless_hung_up(request, all_of([anext(chunks) for chunks in streams]))
                except BaseException:
                    await asyncio.gather(*(chunks.aclose() for chunks in streams), return_exceptions=True)
                    raise
            except CORE_ERRORS as e:
                named = isinstance(body, ChatBody) and body.max_completion_tokens is not None
                refused = core_error(e, "max_completion_tokens" if named else "max_tokens")
                if refused.status == 400 and refused.param is None and "constraint" in str(refused):
                    if isinstance(replies[0], ToolReply):
                        # (the constraint is the tools': a schema of theirs, or the answer's, that does not compile)
                        whose = "the tools' schemas" if replies[0].use.response is None else \
                            "the tools' or the structured output's schemas"
                        raise ApiError(400, f"{whose}: {refused}", "tools", refused.code) from e
                    if (field := constraint_field(body)) is not None:  # (a compiler's or matcher's refusal)
                        raise ApiError(400, str(refused), field, refused.code) from e
                raise refused from e
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return EventStream(self.events(firsts, streams, endpoint, head, include_usage, replies, scorers, n))

        return Route(endpoint.path, handle, methods=["POST"])

    def scorers(self, endpoint: Endpoint, count: int) -> list[ChoiceLogprobs]:
        """Each choice's logprobs object maker (a request that asks for them)."""
        tokenizer = self.coordinator.ready().tokenizer
        if self.texts is None or self.texts.tokenizer is not tokenizer:
            self.texts = TokenText(tokenizer)  # (kept: the tokens' texts are worked out once, not per request)
        return [ChoiceLogprobs(self.texts, endpoint is CHAT) for _ in range(count)]

    async def unary(self, streams: list[AsyncIterator[Chunk]], endpoint: Endpoint, head: dict,
                    replies: list[Reply], scorers: list[ChoiceLogprobs] | None = None,
                    per_prompt: int = 1) -> Response:
        async def whole(chunks: AsyncIterator[Chunk]) -> tuple[str, Chunk, list[int], Logprobs | None,
                                                               ScoredPrompt | None]:
            pieces, tokens, scores, prompt = [], [], [], None
            async with contextlib.aclosing(chunks):
                async for chunk in chunks:
                    pieces.append(chunk.text)
                    shown, scored = seen(chunk, endpoint)
                    tokens += shown
                    scores.append(scored)
                    prompt = prompt or chunk.prompt
            return "".join(pieces), chunk, tokens, Logprobs.join(scores), prompt

        answers = await all_of([whole(chunks) for chunks in streams])
        choices = [{**reply(text, FINISH[last.finish], False, True)[0], "index": i} for i, ((text, last, *_), reply)
                   in enumerate(zip(answers, replies))]
        for choice, scorer, (_, _, tokens, scores, prompt) in zip(choices, scorers or [], answers):
            choice["logprobs"] = scorer(tokens, scores, prompt)
        summary = together([answer[1].summary for answer in answers], per_prompt)
        return JSONResponse({
            **head, "object": endpoint.object, "choices": choices,
            "usage": usage(summary), "specdec": specdec_fields(summary),
        }, headers=specdec_headers(summary))

    async def events(self, firsts: list[Chunk], streams: list[AsyncIterator[Chunk]], endpoint: Endpoint,
                     head: dict, include_usage: bool, replies: list[Reply],
                     scorers: list[ChoiceLogprobs] | None = None, per_prompt: int = 1) -> AsyncIterator[str]:
        """One event per choice and round that brought text, the finish_reason (and the choice's
        `specdec`) on its last; with include_usage one more, the usage of all; then [DONE]. The
        choices' rounds come as they are made. A failure after the first round is an error event."""
        head = {**head, "object": endpoint.chunk_object, **({"usage": None} if include_usage else {})}
        rounds: asyncio.Queue[tuple[int, Chunk | BaseException]] = asyncio.Queue(maxsize=1)

        async def pump(i: int, chunk: Chunk, chunks: AsyncIterator[Chunk]) -> None:  # a choice's rounds, in turn
            try:
                async with contextlib.aclosing(chunks):
                    await rounds.put((i, chunk))
                    while chunk.summary is None:
                        chunk = await anext(chunks)
                        await rounds.put((i, chunk))
            except BaseException as e:
                if asyncio.current_task().cancelling():  # (this stream is being closed: nobody reads on)
                    raise
                # anything else ends the stream, a CancelledError from below (a peer's call cancelled
                # under it) too: the reader waits on this queue for it
                await rounds.put((i, e))

        pumps = [asyncio.ensure_future(pump(i, *made)) for i, made in enumerate(zip(firsts, streams))]
        opened, summaries = [False] * len(pumps), {}
        # each choice's tokens not yet sent with an event, their logprobs, and its scored prompt (echo) if unsent
        unsent: list[tuple[list[int], list[Logprobs | None], ScoredPrompt | None]] = [([], [], None) for _ in pumps]
        try:
            while len(summaries) < len(pumps):
                i, chunk = await rounds.get()
                if isinstance(chunk, asyncio.CancelledError):
                    raise ApiError(503, "a model service call was cancelled (the server is stopping?)",
                                   code="unavailable") from chunk
                if isinstance(chunk, BaseException):
                    raise chunk
                finish = None if chunk.finish is None else FINISH[chunk.finish]
                if scorers:
                    shown, scored = seen(chunk, endpoint)
                    unsent[i][0].extend(shown)
                    unsent[i][1].append(scored)
                    if chunk.prompt is not None:
                        unsent[i] = (*unsent[i][:2], chunk.prompt)
                if chunk.text or finish or (not opened[i] and endpoint is CHAT):
                    choices = replies[i](chunk.text, finish, True, not opened[i])
                    for n, choice in enumerate(choices, 1):
                        extra = {"specdec": specdec_fields(chunk.summary)} if chunk.summary and n == len(choices) \
                            else {}
                        scores = Logprobs.join(unsent[i][1]) if scorers else None
                        prompt = unsent[i][2] if scorers else None
                        # (the first event of a round that has tokens, or of the echoed prompt)
                        if scores is not None and len(scores) or prompt is not None:
                            choice = {**choice, "logprobs": scorers[i](unsent[i][0], scores, prompt)}
                            unsent[i] = ([], [], None)
                        yield event({**head, "choices": [{**choice, "index": i}], **extra})
                        opened[i] = True
                if chunk.summary is not None:
                    summaries[i] = chunk.summary
            if include_usage:
                ordered = [summaries[i] for i in range(len(pumps))]
                yield event({**head, "choices": [], "usage": usage(together(ordered, per_prompt))})
        except CORE_ERRORS as e:
            yield event(core_error(e).body())
        except ApiError as e:
            yield event(e.body())
        finally:  # (the client gone, or a choice failed: the others' generations stop)
            for task in pumps:
                task.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
        yield event("[DONE]")


def key_refused() -> ApiError:
    """What a request without the server's API key gets."""
    return ApiError(401, "a valid API key is required: send `Authorization: Bearer <key>`", code="invalid_api_key")


class RequireApiKey:
    """ASGI middleware: a request without `Authorization: Bearer <key>` gets 401."""

    def __init__(self, app, key: str):
        self.app, self.key = app, key

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and not bearer_ok(Headers(scope=scope).get("authorization"), self.key):
            return await key_refused().response()(scope, receive, send)
        await self.app(scope, receive, send)


class AnswerPastGrace:
    """ASGI middleware: a request the server cancels because its stop's grace ran out (uvicorn cancels what is
    left) gets OpenAI's error object, 503, where no response has started (uvicorn would send a bare 500); a
    stream already under way ends with its error event (EventStream's `cut`), not a connection closed mid-body
    and a traceback logged for each (operations.md, Shutdown)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        started = ended = False

        async def sending(message) -> None:
            nonlocal started, ended
            started = started or message["type"] == "http.response.start"
            ended = ended or message["type"] == "http.response.body" and not message.get("more_body", False)
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if scope["type"] != "http" or ended or started and (CUT not in scope
                                                                 or not asyncio.current_task().cancelling()):
                raise  # (a stream ends with its cut only where the server cancels it, not for a cancel from below)
            refused = ApiError(503, "the server is stopping (its shutdown grace ran out): retry on another replica",
                               code="unavailable")
            if not started:
                return await refused.response()(scope, receive, send)
            log.warning("%s %s: a stream cut, the shutdown grace having run out", scope["method"], scope["path"])
            await send({"type": "http.response.body", "body": scope[CUT](refused).encode(), "more_body": False})


def app(coordinator: Coordinator, api_key: str | None = None, max_request_bytes: int = MAX_REQUEST_BYTES,
        store_responses: int = STORE_RESPONSES, store_bytes: int = STORE_BYTES) -> Starlette:
    """The ASGI application: /v1/* (behind `api_key` if given), /health, /metrics; `store_responses`: the most
    Responses API responses kept, `store_bytes` about the most bytes of them (coordinator/responses.py)."""
    from . import responses  # (it builds on this module's chat path)

    api = OpenAIApi(coordinator, max_request_bytes, api_key)
    v1 = [Route("/models", api.models), Route("/models/{model:path}", api.model), api.route(CHAT),
          api.route(COMPLETIONS), *responses.routes(api, store_responses, store_bytes)]
    open_routes = [Route("/health", api.health)]
    keyed = [Route("/tokenize", api.tokenize, methods=["POST"]), Route("/detokenize", api.detokenize, methods=["POST"])]
    if coordinator.metrics is not None:
        open_routes.append(Route("/metrics", api.metrics))

    def refusal(request: Request, error: Exception) -> Response:
        if isinstance(error, ApiError):
            return error.response()
        if isinstance(error, CORE_ERRORS):
            return core_error(error).response()
        if isinstance(error, HTTPException):
            return ApiError(error.status_code, error.detail).response()
        if isinstance(error, ClientDisconnect):
            return Response(status_code=499)  # nobody to read it
        return ApiError(500, f"internal error: {type(error).__name__}").response()

    handled = (ApiError, *CORE_ERRORS, HTTPException, ClientDisconnect, Exception)
    application = Starlette(
        routes=[Mount("/v1", routes=v1, middleware=[Middleware(RequireApiKey, key=api_key)] if api_key else []),
                *keyed, *open_routes],
        exception_handlers={kind: refusal for kind in handled},
        middleware=[Middleware(AnswerPastGrace)],
    )
    application.state.closing = api.closing  # (HttpServer.run awaits each once it has stopped serving)
    return application


class _InTheLoop(uvicorn.Server):
    """uvicorn in an event loop it does not own: the coordinator's signal handlers stop it."""

    def capture_signals(self):
        return contextlib.nullcontext()


class HttpServer:
    """uvicorn serving `application` as a task of the running event loop.

    The port is bound at construction, so a taken one fails the start; once `run`'s event is set it
    stops taking connections and gives those open `grace` seconds to finish. With `tls` (cert, key, CA or None)
    it serves HTTPS, requiring client certificates where a CA is given, as the gRPC port does."""

    def __init__(self, application, host: str, port: int, grace: float,
                 tls: tuple[str, str, str | None] | None = None):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family)
        self.host, self.port = host, self.socket.getsockname()[1]
        cert, key, ca = tls or (None, None, None)
        config = uvicorn.Config(application, http="h11", ws="none", lifespan="off", log_config=None,
                                access_log=False, timeout_graceful_shutdown=grace, ssl_certfile=cert,
                                ssl_keyfile=key, ssl_ca_certs=ca,
                                ssl_cert_reqs=ssl.CERT_REQUIRED if ca else ssl.CERT_NONE)
        self.server, self.application = _InTheLoop(config), application
        self.url = f"{'https' if tls else 'http'}://{f'[{host}]' if family == socket.AF_INET6 else host}:{self.port}"

    async def run(self, stop: asyncio.Event) -> None:
        """Serve until `stop` is set, then stop gracefully; should the server end by itself, set `stop`."""
        serving, stopping = asyncio.ensure_future(self.server.serve(sockets=[self.socket])), \
            asyncio.ensure_future(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        stopping.cancel()
        self.server.should_exit = True
        stop.set()
        await serving
        for close in getattr(self.application.state, "closing", []):
            await close()
