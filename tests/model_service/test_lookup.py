"""Prompt lookup in the target (VerifyCall.lookup): a call that decodes steps also verifies tokens the
target copies from the session's context. Greedy, the tokens are those of decoding one at a time;
sampled, each still follows the target's p (chi-squared over seeds); copies stop at an EOS, the
call's steps and the context; through the round, the target service and the coordinator."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from model_service.engines import TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from model_service.ngram import NgramDraft
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.protocol import Constraint, Proposal, SamplingParams, VerifyCall
from speculative.round import FixedK, Stats, generate
from tests.stats import chi2_stat, fits

from .test_decode_steps import one_at_a_time
from .test_engines import one_hot_proposal

GREEDY = SamplingParams(0.0)
# a prompt that repeats itself, so that the context has n-grams to copy from from the first call on
PROMPTS = [[5, 17, 42, 9, 100, 3, 5, 17, 42, 9, 100, 3, 5, 17], [7, 8, 9, 7, 8, 9, 7, 8, 9, 7], [40, 41, 42, 43, 44]]


@pytest.fixture(scope="module")
def target(pair):
    _, target_dir = pair
    return TargetEngine(ModelRunner(target_dir))


def with_lookup(target: TargetEngine, session: str, prompt: list[int], n: int, steps: int, lookup: int,
                params: SamplingParams = GREEDY) -> tuple[list[int], int, int]:
    """n tokens in calls of `steps` tokens copying up to `lookup`. -> (tokens, copied, passes)"""
    tokens, copied, passes, start = [], 0, 0, True
    while len(tokens) < n:
        verdict, cost = target.verify(VerifyCall(session, start, prompt if start else [], Proposal(), params,
                                                 steps, lookup=lookup))
        got = [verdict.token, *verdict.decoded]
        assert verdict.accepted == 0 and len(got) <= steps and verdict.copied < len(got)
        tokens, copied, start = tokens + got, copied + verdict.copied, False
        passes += len(got) - verdict.copied  # each pass keeps one token of its own
    target.release(session)
    return tokens[:n], copied, passes


def test_greedy_copies_decode_what_one_token_a_call_does(target):
    copied = passes = made = 0
    for i, prompt in enumerate(PROMPTS):
        want = one_at_a_time(target, f"ref{i}", GREEDY, 40, prompt)
        got, c, p = with_lookup(target, f"lookup{i}", prompt, 40, steps=8, lookup=4)
        assert got == want
        copied, passes, made = copied + c, passes + p, made + len(got)
    assert copied > 0 and passes < made  # copies were kept: fewer passes than tokens
    assert len(target.runner.sessions) == 0


def test_copies_mix_with_verified_proposals_and_rollbacks(target):
    """A session whose calls alternate between verifying (rejected) proposals, which roll it back, and
    copying: its index follows the rollbacks, and the tokens stay the target's."""
    prompt = PROMPTS[1]
    want = one_at_a_time(target, "ref", GREEDY, 36, prompt)
    tokens, start = [], True
    while len(tokens) < 36:
        if len(tokens) % 2:  # a proposal the target rejects at once: it rolls the session back
            wrong = (want[len(tokens)] + 1) % target.runner.vocab_size
            verdict, _ = target.verify(VerifyCall("mixed", False, [], one_hot_proposal([wrong, wrong]), GREEDY))
            assert verdict.accepted == 0
        else:
            verdict, _ = target.verify(VerifyCall("mixed", start, prompt if start else [], Proposal(), GREEDY, 6,
                                                  lookup=3))
        tokens += [verdict.token, *verdict.decoded]
        start = False
    target.release("mixed")
    assert tokens[:36] == want


def test_copies_stop_short_of_an_eos(target):
    """A token the copies would carry is made the end of a sequence: a call's tokens end at it."""
    runner = target.runner
    prompt = PROMPTS[1]
    _, copied, _ = with_lookup(target, "plain", prompt, 30, steps=16, lookup=8)
    want = one_at_a_time(target, "ref", GREEDY, 30, prompt)
    assert copied > 0
    eos = want[5]  # a token decoded sixth, in a stretch the copies carry: make it the end of a sequence
    saved = runner.eos_token_ids
    runner.eos_token_ids = [eos]
    try:
        verdict, _ = target.verify(VerifyCall("eos", True, prompt, Proposal(), GREEDY, 16, lookup=8))
    finally:
        runner.eos_token_ids = saved
        target.release("eos")
    assert [verdict.token, *verdict.decoded] == want[: want.index(eos) + 1]


