"""FastForward's layer loop, compiled by TorchScript: for one sequence (LAYERS) and for several
laid end to end (LAYERS_BATCHED).

A decode or verify pass of a small model is a thousand-odd small torch calls (SmolLM2-135M: ~55
per layer over 30 layers), and in eager mode each pays Python's argument parsing on top of the
dispatcher, so a large share of a pass is spent around the products rather than in them. The
same operations run by TorchScript's interpreter skip Python per call, and every pass (float32
and int4, one sequence or several) is faster for it; `torch.compile` ran slower than eager at
these sizes (measurements: docs/performance.md). The interpreter releases the GIL while it runs,
as eager kernels do.

`torch.jit.script` is deprecated in torch, though torch 2.13 (pinned) ships it; where it is
missing or refuses these functions, LAYERS and LAYERS_BATCHED are None and FastForward keeps its
eager loop, which computes the same thing.
"""

# TorchScript reads typing.Optional and Union (and reads Union[int, float, complex] as Scalar)
# ruff: noqa: UP007, UP045

from __future__ import annotations

import warnings
from typing import Optional, Union

import torch
import torch.nn.functional as F

from . import q4_kernel  # noqa: F401 - defines torch.ops.specdec.q4_mm's schema, which mm names


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm as transformers computes it: in float32, scaled by the weight in the model's dtype
    (both loops')."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, [x.shape[-1]], weight, eps)
    return weight * F.rms_norm(x.float(), [x.shape[-1]], None, eps).to(x.dtype)


def mm(x: torch.Tensor, w: torch.Tensor, packed: Optional[torch.Tensor], q4: Optional[torch.Tensor],
       q4_scales: Optional[torch.Tensor], group: int, out: int, bias: Optional[torch.Tensor],
       packed_rows: int = 2) -> torch.Tensor:
    """x @ w (+ bias), x [rows, in], w [in, out] (both loops'; FastForward._mm): through specdec's
    kernel where q4 alone is given (its int4 tiles, or float32 panels: q4_kernel), through torch's
    int4 CPU kernel where q4 and q4_scales are (activations in bf16; the first `out` of its padded
    outputs), else
    through oneDNN's packed copy of w from `packed_rows` rows on (FastForward.packed_rows: 1 or 2,
    whichever its load measured faster for one row), else as it is."""
    if q4 is not None and q4_scales is None:
        if q4.dtype == torch.float32:  # specdec's float32 panels (q4_kernel.panel)
            y = torch.ops.specdec.f32_mm(x, q4, out)
        else:
            y = torch.ops.specdec.q4_mm(x, q4, out)
        if bias is not None:
            y = y + bias
        return y
    if q4 is not None and q4_scales is not None:
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), q4, group, q4_scales).to(x.dtype)
        if y.shape[1] != out:
            y = y[:, :out]
        if bias is not None:
            y = y + bias
        return y
    if packed is not None and x.shape[0] >= packed_rows:
        no_scalars: list[Optional[Union[int, float, complex]]] = []  # (TorchScript reads this union as Scalar)
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", no_scalars, "")
    if bias is None:
        return x @ w
    return torch.addmm(bias, x, w)


def qk_norm(qk: torch.Tensor, weight: Optional[torch.Tensor], heads: int, eps: float) -> torch.Tensor:
    """(Qwen3) each head's RMSNorm over head_dim before RoPE: qk [T, H + H_kv, head_dim], its first `heads`
    heads q's, the rest k's; weight [2, head_dim] (q's, k's) or None (the model has none: qk as it is)."""
    if weight is None:
        return qk
    y = F.rms_norm(qk if qk.dtype == torch.float32 else qk.float(), [qk.shape[-1]], None, eps).to(qk.dtype)
    return torch.cat((y[:, :heads] * weight[0], y[:, heads:] * weight[1]), dim=1)


