"""The prompt scored (VerifyCall.prompt_logprobs, GenerateRequest.prompt_logprobs, completions' `echo`):
each prompt token after the first gets its log-probability under the target at the position before it,
from the pass that starts the session (whatever the draft proposes beside it), once per request; with
it nothing need be generated (max_new_tokens 0), and completions echo the prompt with its logprobs, as
evaluation harnesses (lm-evaluation-harness's loglikelihood) read them."""

from __future__ import annotations

import asyncio
import json

import grpc
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from model_service.engines import LOGPROB_ROWS, DraftEngine, TargetEngine, token_logprobs
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from speculative.sampling import encode_supports
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.errors import InvalidRequest
from speculative.protocol import (Cost, Logprobs, Proposal, SamplingParams, Verdict, VerifyCall, verdict_from_proto,
                                  verdict_to_proto, verify_call_from_proto, verify_call_to_proto)
from speculative.round import FixedK, PromptScores, SessionLost, Stats, generate
# (the stack and its OpenAI client as the logprobs' tests make them: one stack for this module)
from tests.coordinator.test_logprobs import api, client  # noqa: F401
from tests.coordinator.test_openai import post

PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n"


def scored_by_transformers(target_dir, ids: list[int]) -> torch.Tensor:
    """log-softmax at each position of `ids` but the last: row i scores ids[i + 1]."""
    model = AutoModelForCausalLM.from_pretrained(target_dir, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([ids])).logits[0, :-1].float(), -1)