def test_copies_stay_within_the_context_and_the_steps(pair):
    _, target_dir = pair
    prompt = PROMPTS[1]
    want = one_at_a_time(TargetEngine(ModelRunner(target_dir)), "ref", GREEDY, 3, prompt)
    for lookup in (1, 2, 8):  # copies that fit, that must be cut, that would overrun
        target = TargetEngine(ModelRunner(target_dir, max_context=len(prompt) + 3))
        verdict, _ = target.verify(VerifyCall("ctx", True, prompt, Proposal(), GREEDY, 8, lookup=lookup))
        assert [verdict.token, *verdict.decoded] == want  # the prompt and 3 tokens fill the context
        assert len(target.runner.sessions.get("ctx").tokens) == len(prompt) + 3
    target = TargetEngine(ModelRunner(target_dir))
    for steps in (2, 3, 5):  # (with_lookup checks each call's tokens against its steps)
        copied = sum(with_lookup(target, f"s{steps}-{i}", p, 30, steps, lookup=8)[1] for i, p in enumerate(PROMPTS))
        assert copied > 0, steps


def test_a_call_with_steps_one_copies_nothing(target):
    verdict, cost = target.verify(VerifyCall("one", True, PROMPTS[1], Proposal(), GREEDY, 1, lookup=4))
    target.release("one")
    assert verdict.decoded == [] and verdict.copied == 0 and cost.batch_tokens == len(PROMPTS[1])


def next_p(model, context: list[int]) -> torch.Tensor:
    """The target's p(. | context), in float64."""
    with torch.inference_mode():
        return model(input_ids=torch.tensor([context])).logits[0, -1].softmax(-1).double()


def best_pair(model, eos, candidate):
    """Of candidate(u, v) -> (score, value) over the pairs of tokens that are not EOS, the value scoring
    highest (the first such pair)."""
    vocab = model.config.vocab_size
    pairs = [(u, v) for u in range(vocab) for v in range(vocab) if u not in eos and v not in eos]
    return max((candidate(u, v) for u, v in pairs), key=lambda scored: scored[0])[1]


def copy_prompt(model, eos) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """[3, 5, x, y, 3, 5], whose last 2-gram occurred at 0, so a call copies x, y, with x and y chosen
    so that the target neither surely accepts nor surely rejects them. -> (prompt, p(. | prompt),
    p(. | prompt + [x]))"""

    def candidate(x: int, y: int):
        prompt = [3, 5, x, y, 3, 5]
        first, second = next_p(model, prompt), next_p(model, prompt + [x])
        return float(min(first[x] * (1 - first[x]), second[y] * (1 - second[y]))), (prompt, first, second)

    return best_pair(model, eos, candidate)


@pytest.mark.parametrize("position", [0, 1])
def test_sampled_tokens_follow_the_target(small_vocab_pair, position):
    """The prompt ends in a 2-gram seen before, so the call's first pass copies x, y and verifies them
    with q one-hot. The call's first token must follow p(. | prompt) and, where it is the copied x, its
    second p(. | prompt + [x]): the accepted copy's path (chi-squared over seeds)."""
    _, target_dir = small_vocab_pair
    target = TargetEngine(ModelRunner(target_dir))
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompt, first, second = copy_prompt(model, set(target.runner.eos_token_ids))
    x = prompt[2]
    p = first if position == 0 else second
    seen, copied, calls = [], 0, 0
    for seed in range(1500):
        verdict, _ = target.verify(VerifyCall("s", True, prompt, Proposal(), SamplingParams(1.0, seed=seed), 3,
                                              lookup=2))
        target.release("s")
        got = [verdict.token, *verdict.decoded]
        copied, calls = copied + verdict.copied, calls + 1
        if position == 0:
            seen.append(got[0])
        elif got[0] == x and len(got) > 1:
            seen.append(got[1])
    assert 0 < copied < 2 * calls  # copies were accepted and rejected
    assert len(seen) >= 200, len(seen)
    counts = torch.bincount(torch.tensor(seen), minlength=p.shape[0]).double()
    assert fits(counts, p), chi2_stat(counts, p)


