"""The generation core without a transport: requests are checked, defaulted and counted in the
metrics as both front doors (gRPC, HTTP) rely on. End to end over gRPC: test_bad_input.py."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from types import SimpleNamespace

import pytest

from coordinator.adaptive import AcceptanceK, AdaptiveK, CostModel
from coordinator.generation import (Coordinator, GenerationRequest, Limits, Message, Models, NotPossible, NotReady,
                                    outcome, prompt_bound, resolve)
from coordinator.metrics import CoordinatorMetrics
from speculative.errors import InvalidRequest
from speculative.protocol import PassCost
from speculative.round import FixedK
from speculative.tiny import make_tokenizer

NAN = float("nan")


def models_for(tokenizer, max_context: int = 512) -> Models:
    return Models(tokenizer=tokenizer, vocab_size=len(tokenizer), eos_token_ids=frozenset([tokenizer.eos_token_id]),
                  max_context=max_context, max_k=16, default_k=8, max_draft_call=16,
                  max_token_chars=prompt_bound(tokenizer), costs=CostModel(PassCost(), PassCost()))


@pytest.fixture(scope="module")
def bpe(tmp_path_factory) -> Models:
    return models_for(make_tokenizer(tmp_path_factory.mktemp("bpe"), "bpe"))


@pytest.fixture(scope="module")
def chars(tmp_path_factory) -> Models:
    return models_for(make_tokenizer(tmp_path_factory.mktemp("chars"), "chars"))


def check(request: GenerationRequest, models: Models, limits: Limits | None = None):
    return asyncio.run(resolve(request, models, limits or Limits()))


BAD = {
    "empty prompt": (dict(), "the prompt is empty"),
    "prompt and ids": (dict(prompt="a", prompt_token_ids=[1]), "not prompt and prompt_token_ids"),
    "prompt fills context": (dict(prompt_token_ids=[5] * 512), "leaving no room to generate"),
    "prompt text of megabytes": (dict(prompt="x = 1\n" * 200_000), "characters, more than the context"),
    "max_new_tokens zero": (dict(prompt="a", max_new_tokens=0), "max_new_tokens must be > 0 (0 only where the prompt"),
    "prompt_logprobs past 20": (dict(prompt="a", prompt_logprobs=21), "prompt_logprobs must lie in [0, 20], not 21"),
    "scored prompt fills context, generating": (dict(prompt_token_ids=[5] * 512, prompt_logprobs=0),
                                                "leaving no room to generate"),
    "max_new_tokens beyond context": (dict(prompt_token_ids=[5] * 10, max_new_tokens=503), "at most 502 new tokens"),
    "temperature nan": (dict(prompt="a", temperature=NAN),
                        "temperature must be a finite number >= 0 (a 32-bit float), not nan"),
    "top_p zero": (dict(prompt="a", top_p=0.0), "top_p must lie in (0, 1] (and be above 0 as a 32-bit float), not 0.0"),
    "top_k negative": (dict(prompt="a", top_k=-1), "top_k must lie in [0, 2147483647], not -1"),
    "token id outside vocabulary": (dict(prompt_token_ids=[1, 10**6]), "prompt token id 1000000 is outside"),
    "K too large": (dict(prompt="a", num_speculative_tokens=17), "num_speculative_tokens must lie in [0, 16], not 17"),
    "too many stop strings": (dict(prompt="a", stop=["x"] * 17), "at most 16 stop strings, got 17"),
    "draft_p_min nan": (dict(prompt="a", draft_p_min=NAN), "draft_p_min must lie in [0, 1], not nan"),
    "message without a role": (dict(messages=[Message("", "hi")]), "messages[0] has no role"),
    "top_k past int32": (dict(prompt="a", top_k=2**31), "top_k must lie in [0, 2147483647], not 2147483648"),
    "seed negative": (dict(prompt="a", seed=-1), "seed must lie in [0, 2^64), not -1"),
    "seed past uint64": (dict(prompt="a", seed=2**64), "seed must lie in [0, 2^64)"),
    "temperature past float32": (dict(prompt="a", temperature=1e39), "(a 32-bit float), not 1e+39"),
    "top_p 0 as float32": (dict(prompt="a", top_p=1e-300), "above 0 as a 32-bit float), not 1e-300"),
}
# the field a front door names (`param`), where it is not the first word of the message
PARAMS = {"scored prompt fills context, generating": "prompt_token_ids",
          "prompt fills context": "prompt_token_ids", "prompt text of megabytes": "prompt",
          "max_new_tokens beyond context": "max_new_tokens", "token id outside vocabulary": "prompt_token_ids", "too many stop strings": "stop",
          "message without a role": "messages", "empty prompt": "prompt", "prompt and ids": "prompt_token_ids",
          "temperature past float32": "temperature", "top_p 0 as float32": "top_p"}


def test_a_scored_prompt_may_generate_nothing_and_fill_the_context(bpe):
    plan = check(GenerationRequest(prompt_token_ids=[5] * 512, max_new_tokens=0, prompt_logprobs=3), bpe)
    assert plan.max_new_tokens == 0 and plan.prompt_logprobs == 3 and len(plan.prompt) == 512


@pytest.mark.parametrize("name", list(BAD))
def test_a_bad_request_is_invalid_naming_what_is_wrong(bpe, name):
    fields, says = BAD[name]
    with pytest.raises(InvalidRequest) as err:
        check(GenerationRequest(**fields), bpe)
    assert says in str(err.value)
    assert err.value.param == PARAMS.get(name, says.split()[0].split("=")[0])


def test_a_target_kv_cap_under_its_context_bounds_a_request_and_is_named(bpe):
    """A target whose --max-kv-tokens is under its context holds no session past the cap: connect makes
    the cap the requests' context (Models.kv_capped), and a refusal names it, not the context."""
    from dataclasses import replace

    capped = replace(bpe, max_context=100, kv_capped=True)
    cap = "the target holds at most 100 tokens a session (its --max-kv-tokens)"
    for fields, says in ((dict(prompt_token_ids=[5] * 100), f"the prompt has 100 tokens; {cap}, leaving no room"),
                         (dict(prompt_token_ids=[5] * 90, max_new_tokens=11), f"and {cap}, so at most 10 new"),
                         (dict(prompt="x = 1\n" * 20_000), "than the target's cap of 100 tokens a session (its")):
        with pytest.raises(InvalidRequest) as refused:
            check(GenerationRequest(**fields), capped)
        assert says in str(refused.value)
    assert check(GenerationRequest(prompt_token_ids=[5] * 90, max_new_tokens=10), capped).max_new_tokens == 10
    assert check(GenerationRequest(prompt_token_ids=[5] * 90), capped).max_new_tokens == 10  # the room left
    with pytest.raises(InvalidRequest, match="the context holds 512, leaving"):  # uncapped: the context's words
        check(GenerationRequest(prompt_token_ids=[5] * 512), bpe)


