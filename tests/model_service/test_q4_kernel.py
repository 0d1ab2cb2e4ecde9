"""specdec's int4 CPU kernel (model_service/q4_kernel.py, csrc/q4_mm.cpp): it computes what its
reference computes (int8 activation blocks against 4-bit weights in GGUF Q4_1's form), a row's
result does not depend on the rows or threads beside it, the layout round-trips, bad shapes get a
clear error, and where it cannot be built int4 keeps torch's kernel."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import time

import pytest
import torch

from model_service import q4_kernel
from model_service.int4 import q4_groups

pytestmark = pytest.mark.skipif(not q4_kernel.available(), reason="specdec's int4 kernel is not built here")


def weights(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (n, k), generator=g)
    d = (torch.rand(n, k // 32, generator=g) * 0.02).half()
    m = (-torch.rand(n, k // 32, generator=g) * 0.15).half()
    return q, d, m


@pytest.mark.parametrize("n, k", [(16, 32), (40, 96), (960, 576), (100, 1536), (7, 64)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 9, 10, 17, 33])  # tiles of 1, 2, 3, 5, 8, 9, 5 + 5, 9 + 8, 9 x 3 + 6
# (AVX2, tiles of up to 6 rows: ..., 4 + 4, 5 + 4, 5 + 5, 6 + 6 + 5, 6 x 5 + 3)
def test_the_kernel_computes_its_reference(n, k, rows):
    q, d, m = weights(n, k)
    tiles = q4_kernel.tile(q, d, m)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(1)) * 3
    x[0, :32] = 0  # a block of zeros: scale 0, only its m term
    y = torch.ops.specdec.q4_mm(x, tiles, n)
    expected = q4_kernel.reference_mm(x, tiles, n).double()
    assert y.shape == (rows, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    # and the reference is the product with the dequantized weights, to within int8 activations
    full = x.double() @ q4_kernel.dequantized(tiles, k, n).double()
    assert (y.double() - full).abs().max() <= 0.02 * full.abs().max() + 1e-9


def test_float32_pairs_can_be_set():
    before = torch.ops.specdec.f32_pairs(-1)
    try:
        avx512 = q4_kernel.path().startswith("avx512")
        assert torch.ops.specdec.f32_pairs(1) is avx512  # only AVX-512 builds have pairs
        assert torch.ops.specdec.f32_pairs(-1) is avx512
        assert torch.ops.specdec.f32_pairs(0) is False
    finally:
        torch.ops.specdec.f32_pairs(int(before))


@pytest.mark.parametrize("weights_kind, pairs", [("int4", -1), ("float32", 1), ("float32", 0)],
                         ids=["int4", "float32 panel pairs", "float32 one panel at a time"])
def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads(weights_kind, pairs):
    """Bit for bit, for int4 tiles and float32 panels alike: a verify pass scores each of its
    tokens as a one-token pass would, whatever rows share its call and however many threads. Both
    ways an AVX-512 build takes the panels of a call of a few rows (f32_pairs: the CPU's vendor picks
    one) are tested, whichever this machine would pick."""
    before = torch.ops.specdec.f32_pairs(-1)
    torch.ops.specdec.f32_pairs(pairs)
    try:
        rows_do_not_depend_on_their_batch(weights_kind)
    finally:
        torch.ops.specdec.f32_pairs(int(before))


def rows_do_not_depend_on_their_batch(weights_kind: str) -> None:
    g = torch.Generator().manual_seed(4)
    if weights_kind == "int4":
        packed, mm = q4_kernel.tile(*weights(1000, 576)), torch.ops.specdec.q4_mm
    else:
        packed, mm = q4_kernel.panel(torch.randn(576, 1000, generator=g)).tiles, torch.ops.specdec.f32_mm
    x = torch.randn(29, 576, generator=g)
    together = mm(x, packed, 1000)  # 29 rows: one panel at a time, either way
    for i in range(29):
        assert torch.equal(mm(x[i:i + 1], packed, 1000)[0], together[i]), i
    for a, b in [(3, 9), (0, 12), (5, 18)]:
        assert torch.equal(mm(x[a:b], packed, 1000), together[a:b])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(mm(x, packed, 1000), together)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("n, k", [(16, 32), (40, 97), (960, 576), (100, 1536), (7, 5)])
@pytest.mark.parametrize("rows", [1, 5, 8, 13, 17, 30])
def test_float32_panels_compute_the_product(n, k, rows):
    """f32_mm (float32 weights in panels of 16 outputs) computes x @ w: odd inputs (the AVX-512
    path's two chains leave one input over), outputs short of a panel, row groups of 1..12."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(k, n, generator=g) * 0.05
    x = torch.randn(rows, k, generator=g) * 3
    panels = q4_kernel.panel(w)
    assert panels.out == n and panels.tiles.shape == (-(-n // 16), k * 16)
    assert torch.equal(q4_kernel.unpanel(panels.tiles, n), w)
    y = torch.ops.specdec.f32_mm(x, panels.tiles, n)
    expected = x.double() @ w.double()
    assert y.shape == (rows, n) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), expected, rtol=0, atol=1e-5 * expected.abs().max().item())
    torch.testing.assert_close(q4_kernel.reference_f32_mm(x, panels.tiles, n).double(), expected)


def test_other_dtypes_come_back_in_their_own():
    q, d, m = weights(32, 64)
    tiles = q4_kernel.tile(q, d, m)
    x = torch.randn(3, 64)
    y = torch.ops.specdec.q4_mm(x.bfloat16(), tiles, 32)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.float(), torch.ops.specdec.q4_mm(x.bfloat16().float(), tiles, 32).bfloat16().float())


def test_the_layout_round_trips():
    q, d, m = weights(37, 96)
    tiles = q4_kernel.tile(q, d, m)
    assert tiles.shape == (3, 3 * 320) and tiles.dtype == torch.uint8
    back = q4_kernel.untile(tiles, 96, 37)
    assert torch.equal(back[0], q.to(torch.uint8)) and torch.equal(back[1], d) and torch.equal(back[2], m)
    w = q4_kernel.dequantized(tiles, 96, 37)  # [in, out]
    expected = (q.reshape(37, 3, 32).float() * d.float()[..., None] + m.float()[..., None]).reshape(37, 96).t()
    assert torch.equal(w, expected)


def test_groups_from_float_weights_hold_them_to_half_a_step():
    w = torch.randn(96, 48) * 0.05  # [in, out]
    w[:32, 0] = 0.25  # a constant group: d = 0, every q 0, w = m
    q, d, m = q4_groups(w)
    assert q.dtype == torch.uint8 and q.max() <= 15 and d.dtype == m.dtype == torch.float16
    approx = q4_kernel.dequantized(q4_kernel.tile(q, d, m), 96, 48)
    step = d.float().repeat_interleave(32, dim=1).t()  # [in, out]
    assert ((approx - w).abs() <= step / 2 + 1e-3 * w.abs().max()).all()  # (+ float16 rounding of d and m)
    assert approx[:32, 0].eq(torch.tensor(0.25).half().float()).all()


