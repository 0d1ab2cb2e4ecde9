"""The n-gram drafting method (model_service/ngram.py): its matcher (longest suffix first, most
recent occurrence, copies that run into themselves, rollback), its sessions, and exactness as for
the model draft: greedy output is the target's, sampled tokens follow the target's p; and over
gRPC behind the coordinator."""

from __future__ import annotations

import asyncio
import random
import re

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from coordinator.adaptive import AdaptiveK, CostModel
from model_service.engines import TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from model_service.ngram import NGRAM_CONTEXT, NgramDraft, NgramIndex
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.errors import CapacityExceeded, InvalidRequest, SessionExists, SessionNotFound
from speculative.protocol import PassCost, ProposeCall, SamplingParams
from speculative.round import Stats, generate
from speculative.sampling import check_supports
from tests.stats import chi2_stat, fits

GREEDY = SamplingParams(0.0)


@pytest.fixture(scope="module")
def ngram(pair):
    return NgramDraft.load(pair[1], ngram_max=3, ngram_min=1)


def propose(draft: NgramDraft, session_id, start, rollback, append, k, params=GREEDY):
    return LocalDraft(draft).propose(ProposeCall(session_id, start, rollback, append, k, params))


def proposed(draft, *args, **kwargs) -> list[int]:
    return list(asyncio.run(propose(draft, *args, **kwargs))[0].tokens)


# ----------------------------------------------------------------- the matcher

def continuation(tokens, k, sizes=range(1, 4)):
    index = NgramIndex(sizes)
    index.extend(tokens)
    return index.continuation(k)


def test_longest_suffix_first():
    # [1, 2] occurred at 0 (then 3); [2] alone occurred more recently (then 4): the longer wins
    assert continuation([1, 2, 3, 9, 2, 4, 7, 1, 2], 3) == [3, 9, 2]
    # below ngram_min nothing matches
    assert continuation([9, 2, 4, 7, 8, 2], 2, range(2, 4)) == []
    assert continuation([9, 2, 4, 7, 8, 2], 2, range(1, 4)) == [4, 7]


def test_most_recent_occurrence():
    assert continuation([1, 2, 5, 1, 2, 6, 1, 2], 3) == [6, 1, 2]