def check(scores: Logprobs, ids: list[int], want: torch.Tensor, top: int) -> None:
    assert len(scores) == len(ids) - 1 and scores.top == top
    picked = want[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    assert torch.allclose(torch.tensor(scores.values), picked, atol=1e-4), (scores.values, picked)
    for i in range(len(ids) - 1):
        got_ids, got = zip(*scores.tops(i))
        best = want[i].topk(top)
        assert torch.allclose(torch.tensor(got), best.values, atol=1e-4)
        assert list(got_ids) == best.indices.tolist() or torch.allclose(best.values[:-1], best.values[1:])


class LosingTarget(LocalTarget):
    """Loses the session once, at its `lose`-th call: the round starts it again with everything committed."""

    def __init__(self, engine: TargetEngine, lose: int):
        super().__init__(engine)
        self.lose, self.calls = lose, []

    async def verify(self, call: VerifyCall, *, turn=(0, 0)):
        self.calls.append(call)
        if len(self.calls) == self.lose:
            self.engine.release(call.session_id)
            raise SessionLost(call.session_id)
        return await super().verify(call)


@pytest.mark.parametrize("case", ["K = 0", "draft tokens beside it", "nothing generated", "session lost"])
def test_the_prompt_is_scored_as_the_target_scores_it(pair, case, monkeypatch):
    draft_dir, target_dir = pair
    ids = AutoTokenizer.from_pretrained(target_dir).encode(PROMPT)
    target = LosingTarget(TargetEngine(ModelRunner(target_dir)), lose=3 if case == "session lost" else 0)
    draft = LocalDraft(DraftEngine(ModelRunner(draft_dir)))
    k = 4 if case == "draft tokens beside it" else 0
    scores, stats = PromptScores(3), Stats()

    async def go(scores, stats):
        out = []
        async for new in generate(draft, target, ids, max_new_tokens=0 if case == "nothing generated" else 8,
                                  k=FixedK(k), params=SamplingParams(0.0), max_context=512, prompt_scores=scores,
                                  stats=stats):
            out += new
        return out

    rounds = []
    monkeypatch.setattr(FixedK, "observe", lambda self, r, wall_ms: rounds.append(r))  # (what adaptive K reads)
    out = asyncio.run(go(scores, stats))
    monkeypatch.undo()
    assert [r.scored_prompt for r in rounds] == [True] + [False] * (len(rounds) - 1) or case == "nothing generated"
    calls = target.calls
    target.calls, target.lose = [], 0
    assert out == asyncio.run(go(None, Stats()))  # the same tokens as a request that does not score its prompt
    target.calls = calls
    check(scores.logprobs, ids, scored_by_transformers(target_dir, ids), 3)
    starts = [call for call in target.calls if call.start]
    assert starts[0].prompt_logprobs == 3 and all(call.prompt_logprobs is None for call in target.calls[1:])
    if case == "nothing generated":
        assert out == [] and stats.rounds == 1 and stats.generated_tokens == 0 and len(target.calls) == 1
    else:
        assert len(out) == 8
    if case == "draft tokens beside it":
        assert len(starts[0].proposal.tokens) == 4  # (the start's pass verified them too)
    if case == "session lost":
        assert len(starts) == 2  # scored once: the start again did not ask


def test_prompts_scored_in_one_pass_bound_its_rows_and_change_nothing_else(pair, monkeypatch):
    """Starts that score long prompts beside others in one verify_many: no pass asks for more than
    LOGPROB_ROWS prompt rows (each a vocabulary's logits); scores, tokens and feature rows as each alone."""
    import model_service.engines as engines

    monkeypatch.setattr(engines, "LOGPROB_ROWS", 16)
    target_dir = pair[1]
    ids = AutoTokenizer.from_pretrained(target_dir).encode(PROMPT * 3)  # ~60 tokens: passes of their own
    assert len(ids) > 40
    runner = ModelRunner(target_dir)
    engine = TargetEngine(runner)
    asked = []
    forward = runner.forward_capturing

    def recorded(feeds, capture):
        asked.append(sum(n for _, n in feeds))
        return forward(feeds, capture)

    monkeypatch.setattr(runner, "forward_capturing", recorded)
    params = SamplingParams(0.0)
    draft = Proposal([5, 6], *encode_supports([torch.tensor([5]), torch.tensor([6])],
                                              [torch.tensor([1.0]), torch.tensor([1.0])]))

    def calls(scored: bool) -> list[VerifyCall]:
        top = 2 if scored else None
        return [VerifyCall(f"long{scored}", True, ids, draft, params, feature_layers=(0, 1), prompt_logprobs=top),
                VerifyCall(f"short{scored}", True, ids[:12], Proposal(), params, prompt_logprobs=top),
                VerifyCall(f"other{scored}", True, ids[:30], Proposal(), params, feature_layers=(1,),
                           prompt_logprobs=top),
                VerifyCall(f"plain{scored}", True, ids[:9], Proposal(), params)]

    together = [verdict for verdict, _ in engine.verify_many(calls(True))]
    assert max(asked) <= 16 + 3 + 12 + 1  # (this pass: the short prompt's 11 rows, every call's own)
    alone = [engine.verify(call)[0] for call in calls(False)]
    want = scored_by_transformers(target_dir, ids)
    for verdict, plain, call in zip(together, alone, calls(True)):
        assert (verdict.accepted, verdict.token) == (plain.accepted, plain.token)
        assert (verdict.features and verdict.features.data) == (plain.features and plain.features.data)
        if call.prompt_logprobs is not None:
            check(verdict.prompt_logprobs, call.append, want, 2)
    assert together[0].features.start == 0 and together[0].features.rows >= len(ids)


def test_many_rows_are_scored_as_their_log_softmax(pair):
    rows = torch.randn(2 * LOGPROB_ROWS + 5, 50)
    tokens = torch.randint(0, 50, (len(rows),)).tolist()
    parts = token_logprobs(rows, tokens, 2)
    lp = torch.log_softmax(rows, -1)
    assert len(parts) == len(rows) and torch.allclose(torch.tensor(parts.values), lp[torch.arange(len(rows)), tokens])
    assert parts.top_ids == lp.topk(2).indices.flatten().tolist()


def test_the_target_refuses_prompt_logprobs_off_a_start(pair):
    engine = TargetEngine(ModelRunner(pair[1]))
    params = SamplingParams(0.0)
    with pytest.raises(InvalidRequest, match="top tokens"):
        engine.verify(VerifyCall("s", True, [1, 2, 3], Proposal(), params, prompt_logprobs=21))
    verdict, _ = engine.verify(VerifyCall("s", True, [1, 2, 3], Proposal(), params, prompt_logprobs=0))
    assert verdict.prompt_logprobs.top == 0 and len(verdict.prompt_logprobs) == 2
    with pytest.raises(InvalidRequest, match="session's start"):
        engine.verify(VerifyCall("s", False, [], Proposal(), params, prompt_logprobs=0))
    plain, _ = engine.verify(VerifyCall("t", True, [1, 2, 3], Proposal(), params))
    assert plain.prompt_logprobs is None
    engine.runner.vocab_size = 50  # a padded output layer: ids past the vocabulary have logits, not texts
    padded = VerifyCall("u", True, [1, 60, 3], Proposal(), params, prompt_logprobs=0)
    together = engine.verify_many([padded, VerifyCall("v", True, [1, 2, 3], Proposal(), params, prompt_logprobs=0)])
    assert isinstance(together[0], InvalidRequest) and "outside the vocabulary [0, 50)" in str(together[0])
    assert len(together[1][0].prompt_logprobs) == 2 and "u" not in engine.sessions  # (the other call served)


def test_prompt_logprobs_cross_the_wire_and_refuse_what_does_not_add_up():
    call = VerifyCall("s", True, [5, 6, 7], Proposal(), SamplingParams(0.0), prompt_logprobs=2)
    assert verify_call_from_proto(verify_call_to_proto(call)).prompt_logprobs == 2
    assert verify_call_from_proto(verify_call_to_proto(VerifyCall("s", True, [5], Proposal(), SamplingParams(),
                                                                  prompt_logprobs=0))).prompt_logprobs == 0
    assert verify_call_from_proto(verify_call_to_proto(VerifyCall("s", True, [5], Proposal(),
                                                                  SamplingParams()))).prompt_logprobs is None
    scores = Logprobs(2, [-0.5, -1.5], [1, 2, 3, 4], [-0.5, -1.0, -1.5, -2.0])
    back = verdict_from_proto(verdict_to_proto(Verdict(0, 9, prompt_logprobs=scores), Cost()))
    assert back.prompt_logprobs == scores and back.prompt_logprobs_fault(call) is None
    assert "older" in Verdict(0, 9).prompt_logprobs_fault(call)
    assert Verdict(0, 9, prompt_logprobs=scores.slice(1)).prompt_logprobs_fault(call)  # one token short
    assert Verdict(0, 9).prompt_logprobs_fault(VerifyCall("s", False, [5], Proposal(), SamplingParams(),
                                                          prompt_logprobs=2)) is None  # (asked on starts only)


@pytest.fixture(scope="module")
def grpc_scored(api):
    """The prompt's ids and logprobs (top 2) as gRPC's Generate gives them, nothing generated."""
    with grpc.insecure_channel(api.addr) as channel:
        reply = pb_grpc.GenerationStub(channel).Generate(
            pb.GenerateRequest(prompt=PROMPT, max_new_tokens=0, prompt_logprobs=2), timeout=120)
    return reply


def test_grpc_scores_the_prompt_unary_and_streamed(api, pair, grpc_scored):
    ids = AutoTokenizer.from_pretrained(pair[1]).encode(PROMPT)
    assert list(grpc_scored.prompt_token_ids) == ids and not grpc_scored.token_ids
    assert grpc_scored.finish_reason == pb.FINISH_REASON_LENGTH and grpc_scored.stats.generated_tokens == 0
    check(Logprobs(2, list(grpc_scored.prompt_logprobs.values), list(grpc_scored.prompt_logprobs.top_ids),
                   list(grpc_scored.prompt_logprobs.top_values)), ids, scored_by_transformers(pair[1], ids), 2)
    request = pb.GenerateRequest(prompt=PROMPT, max_new_tokens=6, temperature=0.0, prompt_logprobs=2)
    with grpc.insecure_channel(api.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        chunks = list(stub.GenerateStream(request, timeout=120))
        whole = stub.Generate(request, timeout=120)
        plain = stub.Generate(pb.GenerateRequest(prompt=PROMPT, max_new_tokens=2), timeout=120)
        refused = []
        for bad in (pb.GenerateRequest(prompt=PROMPT, max_new_tokens=0),
                    pb.GenerateRequest(prompt=PROMPT, max_new_tokens=2, prompt_logprobs=21)):
            with pytest.raises(grpc.RpcError) as error:
                stub.Generate(bad, timeout=120)
            refused.append(error.value)
    assert [c.HasField("prompt_logprobs") for c in chunks] == [True] + [False] * (len(chunks) - 1)
    assert chunks[0].prompt_logprobs == whole.prompt_logprobs == grpc_scored.prompt_logprobs
    assert list(chunks[0].prompt_token_ids) == ids and len(whole.token_ids) == 6
    assert not plain.HasField("prompt_logprobs") and not plain.prompt_token_ids
    assert [e.code() for e in refused] == [grpc.StatusCode.INVALID_ARGUMENT] * 2
    assert "max_new_tokens" in refused[0].details() and "prompt_logprobs" in refused[1].details()


@pytest.mark.parametrize("max_tokens", [0, 5])
def test_completions_echo_the_prompt_with_its_logprobs(client, pair, grpc_scored, max_tokens):
    ids = list(grpc_scored.prompt_token_ids)
    reply = client.completions.create(model="target", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                      echo=True, logprobs=2)
    choice = reply.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and reply.usage.completion_tokens == max_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + max_tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    values = list(grpc_scored.prompt_logprobs.values)
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs[1 : len(ids)], values))
    for i in range(1, len(ids)):  # the prompt's token beside its two likeliest
        assert lp.top_logprobs[i][lp.tokens[i]] == lp.token_logprobs[i] and 1 <= len(lp.top_logprobs[i]) <= 3
    whole = [(token, at) for token, at in zip(lp.tokens, lp.text_offset) if "\ufffd" not in token]
    assert all(choice.text[at : at + len(token)] == token for token, at in whole)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[len(ids) - 1] < len(PROMPT)
    if max_tokens:
        alone = client.completions.create(model="target", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                          logprobs=2)
        assert choice.text == PROMPT + alone.choices[0].text
        assert lp.token_logprobs[len(ids) :] == alone.choices[0].logprobs.token_logprobs
        assert [at - len(PROMPT) for at in lp.text_offset[len(ids) :]] == alone.choices[0].logprobs.text_offset


