"""Structured output (model_service/grammar.py): constrained requests through the three services
follow their constraint exactly, greedy output is the target's own under the same mask, sampled
tokens follow the target's masked distribution, and bad constraints get clear errors."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import grpc
import jsonschema
import llguidance
import llguidance.hf
import pydantic
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LogitsProcessor, LogitsProcessorList

from coordinator.launch import LocalStack
from model_service.engines import DraftEngine, TargetEngine
from model_service.model_runner import ModelRunner
from model_service.ngram import NgramDraft
from runtime.ports import free_port
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.errors import InvalidRequest
from speculative.protocol import Constraint, Proposal, ProposeCall, SamplingParams, VerifyCall
from speculative.sampling import logits_to_probs
from tests.coordinator.test_openai import openai_client
from tests.services.test_metrics import scrape, value
from tests.stats import chi2_stat, fits

# a small record: bounded strings and numbers, no free whitespace (llguidance's x-guidance option), so
# that even a random-weight model completes it within the token budget
RECORD = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "minLength": 1, "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["draft", "target", "coordinator"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 2},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
    "x-guidance": {"whitespace_flexible": False},
}
PROMPT = "def speculative_round(draft, target):"


@pytest.fixture(scope="module")
def api(pair, request):
    ports = {role: free_port() for role in ("draft", "target")}
    stack = LocalStack(*pair, http_port=0, draft_args=["--metrics-port", str(ports["draft"])],
                       target_args=["--metrics-port", str(ports["target"])]).start()
    request.addfinalizer(stack.stop)
    stack.metrics_ports = ports
    return stack


@pytest.fixture(scope="module")
def stub(api):
    with grpc.insecure_channel(api.addr) as channel:
        yield pb_grpc.GenerationStub(channel)


def constrained(stub, constraint: pb.Constraint, **fields) -> pb.GenerateResponse:
    return stub.Generate(pb.GenerateRequest(constraint=constraint, **fields), timeout=120)


def test_sampled_requests_with_a_json_schema_all_parse_and_validate(stub):
    texts = set()
    futures = [stub.Generate.future(pb.GenerateRequest(
        prompt=PROMPT, max_new_tokens=96, temperature=1.0, seed=i, num_speculative_tokens=3,
        constraint=pb.Constraint(json_schema=json.dumps(RECORD))), timeout=120) for i in range(50)]
    for f in futures:
        reply = f.result()
        assert reply.finish_reason == pb.FINISH_REASON_EOS, reply.text
        jsonschema.validate(json.loads(reply.text), RECORD)
        texts.add(reply.text)
    assert len(texts) > 40  # sampled: the seeds give different records


class Masked(LogitsProcessor):
    """transformers' greedy decoding under llguidance's own mask (not specdec's code path)."""

    def __init__(self, tokenizer, grammar: str, prompt_length: int, vocab: int):
        self.matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab), grammar,
                                            log_level=0)
        self.prompt_length, self.seen = prompt_length, 0

    def __call__(self, input_ids, scores):
        out = input_ids[0, self.prompt_length :].tolist()
        assert self.matcher.consume_tokens(out[self.seen :])
        self.seen = len(out)
        allowed = torch.frombuffer(bytearray(self.matcher.compute_logit_bias()), dtype=torch.uint8) > 0
        scores = scores.clone()
        scores[0, : allowed.shape[0]][~allowed[: scores.shape[1]]] = float("-inf")
        scores[0, allowed.shape[0] :] = float("-inf")
        return scores


CASES = [
    ("json_schema", pb.Constraint(json_schema=json.dumps(RECORD)),
     llguidance.LLMatcher.grammar_from_json_schema(RECORD)),
    ("regex", pb.Constraint(regex=r"(yes|no), because [a-z ]{3,20}\."),
     llguidance.LLMatcher.grammar_from_regex(r"(yes|no), because [a-z ]{3,20}\.")),
    ("choice", pb.Constraint(choice=pb.ChoiceList(choices=["draft", "target", "both of them"])),
     llguidance.grammar_from("choice", ["draft", "target", "both of them"])),
    ("grammar", pb.Constraint(grammar='start: "f(" num ("," num)* ")"\nnum: /[0-9]{1,3}/'),
     llguidance.grammar_from("grammar", 'start: "f(" num ("," num)* ")"\nnum: /[0-9]{1,3}/')),
]


