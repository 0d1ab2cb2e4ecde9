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
from training.convert import convert, ensure, load_gguf

gguf = pytest.importorskip("gguf")

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 64, 2, 4, 2, 96


def write_gguf(path, tokenizer_dir) -> dict[str, np.ndarray]:
    """A tiny Llama GGUF; returns the float weights each tensor decodes to (Q4_1 ones after rounding)."""
    spec = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    merges = [m if isinstance(m, str) else " ".join(m) for m in spec["model"]["merges"]]
    eos = vocab["<|endoftext|>"]
    writer = gguf.GGUFWriter(str(path), "llama")
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
    rng = np.random.default_rng(0)
    head_dim = HIDDEN // HEADS
    shapes = {"token_embd.weight": (len(tokens), HIDDEN), "output_norm.weight": (HIDDEN,)}
    for i in range(LAYERS):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (HIDDEN,), f"blk.{i}.ffn_norm.weight": (HIDDEN,),
            f"blk.{i}.attn_q.weight": (HIDDEN, HIDDEN), f"blk.{i}.attn_k.weight": (KV_HEADS * head_dim, HIDDEN),
            f"blk.{i}.attn_v.weight": (KV_HEADS * head_dim, HIDDEN), f"blk.{i}.attn_output.weight": (HIDDEN, HIDDEN),
            f"blk.{i}.ffn_gate.weight": (FFN, HIDDEN), f"blk.{i}.ffn_up.weight": (FFN, HIDDEN),
            f"blk.{i}.ffn_down.weight": (HIDDEN, FFN),
        }
    decoded = {}
    for name, shape in shapes.items():
        data = (1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else 0.05 * rng.standard_normal(shape))
        data = data.astype(np.float32)
        if len(shape) == 2:  # Q4_1: blocks of 32 as d * q + m
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
    from training.convert import packaged_gguf

    with pytest.raises(FileNotFoundError, match="not installed"):
        packaged_gguf("no_such_package_here")