def test_echo_offsets_count_the_text_of_a_special_token_the_prompt_spells_out(client, pair):
    """A text prompt that spells out a special token's text is echoed as sent, that text included: the offsets
    after it count it (they pointed that many characters early: a completion's own text has no special's)."""
    special = AutoTokenizer.from_pretrained(pair[1]).eos_token
    prompt = f"a{special}b c"
    reply = client.completions.create(model="target", prompt=prompt, max_tokens=3, temperature=0, echo=True,
                                      logprobs=0)
    text, lp, read = reply.choices[0].text, reply.choices[0].logprobs, reply.usage.prompt_tokens
    assert text.startswith(prompt) and special in lp.tokens[:read]  # (read as the special token, not its letters)
    assert [text[at : at + len(token)] for token, at in zip(lp.tokens[:read], lp.text_offset)] == lp.tokens[:read]
    assert lp.text_offset[read] == len(prompt)  # (the completion's first token right after it)


def test_echo_without_logprobs_and_from_token_ids(client, grpc_scored):
    ids = list(grpc_scored.prompt_token_ids)
    plain = client.completions.create(model="target", prompt=PROMPT, max_tokens=3, temperature=0, echo=True)
    assert plain.choices[0].text.startswith(PROMPT) and plain.choices[0].logprobs is None
    only = client.completions.create(model="target", prompt=PROMPT, max_tokens=0, echo=True)
    assert only.choices[0].text == PROMPT and only.usage.completion_tokens == 0
    # lm-evaluation-harness's loglikelihood request: token ids, echo, logprobs 1, one token generated
    harness = client.completions.create(model="target", prompt=[ids], max_tokens=1, temperature=0, echo=True,
                                        logprobs=1)
    lp = harness.choices[0].logprobs
    assert harness.choices[0].text.startswith(PROMPT) and len(lp.token_logprobs) == len(ids) + 1
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs[1:-1], grpc_scored.prompt_logprobs.values))
    refused = client.with_options(max_retries=0)
    with pytest.raises(openai.BadRequestError, match="max_new_tokens|max_tokens"):
        refused.completions.create(model="target", prompt=PROMPT, max_tokens=0)


