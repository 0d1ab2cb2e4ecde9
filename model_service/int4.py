"""Weight-only int4 for the lean forward (FastForward.quantize): asymmetric groups in torch's int4
CPU layout, and the weights they stand for."""

from __future__ import annotations

from typing import NamedTuple

import torch


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
    out = w.shape[1]
    padded = torch.nn.functional.pad(w, (0, -out % 16))  # [in, out']: the kernel takes outputs by 16
    q, scale, zero = int4_groups(padded, group)
    scales_and_zeros = torch.stack([scale, zero], dim=-1).transpose(0, 1).contiguous()  # [in / group, out', 2]
    return Int4(torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1), scales_and_zeros, group, out)


def int4_dequantized(w: torch.Tensor, group: int) -> torch.Tensor:
    """The weights [in, out] an int4-packed w stands for, in float32 (tests, error figures)."""
    q, scale, zero = int4_groups(w, group)
    out, inp = q.shape
    g = (q.reshape(out, inp // group, group).float() - 8) * scale.float()[..., None] + zero.float()[..., None]
    return g.reshape(out, inp).t()