def test_sampled_copies_of_a_later_pass_follow_the_target(small_vocab_pair):
    """The prompt [3, a, y, z, 5, 3]: once the first pass has decoded a, the context ends in "3 a",
    seen at 0, so the second pass copies y, z and verifies them with q one-hot (the decode-on passes,
    not the first). Where the call's first token is a, its second must follow p(. | prompt + [a])
    (chi-squared over seeds), with a and y chosen so that a comes often and y is neither sure nor
    hopeless."""
    _, target_dir = small_vocab_pair
    target = TargetEngine(ModelRunner(target_dir))
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    vocab = model.config.vocab_size

    def candidate(a: int, y: int):
        if a in (3, 5):
            return -1.0, None
        prompt = [3, a, y, (y + 1) % vocab, 5, 3]
        second = next_p(model, prompt + [a])
        return min(float(next_p(model, prompt)[a]), float(second[y] * (1 - second[y]))), (prompt, second)

    prompt, second = best_pair(model, set(target.runner.eos_token_ids), candidate)
    a, y = prompt[1], prompt[2]
    seen, copied = [], 0
    for seed in range(2000):
        verdict, _ = target.verify(VerifyCall("s", True, prompt, Proposal(), SamplingParams(1.0, seed=seed), 4,
                                              lookup=2))
        target.release("s")
        got = [verdict.token, *verdict.decoded]
        if got[0] == a and len(got) > 1:
            seen.append(got[1])
            copied += got[1] == y
    assert len(seen) >= 300, len(seen)
    assert 0 < copied < len(seen)  # the copied y was kept and rejected
    counts = torch.bincount(torch.tensor(seen), minlength=second.shape[0]).double()
    assert fits(counts, second), chi2_stat(counts, second)


# a record whose keys and punctuation its schema fixes, written without free whitespace: much of it is forced
RECORD = Constraint("json_schema", json.dumps({
    "type": "object", "properties": {"name": {"enum": ["alpha", "beta"]}, "n": {"type": "integer", "minimum": 0,
                                                                            "maximum": 9}},
    "required": ["name", "n"], "additionalProperties": False, "x-guidance": {"whitespace_flexible": False}}))


def constrained(target: TargetEngine, session: str, prompt: list[int], steps: int, lookup: int,
                params: SamplingParams = GREEDY, rule: Constraint = RECORD, most: int = 0) -> tuple[list[int], int, int]:
    """The whole constrained output (or its first `most` tokens) in calls of `steps` tokens. ->
    (tokens, copied, passes: the runner's forward passes, counted where they run)"""
    tokens, copied, start, passes = [], 0, True, []
    runner = target.runner
    forward = runner.forward_capturing
    runner.forward_capturing = lambda *args: passes.append(1) or forward(*args)
    try:
        while (not tokens or tokens[-1] not in runner.eos_token_ids) and not (most and len(tokens) >= most):
            verdict, _ = target.verify(VerifyCall(session, start, prompt if start else [], Proposal(), params, steps,
                                                  constraint=rule.at(len(prompt)) if start else None,
                                                  lookup=lookup))
            tokens, copied, start = tokens + [verdict.token, *verdict.decoded], copied + verdict.copied, False
            assert len(tokens) < 64 + steps
    finally:
        runner.forward_capturing = forward
    target.release(session)
    return tokens, copied, len(passes)


def test_a_constrained_session_copies_what_its_grammar_forces(target):
    """Greedy: the tokens of decoding one a call, in fewer passes; a call that must not copy (lookup 0:
    a seeded request's replay) copies nothing."""
    tokenizer = target.runner.tokenizer
    for i, prompt in enumerate(PROMPTS):
        want, copied, passes = constrained(target, f"one{i}", prompt, steps=1, lookup=0)
        json.loads(tokenizer.decode(want[:-1]))  # (the record, then the EOS)
        assert copied == 0 and passes == len(want)
        got, copied, passes = constrained(target, f"ff{i}", prompt, steps=8, lookup=4)
        assert got == want and copied > 0 and passes == len(got) - copied < len(got)
        assert constrained(target, f"off{i}", prompt, steps=8, lookup=0)[:2] == (want, 0)


def test_where_nothing_is_forced_a_constrained_session_copies_the_context_as_far_as_allowed(target):
    """A constraint that forces nothing (free text, no newline): the calls copy from the context as
    unconstrained ones do, cut where the constraint forbids, and decode what one token a call does."""
    free = Constraint("regex", "[^\\n]{0,400}")
    copied = 0
    for i, prompt in enumerate(PROMPTS):
        want = constrained(target, f"one{i}", prompt, steps=1, lookup=0, rule=free, most=40)[0][:40]
        got, c, passes = constrained(target, f"copy{i}", prompt, steps=8, lookup=4, rule=free, most=40)
        assert got[:40] == want and passes == len(got) - c
        copied += c
    assert copied > 0


