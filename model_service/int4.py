"""Weight-only int4 for the lean forward (FastForward.quantize): asymmetric groups in torch's int4
CPU layout, and the weights they stand for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch


class Q4Tiles(NamedTuple):
    """A weight [in, out] in specdec's int4 kernel's layout (q4_kernel.tile): w = d * q + m per
    group of 32 inputs, q in 0..15, d and m float16 (GGUF Q4_1's numbers)."""

    tiles: torch.Tensor  # [ceil(out / 16), in / 32 * 320] uint8
    out: int


def q4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [in, out] -> asymmetric groups of 32 in GGUF Q4_1's form: q [out, in] in 0..15, d, m
    [out, in / 32] float16 with w ~ d * q + m: m = the group's min, d = (max - min) / 15 (both
    rounded to float16 first; q = round((w - m) / d), 0 where d is 0)."""
    wt = w.t().float()
    out, inp = wt.shape
    g = wt.reshape(out, inp // 32, 32)
    m = g.amin(-1).to(torch.float16)
    d = ((g.amax(-1) - m.float()) / 15).to(torch.float16)
    df = d.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))
    q = torch.where(df[..., None] > 0, ((g - m.float()[..., None]) / safe[..., None]).round(), torch.zeros_like(g))
    return q.clamp(0, 15).to(torch.uint8).reshape(out, inp), d, m


class Int4(NamedTuple):
    """A weight [in, out] in torch's int4 CPU layout (FastForward.quantize)."""

    weight: torch.Tensor            # [out', in / 2] uint8: two 4-bit q per byte
    scales_and_zeros: torch.Tensor  # [in / group, out', 2] bf16
    group: int
    out: int                        # outputs; out' rounds it up to a multiple of 16 (the kernel's), with zeros


def int4_groups(w: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [in, out] -> its asymmetric int4 groups (q [out, in] int32 in 0..15; scale, zero [out, in / group]
    bf16): per `group` inputs of each output, scale = (max - min) / 15, q = round((w - min) / scale),
    and w ~ (q - 8) * scale + zero with zero = min + 8 * scale (the kernel's convention)."""
    wt = w.t().float()  # [out, in]
    out, inp = wt.shape
    g = wt.reshape(out, inp // group, group)
    low, high = g.amin(-1), g.amax(-1)  # [out, in / group]
    scale = ((high - low) / 15).clamp(min=torch.finfo(torch.bfloat16).tiny)
    q = ((g - low[..., None]) / scale[..., None]).round().clamp(0, 15).to(torch.int32).reshape(out, inp)
    return q, scale.to(torch.bfloat16), (low + 8 * scale).to(torch.bfloat16)


def int4_pack(w: torch.Tensor, group: int) -> Int4:
    """w [in, out] in torch's int4 CPU layout (see int4_groups)."""
    return groups_pack(*int4_groups(w, group), group)


def groups_pack(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int) -> Int4:
    """Asymmetric int4 groups (q [out, in] in 0..15; scale, zero [out, in / group], w = (q - 8) *
    scale + zero) in torch's int4 CPU layout: outputs padded to a multiple of 16 (the kernel's)
    with zero weights, scale and zero in bf16."""
    out = q.shape[0]
    pad = -out % 16
    q = torch.nn.functional.pad(q.to(torch.int32), (0, 0, 0, pad), value=8)
    scale, zero = (torch.nn.functional.pad(t.to(torch.bfloat16), (0, 0, 0, pad)) for t in (scale, zero))
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [in / group, out', 2]
    return Int4(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros, group, out)


# A GGUF's Q4_1 weights as they shipped, beside the model directory converted from it (training.convert).
Q4_1_BLOCKS = "q4_1_blocks.safetensors"


class Q4_1Blocks(Mapping):
    """The Q4_1 blocks saved beside a converted model, by the transformers name of the weight they
    encode: (q [out, in] int32 in 0..15, d, m [out, in / 32] float32), w = d * q + m. Stored per
    weight as `NAME.q` (uint8 [out, in / 2]: inputs 2j and 2j + 1 in the low and high nibble of
    byte j), `NAME.d` and `NAME.m` (float16, as in the GGUF); each is unpacked when read (the
    whole model's q at once would take 4 bytes a weight)."""

    def __init__(self, stored: dict[str, torch.Tensor]):
        self.stored = stored

    def __getitem__(self, name: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        nibbles = self.stored[name + ".q"].to(torch.int32)
        q = torch.stack([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(nibbles.shape[0], -1)
        return q, self.stored[name + ".d"].float(), self.stored[name + ".m"].float()

    def __iter__(self):
        return (key[:-2] for key in self.stored if key.endswith(".q"))

    def __len__(self) -> int:
        return sum(1 for _ in self)


def read_q4_1_blocks(directory) -> Q4_1Blocks:
    """The blocks beside the model at `directory` (empty without the file)."""
    from pathlib import Path

    from safetensors.torch import load_file

    path = Path(directory) / Q4_1_BLOCKS
    return Q4_1Blocks(load_file(path) if path.is_file() else {})


def q4_1_tensors(blocks: dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """read_q4_1_blocks' inverse: the tensors of its file."""
    tensors = {}
    for name, (q, d, m) in blocks.items():
        q = q.to(torch.uint8)
        tensors |= {name + ".q": (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous(),
                    name + ".d": d.to(torch.float16).contiguous(), name + ".m": m.to(torch.float16).contiguous()}
    return tensors


def int4_dequantized(w: torch.Tensor, group: int) -> torch.Tensor:
    """The weights [in, out] an int4-packed w stands for, in float32 (tests, error figures)."""
    q, scale, zero = int4_groups(w, group)
    out, inp = q.shape
    g = (q.reshape(out, inp // group, group).float() - 8) * scale.float()[..., None] + zero.float()[..., None]
    return g.reshape(out, inp).t()
