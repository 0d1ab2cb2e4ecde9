"""Tool calls on the chat endpoint (coordinator/tools.py): the constraint each tool_choice gives holds
exactly the answers it should, answers read back into OpenAI's tool_calls, earlier calls and tool
results render through any chat template, and through the three services the official client gets
calls whose arguments follow each tool's schema, unary and streamed; bad tool fields are 400."""

from __future__ import annotations

import json
from types import SimpleNamespace

import jsonschema
import openai
import pydantic
import pytest

from coordinator.http import ToolReply
from coordinator.launch import LocalStack
from coordinator.tools import ToolUse, conversation, rebased, tools_of
from speculative.errors import InvalidRequest
from speculative.protocol import Constraint
from speculative.tiny import make_model, make_tokenizer
from tests.coordinator.test_openai import openai_client
from tests.coordinator.test_structured import post

# bounded arguments, so that even a random-weight model completes a call within the token budget
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 5}, "unit": {"enum": ["c", "f"]}},
           "required": ["city", "unit"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
       "required": ["a"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "A city's weather.",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "parameters": ADD}}]
SCHEMAS = {"weather": WEATHER, "add": ADD}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]


def schema_of(use: ToolUse) -> dict:
    constraint = use.constraint()
    assert constraint.kind == "json_schema"
    return json.loads(constraint.text)


def valid(schema: dict, answer) -> bool:
    try:
        jsonschema.validate(answer, schema)
        return True
    except jsonschema.ValidationError:
        return False


@pytest.mark.parametrize("tools,reason", [
    ([{"type": "function"}], "a tool is"),
    ([{"type": "retrieval", "function": {"name": "a"}}], "a tool is"),
    ([{"type": "function", "function": {"name": "has space"}}], "letters, digits"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "1 to 64"),
    ([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}], "two tools"),
    ([{"type": "function", "function": {"name": "a", "parameters": "{}"}}], "JSON schema of an object"),
    ([{"type": "function", "function": {"name": "a", "parameters": {"type": "string"}}}], "JSON schema of an object"),
    ([{"type": "function", "function": {"name": "a", "description": 3}}], "description"),
])
def test_bad_tools_are_refused_naming_the_tool(tools, reason):
    with pytest.raises(InvalidRequest, match=reason) as refused:
        tools_of(tools)
    assert refused.value.param == "tools"


@pytest.mark.parametrize("tools,choice,reason", [
    (TOOLS, "sometimes", "one of none, auto, required"),
    (TOOLS, {"type": "function", "function": {"name": "mail"}}, "'mail', which is not among the tools"),
    (TOOLS, {"type": "function"}, "tool_choice"),
    (None, "required", "needs tools"),
    (None, {"type": "function", "function": {"name": "add"}}, "not among the tools"),
])
def test_bad_tool_choices_are_refused(tools, choice, reason):
    with pytest.raises(InvalidRequest, match=reason) as refused:
        ToolUse.of(tools, choice, None)
    assert refused.value.param == "tool_choice"


def test_a_tool_takes_only_the_arguments_its_schema_lists_unless_it_says_otherwise():
    listed = {"type": "object", "properties": {"x": {"type": "integer"}}}
    given = [{"type": "function", "function": {"name": "f", "parameters": listed}},
             {"type": "function", "function": {"name": "g", "parameters": {**listed, "additionalProperties": True}}},
             {"type": "function", "function": {"name": "h"}}]
    assert [t.parameters.get("additionalProperties") for t in tools_of(given)] == [False, True, False]  # h: none
    f = ToolUse.of(given, {"type": "function", "function": {"name": "f"}}, None)
    assert valid(schema_of(f), {"x": 1}) and not valid(schema_of(f), {"x": 1, "y": 2})
    assert "additionalProperties" not in listed  # (the request's own schema is left as it was)


