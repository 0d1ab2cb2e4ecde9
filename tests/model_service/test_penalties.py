"""Penalties and logit bias on the target's logits (SamplingParams.frequency_penalty, presence_penalty,
logit_bias; model_service/engines.py `shaped`): greedy output is transformers' own greedy decode under
them, whatever the speculation (decode steps, draft tokens accepted, copies), each verify row counting
the draft tokens before it; sampled tokens follow the shaped p (chi-squared over seeds), in a verify
pass's bonus row and in a decode step alike; the output counted from where it begins, not the prompt."""

from __future__ import annotations

import asyncio

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from model_service.engines import DraftEngine, TargetEngine, shaped
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from speculative.errors import InvalidRequest
from speculative.protocol import Proposal, SamplingParams, VerifyCall, params_from_proto, params_to_proto
from speculative.round import FixedK, SessionLost, Stats, generate
from tests.stats import chi2_stat, fits

PROMPT = "def fibonacci(n):"
REPEATS = "a b c d e f g h a b c d e f g h a b c d e f g h a b c d"  # (copies: lookup)


def shaped_by_hand(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The next token's logits after `prompt` and `output` under the penalties and bias, written out plainly."""
    logits = logits.double().clone()
    vocab = logits.shape[0]
    for token in set(prompt + output):
        if token < vocab:
            r = params.repetition_penalty
            logits[token] = logits[token] / r if logits[token] > 0 else logits[token] * r
    for token in set(output):
        logits[token] -= params.frequency_penalty * output.count(token) + params.presence_penalty
    for token, bias in params.logit_bias:
        if token < vocab:
            logits[token] += bias
    return logits


def reference_greedy(target, prompt: list[int], params: SamplingParams, n: int) -> list[int]:
    """transformers' greedy decode under the penalties and bias; target: its directory or the model."""
    model = target if isinstance(target, torch.nn.Module) else \
        AutoModelForCausalLM.from_pretrained(target, torch_dtype=torch.float32).eval()
    out: list[int] = []
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
            out.append(int(shaped_by_hand(logits, params, prompt, out).argmax()))
    return out


class Losing(LocalTarget):
    """Loses its session (SessionLost, as failover raises) on the `at`th call."""

    def __init__(self, engine, at: int | None):
        super().__init__(engine)
        self.at, self.calls, self.starts = at, 0, []

    async def verify(self, call, *, turn=(0, 0)):
        self.calls += 1
        if call.start:
            self.starts.append(call.output_from)
        if self.calls == self.at:
            await self.release(call.session_id)
            raise SessionLost(call.session_id)
        return await super().verify(call)


class Recording(LocalDraft):
    async def propose(self, call, *, turn=(0, 0)):
        assert call.params.logit_bias == () and not call.params.shapes_logits  # (the target's alone)
        return await super().propose(call)


def run(pair, k, params: SamplingParams, prompt: str = PROMPT, lookup: int = 0, draft_dir=None, n: int = 24,
        lose_target_at: int | None = None):
    target = Losing(TargetEngine(ModelRunner(pair[1])), lose_target_at)
    draft = Recording(DraftEngine(ModelRunner(draft_dir or pair[0])))
    ids = AutoTokenizer.from_pretrained(pair[1]).encode(prompt)
    stats = Stats()

    async def go():
        out = []
        async for new in generate(draft, target, ids, max_new_tokens=n, k=k, params=params, max_context=512,
                                  lookup=lookup, stats=stats):
            out += new
        return out

    out = asyncio.run(go())
    if lose_target_at is not None:
        assert target.starts == [len(ids), len(ids)]  # (started again: the output counted from the prompt's end)
    return out, ids, stats


@pytest.mark.parametrize("case", ["decode steps", "draft tokens accepted", "copies", "target restarted"])
def test_greedy_output_is_the_targets_own_under_penalties_and_bias(pair, case):
    params = SamplingParams(0.0, frequency_penalty=0.7, presence_penalty=0.9, logit_bias=((5, 2.5), (40, -3.0)),
                            repetition_penalty=1.3)
    if case == "copies":  # (mild: a text that may still repeat itself, so that copies are kept)
        params = SamplingParams(0.0, frequency_penalty=0.02, presence_penalty=0.01, logit_bias=((5, 0.3),),
                                repetition_penalty=1.02)
    if case == "decode steps":
        out, prompt, stats = run(pair, FixedK(0, steps=6), params)
        assert stats.rounds < 24
    elif case == "draft tokens accepted":  # the target drafting for itself, without the penalties: some rejected
        out, prompt, stats = run(pair, 3, params, draft_dir=pair[1])
        assert stats.accepted_tokens > 0
    elif case == "copies":
        out, prompt, stats = run(pair, FixedK(0, steps=8), params, prompt=REPEATS, lookup=4)
        assert stats.copied_tokens > 0
    else:  # the target's session lost mid-stream: started again with the output so far, counted from the prompt's end
        out, prompt, stats = run(pair, FixedK(0, steps=3), params, lose_target_at=4)
    assert out == reference_greedy(pair[1], prompt, params, 24)
    if case != "copies":
        plain, _, _ = run(pair, FixedK(0, steps=6), SamplingParams(0.0))
        assert plain != out  # (they change the output: the test above can fail)


def test_the_rows_of_one_pass_count_the_draft_tokens_before_them():
    rows = torch.tensor([[1.5, -2.0, 3.0, 0.5, -1.0, 2.0, 0.25]] * 3)
    params = SamplingParams(0.0, frequency_penalty=1.0, presence_penalty=0.5, logit_bias=((2, 4.0), (9, 1.0)),
                            repetition_penalty=2.0)
    # the session's tokens [5, 0 | 1, 1, 3] (the output from 2), then draft tokens 3 and 4
    got = shaped(rows, [1, 1, 3], [3, 4], params, prompt=torch.tensor([0, 5]))
    for i, output in enumerate([[1, 1, 3], [1, 1, 3, 3], [1, 1, 3, 3, 4]]):
        want = shaped_by_hand(rows[i], params, [5, 0], output).float()  # (id 9: past this vocabulary, none)
        assert torch.allclose(got[i], want), (i, got[i], want)
    assert got[0, 6] == rows[0, 6] and got[0, 5] == rows[0, 5] / 2  # unseen; in the prompt only: repetition alone
    masked = torch.full((1, 7), float("-inf"))
    assert torch.isinf(shaped(masked, [1], [], params)).all()  # what a constraint forbids stays forbidden
    assert torch.equal(rows[0, :3], torch.tensor([1.5, -2.0, 3.0]))  # (the rows given are left as they were)


def next_p(model, prompt: list[int], params: SamplingParams, output: list[int]) -> torch.Tensor:
    """p after prompt + output, output counted as such."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + output])).logits[0, -1]
    return torch.softmax(shaped_by_hand(logits, params, prompt, output), -1)


def test_sampled_tokens_follow_the_shaped_p_in_a_bonus_row_and_a_decode_step(small_vocab_pair):
    """t1 from the first row (bias only), t2 after t1 (penalised for it): through a verify pass's bonus
    row (a draft token d, q one-hot, accepted) and through a decode step (steps 2). Chi-squared, 1,500 seeds."""
    _, target_dir = small_vocab_pair
    target = TargetEngine(ModelRunner(target_dir))
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompt = [3, 1, 4, 1, 5]
    base = SamplingParams(1.0)
    first = next_p(model, prompt, base, [])
    d = int(first.argmax())  # the likeliest, penalised after itself: the bias on the runner-up changes p
    runner_up = int(first.topk(2).indices[1])
    params = SamplingParams(1.0, frequency_penalty=0.8, presence_penalty=0.6, logit_bias=((runner_up, 0.7),))
    p1 = next_p(model, prompt, params, [])
    proposal = Proposal([d], [1], torch.tensor([d], dtype=torch.int32).numpy().tobytes(),
                        torch.tensor([1.0]).numpy().tobytes())
    firsts, after_d, steps_first, steps_after = [], [], [], []
    for seed in range(1500):
        seeded = SamplingParams(1.0, seed=seed, frequency_penalty=0.8, presence_penalty=0.6,
                                logit_bias=((runner_up, 0.7),))
        verdict, _ = target.verify(VerifyCall("s", True, prompt, proposal, seeded, output_from=len(prompt)))
        target.release("s")
        if verdict.accepted:
            firsts.append(d)
            after_d.append(verdict.token)
        else:
            firsts.append(verdict.token)
        verdict, _ = target.verify(VerifyCall("s", True, prompt, Proposal(), seeded, 2, output_from=len(prompt)))
        target.release("s")
        steps_first.append(verdict.token)
        if verdict.token == d and verdict.decoded:
            steps_after.append(verdict.decoded[0])
    vocab = p1.shape[0]
    p2 = next_p(model, prompt, params, [d])
    for seen, p in ((firsts, p1), (steps_first, p1), (after_d, p2), (steps_after, p2)):
        assert len(seen) >= 300, len(seen)
        counts = torch.bincount(torch.tensor(seen), minlength=vocab).double()
        assert fits(counts, p), chi2_stat(counts, p)
    assert not fits(torch.bincount(torch.tensor(after_d), minlength=vocab).double(), next_p(model, prompt, base, [d]))


def test_penalties_count_the_output_only_and_cross_the_wire(pair):
    params = SamplingParams(0.0, frequency_penalty=2.0, presence_penalty=-1.5, logit_bias=((3, -100.0), (7, 100.0)),
                            repetition_penalty=1.25)
    assert params_from_proto(params_to_proto(params)) == params
    assert params_from_proto(params_to_proto(SamplingParams())).repetition_penalty == 1.0
    target = TargetEngine(ModelRunner(pair[1]))
    greedy = SamplingParams(0.0, frequency_penalty=1.5, presence_penalty=1.0)
    model = AutoModelForCausalLM.from_pretrained(pair[1], torch_dtype=torch.float32).eval()
    for start in range(10, 60):  # a prompt whose own tokens, counted, would change the output
        prompt = [start, start + 1] * 3
        output_only = reference_greedy(model, prompt, greedy, 3)
        with torch.no_grad():
            first = model(torch.tensor([prompt])).logits[0, -1].double()
        if int(shaped_by_hand(first, greedy, [], prompt).argmax()) != output_only[0]:
            break
    verdict, _ = target.verify(VerifyCall("s", True, prompt, Proposal(), greedy, 3, output_from=len(prompt)))
    assert [verdict.token, *verdict.decoded] == output_only  # (counting the prompt too would differ)
    with pytest.raises(InvalidRequest, match="output_from"):
        target.verify(VerifyCall("t", True, prompt, Proposal(), params, output_from=len(prompt) + 1))
    for bad, field in [(dict(frequency_penalty=2.5), "frequency_penalty"), (dict(presence_penalty=float("nan")),
                       "presence_penalty"), (dict(logit_bias=((4, 1.0), (2, 1.0))), "logit_bias"),
                       (dict(logit_bias=((2, 101.0),)), "logit_bias"), (dict(logit_bias=((-1, 1.0),)), "logit_bias"),
                       (dict(repetition_penalty=0.0), "repetition_penalty"),
                       (dict(repetition_penalty=1e-38), "repetition_penalty"),  # (a logit / it: inf)
                       (dict(repetition_penalty=101.0), "repetition_penalty")]:
        with pytest.raises(InvalidRequest) as refused:
            SamplingParams(**bad).validate()
        assert refused.value.param == field


def test_min_tokens_masks_the_ends_in_the_rows_before_it():
    rows = torch.tensor([[1.5, -2.0, 3.0, 0.5, -1.0]] * 3)
    params = SamplingParams(0.0, min_tokens=4, stop_token_ids=(3, 9))  # (9: past this vocabulary)
    got = shaped(rows, [1, 2], [4, 4], params, ends=(0,))  # rows 0, 1 decide output tokens 2, 3; row 2 token 4
    inf = float("-inf")
    assert got[:2, [0, 3]].eq(inf).all() and torch.equal(got[:2, [1, 2, 4]], rows[:2, [1, 2, 4]])
    assert torch.equal(got[2], rows[2])
    assert torch.equal(shaped(rows, [1, 2, 3, 4], [], params, ends=(0,)), rows)  # past min_tokens: nothing
    assert params.drafting().min_tokens == 0 and params.shapes_logits
    assert params_from_proto(params_to_proto(params)) == params


@pytest.mark.parametrize("case", ["decode steps", "draft tokens accepted"])
def test_min_tokens_keeps_the_ends_out_of_the_first_tokens(pair, case):
    """vLLM's min_tokens: the tiny target ends "x" at its 24th token; with min_tokens 26 (and a stop id
    among the ends) the output is transformers' greedy decode with those masked for 26 tokens."""
    eos = AutoTokenizer.from_pretrained(pair[1]).eos_token_id
    k = FixedK(0, steps=6) if case == "decode steps" else 3
    draft = pair[1] if case == "draft tokens accepted" else None
    plain, prompt, _ = run(pair, k, SamplingParams(0.0), prompt="x", n=30, draft_dir=draft)
    stop = plain[2]
    assert eos in plain[:26] and stop in plain[:26]  # (the test can fail)
    out, _, stats = run(pair, k, SamplingParams(0.0, min_tokens=26, stop_token_ids=(stop,)), prompt="x", n=30,
                        draft_dir=draft)
    model = AutoModelForCausalLM.from_pretrained(pair[1], torch_dtype=torch.float32).eval()
    want: list[int] = []
    with torch.no_grad():
        for _ in range(30):
            logits = model(torch.tensor([prompt + want])).logits[0, -1]
            if len(want) < 26:
                logits[[eos, stop]] = float("-inf")
            want.append(int(logits.argmax()))
    assert out == want and eos not in out[:26] and stop not in out[:26]
    if case == "draft tokens accepted":
        assert stats.accepted_tokens > 0