def test_a_continuation_that_ends_the_sequence_keeps_its_end_token_on_completions_not_in_chat(api, client, pair,
                                                                                               grpc_scored):
    eos = AutoTokenizer.from_pretrained(pair[1]).eos_token_id
    ids, forced = list(grpc_scored.prompt_token_ids), {str(eos): 100}  # (logprobs are the model's, before the bias)
    reply = client.completions.create(model="target", prompt=[ids], max_tokens=1, temperature=0, echo=True,
                                      logprobs=1, logit_bias=forced)
    choice, lp = reply.choices[0], reply.choices[0].logprobs
    assert choice.finish_reason == "stop" and len(lp.token_logprobs) == len(ids) + 1  # lm-eval reads [ctxlen:-1]
    assert all(abs(a - b) < 1e-4 for a, b in zip(lp.token_logprobs[1:-1], grpc_scored.prompt_logprobs.values))
    assert lp.text_offset[-1] == len(choice.text) and lp.token_logprobs[-1] < 0  # (the end token takes no room)
    streamed = []

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{api.http_url}/v1", api_key="none", max_retries=0,
                                      timeout=120) as streaming:
            async for event in await streaming.completions.create(model="target", prompt=[ids], max_tokens=1,
                                                                  temperature=0, echo=True, logprobs=1,
                                                                  logit_bias=forced, stream=True):
                for c in event.choices:
                    streamed.extend(c.logprobs.token_logprobs if c.logprobs else [])

    asyncio.run(go())
    assert streamed == lp.token_logprobs
    messages = [{"role": "user", "content": "hi"}]
    chat = client.chat.completions.create(model="target", messages=messages, max_tokens=3, temperature=0,
                                          logprobs=True, logit_bias=forced)
    assert chat.choices[0].finish_reason == "stop" and chat.usage.completion_tokens == 1
    assert chat.choices[0].logprobs.content == [] and chat.choices[0].message.content == ""
    with grpc.insecure_channel(api.addr) as channel:
        whole = pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
            prompt_token_ids=ids, max_new_tokens=3, temperature=0.0, logprobs=0, logit_bias={eos: 100}), timeout=120)
    assert list(whole.token_ids) == [eos] and len(whole.logprobs.values) == 1