def test_without_a_draft_requests_run_at_k_0_under_the_policy_they_would_have(bpe):
    """A coordinator serving without a draft (none ready at start-up): each request's K is 0, its policy the
    one it would have had, so an unseeded sampled request is not taken for one replaying its seed (which
    would forgo waiting for a full target's room and the target's lookup)."""
    undrafted = replace(bpe, drafts=False)
    for request, kind in ((GenerationRequest(prompt="a"), AdaptiveK),
                          (GenerationRequest(prompt="a", seed=7), AcceptanceK),
                          (GenerationRequest(prompt="a", num_speculative_tokens=3), FixedK)):
        plan = check(request, undrafted)
        assert isinstance(plan.policy, kind) and plan.policy.k == 0, plan.policy
    assert not check(GenerationRequest(prompt="a"), undrafted).policy.replays


def test_messages_without_a_chat_template_are_not_possible(chars):
    with pytest.raises(NotPossible, match="no chat template"):
        check(GenerationRequest(messages=[Message("user", "abc")]), chars)


def test_defaults_fill_what_the_request_leaves_out(bpe):
    plan = check(GenerationRequest(prompt_token_ids=[5] * 500), bpe)
    assert plan.max_new_tokens == 12  # the room left, under the default 256
    assert (plan.params.temperature, plan.params.top_k, plan.params.top_p, plan.p_min) == (1.0, 0, 1.0, 0.0)
    assert isinstance(plan.policy, AdaptiveK) and plan.policy.k == 8
    assert plan.policy.sampled  # (temperature 1: its acceptance is the sampled requests', CostModel.alpha_of)
    greedy = check(GenerationRequest(prompt="a", temperature=0.0), bpe)
    assert isinstance(greedy.policy, AdaptiveK) and not greedy.policy.sampled
    tiny = check(GenerationRequest(prompt="a", temperature=1e-50, seed=3), bpe)  # 0 as the wire's float: greedy
    assert tiny.params.greedy and isinstance(tiny.policy, AdaptiveK) and not tiny.policy.sampled
    seeded = check(GenerationRequest(prompt="a", seed=7, temperature=0.5), bpe)
    assert seeded.params.seed == 7 and isinstance(seeded.policy, AcceptanceK)  # reproducible under any load
    fixed = check(GenerationRequest(prompt="a", num_speculative_tokens=3, temperature=0.0, stop=["\n"]), bpe,
                  Limits(draft_p_min=0.2))
    assert isinstance(fixed.policy, FixedK) and fixed.policy.k == 3 and fixed.params.greedy
    assert fixed.p_min == 0.2 and fixed.stop == ["\n"]
    chat = check(GenerationRequest(messages=[Message("user", "hi")]), bpe)
    assert chat.prompt == bpe.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}],
                                                            add_generation_prompt=True, tokenize=True,
                                                            return_dict=True)["input_ids"]