def _qkv(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, i: int, heads: int, kv_heads: int, head_dim: int,
         eps: float, in_norm: list[torch.Tensor], qkv_bias: list[Optional[torch.Tensor]],
         norms: list[Optional[torch.Tensor]], rope: list[bool], w: list[torch.Tensor],
         packed: list[Optional[torch.Tensor]], q4: list[Optional[torch.Tensor]],
         q4_scales: list[Optional[torch.Tensor]], outs: list[int], group: int,
         packed_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer i's RMSNorm, q/k/v and RoPE (where rope[i]): -> qk [T, H + H_kv, head_dim] (rotated), v [T, H_kv,
    head_dim]."""
    total, split, rotate = x.shape[0], (heads + kv_heads) * head_dim, head_dim // 2
    j = 4 * i
    qkv = mm(rms_norm(x, in_norm[i], eps), w[j], packed[j], q4[j], q4_scales[j], group, outs[j], qkv_bias[i],
             packed_rows)
    qk = qk_norm(qkv[:, :split].view(total, heads + kv_heads, head_dim), norms[i], heads, eps)
    if rope[i]:
        qk = qk * cos + torch.cat((-qk[..., rotate:], qk[..., :rotate]), dim=-1) * sin
    return qk, qkv[:, split:].view(total, kv_heads, head_dim)


def _rest(x: torch.Tensor, att: torch.Tensor, i: int, eps: float, post_norm: list[torch.Tensor], half: list[int],
          w: list[torch.Tensor], packed: list[Optional[torch.Tensor]], q4: list[Optional[torch.Tensor]],
          q4_scales: list[Optional[torch.Tensor]], outs: list[int], group: int,
          packed_rows: int) -> torch.Tensor:
    """Layer i after attention (att [T, H * head_dim]): o, residual, RMSNorm, gate/up, SiLU, down, residual."""
    j = 4 * i
    x = x + mm(att, w[j + 1], packed[j + 1], q4[j + 1], q4_scales[j + 1], group, outs[j + 1], None, packed_rows)
    gate_up = mm(rms_norm(x, post_norm[i], eps), w[j + 2], packed[j + 2], q4[j + 2], q4_scales[j + 2], group,
                 outs[j + 2], None, packed_rows)
    hidden = F.silu(gate_up[:, : half[i]]) * gate_up[:, half[i]:]
    return x + mm(hidden, w[j + 3], packed[j + 3], q4[j + 3], q4_scales[j + 3], group, outs[j + 3], None,
                  packed_rows)


def _layers(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor, start: int,
            mask: Optional[torch.Tensor], keep: int, heads: int, kv_heads: int, head_dim: int, eps: float, scaling: list[float],
            in_norm: list[torch.Tensor], post_norm: list[torch.Tensor], half: list[int],
            qkv_bias: list[Optional[torch.Tensor]], norms: list[Optional[torch.Tensor]], rope: list[bool],
            w: list[torch.Tensor],
            packed: list[Optional[torch.Tensor]],
            q4: list[Optional[torch.Tensor]], q4_scales: list[Optional[torch.Tensor]], outs: list[int],
            group: int, packed_rows: int) -> torch.Tensor:
    """Every layer of FastForward.many for one sequence of T new tokens at positions start..start+T-1:
    x [T, D] (embedded), cos/sin [T, 1, head_dim], kv the sequence's cache [L, 2, 1, H_kv, capacity,
    head_dim] (its positions past start are written), mask [T, start+T] (query i sees keys
    0..start+i; None for one token), keep: how many of the last rows the last layer's attention
    output and MLP are computed for (0: all); norms[i]: layer i's q and k heads' RMSNorm weights [2,
    head_dim] or None (qk_norm); rope[i]: whether layer i rotates q and k. Linear j of layer i (q/k/v, o,
    gate/up, down) is entry 4 i + j of w, packed, q4, q4_scales, outs. -> x after the last layer."""
    total = x.shape[0]
    end = start + total
    last = len(in_norm) - 1
    for i in range(len(in_norm)):
        qk, v = _qkv(x, cos, sin, i, heads, kv_heads, head_dim, eps, in_norm, qkv_bias, norms, rope, w, packed, q4,
                     q4_scales, outs, group, packed_rows)
        keys, values = kv[i, 0], kv[i, 1]  # [1, H_kv, capacity, head_dim]
        keys[:, :, start:end] = qk[:, heads:].transpose(0, 1).unsqueeze(0)
        values[:, :, start:end] = v.transpose(0, 1).unsqueeze(0)
        att = F.scaled_dot_product_attention(qk[:, :heads].transpose(0, 1).unsqueeze(0), keys[:, :, :end],
                                             values[:, :, :end], attn_mask=mask, scale=scaling[i],
                                             enable_gqa=kv_heads != heads)  # [1, H, T, head_dim]
        att = att[0].transpose(0, 1).reshape(total, -1)  # [T, H * head_dim]
        if i == last and keep > 0 and keep < total:
            att, x = att[total - keep:], x[total - keep:]
        x = _rest(x, att, i, eps, post_norm, half, w, packed, q4, q4_scales, outs, group, packed_rows)
    return x


def _layers_batched(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kvs: list[torch.Tensor],
                    spans: list[list[int]], masks: list[Optional[torch.Tensor]], pool: Optional[torch.Tensor],
                    slot: list[int], slot_index: list[torch.Tensor], keep: Optional[torch.Tensor],
                    heads: int, kv_heads: int, head_dim: int, eps: float, scaling: list[float],
                    in_norm: list[torch.Tensor], post_norm: list[torch.Tensor], half: list[int],
                    qkv_bias: list[Optional[torch.Tensor]], norms: list[Optional[torch.Tensor]], rope: list[bool],
                    w: list[torch.Tensor],
                    packed: list[Optional[torch.Tensor]], q4: list[Optional[torch.Tensor]],
                    q4_scales: list[Optional[torch.Tensor]], outs: list[int], group: int,
                    packed_rows: int) -> torch.Tensor:
    """Every layer of FastForward.many for several sequences laid end to end in x [T, D]. Attention
    per sequence (pool None): sequence f is rows spans[f] = [a, b, start, end) of x, its cache kvs[f]
    [L, 2, 1, H_kv, capacity, head_dim], its mask masks[f]; or as one call over the pool's slots
    (pool: the pool's [L, 2, slots, H_kv, capacity, head_dim]; slot = [lo, hi, width, keys],
    slot_index = [rows, cols, pos, mask]: slot_attention.SlotBatch). keep: the rows the last layer's
    attention output and MLP are computed for (None: all). Weights as for _layers. -> x after the
    last layer."""
    total = x.shape[0]
    last = len(in_norm) - 1
    for i in range(len(in_norm)):
        qk, v = _qkv(x, cos, sin, i, heads, kv_heads, head_dim, eps, in_norm, qkv_bias, norms, rope, w, packed, q4,
                     q4_scales, outs, group, packed_rows)
        if pool is not None:
            lo, hi, width, reach = slot[0], slot[1], slot[2], slot[3]
            rows, cols, pos, mask = slot_index[0], slot_index[1], slot_index[2], slot_index[3]
            keys, values = pool[i, 0, lo:hi], pool[i, 1, lo:hi]  # [B, H_kv, capacity, head_dim]
            keys[rows, :, pos] = qk[:, heads:]
            values[rows, :, pos] = v
            q = qk.new_zeros(hi - lo, width, heads, head_dim)
            q[rows, cols] = qk[:, :heads]
            out = F.scaled_dot_product_attention(q.transpose(1, 2), keys[:, :, :reach], values[:, :, :reach],
                                                 attn_mask=mask, scale=scaling[i], enable_gqa=kv_heads != heads)
            att = out.transpose(1, 2)[rows, cols].reshape(total, -1)  # [T, H * head_dim]
        else:
            q = qk[:, :heads].transpose(0, 1).unsqueeze(0)  # [1, H, T, head_dim]
            k = qk[:, heads:].transpose(0, 1).unsqueeze(0)  # [1, H_kv, T, head_dim]
            vt = v.transpose(0, 1).unsqueeze(0)
            parts: list[torch.Tensor] = []
            for f in range(len(kvs)):
                a, b, start, end = spans[f][0], spans[f][1], spans[f][2], spans[f][3]
                keys, values = kvs[f][i, 0], kvs[f][i, 1]
                keys[:, :, start:end] = k[:, :, a:b]
                values[:, :, start:end] = vt[:, :, a:b]
                parts.append(F.scaled_dot_product_attention(q[:, :, a:b], keys[:, :, :end], values[:, :, :end],
                                                            attn_mask=masks[f], scale=scaling[i],
                                                            enable_gqa=kv_heads != heads))
            att = torch.cat(parts, dim=2)[0].transpose(0, 1).reshape(total, -1)  # [T, H * head_dim]
        if i == last and keep is not None:
            att, x = att[keep], x[keep]
        x = _rest(x, att, i, eps, post_norm, half, w, packed, q4, q4_scales, outs, group, packed_rows)
    return x


def _script():
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.jit.script's deprecation notice
            return torch.jit.script(_layers), torch.jit.script(_layers_batched)
    except Exception as error:  # noqa: BLE001 - any refusal leaves the eager loop, which is complete
        warnings.warn(f"TorchScript unavailable ({error}); the lean forward runs its layers eagerly",
                      RuntimeWarning, stacklevel=2)
        return None, None


LAYERS, LAYERS_BATCHED = _script()