def test_which_mode_a_request_is_in():
    assert ToolUse.of(None, None, None) is None and ToolUse.of([], "auto", None) is None
    assert ToolUse.of(TOOLS, "none", None) is None
    assert ToolUse.of(TOOLS, None, None).mode == "auto"  # OpenAI's default where tools are given
    named = ToolUse.of(TOOLS, {"type": "function", "function": {"name": "add"}}, False)
    assert (named.mode, named.named) == ("function", "add")
    assert ToolUse.of(TOOLS, "required", False).parallel is False


def call(name: str, **arguments) -> dict:
    return {"name": name, "arguments": arguments}


def test_each_modes_constraint_holds_exactly_its_answers():
    auto, required = ToolUse.of(TOOLS, "auto", None), ToolUse.of(TOOLS, "required", False)
    named = ToolUse.of(TOOLS, {"type": "function", "function": {"name": "weather"}}, None)
    good_calls = {"tool_calls": [call("weather", city="Paris", unit="c"), call("add", a=2)]}
    one_call = {"tool_calls": [call("add", a=2)]}
    bad = [{"tool_calls": []}, {"tool_calls": [call("mail", to="x")]}, {"tool_calls": [call("add")]},
           {"tool_calls": [call("add", a=20)]}, {"tool_calls": [call("add", a=2, b=3)]},
           {"tool_calls": [call("weather", city="Paris", unit="k")]}, {"tool_calls": [{"name": "add"}]},
           {"tool_calls": [{**call("add", a=1), "extra": 1}]}, {"response": 3}, {"response": "x", "other": 1},
           {"tool_calls": [call("add", a=1)], "response": "x"}, [call("add", a=1)], "hello"]
    assert valid(schema_of(auto), good_calls) and valid(schema_of(auto), {"response": "It is sunny."})
    assert valid(schema_of(required), one_call)
    assert not valid(schema_of(required), good_calls)  # parallel_tool_calls false: one call
    assert not valid(schema_of(required), {"response": "It is sunny."})  # required: a call
    assert valid(schema_of(ToolUse.of(TOOLS, "required", None)), good_calls)
    for answer in bad:
        assert not valid(schema_of(auto), answer), answer
    assert valid(schema_of(named), {"city": "Paris", "unit": "f"})
    assert not valid(schema_of(named), {"a": 1}) and not valid(schema_of(named), call("weather", city="P"))
    # the answer's JSON without free whitespace (llguidance's option), the schema's own keys kept
    assert schema_of(named)["x-guidance"] == {"whitespace_flexible": False}
    assert schema_of(named)["required"] == ["city", "unit"]


def compact(answer) -> str:
    """An answer as the model writes it under the constraint: JSON without whitespace."""
    return json.dumps(answer, separators=(",", ":"))