def test_copy_runs_into_itself():
    assert continuation([5, 1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]
    assert continuation([7, 7], 4) == [7, 7, 7, 7]


def test_no_match_is_empty():
    assert continuation([1, 2, 3, 4, 5], 4) == []
    assert continuation([1], 4) == [] and continuation([], 4) == [] and continuation([1, 2, 1], 0) == []


def test_crop_is_a_fresh_index_of_the_prefix():
    rng = random.Random(0)
    for _ in range(200):
        tokens = [rng.randrange(4) for _ in range(30)]
        keep = rng.randrange(30)
        cropped, fresh = NgramIndex(range(1, 4)), NgramIndex(range(1, 4))
        cropped.extend(tokens)
        cropped.crop(keep - 30)
        fresh.extend(tokens[:keep])
        assert (cropped.tokens, cropped.starts) == (fresh.tokens, fresh.starts)


# ----------------------------------------------------------------- sessions and deltas

def test_proposal_is_one_hot_at_each_copied_token(ngram):
    proposal, cost = asyncio.run(propose(ngram, "q", True, 0, [5, 6, 7, 8, 5, 6], 3))
    assert list(proposal.tokens) == [7, 8, 5]
    ids, probs, sizes = check_supports(list(proposal.tokens), list(proposal.support_sizes), proposal.support_ids,
                                       proposal.support_probs, ngram.vocab_size)
    assert list(sizes) == [1, 1, 1] and list(ids) == [7, 8, 5] and list(probs) == [1.0, 1.0, 1.0]
    assert cost.batch_size == 1 and cost.batch_tokens == 3
    assert ngram.release("q") and not ngram.release("q")


def test_rollback_append_and_predraft(ngram):
    prompt = [5, 6, 7, 8, 9, 5, 6]
    assert proposed(ngram, "r", True, 0, prompt, 3) == [7, 8, 9]
    # the target kept one proposal and sampled 11: roll back two, append 11 -> context ends 5 6 7 11
    assert proposed(ngram, "r", False, 2, [11], 2) == []  # [7, 11], [11] never occurred before
    assert ngram.sessions.get("r").tokens == prompt + [7, 11]
    # append 5 6: matches again, then a call appending nothing drafts on after its own proposal
    assert proposed(ngram, "r", False, 0, [5, 6], 2) == [7, 11]
    assert proposed(ngram, "r", False, 0, [], 2) == [5, 6]  # ... 5 6 [7 11] -> after "7 11": 5 6
    session = ngram.sessions.get("r")
    assert session.tokens == prompt + [7, 11, 5, 6, 7, 11, 5, 6] and session.proposed == 4
    # the next rollback may span both proposals; the index then equals a fresh one of what is held
    assert proposed(ngram, "r", False, 4, [8], 0) == []
    assert session.tokens == prompt + [7, 11, 5, 6, 8]
    proposed(ngram, "r", False, 0, [9], 0)  # indexes what was appended
    fresh = NgramIndex(ngram.sizes)
    fresh.extend(session.tokens)
    assert (session.cache.tokens, session.cache.starts) == (fresh.tokens, fresh.starts)
    ngram.release("r")


def test_refused_calls_leave_the_session_alone(ngram):
    proposed(ngram, "v", True, 0, [1, 2, 3, 1, 2], 2)
    held = list(ngram.sessions.get("v").tokens)
    for args, error in [
        (("v", True, 0, [1], 1), SessionExists),
        (("none", False, 0, [1], 1), SessionNotFound),
        (("v", False, 3, [], 1), InvalidRequest),  # only 2 proposed
        (("v", False, 0, [ngram.vocab_size], 1), InvalidRequest),
        (("v", False, 0, [], ngram.max_tokens + 1), InvalidRequest),
        (("w", True, 1, [1], 1), InvalidRequest),
        (("w", True, 0, [], 1), InvalidRequest),
    ]:
        with pytest.raises(error):
            asyncio.run(propose(ngram, *args))
    assert ngram.sessions.get("v").tokens == held and "w" not in ngram.sessions
    ngram.release("v")


def test_a_tokenizer_path_that_is_no_directory_is_named(tmp_path):
    """--tokenizer naming no directory says so (HF's message read the path as a malformed hub repo id)."""
    for missing in (tmp_path / "nonexistent", "/nonexistent"):
        with pytest.raises(FileNotFoundError, match=re.escape(f"{missing} is not a tokenizer or model directory")):
            NgramDraft.load(missing)


def test_capacity_and_idle_eviction(pair):
    draft = NgramDraft.load(pair[1], max_sessions=1, idle_timeout=60.0, max_context=8)
    proposed(draft, "a", True, 0, [1, 2], 1)
    with pytest.raises(CapacityExceeded):
        proposed(draft, "b", True, 0, [1, 2], 1)
    with pytest.raises(InvalidRequest, match="beyond the context"):
        proposed(draft, "a", False, 0, [3] * 6, 1)
    draft.sessions.get("a").last_used -= 61
    assert draft.evict_idle() == 1 and len(draft.sessions) == 0
    proposed(draft, "b", True, 0, [1, 2], 1)


def test_the_kv_token_cap_holds_for_a_method_without_a_model(pair):
    """--max-kv-tokens caps the tokens all sessions hold together on a draft that holds no
    ModelRunner too (ngram, EAGLE: MethodSessions): a start or a call that would pass it gets
    RESOURCE_EXHAUSTED and changes nothing (it was ignored: three 5,000-token sessions under a cap
    of 100)."""
    draft = NgramDraft.load(pair[1], max_kv_tokens=20)
    proposed(draft, "a", True, 0, [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 2)
    with pytest.raises(CapacityExceeded, match="--max-kv-tokens"):
        proposed(draft, "b", True, 0, [1] * 10, 2)
    held = list(draft.sessions.get("a").tokens)
    with pytest.raises(CapacityExceeded):
        proposed(draft, "a", False, 0, [5] * 12, 2)
    assert "b" not in draft.sessions and draft.sessions.get("a").tokens == held
    proposed(draft, "a", False, 0, [5] * 4, 2)  # within the cap
    from draft_service.__main__ import make_engine, parse_args  # the service's flag reaches it
    args = parse_args(["--method", "ngram", "--tokenizer", str(pair[1]), "--max-kv-tokens", "77"])
    engine = make_engine(args, None)
    assert engine.host.max_kv_tokens == 77
    # from a model's directory a session holds at most its context (as the target's), not NGRAM_CONTEXT
    assert engine.max_context == ModelRunner(pair[1]).max_context < NGRAM_CONTEXT
    args = parse_args(["--method", "ngram", "--tokenizer", str(pair[1]), "--max-context", "100"])
    assert make_engine(args, None).max_context == 100


def test_info_pairs_with_the_target(pair, ngram):
    runner = ModelRunner(pair[1])
    target, info = runner.info(), ngram.info()
    assert info["vocab_size"] == target["vocab_size"]
    assert info["tokenizer_fingerprint"] == target["tokenizer_fingerprint"]
    assert info["draft_method"] == "ngram" and info["num_parameters"] == 0 and info["pass_ms_fixed"] == 0.0
    assert pb.ModelInfo(**info).draft_method == "ngram"  # every field is ModelInfo's
    assert ngram.tokenizer_files() == runner.tokenizer_files()  # GetTokenizer: the target's files


# ----------------------------------------------------------------- exactness through the round

def run(draft, target, prompt, n, k, params, totals: Stats, predraft=False, eos=frozenset()):
    async def go():
        out, stats = [], Stats()  # (generate counts its tokens in the Stats it is given)
        async for new in generate(draft, target, prompt, max_new_tokens=n, k=k, params=params,
                                  eos_token_ids=eos, max_context=512, stats=stats, predraft=predraft,
                                  session_id=f"s{params.seed}"):
            out += new
        totals.merge(stats)
        return out

    return asyncio.run(go())


@pytest.mark.parametrize("policy", ["fixed", "adaptive", "predraft"])
def test_greedy_is_the_targets(pair, policy):
    """The random tiny target falls into loops quickly: the n-gram draft then copies them."""
    _, target_dir = pair
    runner = ModelRunner(target_dir)
    draft, target = LocalDraft(NgramDraft.load(target_dir)), LocalTarget(TargetEngine(runner))
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    stats = Stats()
    for prompt in ([5, 17, 42, 9, 100, 5, 17], [3, 1, 4, 1, 5, 9, 2, 6], [200, 201, 202, 200, 201]):
        with torch.inference_mode():
            expected = model.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False)[0, len(prompt):]
        k = AdaptiveK(CostModel(runner.pass_cost, PassCost()), 6) if policy == "adaptive" else 4
        assert run(draft, target, prompt, 48, k, GREEDY, stats, policy == "predraft",
                   {model.generation_config.eos_token_id}) == expected.tolist()
    assert stats.accepted_tokens > 0 and stats.draft_tokens > stats.accepted_tokens  # both paths ran
    assert len(runner.sessions) == 0 and len(draft.engine.sessions) == 0


def test_sampled_first_token_follows_the_target(small_vocab_pair):
    """The prompt ends in a 2-gram seen before, so the first round proposes a copy, q one-hot at
    it; the first emitted token must still follow the target's p (chi-squared over seeds)."""
    _, target_dir = small_vocab_pair
    draft, target = LocalDraft(NgramDraft.load(target_dir)), LocalTarget(TargetEngine(ModelRunner(target_dir)))
    prompt = [3, 5, 4, 7, 3, 5]  # "3 5" occurred at 0: the draft proposes 4, 7
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    with torch.inference_mode():
        p = model(input_ids=torch.tensor([prompt])).logits[0, -1].softmax(-1).double()
    firsts, stats = [], Stats()
    for seed in range(1200):
        firsts.append(run(draft, target, prompt, 2, 2, SamplingParams(1.0, seed=seed), stats)[0])
    counts = torch.bincount(torch.tensor(firsts), minlength=p.shape[0]).double()
    assert stats.draft_tokens >= 1200 and 0 < stats.accepted_tokens < stats.draft_tokens  # accepted and rejected
    assert counts[4] < 1200  # the copied token is not simply emitted
    assert fits(counts, p), chi2_stat(counts, p)


# ----------------------------------------------------------------- over gRPC

def test_behind_the_coordinator_greedy_is_the_targets(pair, reference):
    from coordinator.launch import LocalStack

    _, target_dir = pair
    with LocalStack(None, target_dir, draft_method="ngram") as stack:
        channel = grpc.insecure_channel(stack.addr)
        client = pb_grpc.GenerationStub(channel)
        info = client.GetInfo(pb.GetInfoRequest())
        assert info.draft.draft_method == "ngram" and info.target.draft_method == ""
        assert [r.model_name for r in info.replicas if r.role == "draft"] == ["ngram"]
        # a draft that costs nothing per token: adaptive K may grow to every K the services take
        # (a model draft's ceiling is 8: test_limits)
        assert info.default_speculative_tokens == info.max_speculative_tokens == 16
        drafted = 0
        for prompt, k in (("def speculative_round(draft, target):", 4), ("for i in range(10):\n    print(", None)):
            request = pb.GenerateRequest(prompt=prompt, max_new_tokens=40, temperature=0.0)
            if k is not None:
                request.num_speculative_tokens = k
            reply = client.Generate(request)
            assert list(reply.token_ids) == reference(prompt, 40), (prompt, k)
            drafted += reply.stats.draft_tokens
        assert drafted > 0
        channel.close()
        with grpc.insecure_channel(stack.draft_addr) as channel:
            draft = pb_grpc.DraftStub(channel)
            assert draft.GetModelInfo(pb.ModelInfoRequest()).active_sessions == 0  # the streams released theirs
            assert b"".join(f.data for f in draft.GetTokenizer(pb.TokenizerRequest()))
