"""Predicted outputs (speculative/prediction.py): where the output stands in the prediction, and rounds
that verify the prediction's tokens leave the output exactly the target's, greedy and sampled."""

from __future__ import annotations

import asyncio

import pytest
import torch

from model_service.engines import DraftEngine, TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from speculative.prediction import MIN_SIZE, Prediction
from speculative.protocol import SamplingParams
from speculative.round import Stats, generate
from speculative.sampling import logits_to_probs
from tests.stats import chi2_stat, fits

GREEDY = SamplingParams(0.0)


def test_the_offer_follows_the_output_and_finds_the_prediction_again_after_an_edit():
    predicted = Prediction(list(range(100, 140)), most=16)
    assert predicted.offer([], 10) == [100, 101, 102, 103]  # the first round's size
    predicted.kept(4, 4)
    assert predicted.offer([100, 101, 102, 103, 104], 10) == list(range(105, 113))  # doubled, and followed on
    predicted.kept(8, 2)  # kept 2 of 8: halved
    # the output inserts 7, 8 after 106, then goes on with 107, 108 (the prediction again): found by its tail
    output = [100, 101, 102, 103, 104, 105, 106, 7, 8]
    assert predicted.offer(output, 10) == []  # its last tokens occur nowhere in the prediction: the draft drafts
    assert predicted.offer(output + [107, 108], 10) == [109, 110, 111, 112]
    assert predicted.offer(output + [107, 108, 109], 2) == [110, 111]  # within the limit given
    assert predicted.offer(output + [107, 108, 109], 0) == []
    predicted.kept(4, 0)
    assert predicted.size == MIN_SIZE
    # an output that skips ahead (a line deleted) is found where it went on
    assert predicted.offer(output + [107, 108, 109, 130, 131], 10) == [132, 133]
    assert (predicted.offered, predicted.accepted) == (16, 6)


def test_a_repeated_stretch_is_found_at_or_after_where_the_output_stood():
    predicted = Prediction([1, 2, 3, 9, 1, 2, 3, 10, 1, 2, 3, 11], most=4)
    out = [1, 2, 3, 9, 1]
    assert predicted.offer(out, 4) == [2, 3, 10, 1]
    # the output parts (5), then says 1 2 3: the occurrence that starts after where it stood (at 5), not 4's
    assert predicted.offer(out + [2, 5, 1, 2, 3], 4) == [11]
    assert Prediction([], 4).offer([], 4) == []


def run(target: ModelRunner, draft: ModelRunner, prompt, n, k, params, prediction=None, stats=None) -> list[int]:
    async def go() -> list[int]:
        out, own = [], Stats()
        async for new in generate(LocalDraft(DraftEngine(draft)), LocalTarget(TargetEngine(target)), prompt,
                                  max_new_tokens=n, k=k, params=params, max_context=512, stats=own,
                                  prediction=Prediction(prediction, 8) if prediction is not None else None):
            out += new
        if stats is not None:
            stats.merge(own)
        return out

    return asyncio.run(go())


def test_greedy_output_is_the_targets_with_any_prediction(pair):
    draft_dir, target_dir = pair
    prompt = [5, 17, 42, 9, 100]
    target, draft = ModelRunner(target_dir), ModelRunner(draft_dir)
    with torch.inference_mode():
        expected = target.model.generate(torch.tensor([prompt]), max_new_tokens=40, do_sample=False)[0, 5:].tolist()
    assert len(expected) == 40
    right = Stats()
    assert run(target, draft, prompt, 40, 2, GREEDY, expected, right) == expected
    assert right.accepted_prediction_tokens == 35 and right.rounds == 5  # offers of 4, 8, 8, 8 and the last 7
    assert right.draft_tokens == 0 and right.draft_calls == 0  # the draft was never asked
    edited = expected[:10] + [7, 7, 7] + expected[13:25] + expected[30:]  # a change and a cut
    some = Stats()
    assert run(target, draft, prompt, 40, 2, GREEDY, edited, some) == expected
    assert some.accepted_prediction_tokens >= 20 and some.prediction_tokens > some.accepted_prediction_tokens
    assert some.draft_calls > 0  # where the prediction was lost, the draft drafted
    wrong = Stats()
    assert run(target, draft, prompt, 40, 0, GREEDY, [3, 1, 4, 1, 5] * 6, wrong) == expected
    assert wrong.prediction_tokens > 0 and wrong.draft_calls == 0  # (K = 0: the draft never drafts)


@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.8, top_k=5)], ids=["plain", "top_k"])
def test_sampled_tokens_with_a_prediction_follow_the_target(small_vocab_pair, params):
    """The prediction offers the target's two most likely first tokens in turn: the first round verifies
    them (accepted with probability p(x), else drawn from p without x), and the first and second tokens'
    marginals must be the target's."""
    draft_dir, target_dir = small_vocab_pair
    target, draft = ModelRunner(target_dir), ModelRunner(draft_dir)
    prompt, n = [3, 5, 4, 7], 800

    def probs(ids):
        with torch.inference_mode():
            return logits_to_probs(target.model(input_ids=torch.tensor([ids])).logits[0, -1], params).double()

    first = probs(prompt)
    v = first.shape[0]
    likely = torch.argsort(first, descending=True)[:2].tolist()
    second = torch.zeros(v, dtype=torch.float64)
    for x in range(v):
        if first[x] > 0:
            second += first[x] * probs(prompt + [x])
    firsts, seconds, stats = [], [], Stats()
    for seed in range(n):
        out = run(target, draft, prompt, 3, 1, SamplingParams(params.temperature, top_k=params.top_k, seed=seed),
                  likely, stats)
        firsts.append(out[0])
        seconds.append(out[1])
    assert 0 < stats.accepted_prediction_tokens < stats.prediction_tokens  # both paths taken
    first_counts = torch.bincount(torch.tensor(firsts), minlength=v).double()
    second_counts = torch.bincount(torch.tensor(seconds), minlength=v).double()
    assert fits(first_counts, first), chi2_stat(first_counts, first)
    assert fits(second_counts, second), chi2_stat(second_counts, second)