def test_answers_are_read_back_into_tool_calls():
    auto = ToolUse.of(TOOLS, "auto", None)
    text = compact({"tool_calls": [call("weather", city="Paris", unit="c"), call("add", a=2)]})
    content, calls, finish = auto.read(text, "stop")
    assert content is None and finish == "tool_calls"
    assert [(c["type"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("function", "weather", {"city": "Paris", "unit": "c"}), ("function", "add", {"a": 2})]
    assert len({c["id"] for c in calls}) == 2 and all(c["id"].startswith("call_") for c in calls)
    assert auto.read('{"response":"Sunny \\"and\\" warm."}', "stop") == ('Sunny "and" warm.', [], "stop")
    # each call's arguments are the model's own text: numbers as written (json would read 1e999 as inf and
    # write Infinity, which is not JSON, and round 12345678901234567890.5)
    raw = '{"tool_calls":[{"name":"add","arguments":{"a":1e999,"b":12345678901234567890.5}}]}'
    assert [c["function"]["arguments"] for c in auto.read(raw, "stop")[1]] == [
        '{"a":1e999,"b":12345678901234567890.5}']
    named = ToolUse.of(TOOLS, {"type": "function", "function": {"name": "add"}}, None)
    content, calls, finish = named.read('{"a":2}', "stop")
    assert content is None and finish == "stop" and calls[0]["function"] == {"name": "add", "arguments": '{"a":2}'}


@pytest.mark.parametrize("text,content,calls", [
    ('{"response":"Hello, wor', "Hello, wor", []),
    ('{"response":"caf\\u00', "caf", []),  # an escape cut short
    ('{"response":"done"', "done", []),
    ('{"response":', "", []),
    ('{"too', "", []),
    ('{"tool_calls":[{"name":"weather","arguments":{"city":"Pa', None, [("weather", '{"city":"Pa')]),
    ('{"tool_calls":[{"name":"add","arguments":{"a":2}},{"name":"wea', None, [("add", '{"a":2}')]),
    ('{"tool_calls":[{"name":"add","arguments":{"a":2}}]', None, [("add", '{"a":2}')]),
])
def test_an_answer_cut_short_gives_what_it_has(text, content, calls):
    for finish in ("length", "stop"):  # (max_tokens, or a stop string)
        said, made, reason = ToolUse.of(TOOLS, "auto", None).read(text, finish)
        assert said == content and [(c["function"]["name"], c["function"]["arguments"]) for c in made] == calls
        assert reason == finish


def test_parameters_are_an_object_and_references_keep_their_meaning():
    # none given: no arguments (OpenAI's empty parameter list); no type: still an object
    bare, untyped = tools_of([{"type": "function", "function": {"name": "now"}},
                              {"type": "function", "function": {"name": "u", "parameters": {"properties": {
                                  "c": {"enum": ["a"]}}}}}])
    now = ToolUse.of([{"type": "function", "function": {"name": "now", "parameters": None}}],
                     {"type": "function", "function": {"name": "now"}}, None)
    assert valid(schema_of(now), {}) and not valid(schema_of(now), {"x": 1}) and not valid(schema_of(now), 8)
    assert untyped.parameters["type"] == "object" and bare.parameters["additionalProperties"] is False
    # a schema with its own $defs and references, to them and to its root ("#"), under required and auto
    tree = {"type": "object", "properties": {"n": {"$ref": "#/$defs/Name"}, "child": {"$ref": "#"}},
            "required": ["n"], "$defs": {"Name": {"type": "string", "maxLength": 3}}}
    use = ToolUse.of([{"type": "function", "function": {"name": "tree", "parameters": tree}}], "required", None)
    good = {"tool_calls": [call("tree", n="a", child={"n": "b", "child": {"n": "c"}})]}
    assert valid(schema_of(use), good)
    assert not valid(schema_of(use), {"tool_calls": [call("tree", n="a", child={"tool_calls": []})]})
    assert not valid(schema_of(use), {"tool_calls": [call("tree", n="abcd")]})
    # references inside properties whose names are also keywords whose values are data ("default", "enum")
    odd = {"type": "object", "properties": {"default": {"$ref": "#/$defs/Inner"}, "enum": {"$ref": "#/$defs/Inner"}},
           "required": ["default"], "$defs": {"Inner": {"type": "integer", "maximum": 5}}}
    use = ToolUse.of([{"type": "function", "function": {"name": "odd", "parameters": odd}}], "required", None)
    assert valid(schema_of(use), {"tool_calls": [call("odd", default=3, enum=1)]})
    assert not valid(schema_of(use), {"tool_calls": [call("odd", default=9)]})
    assert '"#/$defs/Inner"' not in use.constraint().text
    assert rebased({"dependencies": {"default": {"$ref": "#/$defs/X"}, "b": ["a"]}}, "#/$defs/t") == {
        "dependencies": {"default": {"$ref": "#/$defs/t/$defs/X"}, "b": ["a"]}}  # (draft-07's dependencies)
    # a combinator adds properties: additionalProperties is not forced false beside it
    either = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}}, "required": ["kind"],
              "anyOf": [{"properties": {"x": {"type": "integer"}}, "required": ["x"]}]}
    (tool,) = tools_of([{"type": "function", "function": {"name": "e", "parameters": either}}])
    assert "additionalProperties" not in tool.parameters
    named = ToolUse.of([{"type": "function", "function": {"name": "e", "parameters": either}}],
                       {"type": "function", "function": {"name": "e"}}, None)
    assert valid(schema_of(named), {"kind": "a", "x": 1})


