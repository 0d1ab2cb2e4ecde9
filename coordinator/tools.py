"""Tool calls on the chat endpoint (OpenAI's `tools` and `tool_choice`), for any model, by
structured output: the request's tools are described to the model in a system message, and its
answer is constrained to a JSON shape that says which tools it calls with which arguments, each
call's arguments following the tool's own JSON schema. The answer is then read back into OpenAI's
`tool_calls`. (llama.cpp's server does the same for models without a tool-call format of their
own; vLLM instead parses each model family's own format.)

    tool_choice             the model's answer (the constraint)               the reply
    none                    free text; the tools are not described           content
    auto (with tools)       {"tool_calls": [CALL, ...]} or {"response": S}    tool_calls, or S as content
    auto, response_format   {"tool_calls": [CALL, ...]} or {"response": R}    tool_calls, or R's JSON as content
    required                {"tool_calls": [CALL, ...]}                       tool_calls
    {"type": "function",    the function's arguments                          one tool call
     "function": {"name"}}

CALL is {"name": a tool's name, "arguments": that tool's parameters}; `parallel_tool_calls: false`
allows one call. A tool's parameters are a JSON schema of an object (none given: no arguments), each
moved under the answer's $defs with its references; its arguments are those it lists: where the
schema does not say otherwise (additionalProperties, a combinator, a reference), additionalProperties
is false (JSON schema's default, true, lets a model invent arguments). Each call's arguments are the
model's text as it wrote it. A structured output asked beside the tools (response_format json_schema or
json_object, guided_json, structured_outputs.json: the agent frameworks' final answer) shapes the direct
answer R (auto): its schema moved under $defs as a tool's is, R's JSON text the content as the model
wrote it; under required and a named function the answer is calls, which it does not shape.
finish_reason is "tool_calls" where the model chose to call (auto, required) and "stop" for a named
function (as OpenAI's); an answer cut short (max_tokens, a stop string) gives what it has, with that
finish_reason: the response's text so far, or the calls begun, the last one's arguments cut. A
conversation's earlier calls (an assistant message's `tool_calls`, after its content) are shown to
the model in the same JSON, and tool results (role `tool`, named by the call they answer) in user
turns, a user message after them joining theirs, so that templates that want turns to alternate
render them.

Streamed, a named function's arguments arrive as they are generated; under auto and required, a
response's text as it is generated, and each call once its arguments are whole; the finish_reason
in an event of its own after them (as OpenAI's streams end: the openai client's stream helper reads
it so).
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, replace
from typing import Any

from speculative.errors import InvalidRequest
from speculative.protocol import Constraint

NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's rule for a function's name
CHOICES = ("none", "auto", "required")
COMPACT = {"x-guidance": {"whitespace_flexible": False}}  # the answer's JSON without free whitespace
# keys past which a schema's own properties are not all it takes: additionalProperties false would
# forbid what they add
OPEN = {"anyOf", "allOf", "oneOf", "not", "$ref", "patternProperties", "additionalProperties",
        "unevaluatedProperties", "if", "then", "else", "dependentSchemas"}
DATA = {"enum", "const", "default", "examples"}  # a schema's keys whose values are data, not schemas
NAMED = {"properties", "patternProperties", "$defs", "definitions", "dependentSchemas",  # name -> schema maps
         "dependencies"}
# the answer's layout (llguidance keeps a schema's property order, and COMPACT leaves no whitespace)
CALLS, NAME_KEY, ARGUMENTS_KEY, RESPONSE = '{"tool_calls":[', '{"name":', ',"arguments":', '{"response":'


@dataclass(frozen=True)
class Tool:
    name: str
    description: str
    parameters: dict[str, Any]  # a JSON schema of its arguments


def tools_of(tools: list[Any]) -> list[Tool]:
    """The request's `tools`, checked: each {"type": "function", "function": {"name", "description"?,
    "parameters"?}}, names unique."""
    found: dict[str, Tool] = {}
    for i, item in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(item, dict) or item.get("type") != "function" or not isinstance(item.get("function"), dict):
            raise InvalidRequest(f'{where}: a tool is {{"type": "function", "function": {{"name": ...}}}}', "tools")
        function = item["function"]
        name, description = function.get("name"), function.get("description") or ""
        parameters = function.get("parameters")
        if parameters is None:  # (OpenAI's: a function without parameters takes none)
            parameters = {"type": "object", "properties": {}}
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise InvalidRequest(f"{where}.function.name: 1 to 64 letters, digits, '_' or '-', not {name!r}", "tools")
        if name in found:
            raise InvalidRequest(f"{where}.function.name: {name!r} names two tools", "tools")
        if not isinstance(description, str):
            raise InvalidRequest(f"{where}.function.description: a string", "tools")
        if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
            raise InvalidRequest(f"{where}.function.parameters: a JSON schema of an object (its arguments)", "tools")
        parameters = {"type": "object", **parameters}  # (arguments are an object even where the schema omits it)
        if not OPEN & parameters.keys():
            # a function takes the arguments it lists: a model left free to add others (as JSON schema's
            # default allows) invents some
            parameters["additionalProperties"] = False
        found[name] = Tool(name, description, parameters)
    return list(found.values())


@dataclass(frozen=True)
class ToolUse:
    """How one chat request uses its tools: `mode` none, auto, required or function (`named`)."""

    tools: list[Tool]
    mode: str
    named: str = ""
    parallel: bool = True
    response: Any = None  # the JSON schema of a direct answer (auto) where a structured output is asked; else text

    @classmethod
    def of(cls, tools: list[Any] | None, choice: str | dict | None, parallel: bool | None) -> "ToolUse | None":
        """From the request's fields; None where no tool is in play (tool_choice none, or no tools)."""
        listed = tools_of(tools or [])
        if isinstance(choice, dict):
            function = choice.get("function")
            name = function.get("name") if isinstance(function, dict) else None
            if choice.get("type") != "function" or not isinstance(name, str):
                raise InvalidRequest('tool_choice: "none", "auto", "required" or {"type": "function", "function":'
                                     ' {"name": ...}}', "tool_choice")
            if name not in {t.name for t in listed}:
                raise InvalidRequest(f"tool_choice names the function {name!r}, which is not among the tools",
                                     "tool_choice")
            return cls(listed, "function", name, parallel is not False)
        if choice is not None and choice not in CHOICES:
            raise InvalidRequest(f"tool_choice must be one of {', '.join(CHOICES)} or a function, not {choice!r}",
                                 "tool_choice")
        if choice == "required" and not listed:
            raise InvalidRequest("tool_choice required needs tools", "tool_choice")
        if choice == "none" or not listed:
            return None
        return cls(listed, choice or "auto", "", parallel is not False)

    def answering(self, constraint: Constraint) -> "ToolUse":
        """This use with a direct answer shaped by `constraint`, a structured output asked beside the tools
        (a JSON schema or any JSON object; a regex, choice or grammar is refused: the answer is JSON)."""
        if constraint.kind == "json_object":
            return replace(self, response={"type": "object"})
        if constraint.kind != "json_schema":
            raise InvalidRequest(f"tools are answered in JSON: a {constraint.kind} constraint cannot shape the answer"
                                 " beside them (give a JSON schema, or tool_choice none)", "tool_choice")
        try:
            schema = json.loads(constraint.text)
        except ValueError:
            raise InvalidRequest("the structured output's JSON schema is not JSON", "response_format") from None
        if not isinstance(schema, dict | bool):
            raise InvalidRequest("the structured output's JSON schema is an object", "response_format")
        return replace(self, response={} if schema is True else schema)

    # ---------------------------------------------------------------- what the model is given

    def constraint(self) -> Constraint:
        """The answer's shape (the module docstring's table) as a JSON-schema constraint."""
        if self.mode == "function":
            schema = {**COMPACT, **self.tool(self.named).parameters}
        else:
            # each tool's schema under $defs, its references (to its own root "#", its $defs...) pointing there
            defs = {f"tool-{t.name}": rebased(t.parameters, f"#/$defs/tool-{t.name}") for t in self.tools}
            call = {"anyOf": [{"type": "object", "properties": {"name": {"const": t.name},
                                                                "arguments": {"$ref": f"#/$defs/tool-{t.name}"}},
                               "required": ["name", "arguments"], "additionalProperties": False}
                              for t in self.tools]}
            calls = {"type": "array", "items": call, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}
            called = {"type": "object", "properties": {"tool_calls": calls}, "required": ["tool_calls"],
                      "additionalProperties": False}
            said = {"type": "string"}
            if self.response is not None and self.mode == "auto":
                defs["response"] = rebased(self.response, "#/$defs/response")
                said = {"$ref": "#/$defs/response"}
            answered = {"type": "object", "properties": {"response": said}, "required": ["response"],
                        "additionalProperties": False}
            schema = {**COMPACT, "$defs": defs,
                      **(called if self.mode == "required" else {"anyOf": [called, answered]})}
        return Constraint("json_schema", json.dumps(schema))

    def instructions(self) -> str:
        """The system message's words on the tools and how to answer (compact: they take prompt tokens)."""
        listed = compact([{"name": t.name, **({"description": t.description} if t.description else {}),
                           "parameters": t.parameters} for t in self.tools])
        calls = '{"tool_calls":[{"name":NAME,"arguments":{...}}' + (",...]}" if self.parallel else "]}")
        direct = ' {"response":"..."}' if self.response is None else \
            f' {{"response":ANSWER}}, ANSWER as this JSON schema says: {compact(self.response)}'
        how = {"function": f"Call the tool {self.named}: answer with its arguments as one JSON object.",
               "required": f"Call {'one or more tools' if self.parallel else 'one tool'}: answer {calls}",
               "auto": f"To call {'tools' if self.parallel else 'a tool'}, answer {calls}; to answer directly,"
                       + direct}[self.mode]
        return f"Tools (their arguments as JSON schemas): {listed}\n{how}"

    def tool(self, name: str) -> Tool:
        return next(t for t in self.tools if t.name == name)

    # ---------------------------------------------------------------- what comes back

    def read(self, text: str, finish: str) -> tuple[str | None, list[dict], str]:
        """The answer's text -> (content, tool_calls, finish_reason). Each call's arguments are the
        model's own text (not parsed and written again: numbers stay as they were). An answer cut
        short (max_tokens, a stop string) gives what it has: the response's text so far, or its
        calls, the last one's arguments cut."""
        if self.mode == "function":
            return None, [call_of(self.named, text)], finish
        if text.startswith(RESPONSE):
            return self.answer(text), [], finish
        calls, whole = calls_in(text)
        made = [call_of(name, arguments) for name, arguments, _ in calls]
        if whole:
            return None, made, "tool_calls" if finish == "stop" else finish
        return None if made else "", made, finish


    def so_far(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """Of an answer still being written (auto, required): (the response's text so far, "" where it
        is calls, the calls whose arguments are whole), as a stream sends them."""
        if text.startswith(RESPONSE):
            return self.answer(text), []
        return "", [(name, arguments) for name, arguments, whole in calls_in(text)[0] if whole]


    def answer(self, text: str) -> str:
        """A direct answer's content, {"response": ...} whole or as far as it goes: a text response's string
        (string_prefix), a shaped one's JSON as the model wrote it, without the closing brace after it."""
        if self.response is None:
            return string_prefix(text[len(RESPONSE) + 1 :])
        body = text[len(RESPONSE) :]
        try:
            _, end = json.JSONDecoder().raw_decode(body)
        except ValueError:
            return body  # (the answer not yet whole: all of it is the answer's)
        return body[:end]


def call_of(name: str, arguments: str) -> dict:
    return {"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def rebased(schema: Any, root: str) -> Any:
    """A schema moved from a document's root to `root`: its local references ("#", "#/$defs/..."...)
    rewritten to point there (not inside data: an enum's values, a default)."""
    if isinstance(schema, list):
        return [rebased(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in NAMED and isinstance(value, dict):  # (its keys are names, "default" among them maybe)
            out[key] = {name: rebased(each, root) for name, each in value.items()}
        else:
            out[key] = value if key in DATA else rebased(value, root)
    return out


def calls_in(text: str) -> tuple[list[tuple[str, str, bool]], bool]:
    """(name, arguments' text, whether they are whole) of each call an answer {"tool_calls": [...]}
    holds, and whether the answer is whole; of an answer cut short (or still being written), the
    calls begun, the last one's arguments as far as they go."""
    decoder, calls = json.JSONDecoder(), []
    if not text.startswith(CALLS):
        return calls, False
    at = len(CALLS)
    while text.startswith(NAME_KEY, at):
        try:
            name, at = decoder.raw_decode(text, at + len(NAME_KEY))
        except ValueError:
            break  # the name is cut
        if not text.startswith(ARGUMENTS_KEY, at):
            calls.append((name, "", False))
            break
        start = at = at + len(ARGUMENTS_KEY)
        try:
            _, at = decoder.raw_decode(text, at)  # (arguments are an object: whole once it closes)
        except ValueError:
            calls.append((name, text[start:], False))
            break
        calls.append((name, text[start:at], True))
        if text.startswith("},", at):
            at += 2
        else:
            return calls, text[at:] == "}]}"
    return calls, False


def string_prefix(body: str) -> str:
    """The text of a JSON string from just after its opening quote, however far it goes (its closing
    quote and what follows dropped; an escape cut short too)."""
    for cut in range(len(body), max(-1, len(body) - 16), -1):
        try:
            text = json.loads(f'"{body[:cut]}"')
            text.encode()  # (not a lone surrogate)
            return text
        except (ValueError, UnicodeEncodeError):
            continue
    return ""


def conversation(messages: list, use: ToolUse | None) -> list[tuple[str, str]]:
    """The chat's messages as (role, text) turns any template renders: earlier tool calls as the JSON
    the model answers with, tool results (role tool) as one user turn per run of them, and where tools
    are in use their instructions in the system message (added to the first one, or a new one first).
    Each message has role, content (a str or None) and, where given, tool_calls / tool_call_id / name."""
    turns: list[tuple[str, str]] = []
    named: dict[str, str] = {}  # call id -> its function's name
    results = False  # whether the last turn holds tool results (a user turn the next user message joins)
    for i, m in enumerate(messages):
        if m.role == "tool" or (m.role == "user" and results):
            if m.role == "tool":
                text = compact({"tool_response": {"name": named.get(m.tool_call_id or "", ""),
                                                  "tool_call_id": m.tool_call_id or "", "content": m.content or ""}})
            else:
                text = m.content or ""
            if results:
                turns[-1] = ("user", f"{turns[-1][1]}\n{text}")
            else:
                turns.append(("user", text))
            results = m.role == "tool"
            continue
        results = False
        if m.tool_calls:
            said = calls_said(i, m.tool_calls, named)
            turns.append((m.role, f"{m.content}\n{said}" if m.content else said))
        else:
            turns.append((m.role, m.content or ""))
    if use is not None:
        if turns and turns[0][0] == "system":
            turns[0] = ("system", f"{turns[0][1]}\n\n{use.instructions()}" if turns[0][1] else use.instructions())
        else:
            turns.insert(0, ("system", use.instructions()))
    return turns


def calls_said(i: int, tool_calls: list, named: dict[str, str]) -> str:
    """An assistant message's (messages[i]) earlier calls as the model answers with them; each call's
    id -> its function's name into `named`."""
    calls = []
    for j, call in enumerate(tool_calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise InvalidRequest(f"messages[{i}].tool_calls[{j}]: a call is {{\"type\": \"function\","
                                 f" \"function\": {{\"name\": ..., \"arguments\": ...}}}}", "messages")
        arguments = function.get("arguments", "{}")
        try:  # (a string of JSON, as OpenAI's API sends them)
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            pass
        calls.append({"name": function["name"], "arguments": arguments})
        if isinstance(call.get("id"), str):
            named[call["id"]] = function["name"]
    return compact({"tool_calls": calls})


def compact(value: Any) -> str:
    """JSON as the model writes it under the constraint (COMPACT): no whitespace."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))