@pytest.mark.parametrize("kind,constraint,grammar", CASES, ids=[c[0] for c in CASES])
def test_greedy_constrained_output_is_the_target_alone_under_the_same_mask(stub, pair, kind, constraint, grammar):
    _, target_dir = pair
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    for prompt in (PROMPT, "The draft proposes"):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        masked = Masked(tokenizer, grammar, ids.shape[1], model.config.vocab_size)
        with torch.inference_mode():
            alone = model.generate(ids, max_new_tokens=40, do_sample=False,
                                   logits_processor=LogitsProcessorList([masked]))[0, ids.shape[1] :].tolist()
        if tokenizer.eos_token_id in alone:
            alone = alone[: alone.index(tokenizer.eos_token_id) + 1]
        for k in (0, 3):
            reply = constrained(stub, constraint, prompt=prompt, max_new_tokens=40, temperature=0.0,
                                num_speculative_tokens=k)
            assert list(reply.token_ids) == alone, (kind, k, reply.text, tokenizer.decode(alone))


REGEX = r"[abc][d-g]\."


def test_sampled_constrained_tokens_follow_the_targets_masked_distribution(small_vocab_pair, request):
    """The first and second tokens under a regex, sampled through the three services with a draft
    that masks its q, against the target's p renormalised over the allowed tokens."""
    draft_dir, target_dir = small_vocab_pair
    stack = LocalStack(draft_dir, target_dir).start()
    request.addfinalizer(stack.stop)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompt = tokenizer.encode("ab ca")
    first_ids = tokenizer.convert_tokens_to_ids(list("abc"))
    second_ids = tokenizer.convert_tokens_to_ids(list("defg"))

    def masked_p(ids: list[int], allowed: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            p = logits_to_probs(model(input_ids=torch.tensor([ids])).logits[0, -1], SamplingParams(1.0)).double()
        keep = torch.zeros_like(p)
        keep[allowed] = p[allowed]
        return keep / keep.sum()

    p_first = masked_p(prompt, first_ids)
    p_pair = torch.zeros(len(p_first), len(p_first), dtype=torch.float64)
    for x in first_ids:
        p_pair[x] = p_first[x] * masked_p(prompt + [x], second_ids)
    firsts, pairs = [], []
    with grpc.insecure_channel(stack.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        n = 1000
        for start in range(0, n, 25):
            futures = [stub.Generate.future(pb.GenerateRequest(
                prompt_token_ids=prompt, max_new_tokens=4, temperature=1.0, seed=5000 + i, num_speculative_tokens=2,
                constraint=pb.Constraint(regex=REGEX)), timeout=120) for i in range(start, min(n, start + 25))]
            for f in futures:
                ids = list(f.result().token_ids)
                assert tokenizer.decode(ids[:3]) in {a + b + "." for a in "abc" for b in "defg"}, ids
                firsts.append(ids[0])
                pairs.append(ids[0] * len(p_first) + ids[1])
    v = len(p_first)
    first_counts = torch.bincount(torch.tensor(firsts), minlength=v).double()
    pair_counts = torch.bincount(torch.tensor(pairs), minlength=v * v).double()
    assert fits(first_counts, p_first), chi2_stat(first_counts, p_first)
    assert fits(pair_counts, p_pair.flatten()), chi2_stat(pair_counts, p_pair.flatten())
    # the check has power: the unmasked p would not fit (it puts mass on tokens the regex forbids)
    with torch.inference_mode():
        p_plain = logits_to_probs(model(input_ids=torch.tensor([prompt])).logits[0, -1], SamplingParams(1.0)).double()
    assert float(p_plain[first_ids].sum()) < 0.9


def test_a_constrained_session_and_unconstrained_ones_share_a_pass_unaffected(pair):
    draft_dir, target_dir = pair
    target = TargetEngine(ModelRunner(target_dir))
    draft = DraftEngine(ModelRunner(draft_dir))
    tokenizer = target.runner.tokenizer
    prompt = tokenizer.encode(PROMPT)
    rule = Constraint("regex", r"[0-9]{2,6}", len(prompt))
    greedy = SamplingParams(0.0)

    def run(calls_of):
        """Three rounds of propose + verify for sessions named in calls_of -> each one's tokens."""
        names = list(calls_of)
        tokens = {name: list(prompt) for name in names}
        proposals = draft.propose_many([ProposeCall(n, True, 0, list(prompt), 3, greedy, constraint=calls_of[n])
                                        for n in names])
        verdicts = target.verify_many([VerifyCall(n, True, list(prompt), p, greedy, constraint=calls_of[n])
                                       for n, (p, _) in zip(names, proposals)])
        for _ in range(2):
            rollbacks = {}
            for n, (p, _), (v, _) in zip(names, proposals, verdicts):
                tokens[n] += p.tokens[: v.accepted] + [v.token]
                rollbacks[n] = (len(p.tokens) - v.accepted, v.token)
            proposals = draft.propose_many([ProposeCall(n, False, rollbacks[n][0], [rollbacks[n][1]], 3, greedy)
                                            for n in names])
            for n, (p, _) in zip(names, proposals):
                if calls_of[n] is not None:  # the draft proposes only what the constraint allows
                    text = tokenizer.decode(p.tokens, skip_special_tokens=True)
                    assert text.isdigit() or not text, tokenizer.decode(p.tokens)
            verdicts = target.verify_many([VerifyCall(n, False, [], p, greedy) for n, (p, _) in zip(names, proposals)])
        for n, (v, _) in zip(names, verdicts):
            tokens[n].append(v.token)
        for n in names:
            target.release(n)
            draft.release(n)
        return {n: tokens[n][len(prompt) :] for n in names}

    together = run({"a": None, "ruled": rule, "b": None})
    assert together["a"] == run({"a": None})["a"] == together["b"]
    assert together["ruled"] == run({"ruled": rule})["ruled"]
    assert tokenizer.decode(together["ruled"], skip_special_tokens=True).isdigit()
    assert together["ruled"] != together["a"]


def test_a_service_finds_a_constraint_no_text_completes_at_compilation(pair):
    """Each service computes a new constraint's first mask as it compiles it, off the model thread
    (the lexer's first states: ~0.4 s for a{655000} on SmolLM2's vocabulary, else taken by the model
    thread while every session waited): a grammar whose matcher stops there is refused before any pass."""
    from model_service.grammar import Grammars

    tokenizer = AutoTokenizer.from_pretrained(pair[1])
    grammars = Grammars(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    for constraint in (Constraint("grammar", "start: a\na: a"), Constraint("json_schema", '{"$ref": "#"}')):
        with pytest.raises(InvalidRequest, match="cannot be followed"):
            grammars.compile(constraint)
        with pytest.raises(InvalidRequest, match="cannot be followed"):  # (refused again from the cache)
            grammars.session(constraint)
    assert grammars.session(Constraint("regex", "[0-9]{3}")).error is None


def test_a_constraint_failing_mid_call_costs_only_its_own_session(pair):
    """Calls that decode on (steps > 1) share their passes: one whose constraint's matcher stops on an
    error as it consumes a token (a regex past llguidance's lexer limits) is refused at its next
    verify, while the others in its passes get their verdicts, as if it were not there."""
    _, target_dir = pair
    target = TargetEngine(ModelRunner(target_dir))
    prompt = target.runner.tokenizer.encode(PROMPT)
    greedy = SamplingParams(0.0)

    def calls(*names):
        return [VerifyCall(n, True, list(prompt), Proposal(), greedy, 4,
                           constraint=Constraint("regex", "a{1000000}", len(prompt)) if n == "lexer" else None)
                for n in names]

    alone = target.verify_many(calls("plain"))
    target.release("plain")
    together = target.verify_many(calls("plain", "lexer"))
    assert together[0][0].token == alone[0][0].token and together[0][0].decoded == alone[0][0].decoded
    if isinstance(together[1], tuple):  # it decoded until its matcher failed: the next call refuses it
        refused = target.verify_many([VerifyCall("lexer", False, [], Proposal(), greedy)])[0]
    else:
        refused = together[1]
    assert isinstance(refused, InvalidRequest) and "cannot be followed" in str(refused)
    assert "lexer" not in target.runner.sessions


def test_an_ngram_draft_copies_only_what_the_constraint_allows(pair):
    _, target_dir = pair
    ngram = NgramDraft.load(target_dir, ngram_min=1)
    tokenizer = ngram.tokenizer
    prompt = tokenizer.encode("x = 12 + 345; y = 12 + 678; z = 12")
    greedy = SamplingParams(0.0)
    (free, _), = ngram.propose_many([ProposeCall("free", True, 0, prompt, 6, greedy)])
    assert tokenizer.decode(free.tokens).startswith(" +")  # the copy goes on past the number
    (ruled, _), = ngram.propose_many([ProposeCall("ruled", True, 0, prompt, 6, greedy,
                                                  constraint=Constraint("regex", r" \+ [0-9]+", len(prompt)))])
    assert tokenizer.decode(ruled.tokens) == tokenizer.decode(free.tokens)[: len(tokenizer.decode(ruled.tokens))]
    assert 0 < len(ruled.tokens) < len(free.tokens)  # cut where the copy leaves the constraint


BAD = [
    (pb.Constraint(json_schema="{not json"), "not valid JSON"),
    (pb.Constraint(json_schema='{"type": "frobnicate"}'), "frobnicate"),
    (pb.Constraint(json_schema='[1, 2]'), "a JSON schema is a JSON object"),
    (pb.Constraint(regex="a(b"), "unclosed group"),
    (pb.Constraint(regex="(?=a)b"), "look-around"),  # not in Rust's regex syntax
    (pb.Constraint(grammar="start: missing_rule"), "missing_rule"),
    (pb.Constraint(choice=pb.ChoiceList()), "at least one choice"),
    (pb.Constraint(json_schema=json.dumps({"type": "object", "properties": {
        f"field_{i}": {"type": "string", "pattern": "[a-z]{3,9}" * 40} for i in range(3000)}})), "bytes; at most"),
    (pb.Constraint(json_schema="[" * 100_000 + "]" * 100_000), "nested too deeply"),  # (was UNKNOWN)
    # messages that quote a long input, cut to fit gRPC's metadata (were RESOURCE_EXHAUSTED from gRPC itself)
    (pb.Constraint(regex="a" * 100_000 + "("), "characters in all"),
]


@pytest.mark.parametrize("constraint,reason", BAD, ids=[b[1].split()[0] for b in BAD])
def test_bad_constraints_are_invalid_argument_with_the_compilers_reason(stub, constraint, reason):
    with pytest.raises(grpc.RpcError) as e:
        constrained(stub, constraint, prompt=PROMPT, max_new_tokens=8)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert reason in e.value.details(), e.value.details()
    # and the stack serves the next request
    assert constrained(stub, pb.Constraint(regex="[0-9]{3}"), prompt=PROMPT, max_new_tokens=8,
                       temperature=0.0).text.isdigit()


UNFOLLOWABLE = [pb.Constraint(grammar="start: a\na: a"), pb.Constraint(json_schema='{"$ref": "#"}'),
                pb.Constraint(regex="a{1000000}")]


@pytest.mark.parametrize("constraint", UNFOLLOWABLE, ids=["no-text", "self-ref", "lexer-limit"])
def test_a_constraint_that_compiles_but_cannot_be_followed_is_refused_each_time(stub, constraint):
    """The compiler's check passes these, but no text completes the first two, and the third's lexer
    passes llguidance's limits at its first tokens: refused (INVALID_ARGUMENT, the matcher's error),
    every time, never a complete-looking empty output; the stack serves the next request."""
    for _ in range(2):  # (the second meets the constraint compiled for the first)
        with pytest.raises(grpc.RpcError) as e:
            constrained(stub, constraint, prompt=PROMPT, max_new_tokens=8, temperature=0.0)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "cannot be followed" in e.value.details(), e.value.details()
    assert constrained(stub, pb.Constraint(regex="[0-9]{3}"), prompt=PROMPT, max_new_tokens=8,
                       temperature=0.0).text.isdigit()


def post(api, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(api.http_url + "/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


MESSAGES = [{"role": "user", "content": "Describe a service as JSON."}]


@pytest.mark.parametrize("field,value,check", [
    ("response_format", {"type": "json_object"}, lambda text: isinstance(json.loads(text), dict)),
    ("guided_json", RECORD, lambda text: jsonschema.validate(json.loads(text), RECORD) is None),
    ("guided_regex", "[0-9]{4}-[0-9]{2}", lambda text: len(text) == 7 and text[4] == "-"),
    ("guided_choice", ["red", "green"], lambda text: text in ("red", "green")),
    ("structured_outputs", {"choice": ["up", "down"]}, lambda text: text in ("up", "down")),
    ("guided_grammar", 'root ::= "x" [0-9] [0-9]', lambda text: len(text) == 3 and text[0] == "x"),  # GBNF
], ids=["json_object", "guided_json", "guided_regex", "guided_choice", "structured_outputs", "gbnf"])
def test_http_structured_output_fields(api, field, value, check):
    status, body = post(api, {"messages": MESSAGES, "max_tokens": 200, "temperature": 0.7, "seed": 3, field: value})
    assert status == 200, body
    choice = body["choices"][0]
    if choice["finish_reason"] == "length" and body["specdec"]["lost_draft_rounds"]:
        # a round that went on without a late draft call draws other numbers: the seeded path is another
        pytest.skip("a late draft call (a loaded machine) changed the seeded path, which ran to max_tokens")
    assert choice["finish_reason"] == "stop"
    assert check(choice["message"]["content"]) is not False, choice["message"]["content"]


NUMBERS = {"type": "object", "required": ["a", "b"], "additionalProperties": False,
           "properties": {"a": {"type": "integer"}, "b": {"type": "array", "items": {"type": "integer"}}}}


@pytest.mark.parametrize("layout", [
    {"structured_outputs": {"json": NUMBERS, "disable_any_whitespace": True}},
    {"guided_json": NUMBERS, "guided_whitespace_pattern": ""},
    {"response_format": {"type": "json_object"}, "structured_outputs": {"disable_any_whitespace": True}},
], ids=["disable_any_whitespace", "guided_whitespace_pattern", "json_object"])
def test_http_json_without_free_whitespace(api, layout):
    """vLLM's whitespace settings: JSON with none between its tokens (a random model at a high temperature
    pads it with whitespace where it may: each of these requests did without them)."""
    texts = []
    for seed in range(4):
        status, body = post(api, {"messages": MESSAGES, "max_tokens": 40, "temperature": 1.5, "seed": seed, **layout})
        assert status == 200, body
        texts.append(body["choices"][0]["message"]["content"])
    assert not any(map(free_whitespace, texts)), texts


def free_whitespace(text: str) -> bool:
    """Whether JSON text (whole or cut short) has whitespace outside its strings."""
    in_string = escaped = False
    for c in text:
        if in_string:
            in_string, escaped = (escaped or c != '"'), (not escaped and c == "\\")
        elif c == '"':
            in_string = True
        elif c.isspace():
            return True
    return False


@pytest.mark.parametrize("body,reason,param", [
    ({"response_format": {"type": "xml"}}, "response_format.type", "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "needs its schema", "response_format"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "give one structured-output constraint",
     "guided_regex"),
    ({"guided_json": {"type": "nonsense"}}, "nonsense", "guided_json"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wibble"}}}},
     "wibble", "response_format"),
    ({"guided_regex": "(("}, "does not compile", "guided_regex"),
    ({"guided_grammar": "root ::= ("}, "does not compile", "guided_grammar"),
    ({"structured_outputs": {"regex": "(("}}, "does not compile", "structured_outputs"),
    ({"structured_outputs": {"xml": "<a/>"}}, "structured_outputs.xml", "structured_outputs"),
    ({"guided_regex": "[0-9]+", "ignore_eos": True}, "ignore_eos cannot go with", "ignore_eos"),
    ({"guided_regex": "[0-9]+", "guided_whitespace_pattern": " "}, "not a regex one", "guided_regex"),
    ({"structured_outputs": {"json_object": True, "disable_any_whitespace": "yes"}}, "must be a boolean",
     "structured_outputs"),
    # (compiles, but the target's matcher stops: the services' refusal, without a service's address)
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "cannot be followed", "response_format"),
])
def test_http_bad_structured_output_is_400_naming_its_field(api, body, reason, param):
    status, answer = post(api, {"messages": MESSAGES, "max_tokens": 8, **body})
    assert status == 400, answer
    assert reason in answer["error"]["message"] and answer["error"]["param"] == param, answer
    assert "service at" not in answer["error"]["message"], answer


class Service(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=8)
    replicas: int = pydantic.Field(ge=0, le=9)
    role: str = pydantic.Field(pattern="^(draft|target)$")


def test_the_official_client_parses_a_pydantic_model(api):
    with openai_client(api) as client:
        for seed in range(3):
            completion = client.chat.completions.parse(model="target", messages=MESSAGES, response_format=Service,
                                                       max_tokens=300, temperature=0.8, seed=seed)
            parsed = completion.choices[0].message.parsed
            assert isinstance(parsed, Service), completion.choices[0].message.content
            assert parsed.role in ("draft", "target")
        plain = client.chat.completions.create(
            model="target", messages=MESSAGES, max_tokens=300, temperature=0.0,
            response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": RECORD, "strict": True}})
        jsonschema.validate(json.loads(plain.choices[0].message.content), RECORD)


def test_both_services_count_their_mask_work_and_compile_each_constraint_once(api, stub):
    rule = pb.Constraint(regex=r"[a-f]{4}-[0-9]{4}")
    before = {role: scrape(port) for role, port in api.metrics_ports.items()}
    for seed in range(3):
        constrained(stub, rule, prompt=PROMPT, max_new_tokens=12, temperature=1.0, seed=seed, num_speculative_tokens=3)
    for role, port in api.metrics_ports.items():
        after = scrape(port)
        assert value(after, "specdec_grammar_mask_seconds_total") > value(before[role], "specdec_grammar_mask_seconds_total")
        assert value(after, "specdec_grammar_compiles_total") == value(before[role], "specdec_grammar_compiles_total") + 1


def test_a_request_that_runs_out_of_tokens_before_completing_says_length(stub):
    reply = constrained(stub, pb.Constraint(regex="[a-z]{50}"), prompt=PROMPT, max_new_tokens=5, temperature=0.0)
    assert reply.finish_reason == pb.FINISH_REASON_LENGTH
    assert reply.text.isalpha() and len(reply.text) < 50


def test_constrained_requests_in_one_process_round(pair):
    """The round's start calls carry the constraint to both peers (speculative/round.py)."""
    from model_service.local import LocalDraft, LocalTarget
    from speculative.round import generate

    draft_dir, target_dir = pair
    target = LocalTarget(TargetEngine(ModelRunner(target_dir)))
    draft = LocalDraft(DraftEngine(ModelRunner(draft_dir)))
    tokenizer = AutoTokenizer.from_pretrained(target_dir)

    async def go() -> list[int]:
        out = []
        async for new in generate(draft, target, tokenizer.encode(PROMPT), max_new_tokens=20, k=3,
                                  params=SamplingParams(0.9, seed=1), eos_token_ids={tokenizer.eos_token_id},
                                  max_context=512, constraint=Constraint("choice", json.dumps(["alpha", "beta"]))):
            out += new
        return out

    out = asyncio.run(go())
    assert tokenizer.decode(out[:-1]) in ("alpha", "beta") and out[-1] == tokenizer.eos_token_id


def test_streamed_constrained_output_over_both_front_doors(api, stub):
    chunks = list(stub.GenerateStream(pb.GenerateRequest(
        prompt=PROMPT, max_new_tokens=40, temperature=0.8, seed=11, num_speculative_tokens=3,
        constraint=pb.Constraint(choice=pb.ChoiceList(choices=["alpha beta gamma", "delta"]))), timeout=120))
    assert "".join(c.text for c in chunks) in ("alpha beta gamma", "delta")
    assert chunks[-1].finish_reason == pb.FINISH_REASON_EOS
    with openai_client(api) as client:
        events = client.chat.completions.create(model="target", messages=MESSAGES, max_tokens=60, temperature=0.8,
                                                seed=2, stream=True, extra_body={"guided_regex": "[a-e]{3}-[0-9]{2}"})
        parts = [(e.choices[0].delta.content or "", e.choices[0].finish_reason) for e in events if e.choices]
    text = "".join(p for p, _ in parts)
    assert len(text) == 6 and set(text[:3]) <= set("abcde") and text[3] == "-" and text[4:].isdigit(), text
    assert parts[-1][1] == "stop"