def message(role: str, content: str | None = None, **fields):
    return SimpleNamespace(role=role, content=content, tool_calls=fields.get("tool_calls"),
                           tool_call_id=fields.get("tool_call_id"))


def test_a_conversation_with_calls_and_results_renders_as_plain_turns():
    asked = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    history = [message("system", "Be brief."), message("user", "2 + 3?"),
               message("assistant", "Adding.", tool_calls=[asked, {**asked, "id": "call_2"}]),
               message("tool", "5", tool_call_id="call_1"), message("tool", "5", tool_call_id="call_2"),
               message("user", "And?"), message("assistant", "5."), message("user", "Thanks.")]
    use = ToolUse.of(TOOLS, "auto", None)
    turns = conversation(history, use)
    assert [role for role, _ in turns] == ["system", "user", "assistant", "user", "assistant", "user"]
    assert turns[0][1].startswith("Be brief.\n\n") and '"name":"weather"' in turns[0][1]
    said, calls = turns[2][1].split("\n")  # the assistant's words, then its calls as the model answers them
    assert said == "Adding." and json.loads(calls) == {"tool_calls": [call("add", a=2)] * 2}
    # both results, named by the call they answer, and the user's next message in one user turn (templates
    # that want turns to alternate)
    *results, then = turns[3][1].splitlines()
    assert [json.loads(line) for line in results] == [
        {"tool_response": {"name": "add", "tool_call_id": f"call_{i}", "content": "5"}} for i in (1, 2)]
    assert then == "And?"
    # tool_choice none: no instructions, the history still renders; a conversation without a system message
    # gets one first
    assert [t for t in conversation(history, None)] == [("system", "Be brief."), *turns[1:]]
    assert conversation(history[1:2], use)[0] == ("system", use.instructions())
    with pytest.raises(InvalidRequest, match=r"messages\[0\].tool_calls\[0\]"):
        conversation([message("assistant", None, tool_calls=[{"type": "function"}])], use)


def test_a_streamed_reply_sends_text_and_arguments_as_they_come_and_calls_once_whole():
    named = ToolReply(ToolUse.of(TOOLS, {"type": "function", "function": {"name": "add"}}, None))
    events = [*named('{"a', None, True, True), *named('":', None, True, False), *named('2}', "stop", True, False)]
    deltas = [e["delta"] for e in events]
    assert deltas[0]["role"] == "assistant" and deltas[0]["tool_calls"][0]["function"]["name"] == "add"
    arguments = "".join(d["tool_calls"][0]["function"]["arguments"] for d in deltas if d)
    assert arguments == '{"a":2}'
    # the finish_reason in an event of its own after the calls, as OpenAI's streams end (the openai
    # client's stream helper reads a call as done only then)
    assert [e["finish_reason"] for e in events] == [None, None, None, "stop"] and deltas[-1] == {}
    # auto and required: each call once its arguments are whole, the response's text as it comes
    held = ToolReply(ToolUse.of(TOOLS, "auto", None))
    text = compact({"tool_calls": [call("add", a=2), call("weather", city="Oslo", unit="c")]})
    cut = text.index("}") + 1  # the first call's arguments whole
    assert [e["delta"] for e in held(text[:5], None, True, True)] == [{"role": "assistant", "content": None}]
    assert held(text[5:cut - 1], None, True, False) == []  # nothing sent mid-arguments
    (first,) = held(text[cut - 1 : cut], None, True, False)
    assert [(c["index"], c["function"]["name"], c["function"]["arguments"]) for c in first["delta"]["tool_calls"]] == [
        (0, "add", '{"a":2}')]
    calls, last = held(text[cut:], "stop", True, False)
    assert [(c["index"], c["function"]["name"]) for c in calls["delta"]["tool_calls"]] == [(1, "weather")]
    assert calls["finish_reason"] is None and last == {"index": 0, "delta": {}, "logprobs": None,
                                                        "finish_reason": "tool_calls"}
    answered = ToolReply(ToolUse.of(TOOLS, "auto", None))
    parts = ['{"resp', 'onse":"Fi', 've \\u00e9', "t\\u00e", '9\\n', '"}']
    deltas = [e["delta"] for n, part in enumerate(parts) for e in answered(part, "stop" if n == 5 else None, True,
                                                                             n == 0)]
    assert deltas == [{"role": "assistant", "content": None}, {"content": "Fi"}, {"content": "ve \u00e9"},
                      {"content": "t"}, {"content": "\u00e9\n"}, {}]  # (an escape cut short waits for the rest)


