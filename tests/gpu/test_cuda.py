"""specdec on a GPU in bfloat16 (make test-gpu; skipped without --device cuda): greedy output equals
transformers' within argmax ties, through the runner and through the three services over gRPC;
sampled output follows the target's distribution; a batched pass and a rolled-back session compute
what one session alone and a fresh prefill compute. bf16 rounds differently along different paths
(one row or several, a graph or eager), so where two greedy sequences part, the two tokens must
be tied in the reference's logits to within bf16's error, and nothing after that is compared."""

from __future__ import annotations

import asyncio

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from coordinator.launch import LocalStack
from model_service.engines import DraftEngine, TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.protocol import SamplingParams
from speculative.round import Stats, generate
from speculative.sampling import logits_to_probs
from speculative.tiny import make_model, make_pair, make_tokenizer
from tests.stats import fits

PROMPTS = [[3, 5, 4, 7], [11, 12, 13, 14, 15, 16], [40, 2, 40, 2, 40], [99, 1, 8]]
NEW = 48


def tied(logits: torch.Tensor, a: int, b: int) -> bool:
    """Whether tokens a and b are within bf16's error of each other in these float32 logits [V]."""
    return abs(float(logits[a] - logits[b])) <= 0.05 + 0.02 * float(logits.abs().max())


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu")
    return make_model(out / "target", make_tokenizer(out / "tok"), hidden=256, layers=4, heads=8, kv_heads=2,
                      max_context=1024, init_std=0.1)


def greedy(runner: ModelRunner, prompt: list[int], n: int) -> list[int]:
    session = runner.start_session(f"greedy-{len(runner.sessions)}-{prompt[0]}", 0)
    session.tokens.extend(prompt)
    out = []
    for _ in range(n):
        token = int(runner.forward(session)[-1, : runner.vocab_size].argmax())
        session.tokens.append(token)
        out.append(token)
    runner.sessions.release(session.id)
    return out


def check_within_ties(model, prompt: list[int], got: list[int], want: list[int]) -> int:
    """Tokens compared before the two sequences part (all of them where they do not); where they
    part, the tokens must be tied in `model`'s logits there."""
    for j, (a, b) in enumerate(zip(got, want)):
        if a != b:
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([prompt + want[:j]], device=model.device)).logits[0, -1].float()
            assert tied(logits, a, b), f"token {j}: {a} against {b}, logits {logits[a]:.3f} / {logits[b]:.3f}"
            return j
    return len(want)


def test_bf16_greedy_matches_transformers_within_ties(device, target_dir):
    runner = ModelRunner(target_dir, device, "bfloat16", cuda_graphs=True)
    assert runner.fast.graphs is not None and "CUDA graphs" in runner.forward_kind
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(device).eval()
    model.generation_config.eos_token_id = None  # (an end token is a token like any other here)
    compared = 0
    for prompt in PROMPTS:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt], device=device), max_new_tokens=NEW, do_sample=False)
        compared += check_within_ties(model, prompt, greedy(runner, prompt, NEW), out[0, len(prompt):].tolist())
    assert compared >= len(PROMPTS) * NEW // 2, compared
    assert runner.fast.graphs.captures >= 1


def test_the_three_services_on_the_gpu_give_the_targets_greedy_output(device, target_dir, tmp_path):
    out = tmp_path / "draft"
    draft_dir = make_model(out, make_tokenizer(tmp_path / "tok"), hidden=64, layers=2, heads=4, kv_heads=2,
                           max_context=1024, init_std=0.1, seed=7)
    runner = ModelRunner(target_dir, device, "bfloat16")  # eager: a third path beside the services' graphs
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.bfloat16).to(device).eval()
    on_gpu = ["--device", device, "--dtype", "bfloat16"]
    stack = LocalStack(draft_dir, target_dir, threads=None, draft_args=on_gpu, target_args=on_gpu).start(timeout=300)
    try:
        stub = pb_grpc.GenerationStub(grpc.insecure_channel(stack.addr))
        compared = 0
        for k in (4, 0):
            for prompt in PROMPTS:
                reply = stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=NEW,
                                                         temperature=0.0, num_speculative_tokens=k))
                compared += check_within_ties(model, prompt, list(reply.token_ids), greedy(runner, prompt, NEW))
        assert compared >= len(PROMPTS) * NEW, compared  # (of 2 x 4 x NEW; a reply ends at an end token)
    finally:
        stack.stop()
    assert "CUDA graphs" in stack.logs["target"].read_text()


def test_sampled_tokens_follow_the_bf16_targets_distribution(device, tmp_path):
    draft_dir, target_dir = make_pair(tmp_path, vocab="chars", init_std=0.3)
    draft = LocalDraft(DraftEngine(ModelRunner(draft_dir, device, "bfloat16", cuda_graphs=True)))
    target_runner = ModelRunner(target_dir, device, "bfloat16", cuda_graphs=True)
    target = LocalTarget(TargetEngine(target_runner))
    prompt, n = [3, 5, 4, 7], 1500
    params = SamplingParams(1.0)
    session = target_runner.start_session("p", 0)
    session.tokens.extend(prompt)
    p = logits_to_probs(target_runner.forward(session)[-1, : target_runner.vocab_size], params).double().cpu()
    target_runner.sessions.release("p")

    async def firsts() -> list[int]:
        out = []
        for i in range(n):
            rounds = generate(draft, target, prompt, max_new_tokens=2, k=3, params=SamplingParams(1.0, seed=i),
                              max_context=256, stats=Stats())
            out.append((await rounds.__anext__())[0])
            await rounds.aclose()  # (releases both sessions)
        return out

    counts = torch.bincount(torch.tensor(asyncio.run(firsts())), minlength=p.shape[0]).double()
    assert fits(counts, p)


def test_batched_and_rolled_back_passes_compute_what_one_fresh_pass_does(device, target_dir):
    runner = ModelRunner(target_dir, device, "bfloat16", cuda_graphs=True)
    sessions = [runner.start_session(f"b{i}", i) for i in range(4)]
    for i, session in enumerate(sessions):
        session.tokens.extend([(7 * i + j) % runner.vocab_size for j in range(5 + 9 * i)])
    batched = runner.forward_many([(s, 2) for s in sessions])
    for i, session in enumerate(sessions):
        alone = runner.start_session(f"a{i}", i)
        alone.tokens.extend(session.tokens)
        torch.testing.assert_close(batched[i], runner.forward(alone, 2), atol=0.1, rtol=0.05)
        # roll back 3 tokens and feed others: what a fresh prefill of the new sequence gives
        session.truncate(len(session.tokens) - 3)
        session.tokens.extend([1, 2])
        fresh = runner.start_session(f"f{i}", i)
        fresh.tokens.extend(session.tokens)
        torch.testing.assert_close(runner.forward(session, 2), runner.forward(fresh, 2), atol=0.1, rtol=0.05)
