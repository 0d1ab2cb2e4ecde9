"""Pre-drafting (drafting the next round while the target verifies): its kept path and its
discard path both leave the output exactly the target's."""

from __future__ import annotations

import asyncio

import pytest
import torch

from model_service.engines import DraftEngine, TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from speculative.round import Stats, generate
from speculative.sampling import logits_to_probs
from speculative.protocol import SamplingParams
from speculative.tiny import make_model, make_tokenizer
from tests.stats import chi2_stat, fits

GREEDY = SamplingParams(0.0)


def run(draft: ModelRunner, target: ModelRunner, prompt, n, k, params, predraft, totals: Stats,
        max_call_tokens: int | None = None) -> list[int]:
    async def go() -> list[int]:
        out, stats = [], Stats()
        async for new in generate(LocalDraft(DraftEngine(draft)), LocalTarget(TargetEngine(target)), prompt,
                                  max_new_tokens=n, k=k, params=params, max_context=target.max_context,
                                  stats=stats, predraft=predraft, max_call_tokens=max_call_tokens):
            out += new
        totals.merge(stats)
        return out

    return asyncio.run(go())


def test_greedy_is_exact_on_both_paths(pair):
    draft_dir, target_dir = pair
    target = ModelRunner(target_dir)
    prompt = [5, 17, 42, 9, 100]
    with torch.inference_mode():
        expected = target.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, 5:].tolist()
    # the target drafting for itself: every guess holds, so most rounds reuse the pre-drafted tokens
    same = Stats()
    assert run(ModelRunner(target_dir), target, prompt, 40, 3, GREEDY, True, same) == expected
    assert same.predraft_hits >= same.rounds // 2
    assert same.draft_calls == same.rounds + 1  # one pre-draft per round, one proposal before the first
    # a draft that disagrees: pre-drafts are thrown away
    other = Stats()
    assert run(ModelRunner(draft_dir), target, prompt, 40, 3, GREEDY, True, other) == expected
    assert other.predrafts > other.predraft_hits
    assert len(target.sessions) == 0


# (the target drafting for itself accepts every token: the draft's rejections are the default suite's case)
@pytest.mark.parametrize("drafter", ["draft", pytest.param("target", marks=pytest.mark.slow)])
def test_sampled_tokens_after_a_predraft_follow_the_target(small_vocab_pair, drafter):
    """k=1, 4 tokens: the first round commits 2 (its draft token and the target's), then
    the second round's proposal is the pre-drafted one whenever the guess held; the third
    token's marginal must be the target's. With the real draft most pre-drafts are thrown
    away; with the target drafting for itself many are kept."""
    draft_dir, target_dir = small_vocab_pair
    target = ModelRunner(target_dir)
    draft = ModelRunner(draft_dir if drafter == "draft" else target_dir)
    params, prompt, n = SamplingParams(1.0), [3, 5, 4, 7], 1200
    thirds, stats = [], Stats()
    for seed in range(n):
        out = run(draft, target, prompt, 4, 1, SamplingParams(1.0, seed=seed), True, stats)
        thirds.append(out[2])
    assert stats.predraft_hits > n // (20 if drafter == "draft" else 4)  # the kept path mattered
    assert stats.predrafts - stats.predraft_hits > n // 4  # and so did the discard path
    if drafter == "target":  # q = p on the right prefix: nothing is ever rejected, kept pre-drafts included
        assert stats.accepted_tokens == stats.draft_tokens

    def probs(ids):
        with torch.inference_mode():
            return logits_to_probs(target.model(input_ids=torch.tensor([ids])).logits[0, -1], params).double()

    first = probs(prompt)  # (no EOS here: generation goes on past it)
    v = first.shape[0]
    third = torch.zeros(v, dtype=torch.float64)
    for x in range(v):
        if first[x] == 0:
            continue
        second = probs(prompt + [x])
        for y in range(v):
            if second[y] > 0:
                third += first[x] * second[y] * probs(prompt + [x, y])
    counts = torch.bincount(torch.tensor(thirds), minlength=v).double()
    assert fits(counts, third), chi2_stat(counts, third)


def test_a_predraft_fits_the_context_and_the_largest_call(tmp_path):
    """The pre-draft asks for k + 1 tokens: near the end of the context it asks for what still
    fits (none at the very end), and at the largest K a call may ask for (the draft's
    max_tokens) it asks for that many. Either way the run ends where it would without."""
    tokenizer = make_tokenizer(tmp_path / "tok", "chars")
    model_dir = make_model(tmp_path / "m", tokenizer, hidden=32, layers=1, heads=2, kv_heads=1, max_context=64,
                           init_std=0.3)
    target = ModelRunner(model_dir)
    for prompt_length in (50, 56, 60):  # the rounds end 14, 8 and 4 tokens before the context's end
        prompt = [2 + i % 9 for i in range(prompt_length)]
        plain, ahead = Stats(), Stats()
        expected = run(ModelRunner(model_dir), target, prompt, 100, 4, GREEDY, False, plain)
        assert len(expected) == 64 - prompt_length
        assert run(ModelRunner(model_dir), target, prompt, 100, 4, GREEDY, True, ahead) == expected
        assert ahead.predraft_hits > 0
    limit = DraftEngine(target).max_tokens
    prompt = [3, 5, 4, 7]
    plain, ahead = Stats(), Stats()
    expected = run(ModelRunner(model_dir), target, prompt, 40, limit, GREEDY, False, plain)
    assert run(ModelRunner(model_dir), target, prompt, 40, limit, GREEDY, True, ahead, max_call_tokens=limit) == expected
    assert ahead.predrafts > 0
    assert len(target.sessions) == 0