PLACE = {"type": "object", "properties": {"city": {"$ref": "#/$defs/City"}}, "required": ["city"],
         "additionalProperties": False, "$defs": {"City": {"type": "string", "maxLength": 5}}}


def test_a_structured_output_beside_the_tools_shapes_the_direct_answer():
    auto = ToolUse.of(TOOLS, "auto", None).answering(Constraint("json_schema", json.dumps(PLACE)))
    schema = schema_of(auto)
    assert valid(schema, {"response": {"city": "Oslo"}})
    assert valid(schema, {"tool_calls": [call("add", a=2)]})
    for answer in ({"response": "Oslo"}, {"response": {"city": "Paris!"}}, {"response": {"city": "Oslo", "x": 1}},
                   {"response": {}}, {"tool_calls": [call("add", a=20)]}):
        assert not valid(schema, answer), answer
    assert '"maxLength":5' in auto.instructions() and '{"response":ANSWER}' in auto.instructions()
    # any JSON object (json_object); under required the answer is calls, which it does not shape
    loose = schema_of(ToolUse.of(TOOLS, "auto", None).answering(Constraint("json_object")))
    assert valid(loose, {"response": {"any": [1]}}) and not valid(loose, {"response": "text"})
    required = ToolUse.of(TOOLS, "required", None)
    assert schema_of(required.answering(Constraint("json_schema", json.dumps(PLACE)))) == schema_of(required)
    # read back: the answer's JSON as the model wrote it, whole or as far as it went
    text = '{"response":{"city":"Oslo","n":1e999}}'
    assert auto.read(text, "stop") == ('{"city":"Oslo","n":1e999}', [], "stop")
    assert auto.read('{"response":{"city":"Os', "length") == ('{"city":"Os', [], "length")
    assert auto.read('{"response":{"city":"Oslo"}', "length") == ('{"city":"Oslo"}', [], "length")
    streamed = ToolReply(auto)
    parts = ['{"response":', '{"ci', 'ty":"Oslo"', "}", "}"]
    deltas = [e["delta"] for n, part in enumerate(parts)
              for e in streamed(part, "stop" if n == len(parts) - 1 else None, True, n == 0)]
    assert "".join(d.get("content") or "" for d in deltas) == '{"city":"Oslo"}'  # (never the wrapper's brace)
    assert deltas[-1] == {}
    for kind, text in (("regex", "[a-z]+"), ("choice", '["a"]'), ("grammar", "start: 'a'")):
        with pytest.raises(InvalidRequest, match=f"a {kind} constraint cannot shape") as refused:
            ToolUse.of(TOOLS, "auto", None).answering(Constraint(kind, text))
        assert refused.value.param == "tool_choice"
    with pytest.raises(InvalidRequest, match="not JSON"):
        ToolUse.of(TOOLS, "auto", None).answering(Constraint("json_schema", "{nope"))


# ------------------------------------------------------------------ through the services


