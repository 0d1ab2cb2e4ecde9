"""Sampling through the whole stack: the first and second generated tokens are distributed
exactly as the target's own, whatever the draft proposes."""

from __future__ import annotations

from dataclasses import replace

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.sampling import logits_to_probs
from speculative.protocol import SamplingParams
from tests.stats import chi2_critical, chi2_stat, fits

PROMPT = [3, 5, 4, 7]
N = 1000  # requests per setting


def next_probs(model, ids: list[int], params: SamplingParams) -> torch.Tensor:
    with torch.inference_mode():
        return logits_to_probs(model(input_ids=torch.tensor([ids])).logits[0, -1], params)


def reference(model, params: SamplingParams, eos: int) -> tuple[torch.Tensor, torch.Tensor]:
    """p(first token), and the marginal of the second over V + 1 cells (the last: ended at the first)."""
    first = next_probs(model, PROMPT, params).double()
    v = first.shape[0]
    second = torch.zeros(v + 1, dtype=torch.float64)
    for x in range(v):
        if first[x] == 0:
            continue
        if x == eos:
            second[v] += first[x]
        else:
            second[:v] += first[x] * next_probs(model, PROMPT + [x], params).double()
    return first, second


def sample_stack(stack, params: SamplingParams, k: int) -> tuple[list[int], list[int]]:
    stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.addr))
    firsts, seconds = [], []
    for start in range(0, N, 25):  # 25 requests in flight at a time
        futures = [
            stub.Generate.future(pb.GenerateRequest(
                prompt_token_ids=PROMPT, max_new_tokens=3, temperature=params.temperature, top_k=params.top_k,
                top_p=params.top_p, min_p=params.min_p, seed=1000 + i, num_speculative_tokens=k))
            for i in range(start, min(N, start + 25))
        ]
        for f in futures:
            ids = list(f.result().token_ids)
            firsts.append(ids[0])
            seconds.append(ids[1] if len(ids) > 1 else -1)
    return firsts, seconds


# (plain sampling is also the filtered case with its filters off: it runs in the slow suite)
@pytest.mark.parametrize("params", [pytest.param(SamplingParams(1.0), marks=pytest.mark.slow),
                                    SamplingParams(0.7, top_k=6, top_p=0.9, min_p=0.1)],
                         ids=["plain", "top_k_top_p_min_p"])
def test_first_and_second_tokens_follow_the_target(small_vocab_stack, small_vocab_pair, params):
    draft_dir, target_dir = small_vocab_pair
    target = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir).eval()
    eos = target.config.eos_token_id
    p_first, p_second = reference(target, params, eos)
    v = p_first.shape[0]
    if params.min_p:  # (min-p cuts tokens the other filters keep: a stack without it would draw them)
        assert int((next_probs(target, PROMPT, replace(params, min_p=0.0)) > 0).sum()) > int((p_first > 0).sum())

    firsts, seconds = sample_stack(small_vocab_stack, params, k=2)
    first_counts = torch.bincount(torch.tensor(firsts), minlength=v).double()
    second_counts = torch.bincount(torch.tensor([s if s >= 0 else v for s in seconds]), minlength=v + 1).double()
    assert fits(first_counts, p_first), chi2_stat(first_counts, p_first)
    assert fits(second_counts, p_second), chi2_stat(second_counts, p_second)

    # the check has power: the draft's own distribution is far from what came out
    q_first = next_probs(draft, PROMPT, params).double()
    q_stat, q_df = chi2_stat(first_counts, q_first) if bool((first_counts[q_first == 0] == 0).all()) else (1e9, 1)
    assert q_stat > chi2_critical(q_df), "draft and target too alike for this test to mean anything"