@pytest.mark.parametrize("x, tiles, n, message", [
    (torch.zeros(2, 48), torch.zeros(1, 320, dtype=torch.uint8), 16, "multiple of 32"),
    (torch.zeros(2, 0), torch.zeros(1, 0, dtype=torch.uint8), 16, "positive multiple of 32"),
    (torch.zeros(2, 64), torch.zeros(1, 320, dtype=torch.uint8), 16, "need"),
    (torch.zeros(2, 32), torch.zeros(1, 320, dtype=torch.uint8), 40, "need"),
    (torch.zeros(2, 32), torch.zeros(1, 320), 16, "uint8"),
    (torch.zeros(32), torch.zeros(1, 320, dtype=torch.uint8), 16, "rows, in"),
])
def test_bad_shapes_get_a_clear_error(x, tiles, n, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.specdec.q4_mm(x, tiles, n)


@pytest.mark.parametrize("x, panels, n, message", [
    (torch.zeros(2, 48), torch.zeros(1, 32 * 16), 16, "need"),
    (torch.zeros(2, 32), torch.zeros(1, 32 * 16), 40, "need"),
    (torch.zeros(2, 32), torch.zeros(1, 32 * 16, dtype=torch.uint8), 16, "float32"),
    (torch.zeros(32), torch.zeros(1, 32 * 16), 16, "rows, in"),
    (torch.zeros(2, 0), torch.zeros(1, 0), 16, "positive"),
])
def test_bad_float32_shapes_get_a_clear_error(x, panels, n, message):
    with pytest.raises(RuntimeError, match=message):
        torch.ops.specdec.f32_mm(x, panels, n)


@pytest.mark.slow  # ~11 s: a process of its own without a compiler
def test_without_a_compiler_int4_keeps_torchs_kernel(tmp_path):
    """No compiler: load() says why, the op's name still resolves (to the reference) for
    TorchScript, auto picks torch's kernel and says so, asking for specdec's is refused."""
    code = """
import warnings, torch
from model_service import q4_kernel
assert not q4_kernel.load()
print(q4_kernel.path())
from model_service.int4 import q4_groups
q, d, m = q4_groups(torch.randn(64, 16))
t = q4_kernel.tile(q, d, m)
assert torch.ops.specdec.q4_mm(torch.randn(2, 64), t, 16).shape == (2, 16)
from model_service import scripted
assert scripted.LAYERS is not None
from model_service.fast_forward import FastForward
from speculative.tiny import make_model, make_tokenizer
import tempfile, pathlib
from model_service.model_runner import ModelRunner
out = pathlib.Path(tempfile.mkdtemp())
model = make_model(out / "m", make_tokenizer(out / "t"), hidden=64, layers=1, heads=2, kv_heads=1, intermediate=96,
                   vocab_size=None, max_context=64)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    runner = ModelRunner(model, "cpu", quantize="int4")
assert runner.fast.int4_kernel == "torch" and any("runs on torch's" in str(w.message) for w in caught)
try:
    ModelRunner(model, "cpu", quantize="int4", int4_kernel="specdec")
    raise SystemExit("specdec's kernel was not refused")
except ValueError as error:
    assert "not built" in str(error), error
"""
    env = dict(os.environ, CXX=str(tmp_path / "no-compiler"), SPECDEC_EXTENSIONS=str(tmp_path / "ext"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("not built:"), done.stdout


# qwen2: q/k/v biases; qwen3: each q and k head's RMSNorm before RoPE; phi3: its fused checkpoint linears, and
# head_dim 96 as Phi-3-mini's (phi3+partial: RoPE over 72 of them, as Phi-4-mini's 96 of 128); granite: its
# multipliers in the weights; head_dim 32 (attention a key at a time), 64 and 128 (8 keys at a time; AVX-512
# float32 caches 16)
@pytest.mark.parametrize("arch, hidden, heads, kv_heads",
                         [("llama", 128, 4, 2), ("qwen2", 128, 4, 2), ("llama", 256, 4, 2), ("qwen2", 256, 2, 1),
                          ("qwen3", 128, 4, 2), ("phi3", 192, 2, 1), ("phi3+partial", 192, 2, 1),
                          ("granite", 128, 4, 2), ("smollm3", 128, 4, 2)])
def test_the_c_layer_loop_computes_what_the_torchscript_loop_does(tmp_path, arch, hidden, heads, kv_heads):
    """One sequence's pass through q4_layers (the C++ loop) against TorchScript's loop over the same
    int4 products: a prompt (keeping 2 rows' logits), decode steps, a verify pass of 4, over the
    lean forward's pooled KV cache. Their float sums (norms, attention) differ in order, and with
    int8 activations a last-bit difference can flip a rounding that later layers carry: scaling
    the embedding by 1 + 1e-6 moves TorchScript's own logits by ~2% (relative L2) on this model.
    So: within 8% of each other, where a wrong step (a dropped bias, a wrong head) is off by
    ~100%, and the same greedy token in all but at most one of the 9 rows. The prompt's 101 positions
    span two of the attention's key blocks (64 keys at head_dim 64, 32 at 128) and give its 8- and
    16-key steps a tail."""
    from transformers import AutoModelForCausalLM

    from model_service.model_runner import ModelRunner
    from speculative.tiny import make_model, make_tokenizer

    arch, _, partial = arch.partition("+")
    model = make_model(tmp_path / "m", make_tokenizer(tmp_path / "t"), arch=arch, hidden=hidden, layers=3, heads=heads,
                       kv_heads=kv_heads, intermediate=160, max_context=128)
    loaded = AutoModelForCausalLM.from_pretrained(model)
    if partial:
        loaded.config.rope_parameters["partial_rotary_factor"] = 0.75
    if arch == "granite":  # Granite 3.3's multipliers (the attention's for head_dim 32)
        loaded.config.update({"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.18,
                              "logits_scaling": 8.0})
    g = torch.Generator().manual_seed(0)
    for layer in loaded.model.layers:  # peaked attention: a wrong score shows
        if arch == "phi3":  # one qkv_proj: q's and k's rows, then v's
            layer.self_attn.qkv_proj.weight.data[: -kv_heads * (hidden // heads)] *= 8
        else:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                proj.weight.data *= 8
        if arch == "qwen2":  # its biases start at zero: give them weight
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.data = torch.randn(proj.bias.shape, generator=g) * 0.5
    loaded.save_pretrained(model)
    fast = ModelRunner(model, "cpu", quantize="int4", int4_kernel="specdec", kv_dtype="float32").fast  # (TorchScript's)
    assert fast._runs_q4_layers() and (fast.head_order is not None) == bool(partial)
    feeds = [(list(range(3, 104)), 2), ([141], 1), ([142], 1), ([143, 144, 145, 146], 4), ([150], 1)]
    logits = {}
    for fused in (True, False):
        fast.fused_layers = fused
        cache = fast.new_cache()
        logits[fused] = torch.cat([fast(ids, cache, n) for ids, n in feeds])
        assert cache.length == sum(len(ids) for ids, _ in feeds)
    c_loop, scripted_loop = logits[True], logits[False]
    assert c_loop.shape == (9, scripted_loop.shape[1])
    assert (c_loop - scripted_loop).norm() < 0.08 * scripted_loop.norm()
    assert (c_loop.argmax(-1) == scripted_loop.argmax(-1)).sum() >= 8
    torch_kernel = ModelRunner(model, "cpu", quantize="int4", int4_kernel="torch").fast
    assert not torch_kernel._runs_q4_layers()


@pytest.mark.slow  # builds the kernel once more (~15 s)
def test_a_compiler_without_openmp_builds_the_one_thread_kernel(tmp_path):
    """Where the compiler refuses -fopenmp, load() builds the kernel without it: it runs (one thread),
    computes what the reference does, and threaded() says so."""
    compiler = tmp_path / "g++"
    compiler.write_text('#!/bin/sh\nfor a in "$@"; do [ "$a" = "-fopenmp" ] && { echo "no OpenMP here" >&2; exit 1; }; done\n'
                        'exec g++ "$@"\n')
    compiler.chmod(0o755)
    code = """
import torch
from model_service import q4_kernel
assert q4_kernel.load(), q4_kernel.path()
assert not q4_kernel.threaded()
from model_service.int4 import q4_groups
q, d, m = q4_groups(torch.randn(96, 40))
t = q4_kernel.tile(q, d, m)
x = torch.randn(9, 96)
assert torch.allclose(torch.ops.specdec.q4_mm(x, t, 40), q4_kernel.reference_mm(x, t, 40), rtol=1e-4, atol=1e-4)
print("ok", q4_kernel.path())
"""
    env = dict(os.environ, CXX=str(compiler), SPECDEC_EXTENSIONS=str(tmp_path / "ext"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().startswith("ok"), done.stdout


def _c_loop_model(tmp_path, weights: str, kv_dtype: str = "float32"):
    """A 3-layer llama through the C++ layer loop: int4 tiles or float32 panels; its keys and values
    in kv_dtype (float32: as TorchScript's loop, which the tests compare it with, reads them)."""
    from model_service.model_runner import ModelRunner
    from speculative.tiny import make_model, make_tokenizer

    model = make_model(tmp_path / "m", make_tokenizer(tmp_path / "t"), arch="llama", hidden=256, layers=3, heads=4,
                       kv_heads=2, intermediate=160, max_context=128)
    if weights == "int4":
        fast = ModelRunner(model, "cpu", quantize="int4", int4_kernel="specdec", kv_dtype=kv_dtype).fast
    else:
        fast = ModelRunner(model, "cpu", float_kernel="specdec", kv_dtype=kv_dtype).fast
    assert fast._runs_q4_layers() and fast.new_cache().data.dtype == getattr(torch, kv_dtype)
    return fast


@pytest.mark.parametrize("weights", ["int4", "float32"])
@pytest.mark.parametrize("pooled", [False, True])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_the_c_layer_loop_runs_several_sequences_each_as_alone(tmp_path, pooled, weights, kv_dtype):
    """A pass over several sessions (a batched verify: each its own cache and positions, its own
    rows kept) runs every linear once over all their rows; each row's logits are bit for bit those
    of its session's pass alone (the kernel computes a row by the same operations whatever it is
    batched with), over caches of their own or slots of one pool, float32 or float16; and within
    TorchScript's batched loop's rounding of the same products (int4 tiles; float32 panels, to 1e-4;
    float32 caches, the ones it reads)."""
    fast = _c_loop_model(tmp_path, weights, kv_dtype)
    if not pooled:
        fast.pool_capacity = 0
    prompts = [list(range(3, 90)), list(range(50, 61)), list(range(7, 24))]  # the first spans two key blocks
    steps = [([41, 42, 43, 44], 4), ([62], 1), ([25, 26, 27, 28, 29], 2)]  # (ids, logits kept)

    def run(together: bool) -> list[torch.Tensor]:
        caches = [fast.new_cache() for _ in prompts]
        assert all(c.pooled == pooled for c in caches)
        if together:
            fast.many([(p, c, 1) for p, c in zip(prompts, caches)])
            return fast.many([(ids, c, n) for (ids, n), c in zip(steps, caches)])
        for p, c in zip(prompts, caches):
            fast(p, c, 1)
        return [fast(ids, c, n) for (ids, n), c in zip(steps, caches)]

    alone, together = run(False), run(True)
    for a, b, (_, n) in zip(alone, together, steps):
        assert a.shape == b.shape == (n, a.shape[1])
        assert torch.equal(a, b)
    if kv_dtype != "float32":
        return
    fast.fused_layers = False  # TorchScript's batched loop over the same products
    scripted_loop = run(True)
    for a, b in zip(together, scripted_loop):
        assert (a - b).norm() < (0.08 if weights == "int4" else 1e-4) * b.norm()


@pytest.mark.parametrize("weights", ["int4", "float32"])
@pytest.mark.parametrize("kv_dtype", ["float32", "float16"])
def test_a_verify_pass_scores_each_token_as_a_decode_step_does(tmp_path, weights, kv_dtype):
    """Through the C++ loop a pass over K + 1 tokens gives each token's logits bit for bit as K + 1
    one-token passes do (and the same cache): the target's verify is its own decode, so greedy
    speculation cannot part from the target alone over a near tie. TorchScript's loop, whose
    products and attention change with the rows, need not (it is shown to differ here, so the
    check can fail). The prompt's 97 positions put the verified rows in the attention's second block of
    keys (64 at this head_dim 64), each row seeing a different number of them. With float16 keys and
    values too (each row's stored before any row reads them)."""
    fast = _c_loop_model(tmp_path, weights, kv_dtype)
    prompt, verify = list(range(3, 100)), [141, 142, 143, 144, 145]

    def passes(one_call: bool) -> tuple[torch.Tensor, torch.Tensor]:
        cache = fast.new_cache()
        fast(prompt, cache, 1)
        if one_call:
            logits = fast(verify, cache, len(verify))
        else:
            logits = torch.cat([fast([token], cache, 1) for token in verify])
        return logits, cache.data[..., :cache.length, :].clone()

    (together, cached), (alone, cached_alone) = passes(True), passes(False)
    assert together.shape == alone.shape == (len(verify), together.shape[1])
    assert torch.equal(together, alone) and torch.equal(cached, cached_alone)
    if kv_dtype != "float32":
        return
    fast.fused_layers = False
    (together, _), (alone, _) = passes(True), passes(False)
    assert not torch.equal(together, alone)
    torch.testing.assert_close(together, alone, atol=1e-4 if weights == "float32" else 0.5, rtol=0.05)


def test_float16_keys_and_values_are_the_float32_ones_rounded(tmp_path):
    """--kv-dtype float16 (the C++ loop's caches): each key and value is stored rounded to nearest
    even (layer 0's, whose inputs are the embeddings alone, equal the float32 run's .half() bit for
    bit) and read back as floats; over float32 panels the logits then stay within float16's rounding
    of the float32 caches' (relative L2 ~1e-4 here; a key read as the wrong half or a misplaced
    position is off by ~100%) and differ from them (so the rounding is real). auto picks float16 for
    int4 weights through specdec's kernel and float32 for float32 weights; a forward that cannot read
    float16 caches (TorchScript's loop, torch's int4 kernel) refuses them."""
    from model_service.model_runner import ModelRunner, kv_dtype_for

    prompt, steps = list(range(3, 100)), [[141], [142, 143, 144, 145, 146]]
    runs = {}
    for kv in ("float32", "float16"):
        fast = _c_loop_model(tmp_path / kv, "float32", kv)
        cache = fast.new_cache()
        logits = [fast(prompt, cache, 3)] + [fast(ids, cache, len(ids)) for ids in steps]
        runs[kv] = torch.cat(logits), cache.data[..., : cache.length, :].clone()
    (full, full_cache), (half, half_cache) = runs["float32"], runs["float16"]
    assert half_cache.dtype == torch.float16 and half_cache.shape == full_cache.shape
    assert torch.equal(half_cache[0], full_cache[0].half())
    assert not torch.equal(half, full)
    assert (half - full).norm() < 2e-3 * full.norm()
    assert torch.equal(half.argmax(-1), full.argmax(-1))

    int4 = _c_loop_model(tmp_path / "int4", "int4")
    assert kv_dtype_for(int4, "auto") == torch.float16
    assert kv_dtype_for(_c_loop_model(tmp_path / "f32", "float32"), "auto") == torch.float32
    model = tmp_path / "float32" / "m"
    torch_kernel = ModelRunner(model, "cpu", quantize="int4", int4_kernel="torch")
    assert torch_kernel.kv_dtype == torch.float32 and not torch_kernel.fast._runs_q4_layers()
    # ModelInfo.kv_dtype, on which a target pool's replicas must agree
    assert torch_kernel.info()["kv_dtype"] == "float32"
    assert ModelRunner(model, "cpu", quantize="int4", int4_kernel="specdec").info()["kv_dtype"] == "float16"
    with pytest.raises(ValueError, match="C\\+\\+ layer loop"):
        ModelRunner(model, "cpu", quantize="int4", int4_kernel="torch", kv_dtype="float16")
    with pytest.raises(ValueError, match="kv-dtype"):
        ModelRunner(model, "cpu", kv_dtype="float8")


def test_the_c_layer_loop_refuses_what_it_cannot_run():
    x = torch.zeros(1, 64)
    kv = torch.zeros(1, 2, 1, 2, 8, 32)
    tiles = [torch.zeros(1, 2 * 320, dtype=torch.uint8)] * 4
    with pytest.raises(RuntimeError, match="cache holds 8 positions"):
        torch.ops.specdec.q4_layers(x, torch.zeros(1, 32), torch.zeros(1, 32), [kv], [8], [1], [1], 2, 2, 32, 1e-5, [1.0],
                                    [torch.ones(64)], [torch.ones(64)], [64], [None], tiles, [128, 64, 128, 64])
    with pytest.raises(RuntimeError, match="start >= 0, length > 0, 0 <= keep <= length"):
        torch.ops.specdec.q4_layers(x, torch.zeros(1, 32), torch.zeros(1, 32), [kv], [-1], [1], [1], 2, 2, 32, 1e-5, [1.0],
                                    [torch.ones(64)], [torch.ones(64)], [64], [None], tiles, [128, 64, 128, 64])
    with pytest.raises(RuntimeError, match="0 <= keep <= length"):
        torch.ops.specdec.q4_layers(x, torch.zeros(1, 32), torch.zeros(1, 32), [kv], [0], [1], [2], 2, 2, 32, 1e-5, [1.0],
                                    [torch.ones(64)], [torch.ones(64)], [64], [None], tiles, [128, 64, 128, 64])
    with pytest.raises(RuntimeError, match="norms must have 64"):
        torch.ops.specdec.q4_layers(x, torch.zeros(1, 32), torch.zeros(1, 32), [kv], [0], [1], [1], 2, 2, 32, 1e-5, [1.0],
                                    [torch.ones(32)], [torch.ones(64)], [64], [None], tiles, [128, 64, 128, 64])
    with pytest.raises(RuntimeError, match="bias must have 192"):  # q/k/v: (2 + 2 + 2) x 32 outputs
        torch.ops.specdec.q4_layers(x, torch.zeros(1, 32), torch.zeros(1, 32), [kv], [0], [1], [1], 2, 2, 32, 1e-5, [1.0],
                                    [torch.ones(64)], [torch.ones(64)], [64], [torch.zeros(5)],
                                    [torch.zeros(12, 2 * 320, dtype=torch.uint8), *tiles[1:]], [192, 64, 128, 64])
    with pytest.raises(RuntimeError, match="one cache, start, length and keep per sequence"):
        torch.ops.specdec.q4_layers(x, torch.zeros(1, 32), torch.zeros(1, 32), [kv], [0, 0], [1], [0], 2, 2, 32, 1e-5, [1.0],
                                    [torch.ones(64)], [torch.ones(64)], [64], [None], tiles, [128, 64, 128, 64])
    with pytest.raises(RuntimeError, match="exceed x's 1 rows"):
        torch.ops.specdec.q4_layers(x, torch.zeros(1, 32), torch.zeros(1, 32), [kv, kv], [0, 2], [1, 1], [1, 1], 2, 2, 32,
                                    1e-5, [1.0], [torch.ones(64)], [torch.ones(64)], [64], [None], tiles,
                                    [128, 64, 128, 64])
    with pytest.raises(RuntimeError, match="per-layer lists"):
        torch.ops.specdec.q4_layers(x, torch.zeros(1, 32), torch.zeros(1, 32), [kv], [0], [1], [1], 2, 2, 32, 1e-5, [1.0, 1.0],
                                    [torch.ones(64)], [torch.ones(64)], [64], [None], tiles, [128, 64, 128, 64])


def _cpu_flags() -> set[str]:
    for line in open("/proc/cpuinfo"):
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def expected_build(extra: str) -> str:
    """The path the kernel takes here built with `extra` flags (instruction sets turned off)."""
    flags = _cpu_flags()
    if "-mno-avx512f" not in extra and {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        return "avx512"
    if "-mno-avx2" not in extra and {"avx2", "fma", "f16c"} <= flags:
        return "avx2"
    return "scalar"


def test_the_kernels_avx2_build_compiles():
    """The AVX2 build compiles and loads wherever this machine's does: a change that misses one #if branch
    of csrc/q4_mm.cpp (a call left with another signature) breaks only the machines of that kind (an
    AVX-512 machine builds it here once, ~20 s, kept beside its own build; the slow test below builds
    the plain C++ one too and runs their checks)."""
    if not q4_kernel.available():
        pytest.skip(f"specdec's kernel is not built here: {q4_kernel.path()}")
    for extra in ("-mno-avx512f",):
        env = dict(os.environ, SPECDEC_Q4_CFLAGS=extra)
        done = subprocess.run([sys.executable, "-c", "from model_service import q4_kernel\n"
                               "assert q4_kernel.load(), q4_kernel.path()\nprint(q4_kernel.path())"],
                              env=env, capture_output=True, text=True, timeout=600,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
        assert done.returncode == 0, done.stderr[-3000:]
        assert done.stdout.strip() == expected_build(extra), done.stdout


@pytest.mark.slow  # builds the kernel three times more (~10 s each)
@pytest.mark.parametrize("extra", ["-mno-avx512vnni", "-mno-avx512f", "-mno-avx512f -mno-avx2 -mno-fma -mno-f16c"])
def test_every_path_of_the_kernel_computes_the_same(tmp_path, extra):
    """The kernel's other paths, built here with the wider instruction sets turned off (AVX-512
    without VNNI; AVX2; plain C++), pass the same checks as the one this machine builds by default
    (int4 and float32 products, the layer loop, an EAGLE head's fused step and one-call draft, a
    sampled draft token's q, the target's sampled p and a draw from it, a sliding window's attention):
    machines of this kind differ (some have AVX2 only, some AVX-512 without VNNI)."""
    expected = expected_build(extra)
    code = f"""
import pathlib, tempfile
from model_service import q4_kernel
assert q4_kernel.load(), q4_kernel.path()
assert q4_kernel.path() == {expected!r}, q4_kernel.path()
from tests.model_service import test_q4_kernel as t
for n, k in [(40, 96), (960, 576)]:
    for rows in (1, 9, 17):
        t.test_the_kernel_computes_its_reference(n, k, rows)
t.test_a_rows_result_does_not_depend_on_its_batch_or_the_threads("int4", -1)
for n, k in [(40, 97), (960, 576)]:
    for rows in (1, 13):
        t.test_float32_panels_compute_the_product(n, k, rows)
for pairs in (1, 0):
    t.test_a_rows_result_does_not_depend_on_its_batch_or_the_threads("float32", pairs)
for weights in ("int4", "float32"):
    for kv in ("float32", "float16"):
        t.test_a_verify_pass_scores_each_token_as_a_decode_step_does(pathlib.Path(tempfile.mkdtemp()), weights, kv)
        t.test_the_c_layer_loop_runs_several_sequences_each_as_alone(pathlib.Path(tempfile.mkdtemp()), True, weights, kv)
t.test_float16_keys_and_values_are_the_float32_ones_rounded(pathlib.Path(tempfile.mkdtemp()))
for geometry in [(128, 4, 2), (256, 2, 1)]:
    t.test_the_c_layer_loop_computes_what_the_torchscript_loop_does(pathlib.Path(tempfile.mkdtemp()), "qwen2", *geometry)
from tests.model_service import test_eagle_head as e
for shape in [{{"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8}},
              {{"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64}}]:
    e.test_the_fused_int4_step_computes_the_op_by_op_step(shape)
from tests.model_service import test_eagle as d
d.test_sessions_drafted_in_one_call_match_the_step_by_step_loop(pathlib.Path(tempfile.mkdtemp()), False)
t.test_the_kernels_sampled_draft_support_is_draft_tokens()
t.test_the_kernels_target_probs_are_logits_to_probs()
t.test_the_kernels_draw_is_samples_draw()
from speculative.tiny import make_tokenizer
from tests.model_service import test_fast_forward as f
tokenizer = make_tokenizer(pathlib.Path(tempfile.mkdtemp()) / "tok")
for kv in ("auto", "float16"):  # (a sliding window: attend and attend_rows)
    f.test_a_sliding_window_matches_transformers(pathlib.Path(tempfile.mkdtemp()), tokenizer, "mistral", "specdec", kv)
print("ok", q4_kernel.path())
"""
    env = dict(os.environ, SPECDEC_Q4_CFLAGS=extra, SPECDEC_EXTENSIONS=str(tmp_path / "ext"))
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600,
                          cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith(f"ok {expected}"), done.stdout


def test_the_kernels_sampled_draft_support_is_draft_tokens():
    """q4_kernel.draft_support (q4_draft_support: one call) gives the q speculative.sampling.draft_token
    computes with torch's ops, for temperatures, top-k under and over the support, top-p inside and past
    it, min-p, a support cut short, rows with masked (-inf) tokens or an `allowed` mask, at 3,000 and 11,264
    ids; the same p_min stops; nothing allowed drafts nothing; and draft_token given it draws the token
    the torch way draws from the same generator state, with as many uniforms."""
    from speculative.protocol import SamplingParams
    from speculative.sampling import draft_token

    if not q4_kernel.available():
        pytest.skip("specdec's int4 kernel is not built here")
    g = torch.Generator().manual_seed(21)
    checked = 0
    for vocab, support in ((3000, 64), (11264, 64), (3000, 7)):
        for temperature in (0.3, 0.7, 1.5):
            for top_k in (0, 5, 100, vocab):
                for top_p in (1.0, 0.9, 0.3):
                    row = torch.randn(vocab, generator=g) * 3
                    row[torch.randperm(vocab, generator=g)[:500]] = float("-inf")
                    allowed = torch.rand(vocab, generator=g) > 0.2 if checked % 2 else None
                    masked = row if allowed is None else row.masked_fill(~allowed, float("-inf"))
                    min_p = (0.0, 0.02, 0.3)[checked % 3]
                    params = SamplingParams(temperature, top_k=top_k, top_p=top_p, min_p=min_p)
                    ids, q = q4_kernel.draft_support(row, params, 0.0, support, allowed)
                    state = g.get_state()
                    token, want_ids, want_q = draft_token(masked, params, 0.0, support, g)
                    assert torch.equal(ids, want_ids), (vocab, temperature, top_k, top_p)
                    assert torch.allclose(q, want_q, rtol=1e-5, atol=1e-7)
                    after = g.get_state()
                    g.set_state(state)
                    assert draft_token(masked, params, 0.0, support, g, q4_kernel.draft_support)[0] == token
                    assert torch.equal(g.get_state(), after)
                    z = masked.sub(masked.max()).div(temperature)
                    z = z.masked_fill(z < math.log(min_p), float("-inf")) if min_p else z
                    top = float(torch.softmax(z.topk(top_k or vocab).values, -1)[0])  # p's top before top-p
                    if min_p:  # no id under min_p times the top in the support
                        assert float(q[-1]) >= min_p * float(q[0]) * (1 - 1e-5), (vocab, temperature, min_p)
                    for p_min in (top * 0.99, top * 1.01):
                        assert (q4_kernel.draft_support(row, params, p_min, support, allowed) is None) == (p_min > top)
                    checked += 1
    assert checked == 108
    nothing = torch.full((3000,), float("-inf"))
    assert q4_kernel.draft_support(nothing, SamplingParams(0.7), 0.0, 64) is None
    none_allowed = torch.zeros(3000, dtype=torch.bool)
    assert q4_kernel.draft_support(torch.randn(3000), SamplingParams(0.7), 0.0, 64, none_allowed) is None


def _same_p(got: torch.Tensor, want: torch.Tensor, uncut: torch.Tensor, case) -> None:
    """got (the kernel's p) is want (logits_to_probs') to float rounding: the same values where both keep a
    token, the same tokens kept but for those torch gives under 1e-30 and, where top-p cut among nearly
    equal probabilities (uncut: p before the cut), a tie at the cut that rounding broke the other way."""
    both = (got > 0) & (want > 0)
    assert torch.allclose(got[both], want[both], rtol=1e-4, atol=1e-7), case
    assert torch.allclose(got.sum(-1), torch.ones(()), atol=1e-5), case
    vocab = got.shape[-1]
    for g, w, u in zip(got.reshape(-1, vocab), want.reshape(-1, vocab), uncut.reshape(-1, vocab)):
        differ = ((g > 0) != (w > 0)) & ((w >= 1e-30) | (g > 0))
        if differ.any():  # only ties at the cut: within rounding of the least token torch kept, a few of them
            edge = float(u[w > 0].min())
            near = torch.isclose(u, torch.full_like(u, edge), rtol=1e-4)
            assert int(differ.sum()) <= 4 and bool(near[differ].all()), case
            assert int(near.sum()) >= 2, case  # (a tie: a token alone at the edge is kept or cut alike)


def test_the_kernels_target_probs_are_logits_to_probs():
    """q4_kernel.target_probs (q4_target_probs: one call) gives the p speculative.sampling.logits_to_probs
    computes with torch's ops, for temperatures, min-p, top-k, top-p (its cut found among the likely tokens first,
    lower while they fall short: a flat row takes it to every token), rows with masked (-inf) tokens and
    logits spread past where exponentials underflow, at 3,000 and 49,152 ids, one row and several: the same
    values up to float rounding, the same tokens kept but for those torch gives under 1e-30 and ties at
    top-p's cut (_same_p); a row with a NaN, or with no finite logit, comes out NaN as torch's does."""
    from speculative.protocol import SamplingParams
    from speculative.sampling import logits_to_probs

    if not q4_kernel.available():
        pytest.skip("specdec's int4 kernel is not built here")
    g = torch.Generator().manual_seed(22)
    checked = 0
    for vocab in (3000, 49152):
        for temperature in (0.3, 0.7, 1.5):
            for top_k in (0, 5, 100, vocab):
                for top_p in (1.0, 0.95, 0.3):
                    logits = torch.randn(2, vocab, generator=g) * 3
                    logits[0, torch.randperm(vocab, generator=g)[:500]] = float("-inf")
                    logits[1, :20] += 8  # a peaked row: the cut among the first candidates
                    min_p = (0.0, 0.001, 0.1)[checked % 3]
                    params = SamplingParams(temperature, top_k=top_k, top_p=top_p, min_p=min_p)
                    # (before top-p)
                    uncut = logits_to_probs(logits, SamplingParams(temperature, top_k=top_k, min_p=min_p))
                    for rows, before in ((logits, uncut), (logits[1], uncut[1])):
                        got, want = q4_kernel.target_probs(rows, params), logits_to_probs(rows, params)
                        assert got.shape == want.shape and got.dtype == torch.float32
                        _same_p(got, want, before, (vocab, temperature, top_k, top_p))
                    checked += 1
    assert checked == 72
    # min-p's line as torch's division draws it (the reciprocal's product rounded the second token over it)
    edge = SamplingParams(1.061075, min_p=0.8422145)
    row = torch.tensor([0.0, -0.18220843, -5.0, -6.0])
    assert torch.equal(q4_kernel.target_probs(row, edge), logits_to_probs(row, edge))
    flat = torch.linspace(0, 0.05, 5000)[torch.randperm(5000, generator=g)]  # top-p keeps ~90% of near-equal tokens:
    for top_p in (0.9, 0.999):  # no threshold above the floor holds the cut
        params = SamplingParams(1.0, top_p=top_p)
        got, want = q4_kernel.target_probs(flat, params), logits_to_probs(flat, params)
        _same_p(got, want, logits_to_probs(flat, SamplingParams(1.0)), ("flat", top_p))
        assert 0.85 * 5000 < int((got > 0).sum()) < 5000
    row = torch.randn(3000, generator=g) * 3
    for temperature in (1e-9, 1e-30, 1.4e-45, 1e-50, 3e38):  # (tests/coordinator/test_fuzz.py's, and under float's
        # least: torch's division gives NaN there, the kernel the limit)
        got = q4_kernel.target_probs(row, SamplingParams(temperature, top_p=0.9))
        assert torch.isfinite(got).all() and abs(float(got.sum()) - 1) < 1e-5
        if temperature < 1:  # the argmax alone; at 3e38 near-uniform, top-p keeping ~90% of the ids
            assert torch.equal(got, logits_to_probs(row, SamplingParams(0.0)))
        else:
            assert 0.85 * 3000 < int((got > 0).sum()) < 0.95 * 3000
    greedy = q4_kernel.target_probs(row, SamplingParams(0.0))
    assert torch.equal(greedy, logits_to_probs(row, SamplingParams(0.0)))
    nan_early, nan_wide = torch.randn(64, generator=g), torch.randn(49152, generator=g)
    nan_early[5], nan_early[10], nan_wide[100] = float("nan"), 3.0, float("nan")  # (the vectorised max and exp
    for bad in (torch.tensor([0.0, float("nan"), 1.0]), torch.full((3,), float("-inf")),  # pass over a NaN)
                torch.tensor([0.0, float("inf"), 1.0]), nan_early, nan_wide):
        assert torch.isnan(q4_kernel.target_probs(bad, SamplingParams(0.7))).all()
        assert torch.isnan(logits_to_probs(bad, SamplingParams(0.7))).any()


def test_the_kernels_draw_is_samples_draw():
    """sample given q4_kernel.draw (q4_sample: sums 16 ids at a time, then id by id) draws the token the torch
    way draws from the same generator state, taking one uniform: over dense and sparse rows, a one-hot row,
    lengths not a multiple of 16, a row's ids of probability 0 never drawn, a uniform next to 1 the last id
    of nonzero mass; a row of no positive finite total is refused both ways."""
    from speculative.sampling import sample

    if not q4_kernel.available():
        pytest.skip("specdec's int4 kernel is not built here")
    g = torch.Generator().manual_seed(23)
    rows = [torch.softmax(torch.randn(49152, generator=g) * 2, -1), torch.rand(37, generator=g),
            torch.zeros(1000).index_fill_(0, torch.tensor([999]), 1.0)]
    sparse = torch.rand(4000, generator=g)
    sparse[torch.rand(4000, generator=g) < 0.95] = 0
    rows.append(sparse)
    for p in rows:
        drawn = set()
        for _ in range(300):
            state = g.get_state()
            want = sample(p, g)
            after = g.get_state()
            g.set_state(state)
            assert sample(p, g, q4_kernel.draw) == want
            assert torch.equal(g.get_state(), after)
            drawn.add(want)
        assert all(p[i] > 0 for i in drawn)
        assert q4_kernel.draw(p, 1 - 2 ** -53) == int(p.nonzero()[-1])
        assert q4_kernel.draw(p, 0.0) == int(p.nonzero()[0])
    for bad in (torch.zeros(40), torch.full((40,), float("nan")), torch.tensor([1.0, float("inf")] * 20)):
        with pytest.raises(ValueError, match="total mass"):
            sample(bad, g, q4_kernel.draw)
        with pytest.raises(ValueError, match="total mass"):
            sample(bad, g)


def test_rejection_sampling_with_the_kernels_p_and_draw_emits_the_target_distribution():
    """A sampled verify as the target service runs it where the kernel is built (ProbRows over
    q4_kernel.target_probs, the draws by q4_kernel.draw): every emitted position is distributed as
    logits_to_probs' p (temperature 0.8, top_p 0.9 over 40 ids), for a q far from it; chi-squared per
    position at alpha = 1e-4 over 4,000 rounds. The draft's tokens uncorrected fail it."""
    from speculative.protocol import SamplingParams
    from speculative.sampling import ProbRows, draft_support, logits_to_probs, rejection_sample
    from tests.stats import chi2_critical, chi2_stat

    if not q4_kernel.available():
        pytest.skip("specdec's int4 kernel is not built here")
    g = torch.Generator().manual_seed(24)
    vocab, k, params = 40, 2, SamplingParams(0.8, top_p=0.9)
    logits = torch.randn(k + 1, vocab, generator=g) * 1.5
    p = logits_to_probs(logits, params)
    supports = [draft_support(torch.softmax(torch.randn(vocab, generator=g), -1), vocab) for _ in range(k)]
    counts, reached, uncorrected = torch.zeros(k + 1, vocab), torch.zeros(k + 1), torch.zeros(vocab)
    for _ in range(4000):
        draft = torch.stack([ids[torch.multinomial(q, 1, generator=g)][0] for ids, q in supports])
        uncorrected[draft[0]] += 1
        accepted, token = rejection_sample(ProbRows(logits, params, q4_kernel.target_probs), draft,
                                           [s[0] for s in supports], [s[1] for s in supports], g, q4_kernel.draw)
        for j, t in enumerate(draft[:accepted].tolist() + [token]):
            counts[j, t] += 1
            reached[j] += 1
    for j in range(k + 1):
        if reached[j] >= 50:
            stat, df = chi2_stat(counts[j], p[j])
            assert stat < chi2_critical(df), f"position {j}: chi2 {stat:.1f} on {df} df"
    assert float(uncorrected[p[0] == 0].sum()) > 0  # (tokens top-p cut: chi2_stat refuses them)
    stat, df = chi2_stat(uncorrected.masked_fill(p[0] == 0, 0), p[0])
    assert stat > 10 * chi2_critical(df)


def test_a_build_lock_left_by_a_killed_build_is_waited_out_then_removed(tmp_path):
    """torch waits for its build lock without end; a killed build leaves it behind: the kernel's load
    removes one older than STALE_LOCK_S at once, waits for a younger one until it is gone (another
    build finished) or that old (one a killed build left), then removes it."""
    lock = tmp_path / "lock"
    q4_kernel.wait_for_build_lock(lock)  # none: nothing to wait for
    lock.touch()
    then = time.time() - 2 * q4_kernel.STALE_LOCK_S
    os.utime(lock, (then, then))
    q4_kernel.wait_for_build_lock(lock)
    assert not lock.exists()
    lock.touch()
    then = time.time() - (q4_kernel.STALE_LOCK_S - 0.3)  # stale in 0.3 s
    os.utime(lock, (then, then))
    start = time.time()
    q4_kernel.wait_for_build_lock(lock, poll_s=0.05)
    assert not lock.exists() and time.time() - start >= 0.25


def test_the_kernel_splits_its_work_across_torchs_threads():
    """Built without OpenMP, ATen's at::parallel_for (a header template in the kernel's source) runs
    the whole range on the calling thread: every int4 pass then used one core of two (the one-token
    pass of SmolLM2-135M 5.4 -> 4.2 ms, five tokens 8.6 -> 6.7 ms with it on a 2-core EPYC)."""
    assert q4_kernel.threaded(), "the kernel was built without OpenMP"


def test_a_q4_linear_is_its_kernels_product_with_fitted_groups():
    """int4.Q4Linear (an EAGLE head's linears on a CPU): the kernel's product over its tiles, plus
    the bias, in any leading shape; its groups' fitted ranges (q4_groups_fitted) stand nearer the
    float weights than q4_groups' min..max ones, and each group's range lies within its min..max."""
    from model_service.int4 import Q4Linear, q4_groups_fitted

    g = torch.Generator().manual_seed(3)
    linear = torch.nn.Linear(96, 40)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(40, 96, generator=g) * 0.05)
        linear.weight[5, 7] = 0.9  # an outlier: its group's min..max grid is coarse
    q4 = Q4Linear(linear)
    x = torch.randn(2, 3, 96, generator=g)
    y = q4(x)
    assert y.shape == (2, 3, 40)
    expected = q4_kernel.reference_mm(x.reshape(6, 96), q4.tiles, 40) + linear.bias.detach()
    torch.testing.assert_close(y.reshape(6, 40), expected, rtol=0, atol=1e-4)
    w = linear.weight.detach()

    def error(groups) -> float:
        return (q4_kernel.dequantized(q4_kernel.tile(*groups), 96, 40) - w.t()).pow(2).sum().item()

    fitted, plain = q4_groups_fitted(w.t()), q4_groups(w.t())
    assert error(fitted) < 0.97 * error(plain)
    assert torch.equal(q4.tiles, q4_kernel.tile(*fitted))  # what the layer multiplies by
    low = w.reshape(40, 3, 32).amin(-1)
    assert (fitted[2].float() >= plain[2].float()).all() and (fitted[2].float() >= low.half().float() - 1e-6).all()
    with pytest.raises(ValueError, match="groups of 32"):
        Q4Linear(torch.nn.Linear(40, 8))


def test_the_c_loop_copies_the_feature_layers_out_in_one_call_as_the_segments_do(tmp_path):
    """An EAGLE head's features from an int4 target (q4_layers_capturing: every layer in one call,
    the asked layers' inputs copied out) are, bit for bit, what a call per segment between them
    gives, in the order asked (duplicates too); the logits and the cache likewise. A prompt, then a
    verify-sized pass over two sessions."""
    from model_service.model_runner import ModelRunner
    from speculative.tiny import make_model, make_tokenizer

    model = make_model(tmp_path / "m", make_tokenizer(tmp_path / "t"), hidden=128, layers=4, heads=4, kv_heads=2,
                       intermediate=160, max_context=128)
    fast = ModelRunner(model, "cpu", quantize="int4", int4_kernel="specdec").fast
    assert fast._runs_q4_layers()
    capture = (3, 0, 2, 2)
    results = {}
    for one_call in (True, False):
        fast.capture_in_loop = one_call
        caches = [fast.new_cache(), fast.new_cache()]
        first = fast.many_capturing([(list(range(3, 40)), caches[0], 1), (list(range(5, 25)), caches[1], 2)], capture)
        second = fast.many_capturing([([41, 42, 43, 44, 45], caches[0], 5), ([46], caches[1], 1)], capture)
        results[one_call] = (first, second, [cache.data[:, :, :, :, :40].clone() for cache in caches])
    for (logits, states), (want_logits, want_states) in zip(results[True][:2], results[False][:2]):
        assert states.shape == (want_states.shape[0], len(capture), 128)
        assert torch.equal(states, want_states)
        assert all(torch.equal(a, b) for a, b in zip(logits, want_logits))
    assert not torch.equal(results[True][0][1][:, 0], results[True][0][1][:, 1])  # layers 3 and 0 differ
    assert all(torch.equal(a, b) for a, b in zip(results[True][2], results[False][2]))


@pytest.mark.parametrize("weights", ["int4", "float32"])
def test_the_c_loop_runs_the_output_layer_in_its_call(tmp_path, weights):
    """The C++ loop's call ends with the final RMSNorm and the output layer (its tiles or panels):
    no torch product for the logits after it (a spy on FastForward._mm sees none), every path of
    the loop (one call, with the feature layers' inputs copied out, or a call per segment between
    them), and the logits those of the norm and product run after the call (head_in_loop off),
    within float32 rounding of the norm (its sum's order), the same argmax; the states unchanged."""
    fast = _c_loop_model(tmp_path, weights)
    calls = []
    product = fast._mm

    def spy(*args, **kwargs):
        calls.append(args[0].shape)
        return product(*args, **kwargs)

    fast._mm = spy
    prompt, verify = list(range(3, 70)), [71, 72, 73, 74, 75]
    results = {}
    for in_loop, capture, one_call in [(True, (), True), (True, (2, 0), True), (True, (2, 0), False),
                                       (False, (), True), (False, (2, 0), True)]:
        fast.head_in_loop, fast.capture_in_loop = in_loop, one_call
        calls.clear()
        cache = fast.new_cache()
        first = fast.many_capturing([(prompt, cache, 1)], capture)
        second = fast.many_capturing([(verify, cache, len(verify))], capture)
        assert len(calls) == (0 if in_loop else 2), calls
        results[in_loop, capture, one_call] = (torch.cat([*first[0], *second[0]]), second[1])
    want, want_states = results[False, (), True]
    assert want.shape == (1 + len(verify), fast.vocab_size)
    for (in_loop, capture, _), (logits, states) in results.items():
        assert torch.allclose(logits, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
        assert torch.equal(logits.argmax(-1), want.argmax(-1))
        if capture:
            assert torch.equal(states, results[False, capture, True][1])
    tiles = [torch.zeros(n // 16, 2 * 320, dtype=torch.uint8) for n in (192, 64, 128, 64)]  # a valid 1-layer loop
    layer = (torch.zeros(1, 64), torch.zeros(1, 32), torch.zeros(1, 32), [torch.zeros(1, 2, 1, 2, 8, 32)], [0], [1],
             [1], 2, 2, 32, 1e-5, [1.0], [torch.ones(64)], [torch.ones(64)], [64], [None], tiles, [192, 64, 128, 64])
    assert torch.ops.specdec.q4_layers(*layer, torch.ones(64), tiles[1], 64).shape == (1, 64)
    with pytest.raises(RuntimeError, match="a head needs its final_norm"):
        torch.ops.specdec.q4_layers(*layer, None, tiles[1], 64)
    with pytest.raises(RuntimeError, match="final_norm must have 64 weights"):
        torch.ops.specdec.q4_layers(*layer, torch.ones(32), tiles[1], 64)
    with pytest.raises(RuntimeError, match="need \\[2, 640\\]"):  # 32 outputs: 2 tiles, not 4
        torch.ops.specdec.q4_layers(*layer, torch.ones(64), tiles[1], 32)


@pytest.mark.parametrize("weights", ["int4", "float32"])
def test_the_c_loop_looks_the_rows_up_from_their_ids(tmp_path, weights, monkeypatch):
    """In the C++ loop's one call the rows' embeddings and RoPE rows are looked up by the call from
    the token ids and each row's position (a tied model's embedding table is a transposed view: read
    by its strides): no torch embedding before it, and the logits and features bit for bit those of
    the lookups done by torch (lookup_in_loop off), for several sequences at once, at their own
    positions; ids or positions outside the tables are refused."""
    import model_service.fast_forward as fast_forward

    fast = _c_loop_model(tmp_path, weights)
    embedded = []
    embedding = fast_forward.F.embedding
    monkeypatch.setattr(fast_forward.F, "embedding", lambda *a, **k: embedded.append(1) or embedding(*a, **k))
    prompts, steps = [list(range(3, 60)), list(range(70, 75))], [[61, 62, 63], [76]]
    results = {}
    table = fast.embed
    for strided, in_loop in [(False, True), (True, True), (False, False)]:
        # strided: the same table as a transposed view, as a tied model's is
        fast.embed, fast.lookup_in_loop = (table.t().contiguous().t() if strided else table), in_loop
        assert fast.embed.is_contiguous() != strided
        embedded.clear()
        caches = [fast.new_cache() for _ in prompts]
        first = fast.many_capturing([(p, c, 1) for p, c in zip(prompts, caches)], (1,))
        second = fast.many_capturing([(ids, c, len(ids)) for ids, c in zip(steps, caches)], (1, 0))
        assert len(embedded) == (0 if in_loop else 2)
        results[strided, in_loop] = [*first[0], *second[0], first[1], second[1]]
    for key in [(False, True), (True, True)]:
        assert all(torch.equal(a, b) for a, b in zip(results[key], results[False, False]))
    cos, sin = fast.rope_table
    scaling, in_norm, post_norm, half, qkv_bias, _, _, _, _, tiles, _, outs, _, _ = fast._scripted_args()
    cache = fast.new_cache()

    def args(start: int, ids: list[int]) -> tuple:
        return (table, cos, sin, [cache.data], [start], [len(ids)], [1], fast.heads, fast.kv_heads, fast.head_dim,
                fast.eps, scaling, in_norm, post_norm, half, qkv_bias, tiles, outs, None, None, 0, ids)

    with pytest.raises(RuntimeError, match="token id .* outside the embedding table"):
        torch.ops.specdec.q4_layers(*args(0, [3, fast.embed.shape[0]]))
    with pytest.raises(RuntimeError, match="position .* outside the RoPE table"):
        torch.ops.specdec.q4_layers(*args(cos.shape[0] - 1, [3, 4]))
    with pytest.raises(RuntimeError, match=r"qk_norm must be \[layers, 2, head_dim\]"):  # one layer too many
        torch.ops.specdec.q4_layers(*args(0, [3, 4]), qk_norm=torch.ones(len(fast.layers) + 1, 2, fast.head_dim))
    with pytest.raises(RuntimeError, match="rope must say for each layer"):
        torch.ops.specdec.q4_layers(*args(0, [3, 4]), rope=[1] * (len(fast.layers) + 1))