@pytest.fixture(scope="module")
def api(tmp_path_factory, request):
    """The suite's tiny pair with a context of 2,048 tokens: the tools' instructions take ~460 of its tokens."""
    out = tmp_path_factory.mktemp("tools")
    tokenizer = make_tokenizer(out / "tokenizer")
    target = make_model(out / "target", tokenizer, seed=1, max_context=2048)
    draft = make_model(out / "draft", tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, seed=2, max_context=2048)
    stack = LocalStack(draft, target, http_port=0).start()
    request.addfinalizer(stack.stop)
    return stack


@pytest.fixture(scope="module")
def client(api):
    with openai_client(api) as made:
        yield made


def test_a_named_function_is_called_with_arguments_its_schema_takes(client):
    for temperature, seed in ((0.0, None), (1.0, 1), (1.0, 2)):
        reply = client.chat.completions.create(
            model="target", messages=MESSAGES, tools=TOOLS, max_tokens=120, temperature=temperature, seed=seed,
            tool_choice={"type": "function", "function": {"name": "weather"}})
        choice = reply.choices[0]
        assert choice.finish_reason == "stop", choice
        assert choice.message.content is None and len(choice.message.tool_calls) == 1
        made = choice.message.tool_calls[0]
        assert made.type == "function" and made.function.name == "weather"
        jsonschema.validate(json.loads(made.function.arguments), WEATHER)


def test_required_and_auto_calls_follow_their_tools_schemas(client):
    kinds = set()
    for i in range(6):
        choice, parallel = "required" if i % 2 else "auto", i < 4
        reply = client.chat.completions.create(model="target", messages=MESSAGES, tools=TOOLS, tool_choice=choice,
                                               parallel_tool_calls=parallel, max_tokens=160, temperature=1.0, seed=i)
        answer = reply.choices[0]
        if answer.finish_reason == "length":  # (a random model's string ran past the budget: what it has)
            calls = answer.message.tool_calls or []
            assert (answer.message.content is None) == bool(calls)
            for made in calls[:-1]:  # (the last one's arguments cut)
                jsonschema.validate(json.loads(made.function.arguments), SCHEMAS[made.function.name])
            continue
        if answer.message.tool_calls:
            assert answer.finish_reason == "tool_calls" and answer.message.content is None
            assert parallel or len(answer.message.tool_calls) == 1
            for made in answer.message.tool_calls:
                jsonschema.validate(json.loads(made.function.arguments), SCHEMAS[made.function.name])
            kinds.add("calls")
        else:
            assert choice == "auto" and answer.finish_reason == "stop" and isinstance(answer.message.content, str)
            kinds.add("content")
    assert "calls" in kinds


def test_a_streamed_call_adds_up_to_the_unary_one(client):
    for choice in ({"type": "function", "function": {"name": "add"}}, "required"):
        fields = dict(model="target", messages=MESSAGES, tools=TOOLS, tool_choice=choice, max_tokens=120,
                      temperature=0.0, parallel_tool_calls=False)  # (one call: a random model may add calls on)
        whole = client.chat.completions.create(**fields).choices[0]
        assert whole.message.tool_calls, whole
        calls: dict[int, dict] = {}
        finish = None
        for event in client.chat.completions.create(**fields, stream=True):
            for part in event.choices[0].delta.tool_calls or []:
                made = calls.setdefault(part.index, {"name": "", "arguments": ""})
                made["name"] += part.function.name or ""
                made["arguments"] += part.function.arguments or ""
            finish = event.choices[0].finish_reason or finish
        assert finish == whole.finish_reason
        assert [calls[i] for i in sorted(calls)] == [
            {"name": c.function.name, "arguments": c.function.arguments} for c in whole.message.tool_calls]


class Place(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=5)


class Trip(pydantic.BaseModel):
    start: Place
    end: Place


