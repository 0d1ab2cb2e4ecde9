"""--quantize int4: weight-only int4 on the lean forward (int4.quantize). The kernel computes
the product of the dequantized weights; a quantized service serves the int4 model exactly (greedy
output through the round is that model's own, sampled tokens follow its distribution)."""

from __future__ import annotations


import pytest
import torch

from model_service.engines import DraftEngine, TargetEngine
from model_service.fast_forward import FastForward
from model_service.int4 import int4_dequantized, int4_pack
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from speculative.protocol import SamplingParams
from tests import rounds
from tests.stats import chi2_stat, fits

PROMPT = [3, 5, 4, 7, 2, 9]


@pytest.mark.parametrize("out", [48, 100])  # 100: not a multiple of the kernel's 16 outputs
def test_the_kernel_computes_the_dequantized_product(out):
    torch.manual_seed(0)
    w, x = torch.randn(96, out), torch.randn(5, 96)  # w [in, out]
    packed = int4_pack(w, 32)
    y = FastForward._mm(x, torch.empty(0), packed)
    expected = x.bfloat16().float() @ int4_dequantized(w, 32)  # activations enter in bf16
    assert y.shape == (5, out) and y.dtype == torch.float32
    torch.testing.assert_close(y, expected, rtol=0, atol=2e-2 * expected.abs().max().item())
    # the groups hold the weights to within half a step: (max - min) / 30 of each group of 32
    groups = w.t().reshape(out, 3, 32)
    step = (groups.amax(-1) - groups.amin(-1)) / 15
    error = (int4_dequantized(w, 32) - w).t().reshape(out, 3, 32).abs().amax(-1)
    assert (error <= step * 0.5 + 2e-2 * w.abs().max()).all()  # (+ the bf16 rounding of scale and zero)


def test_quantize_drops_the_float_weights_and_reports_itself(pair):
    runner = ModelRunner(pair[1], "cpu", quantize="int4")
    assert runner.info()["quantization"].startswith("int4")
    assert all(layer["qkv"].numel() == 0 and layer["down"].numel() == 0 for layer in runner.fast.layers)
    assert runner.fast.lm_head.numel() == 0 and runner.fast.embed.numel() > 0
    assert ModelRunner(pair[1], "cpu").info()["quantization"] == "none"


