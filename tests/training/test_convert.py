"""training.convert: a GGUF file -> a transformers directory that reproduces what transformers
reads from the GGUF (weights, logits, tokenizer, chat template). The GGUF is written here with
the `gguf` package's writer: a 2-layer Llama with Q4_1 and F32 tensors and a byte-level BPE."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from speculative.tiny import CHAT_TEMPLATE, make_tokenizer
from training.convert import convert, ensure, llama3_divisors, load_gguf, q4_1_cells

gguf = pytest.importorskip("gguf")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 96


def narrow_q4_1(data: np.ndarray, rng) -> np.ndarray:
    """Q4_1 blocks for data's shape [rows, in] that a min/max quantizer would not make: q drawn in
    3..12 only, d and m in float16 (ggml's layout: d, m, then byte j holds elements j and j + 16)."""
    rows, inp = data.shape
    q = rng.integers(3, 13, size=(rows, inp // 32, 32)).astype(np.uint8)
    d = (0.01 + 0.01 * rng.random((rows, inp // 32, 1))).astype(np.float16)
    m = (-0.08 * rng.random((rows, inp // 32, 1))).astype(np.float16)
    nibbles = q[..., :16] | (q[..., 16:] << 4)
    return np.concatenate([d.view(np.uint8), m.view(np.uint8), nibbles], axis=-1).reshape(rows, -1)


def write_gguf(path, tokenizer_dir, narrow: bool = False, arch: str = "llama", rope: dict | None = None,
               ) -> dict[str, np.ndarray]:
    """A tiny Llama GGUF (arch "phi3": Phi-3's, q/k/v in one attn_qkv and gate/up in one ffn_up); returns
    the float weights each tensor decodes to (Q4_1 ones after rounding). narrow: the linears' blocks as
    narrow_q4_1 makes them, not from min/max. rope: RoPE metadata (dimension_count, original, attn_factor,
    scaling: (type, factor)), per-frequency tensors (rope_freqs, rope_factors_long, rope_factors_short) and
    the attention's sliding window (window)."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    eos = vocab["<|endoftext|>"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t == "<|endoftext|>" else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_bos_token_id(eos)
    writer.add_eos_token_id(eos)
    writer.add_chat_template(CHAT_TEMPLATE)
    rope = rope or {}
    if "dimension_count" in rope:
        writer.add_rope_dimension_count(rope["dimension_count"])
    if "original" in rope:
        writer.add_rope_scaling_orig_ctx_len(rope["original"])
    if "attn_factor" in rope:
        writer.add_rope_scaling_attn_factors(rope["attn_factor"])
    if "window" in rope:
        writer.add_sliding_window(rope["window"])
    if "scaling" in rope:
        writer.add_rope_scaling_type(gguf.RopeScalingType(rope["scaling"][0]))
        writer.add_rope_scaling_factor(rope["scaling"][1])
    for name in ("rope_freqs", "rope_factors_long", "rope_factors_short"):
        if name in rope:
            writer.add_tensor(f"{name}.weight", np.asarray(rope[name], dtype=np.float32))
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,)}
    if arch == "phi3":
        if "dimension_count" not in rope:
            writer.add_rope_dimension_count(head_dim)
        writer.add_pad_token_id(eos)  # (Phi3Config's own, 32000, is past this vocabulary)
        shapes["output.weight"] = (len(tokens), HIDDEN)
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN), f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
        if arch == "phi3":
            shapes |= {f"blk.{i}.attn_qkv.weight": (HIDDEN + 2 * KV_HEADS * head_dim, HIDDEN),
                       f"blk.{i}.ffn_up.weight": (2 * FFN, HIDDEN)}
        else:
            shapes |= {
                f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
                f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN),
                f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            }
    decoded = {}
    for name, shape in shapes.items():
        data = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.05 * rng.standard_normal(shape))
        data = data.astype(np.float32)
        if len(shape) == 2:  # Q4_1: blocks of 32 as d * q + m
            if narrow and name.startswith("blk."):
                raw = narrow_q4_1(data, rng)
            else:
                raw = gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q4_1)
            writer.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q4_1)
            decoded[name] = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1)
        else:
            writer.add_tensor(name, data)
            decoded[name] = data
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return decoded


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf")
    make_tokenizer(out / "tok")
    decoded = write_gguf(out / "tiny.Q4_1.gguf", out / "tok")
    return out / "tiny.Q4_1.gguf", decoded


def test_converted_directory_reproduces_the_gguf(tiny_gguf, tmp_path):
    path, decoded = tiny_gguf
    info = convert(path, tmp_path / "model")
    assert info["architecture"] == "LlamaForCausalLM" and info["chat_template"]
    assert not (tmp_path / "model.partial").exists()
    loaded, loaded_tok = load_gguf(path)
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "model")
    assert not hasattr(model.config, "quantization_config")
    # the weights are the GGUF's Q4_1 blocks decoded (the embedding is stored unpermuted)
    embedding = model.get_input_embeddings().weight.detach().numpy()
    np.testing.assert_array_equal(embedding, decoded["token_embd.weight"])
    assert model.config.num_hidden_layers == LAYERS and model.config.num_key_value_heads == KV_HEADS
    text = "def speculative_round(draft, target):"
    assert tokenizer(text).input_ids == loaded_tok(text).input_ids
    ids = torch.tensor([tokenizer(text).input_ids])
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, loaded(ids).logits)
    chat = [{"role": "user", "content": "hi"}]
    assert tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) == \
        loaded_tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    assert model.generation_config.eos_token_id == loaded.generation_config.eos_token_id


def test_ensure_converts_once(tiny_gguf, tmp_path):
    path, _ = tiny_gguf
    out = ensure(tmp_path / "model", path)
    stamp = (out / "model.safetensors").stat().st_mtime_ns
    assert ensure(tmp_path / "model", path) == out
    assert (out / "model.safetensors").stat().st_mtime_ns == stamp  # not redone


def test_ensure_names_the_missing_package(tmp_path):
    from assets.models import packaged_gguf

    with pytest.raises(FileNotFoundError, match="not installed"):
        packaged_gguf("no_such_package_here")


def test_int4_groups_of_a_q4_1_model_are_its_gguf_blocks(tiny_gguf, tmp_path):
    """--quantize int4 on a GGUF-born target loses nothing of its Q4_1 weights: the asymmetric
    groups of 32 it derives from the converted weights are the GGUF's own blocks (q identical;
    scale = d and zero = m + 8 d, rounded to the kernel's bf16)."""
    from model_service.int4 import int4_groups

    path, _ = tiny_gguf
    convert(path, tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model")
    names = {"ffn_down": "mlp.down_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj"}  # (q and k rows are permuted)
    checked = 0
    for tensor in gguf.GGUFReader(str(path)).tensors:
        kind = tensor.name.split(".")[-2]
        if tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1 or kind not in names:
            continue
        q, d, m = q4_1_cells(np.asarray(tensor.data))
        weight = model.get_submodule(f"model.layers.{tensor.name.split('.')[1]}.{names[kind]}").weight.detach()
        ours, scale, zero = int4_groups(weight.t(), 32)
        assert torch.equal(ours, q), tensor.name
        torch.testing.assert_close(scale, d.bfloat16(), rtol=2 ** -8, atol=0)
        torch.testing.assert_close(zero, (m + 8 * d).bfloat16(), rtol=2 ** -8, atol=1e-6)
        checked += 1
    assert checked == 5 * LAYERS


@pytest.fixture(scope="module")
def narrow_gguf(tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-narrow")
    make_tokenizer(out / "tok")
    write_gguf(out / "narrow.Q4_1.gguf", out / "tok", narrow=True)
    convert(out / "narrow.Q4_1.gguf", out / "model")
    return out / "model"


def test_the_q4_1_blocks_are_kept_beside_the_model(tiny_gguf, tmp_path):
    """Every Q4_1 linear of the GGUF, q and k included (llama.cpp permutes their rows; the blocks
    follow the converted model's order), decodes to exactly the converted weight."""
    from model_service.int4 import read_q4_1_blocks

    path, _ = tiny_gguf
    info = convert(path, tmp_path / "model")
    blocks = read_q4_1_blocks(tmp_path / "model")
    assert info["q4_1_blocks"] == len(blocks) == 7 * LAYERS
    assert json.loads((tmp_path / "model" / "conversion.json").read_text())["q4_1_blocks"] == 7 * LAYERS
    weights = AutoModelForCausalLM.from_pretrained(tmp_path / "model").state_dict()
    for name, (q, d, m) in blocks.items():
        assert q.min() >= 0 and q.max() <= 15
        decoded = (q.reshape(q.shape[0], -1, 32) * d[..., None] + m[..., None]).reshape(q.shape)
        torch.testing.assert_close(decoded, weights[name], rtol=0, atol=1e-6, msg=name)
    assert len(read_q4_1_blocks(tmp_path)) == 0 and not read_q4_1_blocks(tmp_path)  # no file: nothing


@pytest.mark.parametrize("kernel", ["specdec", "torch"])
def test_int4_runs_the_gguf_blocks_as_shipped(narrow_gguf, kernel):
    """Blocks no min/max quantizer makes (q in 3..12): --quantize int4 runs them as they are
    (specdec's kernel: q, d and m as the file holds them; torch's: scale = d, zero = m + 8 d in its
    bf16), so the weights its kernel multiplies by are the float model's (the blocks decoded) to
    within rounding, where groups re-derived from the floats (steps of 9 d / 15) are off by up to 0.3 d."""
    from model_service import q4_kernel
    from model_service.fast_forward import FastForward
    from model_service.int4 import quantize, read_q4_1_blocks
    from model_service.model_runner import ModelRunner

    if kernel == "specdec" and not q4_kernel.available():
        pytest.skip(f"specdec's int4 kernel: {q4_kernel.path()}")
    blocks = read_q4_1_blocks(narrow_gguf)
    shipped = ModelRunner(narrow_gguf, "cpu", quantize="int4", int4_kernel=kernel)
    assert f"{4 * LAYERS} of {4 * LAYERS} layer linears from the GGUF's Q4_1 blocks" in shipped.info()["quantization"]
    layer = shipped.fast.layers[0]["qkv_packed"]
    q, d, m = (torch.cat(t) for t in zip(*(blocks[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")))
    if kernel == "specdec":
        tq, td, tm = q4_kernel.untile(layer.tiles, HIDDEN, layer.out)
        assert torch.equal(tq, q.to(torch.uint8)) and torch.equal(td.float(), d) and torch.equal(tm.float(), m)
    else:
        assert torch.equal(layer.scales_and_zeros[..., 0].t(), d.bfloat16())
        assert torch.equal(layer.scales_and_zeros[..., 1].t(), (m + 8 * d).bfloat16())
        assert torch.equal(layer.weight, torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1))

    model = AutoModelForCausalLM.from_pretrained(narrow_gguf).eval()
    rederived = FastForward.build(AutoModelForCausalLM.from_pretrained(narrow_gguf).eval(), 64)
    assert quantize(rederived, 32, kernel=kernel) == 0
    eye = torch.eye(HIDDEN)
    for i, layer in enumerate(model.model.layers):
        for name, module in (("o", layer.self_attn.o_proj), ("gate_up", layer.mlp.gate_proj)):
            weight = module.weight.detach().t()  # [in, out]: the first outputs of the fused gate_up
            ours = FastForward._mm(eye, torch.empty(0), shipped.fast.layers[i][f"{name}_packed"])[:, :weight.shape[1]]
            other = FastForward._mm(eye, torch.empty(0), rederived.layers[i][f"{name}_packed"])[:, :weight.shape[1]]
            error, other_error = (ours - weight).abs().max().item(), (other - weight).abs().max().item()
            assert error < 2e-3 and 2 * error < other_error, (i, name, error, other_error)


def test_a_phi3_gguf_s_fused_blocks_are_kept_and_run_as_shipped(tmp_path):
    """Phi-3's GGUFs hold q/k/v in one attn_qkv and gate/up in one ffn_up, as its checkpoints do
    (qkv_proj, gate_up_proj): their Q4_1 blocks are kept too, and --quantize int4 runs all four
    linears of each layer from them, each within rounding of the float model's weight where groups
    re-derived from the floats are not."""
    from model_service import q4_kernel
    from model_service.fast_forward import FastForward
    from model_service.int4 import quantize, read_q4_1_blocks
    from model_service.model_runner import ModelRunner

    make_tokenizer(tmp_path / "tok")
    write_gguf(tmp_path / "phi3.Q4_1.gguf", tmp_path / "tok", narrow=True, arch="phi3")
    info = convert(tmp_path / "phi3.Q4_1.gguf", tmp_path / "model")
    assert info["architecture"] == "Phi3ForCausalLM" and info["q4_1_blocks"] == 4 * LAYERS
    assert {name.split(".", 3)[3] for name in read_q4_1_blocks(tmp_path / "model")} == {
        "self_attn.qkv_proj.weight", "self_attn.o_proj.weight", "mlp.gate_up_proj.weight", "mlp.down_proj.weight"}
    if not q4_kernel.available():
        pytest.skip(f"specdec's int4 kernel: {q4_kernel.path()}")
    shipped = ModelRunner(tmp_path / "model", "cpu", quantize="int4", int4_kernel="specdec")
    assert f"{4 * LAYERS} of {4 * LAYERS} layer linears from the GGUF's Q4_1 blocks" in shipped.info()["quantization"]
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    rederived = FastForward.build(AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval(), 64)
    assert quantize(rederived, 32, kernel="specdec") == 0
    eye = torch.eye(HIDDEN)
    for i, layer in enumerate(model.model.layers):
        for name, module in (("qkv", layer.self_attn.qkv_proj), ("gate_up", layer.mlp.gate_up_proj)):
            weight = module.weight.detach().t()  # [in, out]
            ours = FastForward._mm(eye, torch.empty(0), shipped.fast.layers[i][f"{name}_packed"])
            other = FastForward._mm(eye, torch.empty(0), rederived.layers[i][f"{name}_packed"])
            error, other_error = (ours - weight).abs().max().item(), (other - weight).abs().max().item()
            assert error < 2e-3 and 2 * error < other_error, (i, name, error, other_error)


HEAD = HIDDEN // HEADS


CASES = ["llama3", "llama3 but one", "other divisors", "linear", "phi3 partial longrope", "phi3 within the original"]


@pytest.mark.parametrize("case", CASES)
def test_the_gguf_s_rope_is_the_converted_model_s(tmp_path, case):
    """transformers' GGUF reading keeps only RoPE's theta; the conversion takes the rest from the file
    (llama.cpp's per-frequency divisors, rope_freqs, as llama3's parameters where they make exactly those;
    Phi-3.5's longrope lists and attention factor; the rotated dimensions; linear scaling), so the
    converted rotary makes the frequencies the file's model runs at: cos and sin against those computed
    here, past the original context (longrope's long factors) and within it (its short ones)."""
    make_tokenizer(tmp_path / "tok")
    arch, rotated, attention, theta = "llama", HEAD, 1.0, 10000.0
    positions = torch.arange(200, 232)[None]  # (past the original context of 64)
    if case.startswith("llama3"):
        divisors = llama3_divisors(theta, HEAD, 8.0, 8192, 1.0, 4.0)  # (rotary_emb checks them)
        expect = {"rope_type": "llama3", "factor": 8.0}
        if case == "llama3 but one":  # (not llama3's: the same frequencies through longrope's explicit factors)
            divisors[5] *= 1.01
            expect = {"rope_type": "longrope", "attention_factor": 1.0}
        rope = {"rope_freqs": divisors}
    elif case == "other divisors":
        divisors = [1.0 + 0.37 * i for i in range(HEAD // 2)]
        rope, expect = {"rope_freqs": divisors}, {"rope_type": "longrope", "attention_factor": 1.0}
    elif case == "linear":
        divisors = [2.0] * (HEAD // 2)
        rope, expect = {"scaling": ("linear", 2.0)}, {"rope_type": "linear", "factor": 2.0}
    else:
        arch, rotated, attention = "phi3", 12, 1.25
        long, short = [2.0 + 0.5 * i for i in range(6)], [1.0 + 0.25 * i for i in range(6)]
        rope = {"dimension_count": 12, "original": 64, "attn_factor": attention, "rope_factors_long": long,
                "rope_factors_short": short}
        expect = {"rope_type": "longrope", "partial_rotary_factor": 0.75, "attention_factor": attention}
        divisors = long
        if case == "phi3 within the original":
            divisors, positions = short, torch.arange(10, 42)[None]
    write_gguf(tmp_path / "m.gguf", tmp_path / "tok", arch=arch, rope=rope)
    convert(tmp_path / "m.gguf", tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model").eval()
    got = model.config.rope_parameters
    assert {k: got.get(k) for k in expect} == expect and got["rope_theta"] == theta
    cos, sin = model.model.rotary_emb(torch.zeros(1, 1, dtype=torch.float32), positions)
    inverse = 1 / (theta ** (torch.arange(0, rotated, 2, dtype=torch.float64) / rotated)
                   * torch.tensor(divisors, dtype=torch.float64))
    angles = positions[0, :, None].double() * inverse
    torch.testing.assert_close(cos[0].double(), angles.cos().repeat(1, 2) * attention, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(sin[0].double(), angles.sin().repeat(1, 2) * attention, atol=1e-5, rtol=1e-5)
    from model_service.model_runner import ModelRunner

    fast, slow = ModelRunner(tmp_path / "model"), ModelRunner(tmp_path / "model", forward="transformers")
    assert fast.forward_kind.startswith("fast")  # the lean forward runs it, as transformers does
    outs = []
    for runner in (fast, slow):
        session = runner.start_session("s", 0)
        session.tokens.extend(range(3, 103))  # (past the original context)
        outs.append(runner.forward(session, 5))
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_yarn_is_taken_and_no_scaling_left_as_read(tmp_path):
    """YaRN (Qwen2.5's long context: factor 4 over 32,768) as transformers' yarn; a linear factor of 1 (as
    some files write for none) changes nothing."""
    make_tokenizer(tmp_path / "tok")
    write_gguf(tmp_path / "yarn.gguf", tmp_path / "tok", rope={"scaling": ("yarn", 4.0), "original": 64})
    convert(tmp_path / "yarn.gguf", tmp_path / "yarn")
    got = AutoModelForCausalLM.from_pretrained(tmp_path / "yarn").config.rope_parameters
    assert (got["rope_type"], got["factor"], got["original_max_position_embeddings"]) == ("yarn", 4.0, 64)
    write_gguf(tmp_path / "one.gguf", tmp_path / "tok", rope={"scaling": ("linear", 1.0)})
    convert(tmp_path / "one.gguf", tmp_path / "one")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "one").config.rope_parameters["rope_type"] == "default"


def test_a_rope_scaling_the_conversion_cannot_represent_is_refused(tmp_path):
    make_tokenizer(tmp_path / "tok")
    write_gguf(tmp_path / "m.gguf", tmp_path / "tok", rope={"scaling": ("longrope", 4.0)})  # (with no factors)
    with pytest.raises(ValueError, match="RoPE scaling 'longrope'"):
        convert(tmp_path / "m.gguf", tmp_path / "model")


def test_linear_scaling_of_a_rope_per_layer_type_scales_the_full_attention_layers(tmp_path):
    """Gemma 3's RoPE is per layer type: llama.cpp's linear factor scales its full-attention layers only,
    and the conversion puts it there (at the top of the dict transformers would ignore it)."""
    from transformers import AutoConfig

    from training.convert import gguf_rope

    make_tokenizer(tmp_path / "tok")
    write_gguf(tmp_path / "m.gguf", tmp_path / "tok", rope={"scaling": ("linear", 8.0)})
    config = AutoConfig.for_model("gemma3_text", vocab_size=100, hidden_size=HIDDEN, num_attention_heads=HEADS,
                                  num_key_value_heads=KV_HEADS, head_dim=HEAD, num_hidden_layers=6,
                                  intermediate_size=FFN)
    rope = gguf_rope(tmp_path / "m.gguf", config)
    assert rope["full_attention"]["rope_type"] == "linear" and rope["full_attention"]["factor"] == 8.0
    assert rope["sliding_attention"] == config.rope_parameters["sliding_attention"] and set(rope) == {
        "full_attention", "sliding_attention"}
    config.rope_parameters = rope
    model = AutoModelForCausalLM.from_config(config)
    plain = AutoModelForCausalLM.from_config(AutoConfig.for_model(
        "gemma3_text", vocab_size=100, hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=KV_HEADS,
        head_dim=HEAD, num_hidden_layers=6, intermediate_size=FFN))
    x, at = torch.zeros(1, 1), torch.arange(8, 16)[None]
    cos, _ = model.model.rotary_emb(x, at, "full_attention")
    torch.testing.assert_close(cos, plain.model.rotary_emb(x, at / 8.0, "full_attention")[0])
    torch.testing.assert_close(model.model.rotary_emb(x, at, "sliding_attention")[0],
                               plain.model.rotary_emb(x, at, "sliding_attention")[0])


def test_a_phi3_gguf_s_sliding_window_is_the_converted_model_s(tmp_path):
    """Phi-3-mini-4k's GGUF says it attends over 2,047 keys (attention.sliding_window), which transformers'
    reading leaves out: the converted config has it, and the lean forward runs it."""
    from model_service.model_runner import ModelRunner

    make_tokenizer(tmp_path / "tok")
    write_gguf(tmp_path / "m.gguf", tmp_path / "tok", arch="phi3", rope={"window": 24})
    convert(tmp_path / "m.gguf", tmp_path / "model")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "model").config.sliding_window == 24
    assert ModelRunner(tmp_path / "model").fast.window == 24