def test_a_pydantic_tool_with_nested_models_streams_to_the_clients_helper(client):
    """openai.pydantic_function_tool: a strict schema whose nested models are $defs; the client's stream
    helper reads each call as done once the finish_reason comes in an event of its own."""
    tools = [openai.pydantic_function_tool(Trip)]
    for choice in ("required", {"type": "function", "function": {"name": "Trip"}}):
        with client.chat.completions.stream(model="target", messages=MESSAGES, tools=tools, tool_choice=choice,
                                            parallel_tool_calls=False, max_tokens=200, temperature=0.0) as stream:
            done = [e for e in stream if e.type == "tool_calls.function.arguments.done"]
            final = stream.get_final_completion()
        assert [e.name for e in done] == ["Trip"]
        made = final.choices[0].message.tool_calls[0]
        assert isinstance(made.function.parsed_arguments, Trip), made


class Answer(pydantic.BaseModel):
    city: str = pydantic.Field(max_length=5)
    warm: bool


def test_tools_beside_a_response_format_give_calls_or_an_answer_in_its_shape(client):
    """An agent's request (the OpenAI Agents SDK's, with an output type): tools and a json_schema response
    format; the client's parse helper reads a call's arguments or the answer as their models, unary and
    streamed."""
    tools = [openai.pydantic_function_tool(Trip)]
    kinds = []
    for seed in range(8):
        fields = dict(model="target", messages=MESSAGES, tools=tools, response_format=Answer, max_tokens=200,
                      temperature=1.0, seed=seed, parallel_tool_calls=False)  # (a random model may add calls on)
        message = client.chat.completions.parse(**fields).choices[0].message
        if message.tool_calls:
            assert message.content is None and isinstance(message.tool_calls[0].function.parsed_arguments, Trip)
            kinds.append("calls")
        else:
            assert isinstance(message.parsed, Answer), message
            kinds.append("answer")
            with client.chat.completions.stream(**fields) as stream:
                streamed = "".join(e.delta for e in stream if e.type == "content.delta")
                assert isinstance(stream.get_final_completion().choices[0].message.parsed, Answer)
            assert streamed == message.content  # (seeded: the same answer, its text as it came)
    assert "answer" in kinds, kinds


def test_a_conversation_carrying_calls_and_results_is_answered(client):
    history = [*MESSAGES,
               {"role": "assistant", "content": None, "tool_calls": [
                   {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    for tools in (TOOLS, None):
        reply = client.chat.completions.create(model="target", messages=history, max_tokens=8, temperature=0.0,
                                               **({"tools": tools} if tools else {}))
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("body,param,reason", [
    ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools", "letters, digits"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mail"}}}, "tool_choice", "not among"),
    ({"tools": TOOLS, "guided_regex": "[a-c]{3}"}, "tool_choice", "a regex constraint cannot shape"),
    ({"tools": TOOLS, "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "nosuch"}}}}, "tools", "structured output's schemas"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "ignore_eos": True}, "ignore_eos", "ignore_eos cannot go with"),  # (not the tools' fault)
    ({"functions": [{"name": "a"}]}, "functions", "not supported"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"properties": {
        "a": {"type": "nosuch"}}}}}]}, "tools", "nosuch"),  # (a schema the services' compiler refuses)
    ({"messages": [{"role": "assistant", "tool_calls": [{"id": "x"}]}]}, "messages", "tool_calls[0]"),
])
def test_bad_tool_fields_are_400_naming_the_field(api, body, param, reason):
    status, answer = post(api, {"messages": MESSAGES, "max_tokens": 8, **body})
    assert status == 400, answer
    assert answer["error"]["param"] == param and reason in answer["error"]["message"], answer
    # tool_choice none leaves a structured output as it is
    status, answer = post(api, {"messages": MESSAGES, "max_tokens": 40, "tools": TOOLS, "tool_choice": "none",
                                "guided_regex": "[a-c]{3}"})
    assert status == 200 and answer["choices"][0]["message"]["content"] in {a + b + c for a in "abc" for b in "abc"
                                                                           for c in "abc"}


RESPONSE_TOOLS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # (the Responses API's form)


