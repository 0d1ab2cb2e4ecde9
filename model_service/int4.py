"""Weight-only int4 for the lean forward (--quantize int4): `quantize` turns a FastForward's linears
into asymmetric groups of 4-bit weights, in torch's int4 CPU layout (Int4) or specdec's kernel's
(Q4Tiles, q4_kernel), from its float weights or from a GGUF's Q4_1 blocks as they shipped; and the
weights such groups stand for.

    fast = FastForward.build(model, max_context)
    from_blocks = quantize(fast, 32, read_q4_1_blocks(model_dir), kernel="auto")
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import TYPE_CHECKING, NamedTuple

import torch

from . import q4_kernel

if TYPE_CHECKING:
    from .fast_forward import FastForward


class Q4Tiles(NamedTuple):
    """A weight [in, out] in specdec's int4 kernel's layout (q4_kernel.tile): w = d * q + m per
    group of 32 inputs, q in 0..15, d and m float16 (GGUF Q4_1's numbers)."""

    tiles: torch.Tensor  # [ceil(out / 16), in / 32 * 320] uint8
    out: int


def q4_groups(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [in, out] -> asymmetric groups of 32 in GGUF Q4_1's form: q [out, in] in 0..15, d, m
    [out, in / 32] float16 with w ~ d * q + m: m = the group's min, d = (max - min) / 15 (both
    rounded to float16 first; q = round((w - m) / d), 0 where d is 0)."""
    g = _groups(w)
    q, d, m = _rounded(g, g.amin(-1), g.amax(-1))
    return q.to(torch.uint8).reshape(w.shape[1], w.shape[0]), d, m


def q4_groups_fitted(w: torch.Tensor, steps: int = 6, shrink: float = 0.1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q4_groups' form, each group's range fitted: of the ranges [min + a, max - b] (a and b in
    `steps` steps from 0 to `shrink` of the group's span; a = b = 0 is q4_groups'), the one whose
    rounded weights lie nearest the group's (least squared error; what falls outside is clipped to
    the range's ends)."""
    g = _groups(w)
    low, high = g.amin(-1), g.amax(-1)
    span = high - low
    best = error = None
    for a in torch.linspace(0, shrink, steps).tolist():
        for b in torch.linspace(0, shrink, steps).tolist():
            q, d, m = _rounded(g, low + a * span, high - b * span)
            e = ((q * d.float()[..., None] + m.float()[..., None] - g) ** 2).sum(-1)
            if best is None:
                best, error = (q, d, m), e
                continue
            better = e < error
            error = torch.where(better, e, error)
            best = (torch.where(better[..., None], q, best[0]), torch.where(better, d, best[1]),
                    torch.where(better, m, best[2]))
    q, d, m = best
    return q.to(torch.uint8).reshape(w.shape[1], w.shape[0]), d, m


def _groups(w: torch.Tensor) -> torch.Tensor:
    """w [in, out] -> [out, in / 32, 32] float32."""
    wt = w.t().float()
    return wt.reshape(wt.shape[0], wt.shape[1] // 32, 32)


def _rounded(g: torch.Tensor, low: torch.Tensor, high: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups g [.., 32] on the grid low .. high (m = low, d = (high - m) / 15, both float16) ->
    q (float, 0..15; 0 where d is 0), d, m."""
    m = low.to(torch.float16)
    d = ((high - m.float()) / 15).to(torch.float16)
    df = d.float()
    safe = torch.where(df > 0, df, torch.ones_like(df))
    q = torch.where(df[..., None] > 0, ((g - m.float()[..., None]) / safe[..., None]).round(), torch.zeros_like(g))
    return q.clamp(0, 15), d, m


class Q4Linear(torch.nn.Module):
    """A linear layer over specdec's int4 kernel (q4_kernel: asymmetric 4-bit groups of 32 inputs,
    each activation block of 32 in int8): what an EAGLE head's linears run in on a CPU
    (Eagle3Head.quantize_int4). x [..., in] -> [..., out] in x's dtype."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()  # [out, in]
        self.out_features, self.in_features = w.shape
        if self.in_features % 32:
            raise ValueError(f"the int4 kernel needs inputs in groups of 32, not {self.in_features}")
        if not q4_kernel.load():
            raise RuntimeError(f"specdec's int4 kernel is not built here: {q4_kernel.path()}")
        self.register_buffer("tiles", q4_kernel.tile(*q4_groups_fitted(w.t())))
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.specdec.q4_mm(x.reshape(-1, self.in_features), self.tiles, self.out_features)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int4 groups of 32"


class Int4(NamedTuple):
    """A weight [in, out] in torch's int4 CPU layout (quantize)."""

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


def quantize(fast: FastForward, group_size: int = 32, blocks: Mapping | None = None, kernel: str = "auto") -> int:
    """Weight-only int4 (CPU): every linear of every layer of `fast` and its output layer, in
    asymmetric groups of `group_size` inputs, w = (q - 8) * scale + zero with q in 0..15 (scale and
    zero in bf16; the layout of torch's `_weight_int4pack_mm_for_cpu`, and of a GGUF Q4_1 block of
    32: d * q + m). Activations enter each product in bf16 and leave in the model's dtype; norms,
    attention and the residual stream stay as they were. The float copies of those weights are
    dropped (the embedding stays: the input lookup reads it). From here on this IS the model the
    service runs: its greedy output is this forward's, not the float model's.

    blocks: Q4_1 blocks by transformers weight name (read_q4_1_blocks: a GGUF's weights as they
    shipped). With groups of 32, a linear whose parts all have blocks takes them as they are
    (scale = d, zero = m + 8 d) instead of groups derived from its float weights: the same groups
    where a block spans its 0..15 (min/max quantizers), and the file's own where it does not
    (error-minimising ones). -> how many linears came from blocks.

    kernel: "specdec" runs the products through specdec's own kernel (q4_kernel: activations in
    int8 blocks of 32 against the 4-bit weights, d and m in float16, groups of 32 only), "torch"
    through torch's (bf16 activations, bf16 scales), "auto" specdec's where it is built and the
    groups are 32. The two are different models (their activations and scales are rounded
    differently); the service runs the one chosen."""
    if fast.embed.device.type != "cpu":
        raise ValueError("--quantize int4 runs on CPU only (torch's int4 CPU kernel)")
    if group_size not in (32, 64, 128, 256):
        raise ValueError(f"--quant-group must be 32, 64, 128 or 256, not {group_size}")
    widths = {layer[name].shape[0] for layer in fast.layers for name in fast.PARTS} | {fast.lm_head.shape[0]}
    if any(width % group_size for width in widths):
        raise ValueError(f"--quant-group {group_size} does not divide the model's widths {sorted(widths)}")
    if kernel not in ("auto", "specdec", "torch"):
        raise ValueError(f"--int4-kernel must be auto, specdec or torch, not {kernel!r}")
    if kernel == "specdec" and group_size != 32:
        raise ValueError("--int4-kernel specdec runs groups of 32 only")
    if kernel == "specdec" and not q4_kernel.available():
        raise ValueError(f"--int4-kernel specdec: the kernel is {q4_kernel.path()}")
    if kernel == "auto":
        kernel = "specdec" if group_size == 32 and q4_kernel.available() else "torch"
        if group_size == 32 and kernel == "torch":
            warnings.warn(f"specdec's int4 kernel is {q4_kernel.path()}; int4 runs on torch's", RuntimeWarning,
                          stacklevel=2)
    fast.int4_group, fast.int4_kernel = group_size, kernel
    empty = torch.empty(0, dtype=fast.embed.dtype)
    from_blocks = 0
    if blocks and group_size == 32 and fast.world == 1:
        for i, layer in enumerate(fast.layers):
            for name, parts in fast.PARTS.items():
                found = [blocks.get(f"model.layers.{i}.{part}.weight") for part in parts]
                if all(b is not None for b in found):
                    q, d, m = (torch.cat(t) for t in zip(*found))  # outputs of the parts, in _fuse's order
                    order = fast.qkv_order(layer["sizes"]) if name == "qkv" else None
                    if order is not None:  # (as _fuse keeps q's and k's heads: head_order)
                        q, d, m = q[order], d[order], m[order]
                    if name in fast.folded:  # w = d q + m times the factor its float weights took
                        d, m = d * fast.folded[name], m * fast.folded[name]
                    if tuple(q.shape) != tuple(layer[name].shape[::-1]):
                        raise ValueError(f"Q4_1 blocks of layer {i}'s {name} are {tuple(q.shape)},"
                                         f" its weight {tuple(layer[name].shape[::-1])}")
                    layer[f"{name}_packed"] = q4_1_packed(q, d, m, kernel)
                    layer[name] = empty  # so pack() leaves it as it is
                    from_blocks += 1
    fast.pack()  # (pack_int4, for the rest)
    for layer in fast.layers:  # (the HF modules' weights were views of these: they go too)
        for name in fast.PARTS:
            layer[name] = empty
    for layer in fast.model.model.layers:
        for parts in fast.PARTS.values():
            for part in parts:
                layer.get_submodule(part).weight.data = empty
    head = fast.model.get_output_embeddings()
    if head.weight.data_ptr() != fast.embed.data_ptr():
        head.weight.data = empty
    fast.lm_head = empty
    fast._script_args = None
    return from_blocks


def q4_1_packed(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, kernel: str) -> Int4 | Q4Tiles:
    """Groups of 32 in Q4_1's form (w = d * q + m, q [out, in]) in `kernel`'s layout."""
    if kernel == "specdec":
        return Q4Tiles(q4_kernel.tile(q, d, m), q.shape[0])
    return groups_pack(q, d, m + 8 * d, 32)


def pack_int4(fast: FastForward) -> None:
    """Every float linear `fast` still holds (each layer's, the output layer) in its int4 layout
    (FastForward.pack, once quantized)."""
    def packed(w: torch.Tensor) -> Int4 | Q4Tiles:  # w [in, out]
        if fast.int4_kernel == "specdec":
            return q4_1_packed(*q4_groups(w), "specdec")
        return int4_pack(w, fast.int4_group)

    with torch.inference_mode():
        for layer in fast.layers:
            for name in fast.PARTS:
                if layer[name].numel():
                    layer[f"{name}_packed"] = packed(layer[name])
        if fast.lm_head.numel():
            fast.lm_head_packed = packed(fast.lm_head)