def test_sampled_tokens_after_forced_copies_follow_the_targets_masked_p(pair):
    """The constraint fixes a text, then allows a digit: the call's first pass copies the fixed text's
    tokens (each the one token its mask allows: llguidance allows a forced text's own tokens only)
    and samples the digit in the same pass, from p(. | prompt + text) renormalised over the digits
    (chi-squared over seeds): each copy's row and the row after them are masked."""
    _, target_dir = pair
    target = TargetEngine(ModelRunner(target_dir))
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    prompt, fixed = [5, 17, 42], Constraint("regex", "abcdef[0-9]")
    ruled = target.grammars.session(fixed.at(len(prompt)))
    ruled.follow(prompt)
    forced = ruled.forced(8)
    assert all(int(ruled.mask(prompt + forced[:i]).sum()) == 1 for i in range(len(forced)))
    allowed = ruled.mask(prompt + forced)
    p = next_p(model, prompt + forced)[: allowed.shape[0]] * allowed
    p /= p.sum()
    assert int(allowed.sum()) >= 10 and float(p.max()) < 0.5
    seen = []
    for seed in range(1500):
        verdict, _ = target.verify(VerifyCall("s", True, prompt, Proposal(), SamplingParams(1.0, seed=seed),
                                              len(forced) + 1, constraint=fixed.at(len(prompt)), lookup=1))
        target.release("s")
        got = [verdict.token, *verdict.decoded]
        assert got[: len(forced)] == forced and verdict.copied == len(forced)  # (in the one pass)
        seen.append(got[len(forced)])
    counts = torch.bincount(torch.tensor(seen), minlength=p.shape[0]).double()
    assert fits(counts, p), chi2_stat(counts, p)


def test_the_round_passes_lookup_and_counts_copies(pair):
    """generate() at K = 0 with lookup: the target's own tokens, fewer target passes, copies counted."""
    _, target_dir = pair
    runner = ModelRunner(target_dir)
    draft, target = LocalDraft(NgramDraft.load(target_dir)), LocalTarget(TargetEngine(runner))
    prompt = PROMPTS[0]
    want = one_at_a_time(TargetEngine(runner), "ref", GREEDY, 48, prompt)

    async def run(lookup: int) -> tuple[list[int], Stats]:
        stats, out = Stats(), []
        async for new in generate(draft, target, prompt, max_new_tokens=48, k=FixedK(0, 8), params=GREEDY,
                                  max_context=runner.max_context, stats=stats, lookup=lookup):
            out += new
        return out, stats

    plain, plain_stats = asyncio.run(run(0))
    copying, stats = asyncio.run(run(4))
    assert plain == copying == want
    assert plain_stats.copied_tokens == 0 and stats.copied_tokens > 0


# ----------------------------------------------------------------- over gRPC


def test_the_service_copies_over_grpc(stack):
    channel = grpc.insecure_channel(stack.target_addr)
    stub = pb_grpc.TargetStub(channel)
    greedy = pb.SamplingParams(temperature=0.0, top_p=1.0)
    prompt = PROMPTS[1]
    try:
        one = [stub.Verify(pb.VerifyRequest(session_id="g1", start=True, append=prompt, sampling=greedy)).token]
        while len(one) < 24:
            one.append(stub.Verify(pb.VerifyRequest(session_id="g1", sampling=greedy)).token)
        tokens, copied, start = [], 0, True
        while len(tokens) < 24:
            reply = stub.Verify(pb.VerifyRequest(session_id="g2", start=start, append=prompt if start else [],
                                                 sampling=greedy, decode_steps=8, lookup_tokens=4))
            tokens += [reply.token, *reply.decoded]
            copied, start = copied + reply.copied, False
        assert tokens[:24] == one and copied > 0
    finally:
        for session in ("g1", "g2"):
            stub.Release(pb.ReleaseRequest(session_id=session))
        channel.close()


def test_behind_the_coordinator_rounds_that_draft_nothing_copy(pair):
    """The coordinator's default --target-lookup: requests at K = 0 decode the target's own tokens
    and count the copies they kept; --target-lookup 0 copies nothing."""
    from coordinator.launch import LocalStack

    draft_dir, target_dir = pair
    reference = TargetEngine(ModelRunner(target_dir))
    eos = set(reference.runner.eos_token_ids)
    wants = []
    for i, prompt in enumerate(PROMPTS):
        want = one_at_a_time(reference, f"ref{i}", GREEDY, 40, prompt)
        ends = [n for n, token in enumerate(want) if token in eos]
        wants.append(want[: ends[0] + 1] if ends else want)
    for lookup in (None, 0):
        args = [] if lookup is None else ["--target-lookup", str(lookup)]
        copied = 0
        with LocalStack(draft_dir, target_dir, coordinator_args=args) as stack:
            channel = grpc.insecure_channel(stack.addr)
            client = pb_grpc.GenerationStub(channel)
            for prompt, want in zip(PROMPTS, wants):
                reply = client.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=40,
                                                           temperature=0.0, num_speculative_tokens=0))
                assert list(reply.token_ids) == want
                copied += reply.stats.copied_tokens
            channel.close()
        assert (copied > 0) == (lookup is None)