def test_responses_call_functions_as_the_chat_does(client):
    """POST /v1/responses with function tools: a call is a function_call item with the chat's arguments,
    unary and streamed; a conversation carrying a call and its output is answered as the chat's is."""
    chat = client.chat.completions.create(model="target", messages=MESSAGES, tools=TOOLS, max_tokens=120,
                                          temperature=0.0,
                                          tool_choice={"type": "function", "function": {"name": "weather"}})
    call = chat.choices[0].message.tool_calls[0].function
    asked = dict(model="target", input=MESSAGES[0]["content"], tools=RESPONSE_TOOLS, max_output_tokens=120,
                 temperature=0.0, tool_choice={"type": "function", "name": "weather"})
    reply = client.responses.create(**asked)
    assert [(item.type, item.name, item.arguments) for item in reply.output] == [
        ("function_call", "weather", call.arguments)]
    jsonschema.validate(json.loads(reply.output[0].arguments), WEATHER)
    with client.responses.create(**asked, stream=True) as stream:
        events = list(stream)
    done = [event.item for event in events if event.type == "response.output_item.done"]
    assert [(item.type, item.name, item.arguments, item.call_id) for item in done] == [
        (item.type, item.name, item.arguments, item.call_id) for item in events[-1].response.output]
    assert [(item.name, item.arguments) for item in done] == [("weather", call.arguments)]
    deltas = [event.delta for event in events if event.type == "response.function_call_arguments.delta"]
    assert len(deltas) > 1 and "".join(deltas) == call.arguments  # (a named function's arguments as they come)
    cut = client.responses.create(**{**asked, "max_output_tokens": 3})
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert [(item.type, item.status) for item in cut.output] == [("function_call", "incomplete")]
    history = [*MESSAGES, {"role": "assistant", "content": "Let me add.", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": '{"a":2}'}}]},
               {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    answered = client.chat.completions.create(model="target", messages=history, tools=TOOLS, max_tokens=24,
                                              temperature=0.0)
    chat = answered.choices[0].message
    said = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Let me add."}]}
    reply = client.responses.create(model="target", tools=RESPONSE_TOOLS, max_output_tokens=24, temperature=0.0, input=[
        MESSAGES[0], said, {"type": "function_call", "call_id": "call_1", "name": "add", "arguments": '{"a":2}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "5"}])
    assert reply.usage.input_tokens == answered.usage.prompt_tokens  # (the same conversation, rendered alike)
    assert reply.output_text == (chat.content or "")
    assert [(item.name, item.arguments) for item in reply.output if item.type == "function_call"] == [
        (made.function.name, made.function.arguments) for made in chat.tool_calls or []]


def test_a_responses_function_call_is_answered_by_previous_response_id(client):
    """A function_call output item, then its function_call_output sent with previous_response_id: the
    conversation the chat's messages (the user's, the assistant's call, the tool's output) make."""
    first = client.responses.create(model="target", input=MESSAGES[0]["content"], tools=RESPONSE_TOOLS,
                                    max_output_tokens=120, temperature=0.0,
                                    tool_choice={"type": "function", "name": "weather"})
    [call] = first.output
    assert call.type == "function_call"
    history = [MESSAGES[0], {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
               {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    answered = client.chat.completions.create(model="target", messages=history, tools=TOOLS, max_tokens=24,
                                              temperature=0.0)
    reply = client.responses.create(model="target", previous_response_id=first.id, tools=RESPONSE_TOOLS,
                                    max_output_tokens=24, temperature=0.0, input=[
                                        {"type": "function_call_output", "call_id": call.call_id,
                                         "output": "sunny, 21 C"}])
    assert reply.usage.input_tokens == answered.usage.prompt_tokens
    assert reply.output_text == (answered.choices[0].message.content or "")
    # (an answer to a call never made is named as that, not as the call it leaves unanswered)
    for unanswered, says in (("and now?", "no function_call_output"),
                             ([{"type": "function_call_output", "call_id": "call_nosuch", "output": "1"}],
                              "'call_nosuch', a call no function_call before it made")):
        with pytest.raises(openai.BadRequestError, match=says):
            client.responses.create(model="target", previous_response_id=first.id, input=unanswered,
                                    max_output_tokens=4)