def test_streamed_echo_adds_up_to_the_unary_one(api, client):
    fields = dict(model="target", prompt=PROMPT, max_tokens=8, temperature=0, echo=True, logprobs=1, n=2)
    whole = client.completions.create(**fields)

    async def go():
        async with openai.AsyncOpenAI(base_url=f"{api.http_url}/v1", api_key="none", max_retries=0,
                                      timeout=120) as streaming:
            text, tokens, values = {0: "", 1: ""}, {0: [], 1: []}, {0: [], 1: []}
            firsts = {}
            async for event in await streaming.completions.create(**fields, stream=True):
                for choice in event.choices:
                    firsts.setdefault(choice.index, choice.text)
                    text[choice.index] += choice.text
                    if choice.logprobs is not None:
                        tokens[choice.index] += choice.logprobs.tokens
                        values[choice.index] += choice.logprobs.token_logprobs
            return firsts, text, tokens, values

    firsts, text, tokens, values = asyncio.run(go())
    for i in (0, 1):
        want = whole.choices[i]
        assert firsts[i].startswith(PROMPT) and text[i] == want.text
        assert tokens[i] == want.logprobs.tokens and values[i] == want.logprobs.token_logprobs


@pytest.mark.parametrize("body, param", [
    ({"echo": True, "logprobs": 21}, "logprobs"),
    ({"echo": True, "best_of": 2}, "best_of"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"echo": True, "prompt": [[5, -1]]}, "prompt"),  # ids no tokenizer decodes: the core's 400, not a 500
    ({"echo": True, "prompt": [[5, 2**40]]}, "prompt"),
    ({"echo": True, "prompt": ["a", [5]]}, "prompt"),
    ({"prompt": [5, "a"]}, "prompt"),
])
def test_bad_echo_requests_are_400_naming_the_field(api, body, param):
    status, reply = post(api, "/v1/completions", json.dumps({"model": "target", "prompt": PROMPT, **body}).encode(),
                         key=None)
    assert status == 400 and reply["error"]["param"] == param, reply
    if any(isinstance(p, str) for p in body.get("prompt", [])):
        assert "a list of token ids" in reply["error"]["message"]  # (not the union's first branch's fault)


def test_a_batchs_refused_prompt_is_named(api):
    status, reply = post(api, "/v1/completions", json.dumps({"model": "target", "prompt": [[5, 6], [5, 10**6]],
                                                              "max_tokens": 2, "n": 2}).encode(), key=None)
    assert status == 400 and reply["error"]["param"] == "prompt", reply
    assert reply["error"]["message"].startswith("prompt[1]: "), reply