def test_a_conversation_that_cannot_fit_is_refused_before_its_template_runs(bpe, monkeypatch):
    """Refused untokenized, the field named: more messages than the context has tokens (each is marked
    by its template: 100,000 empty ones held a core for seconds), and roles counted with the contents."""
    rendered = []
    monkeypatch.setattr(bpe.tokenizer, "apply_chat_template", lambda *a, **k: rendered.append(1))
    many = [Message("user", "")] * (bpe.max_context + 1)
    with pytest.raises(InvalidRequest, match="messages cannot fit") as refused:
        check(GenerationRequest(messages=many), bpe)
    assert refused.value.param == "messages"
    long_role = [Message("u" * (bpe.max_token_chars * bpe.max_context * 8), "hi")]
    with pytest.raises(InvalidRequest, match="characters") as refused:
        check(GenerationRequest(messages=long_role), bpe)
    assert refused.value.param == "messages" and not rendered


def test_refusals_are_counted_by_their_status(bpe):
    metrics = CoordinatorMetrics()
    coordinator = Coordinator(SimpleNamespace(), SimpleNamespace(), Limits(), metrics)  # pools unused here

    async def drain(request: GenerationRequest, method: str) -> None:
        async for _ in coordinator.generate(request, method):
            pass

    with pytest.raises(NotReady, match="still connecting"):
        asyncio.run(drain(GenerationRequest(prompt="a"), "Generate"))
    coordinator.models = bpe  # (what connect sets)
    with pytest.raises(InvalidRequest):
        asyncio.run(drain(GenerationRequest(prompt="a", temperature=-1.0), "GenerateStream"))
    count = metrics.requests.labels
    assert count("Generate", "UNAVAILABLE")._value.get() == 1
    assert count("GenerateStream", "INVALID_ARGUMENT")._value.get() == 1
    assert metrics.active._value.get() == 0


def test_a_cancellation_past_the_deadline_is_deadline_exceeded():
    cancelled = asyncio.CancelledError()
    assert outcome(cancelled) == "CANCELLED"
    assert outcome(cancelled, deadline=time.monotonic() + 60) == "CANCELLED"
    assert outcome(cancelled, deadline=time.monotonic() - 1e-3) == "DEADLINE_EXCEEDED"
    assert outcome(InvalidRequest("x")) == "INVALID_ARGUMENT" and outcome(RuntimeError()) == "INTERNAL"