def test_weight_bytes_count_what_a_pass_reads(pair):
    """fp32: every linear, norm and the output layer at 4 bytes a weight; int4: half a byte a weight
    plus a bf16 scale and zero per group of 32 (1/8 + 1/16 of fp32's bytes) for the linears."""
    float_runner, int4_runner = ModelRunner(pair[1], "cpu"), ModelRunner(pair[1], "cpu", quantize="int4")
    model = float_runner.model
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))  # + the head
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    hidden = model.config.hidden_size
    assert float_runner.fast.weight_bytes() == 4 * (linears + norms + hidden)
    padded = sum(-(-w.numel() // (16 * w.shape[-1])) * 16 * w.shape[-1]  # outputs padded to 16
                 for m in model.modules() if isinstance(m, torch.nn.Linear) for w in [m.weight])
    assert int4_runner.fast.weight_bytes() == pytest.approx(padded * (0.5 + 4 / 32) + 4 * (norms + hidden), rel=0.05)


def test_quantize_refuses_what_it_cannot_run(pair):
    with pytest.raises(ValueError, match="lean forward"):
        ModelRunner(pair[1], "cpu", forward="transformers", quantize="int4")
    with pytest.raises(ValueError, match="--quantize must be one of"):
        ModelRunner(pair[1], "cpu", quantize="int3")


def run(draft, target, params, k, seed, n, prompt=PROMPT):
    return rounds.run(draft, target, params, k, seed, n, prompt)


def test_greedy_through_the_round_is_the_int4_targets_own(pair):
    draft_dir, target_dir = pair
    target = LocalTarget(TargetEngine(ModelRunner(target_dir, "cpu", quantize="int4")))
    alone, _ = run(LocalDraft(DraftEngine(ModelRunner(draft_dir, "cpu"))), target, SamplingParams(0.0), 0, 0, 40)
    for draft_quantize in ("int4", "none"):
        draft = LocalDraft(DraftEngine(ModelRunner(draft_dir, "cpu", quantize=draft_quantize)))
        out, stats = run(draft, target, SamplingParams(0.0), 4, 1, 40)
        assert out == alone and stats.draft_tokens > 0


def test_sampled_tokens_follow_the_int4_targets_distribution(small_vocab_pair):
    draft_dir, target_dir = small_vocab_pair
    target_runner = ModelRunner(target_dir, "cpu", quantize="int4")
    session = target_runner.start_session("p", 0)
    session.tokens.extend(PROMPT)
    p = target_runner.forward(session, 1)[0].softmax(-1).double()  # the int4 model's own p
    target_runner.sessions.release("p")
    draft = LocalDraft(DraftEngine(ModelRunner(draft_dir, "cpu", quantize="int4")))
    target = LocalTarget(TargetEngine(target_runner))
    firsts, proposed = [], 0
    for seed in range(800):  # 800 first tokens over 12 ids: chi-squared against p (tests/stats.py)
        out, stats = run(draft, target, SamplingParams(1.0), 2, seed, 2)
        firsts.append(out[0])
        proposed += stats.draft_tokens
    counts = torch.bincount(torch.tensor(firsts), minlength=p.shape[0]).double()
    assert proposed > 0
    assert fits(counts, p), chi2_stat(counts, p)


@pytest.mark.parametrize("arch, linear, fused", [("phi3", "self_attn.qkv_proj", "qkv"),
                                                  ("granite", "self_attn.o_proj", "o")])
def test_q4_1_blocks_follow_what_the_lean_forward_made_of_the_weights(tmp_path, arch, linear, fused):
    """A GGUF's Q4_1 blocks run as shipped (int4.quantize) where the lean forward keeps a linear's
    float weights otherwise than the checkpoint: phi3 whose RoPE rotates part of each head (Phi-4-mini),
    q's and k's rows in head_order; granite, o_proj times the residual multiplier (fold_multipliers).
    The product from the blocks is then the float weights' (their blocks decoded) to within the
    activations' int8 rounding."""
    from transformers import AutoModelForCausalLM

    from model_service.int4 import quantize
    from speculative.tiny import make_model, make_tokenizer

    model_dir = make_model(tmp_path / "m", make_tokenizer(tmp_path / "t"), arch=arch, hidden=128, layers=2,
                           heads=2, kv_heads=1, max_context=64)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.rope_parameters["partial_rotary_factor"] = 0.75 if arch == "phi3" else 1.0  # 48 of 64
    model.config.update({"residual_multiplier": 0.22, "embedding_multiplier": 12.0} if arch == "granite" else {})
    g = torch.Generator().manual_seed(0)
    blocks = {}
    for i, layer in enumerate(model.model.layers):
        weight = layer.get_submodule(linear).weight  # [out, in]
        out, inp = weight.shape
        q = torch.randint(0, 16, (out, inp), generator=g)
        d = (0.01 + 0.02 * torch.rand(out, inp // 32, generator=g)).half().float()
        m = (-8 * d + 0.01 * torch.randn(out, inp // 32, generator=g)).half().float()
        blocks[f"model.layers.{i}.{linear}.weight"] = (q, d, m)
        weight.data = (q.float().view(out, -1, 32) * d[..., None] + m[..., None]).view(out, inp)
    model.save_pretrained(model_dir)
    floats = FastForward.build(AutoModelForCausalLM.from_pretrained(model_dir).eval(), 64)
    shipped = FastForward.build(AutoModelForCausalLM.from_pretrained(model_dir).eval(), 64)
    assert (floats.head_order is not None) == (arch == "phi3") and bool(floats.folded) == (arch == "granite")
    assert quantize(shipped, 32, blocks) == 2  # the linear, each layer
    x = torch.randn(5, 128, generator=g)
    for ours, theirs in zip(shipped.layers, floats.layers):
        y, expected = FastForward._mm(x, torch.empty(0), ours[f"{fused}_packed"]), x @ theirs[fused]
        assert (y - expected).norm() < 0.02 * expected.norm(), (y - expected).norm() / expected.norm()
