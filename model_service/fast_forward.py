"""A lean decoder forward for Llama-family models, over a preallocated KV cache.

At the sizes speculative decoding drafts with, a transformers forward costs more in
Python than in arithmetic: the shipped 2 M-parameter draft spends ~2.7 ms per token
in `LlamaForCausalLM.forward` on one CPU core, most of it module dispatch, mask
building and cache bookkeeping. This module runs the same weights with the fewest
torch calls: q/k/v and gate/up each in one matmul (the HF modules' weights become
views into the fused tensors, so nothing is stored twice), RMSNorm as one
`F.rms_norm`, attention as one `scaled_dot_product_attention` over a KV cache that
grows in place and rolls back by moving an index.

It takes the rotary embedding from the HF model itself, so every RoPE variant
transformers implements is computed the same way. Architectures it does not know,
or features it does not implement (a sliding window shorter than the context,
attention soft-capping...), keep the transformers forward: `FastForward.build`
returns None for them and `ModelRunner` falls back.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F

from . import q4_kernel, scripted
from .int4 import Int4, Q4Tiles, groups_pack, int4_pack, q4_groups
from .kv_cache import POOL_CAPACITY, KVCache, KVPool

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # --dtype

SUPPORTED = {"llama", "mistral", "qwen2"}
# weights with fewer elements stay unpacked (see FastForward.pack): oneDNN's ~25-40 us per call
# outweighs its gain on them. Measured on the shipped pair: the draft's [160, 480] q/k/v takes
# 17 us for 2 rows through x @ w and 44 packed, and its draft step over 2 sessions 1.32 ms with
# it and gate/up unpacked against 1.50 all packed; the target's [384, 1152] q/k/v is even alone
# but its verify pass is ~10% slower with it unpacked; its [160, 8192] lm_head: 293 vs 170 us.
PACK_MIN_ELEMENTS = 1 << 18
# a pass over several pooled sessions runs attention as one call over their slots when its padded
# work (slots spanned x longest feed x furthest position) is at most this many times the feeds'
# own (each feed's tokens x its positions); else per session
POOL_PADDING = 2.0


@dataclass
class SlotBatch:
    """One attention call over a pool's slots lo..hi-1 (see FastForward._slot_batch)."""
    lo: int
    hi: int
    width: int  # queries per row
    keys: int  # positions each row's keys span
    rows: torch.Tensor  # [T]: each new token's row (its slot - lo)
    cols: torch.Tensor  # [T]: its query within the row
    pos: torch.Tensor  # [T]: its position
    mask: torch.Tensor  # [B, 1, width, keys]: 0 where a query sees a key, -inf elsewhere


class FastForward:
    """The forward pass of one loaded HF Llama/Mistral/Qwen2 causal LM.

    Weights are kept as [in, out] (transposed) and applied as `x @ w`: for the few rows a
    decode or verify step multiplies, that runs 25-60% faster than `F.linear` on the
    [out, in] layout on the CPUs measured (the lm_head of the shipped target: 1.0 -> 0.4 ms
    for one row), and no slower for many rows. The HF modules' weights become views of
    these tensors, so nothing is stored twice.
    """

    def __init__(self, model, max_context: int, pool_capacity: int = POOL_CAPACITY):
        config = model.config
        self.model = model
        self.rotary = model.model.rotary_emb
        embed, head = model.model.embed_tokens, model.get_output_embeddings()
        self.lm_head = head.weight.data.t().contiguous()  # [D, V]
        head.weight.data = self.lm_head.t()
        self.embed = embed.weight  # the same tensor as lm_head when they are tied
        self.vocab_size = self.lm_head.shape[1]
        self.final_norm = model.model.norm
        self.eps = config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = [self._fuse(layer) for layer in model.model.layers]
        # tensor parallelism (see shard()): the ranks the weights are split over, the sum of the ranks'
        # partial products, the ranks' logits side by side
        self.world = 1
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.rope_table = self._rope_table(max_context)
        self.lm_head_packed: torch.Tensor | None = None
        self.head_ids: torch.Tensor | None = None  # restrict_head: the ids the output layer scores, [N]
        self.pack_min = PACK_MIN_ELEMENTS
        self.int4_group = 0  # quantize(): weight-only int4 in groups of this many inputs (0: off)
        self.int4_kernel = "torch"  # quantize(): whose kernel runs it, "specdec" (q4_kernel) or "torch"
        # with specdec's kernel, one sequence's layers run in its C++ loop (q4_kernel: q4_layers) rather
        # than TorchScript's; off: TorchScript's loop over the same products (A/B, tests)
        self.fused_layers = True
        # the layer loop through TorchScript (scripted.py) on CPU; CUDA keeps the eager
        # loop, which has not been measured against it there
        self.scripted = scripted.LAYERS is not None and self.embed.device.type == "cpu"
        self._script_args: tuple | None = None  # its weight lists, made by the first pass that uses them
        self._all_tiles = False  # made with them: every linear in specdec's int4 tiles, float32 activations
        self.pack()
        self.pool_capacity = pool_capacity  # 0: every session's cache on its own (no batched attention)
        self.pool: KVPool | None = None  # made by the first new_cache (after to() and shard())

    def _rope_table(self, max_context: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """cos and sin of every position, [max_context, head_dim] each, from the HF rotary module
        itself, so a pass indexes rows instead of recomputing them. None for RoPE variants whose
        frequencies change with the sequence length (dynamic, longrope): those call the module."""
        rope_type = getattr(self.rotary, "rope_type", "default")
        if not isinstance(rope_type, str) or rope_type in ("dynamic", "longrope"):
            return None
        device = self.embed.device
        x = torch.zeros(1, 1, self.head_dim, dtype=self.embed.dtype, device=device)
        with torch.inference_mode():
            cos, sin = self.rotary(x, torch.arange(max_context, device=device)[None])
        return cos[0], sin[0]

    @classmethod
    def build(cls, model, max_context: int, pool_capacity: int = POOL_CAPACITY) -> FastForward | None:
        """The fast forward for `model`, or None where it would not compute the same thing."""
        config = model.config
        if config.model_type not in SUPPORTED or getattr(config, "hidden_act", "silu") != "silu":
            return None
        if getattr(config, "attention_bias", False) and config.model_type != "qwen2":
            return None
        if getattr(config, "mlp_bias", False) or getattr(config, "pretraining_tp", 1) > 1:
            return None
        window = getattr(config, "sliding_window", None)
        if window is not None and getattr(config, "use_sliding_window", True) and window < max_context:
            return None
        return cls(model, max_context, pool_capacity)

    def pack(self) -> None:
        """On CPU, also keep the wide weights (each layer's linears, lm_head) in oneDNN's packed layout.

        MKL's sgemm is slow for the few rows of a verify step: on the 2-core AVX2 machine this was
        measured on, x @ w with a [384, 8192] lm_head takes 2.0 ms for 4 rows and 2.8 ms for 14,
        against 1.0 and 1.8 ms packed; for q/k/v and gate/up, 1.3-1.4x at 2-14 rows. One row
        stays on x @ w, which is faster there (0.4 vs 0.8 ms for that lm_head). o and down too
        since 2026-11-25: SmolLM2-135M's verify pass (2 threads, AMX Xeon, 200 cached positions,
        three interleaved medians) at K = 4 / 8 / 16 took 34.7 / 41.2 / 47.0 ms with them
        unpacked and 32.4 / 37.6 / 45.7 packed (0.93x / 0.91x / 0.97x). The cost is a second copy
        of these weights in memory (o and down: 146 MB more for SmolLM2 in float32). Weights under
        `pack_min` elements stay unpacked (see PACK_MIN_ELEMENTS). Elsewhere (CUDA, no oneDNN,
        half precision) nothing is packed.
        """
        if self.int4_group:
            self._pack_int4()
            return
        on = (self.embed.device.type == "cpu" and self.embed.dtype == torch.float32
              and torch.backends.mkldnn.is_available())
        with torch.inference_mode():
            def packed(w: torch.Tensor) -> torch.Tensor | None:  # w [in, out]
                if not on or w.numel() < self.pack_min:
                    return None
                return torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), 16)

            for layer in self.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    layer[f"{name}_packed"] = packed(layer[name])
            self.lm_head_packed = packed(self.lm_head)
        self._script_args = None  # (the TorchScript loop's weight lists hold the packed copies)

    # the transformers weights each fused linear of layer i is made of (_fuse), in order
    PARTS: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
        "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}

    def quantize(self, group_size: int = 32, blocks: dict | None = None, kernel: str = "auto") -> int:
        """Weight-only int4 (CPU): every linear of every layer and the output layer, in asymmetric
        groups of `group_size` inputs, w = (q - 8) * scale + zero with q in 0..15 (scale and zero in
        bf16; the layout of torch's `_weight_int4pack_mm_for_cpu`, and of a GGUF Q4_1 block of 32:
        d * q + m). Activations enter each product in bf16 and leave in the model's dtype; norms,
        attention and the residual stream stay as they were. The float copies of those weights are
        dropped (the embedding stays: the input lookup reads it). From here on this IS the model the
        service runs: its greedy output is this forward's, not the float model's.

        blocks: Q4_1 blocks by transformers weight name (int4.read_q4_1_blocks: a GGUF's weights as
        they shipped). With groups of 32, a linear whose parts all have blocks takes them as they
        are (scale = d, zero = m + 8 d) instead of groups derived from its float weights: the same
        groups where a block spans its 0..15 (min/max quantizers), and the file's own where it
        does not (error-minimising ones). -> how many linears came from blocks.

        kernel: "specdec" runs the products through specdec's own kernel (q4_kernel: activations
        in int8 blocks of 32 against the 4-bit weights, d and m in float16, groups of 32 only),
        "torch" through torch's (bf16 activations, bf16 scales), "auto" specdec's where it is
        built and the groups are 32. The two are different models (their activations and scales
        are rounded differently); the service runs the one chosen."""
        if self.embed.device.type != "cpu":
            raise ValueError("--quantize int4 runs on CPU only (torch's int4 CPU kernel)")
        if group_size not in (32, 64, 128, 256):
            raise ValueError(f"--quant-group must be 32, 64, 128 or 256, not {group_size}")
        widths = {w.shape[0] for layer in self.layers for w in (layer["qkv"], layer["o"], layer["gate_up"],
                                                                 layer["down"])} | {self.lm_head.shape[0]}
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
        self.int4_group, self.int4_kernel = group_size, kernel
        empty = torch.empty(0, dtype=self.embed.dtype)
        from_blocks = 0
        if blocks and group_size == 32 and self.world == 1:
            for i, layer in enumerate(self.layers):
                for name, parts in self.PARTS.items():
                    found = [blocks.get(f"model.layers.{i}.{part}.weight") for part in parts]
                    if all(b is not None for b in found):
                        q, d, m = (torch.cat(t) for t in zip(*found))  # outputs of the parts, in _fuse's order
                        if tuple(q.shape) != tuple(layer[name].shape[::-1]):
                            raise ValueError(f"Q4_1 blocks of layer {i}'s {name} are {tuple(q.shape)},"
                                             f" its weight {tuple(layer[name].shape[::-1])}")
                        layer[f"{name}_packed"] = self._q4_1_packed(q, d, m)
                        layer[name] = empty  # so pack() leaves it as it is
                        from_blocks += 1
        self.pack()
        for layer in self.layers:  # (the HF modules' weights were views of these: they go too)
            for name in ("qkv", "o", "gate_up", "down"):
                layer[name] = empty
        for layer in self.model.model.layers:
            for linear in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj,
                           layer.self_attn.o_proj, layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
                linear.weight.data = empty
        head = self.model.get_output_embeddings()
        if head.weight.data_ptr() != self.embed.data_ptr():
            head.weight.data = empty
        self.lm_head = empty
        self._script_args = None
        return from_blocks

    def _q4_1_packed(self, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> Int4 | Q4Tiles:
        """Groups of 32 in Q4_1's form (w = d * q + m, q [out, in]) in the quantize kernel's layout."""
        if self.int4_kernel == "specdec":
            return Q4Tiles(q4_kernel.tile(q, d, m), q.shape[0])
        return groups_pack(q, d, m + 8 * d, 32)

    def _pack_int4(self) -> None:
        def packed(w: torch.Tensor) -> Int4 | Q4Tiles:  # w [in, out]
            if self.int4_kernel == "specdec":
                return self._q4_1_packed(*q4_groups(w))
            return int4_pack(w, self.int4_group)

        with torch.inference_mode():
            for layer in self.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    if layer[name].numel():
                        layer[f"{name}_packed"] = packed(layer[name])
            if self.lm_head.numel():
                self.lm_head_packed = packed(self.lm_head)

    def restrict_head(self, ids: torch.Tensor) -> None:
        """Score only `ids` ([N], distinct): the output layer keeps their columns and every other
        logit is -inf, so their probability is exactly 0 (FR-Spec, Zhao et al. 2025: a draft's
        output layer over the most frequent tokens). For a draft this keeps speculative decoding
        exact (q = 0 where it cannot propose; rejection sampling needs nothing else) and cuts the
        layer that dominates a small draft's step by V / N. Never for a target."""
        if self.gather is not None:
            raise ValueError("a restricted output layer is not sharded")
        if self.int4_group:
            raise ValueError("restrict the output layer before quantizing")
        self.head_ids = ids.to(self.lm_head.device)
        self.lm_head = self.lm_head[:, self.head_ids].contiguous()  # [D, N]; the HF module keeps the full one
        self.lm_head_packed = None
        self.pack()

    def weight_bytes(self) -> int:
        """Bytes of weights one single-token pass reads (every layer's linears and norms, the final
        norm, the output layer as it runs: int4-packed with its scales, or float; one embedding row):
        a decode pass can be no faster than this over the memory bandwidth."""
        def size(w: torch.Tensor | Int4 | Q4Tiles | None) -> int:
            if isinstance(w, Int4):
                return size(w.weight) + size(w.scales_and_zeros)
            if isinstance(w, Q4Tiles):
                return size(w.tiles)
            return 0 if w is None else w.numel() * w.element_size()

        total = self.embed.shape[1] * self.embed.element_size() + size(self.final_norm.weight)
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                packed = layer.get(f"{name}_packed")
                total += size(packed if isinstance(packed, (Int4, Q4Tiles)) else layer[name])
            total += size(layer["in_norm"]) + size(layer["post_norm"]) + size(layer["qkv_bias"])
        return total + size(self.lm_head_packed if isinstance(self.lm_head_packed, (Int4, Q4Tiles)) else self.lm_head)

    @staticmethod
    def _mm(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | Int4 | Q4Tiles | None,
            bias: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w (+ bias): x [rows, in], w [in, out]; through `packed` (w's packed copy, if any) for
        several rows; through an Int4 or Q4Tiles (quantize) for every row (scripted.mm, which both
        loops run)."""
        if isinstance(packed, Q4Tiles):
            return scripted.mm(x, w, None, packed.tiles, None, 32, packed.out, bias)
        if isinstance(packed, Int4):
            return scripted.mm(x, w, None, packed.weight, packed.scales_and_zeros, packed.group, packed.out, bias)
        return scripted.mm(x, w, packed, None, None, 0, 0, bias)

    def new_cache(self) -> KVCache:
        args = (len(self.layers), self.kv_heads, self.head_dim, self.embed.dtype, self.embed.device)
        if self.pool_capacity <= 0:
            return KVCache(*args)
        if self.pool is None:
            self.pool = KVPool(*args, max_capacity=self.pool_capacity)
        return KVCache(*args, pool=self.pool)

    @staticmethod
    def _transposed(linears) -> torch.Tensor:
        """The linears' weights side by side as one [in, sum(out)] tensor; each linear's weight
        becomes a view of its block."""
        fused = torch.cat([m.weight.data for m in linears]).t().contiguous()
        for m, block in zip(linears, fused.split([m.weight.shape[0] for m in linears], dim=1)):
            m.weight.data = block.t()
        return fused

    @classmethod
    def _fuse(cls, layer) -> dict:
        """Fuse q/k/v and gate/up, transpose every weight (see the class docstring)."""
        attn, mlp = layer.self_attn, layer.mlp
        parts = [layer.get_submodule(name) for name in cls.PARTS["qkv"]]
        sizes = [p.weight.shape[0] for p in parts]
        qkv_bias = None
        if attn.q_proj.bias is not None:
            qkv_bias = torch.cat([p.bias.data for p in parts])
            for p, view in zip(parts, qkv_bias.split(sizes)):
                p.bias.data = view
        return {
            "in_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
            "qkv": cls._transposed(parts), "qkv_bias": qkv_bias, "sizes": sizes,
            "o": cls._transposed([attn.o_proj]),
            "gate_up": cls._transposed([layer.get_submodule(name) for name in cls.PARTS["gate_up"]]),
            "half": mlp.gate_proj.weight.shape[0], "down": cls._transposed([mlp.down_proj]),
            "scaling": getattr(attn, "scaling", None),
        }

    def __call__(self, input_ids: list[int], cache: KVCache, num_logits: int) -> torch.Tensor:
        """Append `input_ids` to `cache`; -> logits of the last `num_logits` of them, [num_logits, V]."""
        return self.many([(input_ids, cache, num_logits)])[0]

    @torch.inference_mode()
    def many(self, feeds: list[tuple[list[int], KVCache, int]]) -> list[torch.Tensor]:
        """One forward pass over several sequences, each (input_ids, its cache, num_logits).

        The sequences' new tokens are laid end to end ("ragged" batching: no padding), so
        every matrix multiply runs once for all of them. Attention runs per sequence, each
        over its own cache with its own positions, or, where the caches are slots of this
        forward's pool, as one call over those slots (see `_slot_batch`). -> each feed's
        [num_logits, V].
        """
        device = self.embed.device
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        spans, positions, ids = [], [], []
        offset = 0
        for input_ids, cache, _ in feeds:
            n, start = len(input_ids), cache.length
            cache.reserve(start + n)
            spans.append((offset, offset + n, start, start + n))
            positions.append(torch.arange(start, start + n, device=device))
            ids.extend(input_ids)
            offset += n
        total = offset
        slots = self._slot_batch(feeds, spans)
        masks = []
        if slots is None:  # query i of a sequence sits at position start+i and sees keys 0..start+i
            masks = [torch.ones(b - a, end, dtype=torch.bool, device=device).tril(diagonal=start) if b - a > 1 else None
                     for a, b, start, end in spans]
        x = F.embedding(torch.tensor(ids, dtype=torch.long, device=device), self.embed)  # [T, D]
        position = positions[0] if len(feeds) == 1 else torch.cat(positions)  # [T]
        if self.rope_table is not None:
            cos, sin = self.rope_table[0][position], self.rope_table[1][position]  # [T, head_dim]
        else:  # each sequence's own call: these variants pick their frequencies from the call's longest position
            tables = [self.rotary(x[None], p[None]) for p in positions]
            cos, sin = (torch.cat([t[i][0] for t in tables]) for i in (0, 1))
        cos, sin = cos[:, None], sin[:, None]  # [T, 1, head_dim]: broadcast over heads
        # the rows whose logits are asked for (each feed's last num_logits), where fewer than all: the
        # last layer needs every row's keys and values but only these rows' attention output and MLP
        # (a prompt's pass: 1 row of ~100 needs them, 12% of a 6-layer model's arithmetic)
        keep = None
        if sum(n for _, _, n in feeds) < total:
            if len(feeds) == 1:
                keep = slice(total - feeds[0][2], total)
            else:
                keep = torch.tensor([r for (_, _, n), (_, b, _, _) in zip(feeds, spans) for r in range(b - n, b)],
                                    dtype=torch.long).to(device)
        last = len(self.layers) - 1
        if self.scripted and self.reduce is None:  # the same layers, run by TorchScript (see scripted.py)
            if len(feeds) == 1 and self._runs_q4_layers():
                scaling, in_norm, post_norm, half, qkv_bias, _, _, tiles, _, outs, _ = self._scripted_args()
                x = torch.ops.specdec.q4_layers(x, cos, sin, feeds[0][1].data, spans[0][2], feeds[0][2], heads,
                                                kv_heads, head_dim, self.eps, scaling, in_norm, post_norm, half,
                                                qkv_bias, tiles, outs)
            elif len(feeds) == 1:
                x = scripted.LAYERS(x, cos, sin, feeds[0][1].data, spans[0][2], masks[0], feeds[0][2], heads,
                                    kv_heads, head_dim, self.eps, *self._scripted_args())
            elif slots is not None:
                x = scripted.LAYERS_BATCHED(
                    x, cos, sin, [], [], [], self.pool.data, [slots.lo, slots.hi, slots.width, slots.keys],
                    [slots.rows, slots.cols, slots.pos, slots.mask], keep, heads, kv_heads, head_dim, self.eps,
                    *self._scripted_args())
            else:
                x = scripted.LAYERS_BATCHED(
                    x, cos, sin, [cache.data for _, cache, _ in feeds], [list(span) for span in spans], masks, None,
                    [], [], keep, heads, kv_heads, head_dim, self.eps, *self._scripted_args())
            layers = []  # done
        else:
            layers = self.layers
        for i, layer in enumerate(layers):
            h = self._norm(x, layer["in_norm"])
            qkv = self._mm(h, layer["qkv"], layer["qkv_packed"], layer["qkv_bias"])  # [T, (H + 2 H_kv) head_dim]
            # RoPE on q and k at once: they are the first H + H_kv heads of qkv
            qk = qkv[:, : (heads + kv_heads) * head_dim].view(total, heads + kv_heads, head_dim)
            qk = qk * cos + _rotate_half(qk) * sin
            v = qkv[:, (heads + kv_heads) * head_dim :].view(total, kv_heads, head_dim)  # [T, H_kv, head_dim]
            if slots is not None:
                att = self._slot_attention(i, layer, slots, qk, v)
            else:
                q = qk[:, :heads].transpose(0, 1)[None]  # [1, H, T, head_dim]
                k = qk[:, heads:].transpose(0, 1)[None]  # [1, H_kv, T, head_dim]
                v = v.transpose(0, 1)[None]
                outs = []
                for (_, cache, _), (a, b, start, end), mask in zip(feeds, spans, masks):
                    keys, values = cache.data[i, 0], cache.data[i, 1]
                    keys[:, :, start:end] = k[:, :, a:b]
                    values[:, :, start:end] = v[:, :, a:b]
                    outs.append(F.scaled_dot_product_attention(
                        q[:, :, a:b], keys[:, :, :end], values[:, :, :end], attn_mask=mask, scale=layer["scaling"],
                        enable_gqa=kv_heads != heads,
                    ))
                att = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, H, T, head_dim]
                att = att[0].transpose(0, 1)  # [T, H, head_dim]
            att = att.reshape(total, -1)  # [T, H * head_dim]
            if i == last and keep is not None:
                att, x = att[keep], x[keep]  # [rows, ...] from here on
            x = x + self._reduced(self._mm(att, layer["o"], layer.get("o_packed")))
            h = self._norm(x, layer["post_norm"])
            gate, up = self._mm(h, layer["gate_up"], layer["gate_up_packed"]).split(layer["half"], dim=-1)
            x = x + self._reduced(self._mm(F.silu(gate) * up, layer["down"], layer.get("down_packed")))
        for (_, cache, _), (_, _, _, end) in zip(feeds, spans):
            cache.length = end
        # x: the asked rows only (see keep), each feed's last num_logits in feed order
        logits = self._mm(self._norm(x, self.final_norm.weight), self.lm_head, self.lm_head_packed)  # [rows, V / world]
        if self.gather is not None:
            logits = self.gather(logits)  # [rows, V]
        if self.head_ids is not None:  # [rows, N] -> [rows, V], -inf where the head does not score
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            logits = full.index_copy_(1, self.head_ids, logits)
        return list(logits.split([n for _, _, n in feeds]))

    def _runs_q4_layers(self) -> bool:
        """Whether a one-sequence pass runs its layers in specdec's C++ loop (q4_kernel's q4_layers):
        every linear in its int4 tiles, float32 activations, `fused_layers` on."""
        if not self.fused_layers:
            return False
        self._scripted_args()  # (which finds _all_tiles when the weights changed)
        return self._all_tiles

    def _scripted_args(self) -> tuple:
        """The weights as scripted.LAYERS takes them (from `scaling` on), made once per weight change
        (with `_all_tiles`: whether they all suit q4_layers, _runs_q4_layers)."""
        if self._script_args is None:
            linears = [(layer[name], layer.get(f"{name}_packed")) for layer in self.layers
                       for name in ("qkv", "o", "gate_up", "down")]
            self._script_args = (
                [self.head_dim ** -0.5 if layer["scaling"] is None else float(layer["scaling"]) for layer in self.layers],
                [layer["in_norm"] for layer in self.layers], [layer["post_norm"] for layer in self.layers],
                [layer["half"] for layer in self.layers], [layer["qkv_bias"] for layer in self.layers],
                [w for w, _ in linears],
                [None if isinstance(p, (Int4, Q4Tiles)) else p for _, p in linears],
                [p.weight if isinstance(p, Int4) else p.tiles if isinstance(p, Q4Tiles) else None for _, p in linears],
                [p.scales_and_zeros if isinstance(p, Int4) else None for _, p in linears],
                [p.out if isinstance(p, (Int4, Q4Tiles)) else w.shape[1] for w, p in linears],
                self.int4_group,
            )
            self._all_tiles = self.embed.dtype == torch.float32 and all(isinstance(p, Q4Tiles) for _, p in linears)
        return self._script_args

    def _slot_batch(self, feeds, spans) -> SlotBatch | None:
        """How one attention call per layer covers these feeds, or None where it would not pay.

        It covers the pool's slots lo..hi-1 (those of the feeds and any between them) as a batch
        of hi - lo rows of `width` queries each, the longest feed's new tokens: query j of a feed
        that starts at position `start` sees keys 0..start+j, padding queries (past a feed's
        tokens, or in a slot no feed has) see what its last query sees or key 0, and their
        outputs are dropped. Measured on the shipped pair, 2 threads, 8 sessions of 100-256
        positions, 30 interleaved pairs: a target pass of 5 tokens each 19.30 -> 17.64 ms, a
        draft step 2.30 -> 1.89 ms; on one thread the target gains nothing and the draft 14%.
        """
        if len(feeds) < 2 or self.pool is None or not all(c.pooled and c.pool is self.pool for _, c, _ in feeds):
            return None
        taken = [c.slot for _, c, _ in feeds]
        lo, hi = min(taken), max(taken) + 1
        width = max(b - a for a, b, _, _ in spans)
        keys = max(end for _, _, _, end in spans)
        # the call's work, queries x keys, against the feeds' own
        if (hi - lo) * width * keys > POOL_PADDING * sum((b - a) * end for a, b, _, end in spans):
            return None
        device = self.embed.device
        rows, cols, pos = [], [], []
        starts, last = [0] * (hi - lo), [0] * (hi - lo)  # each row's first and last query position
        for slot, (a, b, start, end) in zip(taken, spans):
            rows.extend([slot - lo] * (b - a))
            cols.extend(range(b - a))
            pos.extend(range(start, end))
            starts[slot - lo], last[slot - lo] = start, end - 1  # (a slot no feed has: key 0)
        # built on the host and sent as two tensors: on a GPU each copy is a wait
        tokens = torch.tensor([rows, cols, pos], dtype=torch.long).to(device)  # [3, T]
        per_row = torch.tensor([starts, last], dtype=torch.long).to(device)  # [2, B]
        # the position each padded query sits at: start + j, at most its row's last
        at = torch.minimum(per_row[0][:, None] + torch.arange(width, device=device)[None], per_row[1][:, None])
        mask = torch.zeros(hi - lo, 1, width, keys, dtype=self.embed.dtype, device=device)
        mask.masked_fill_((torch.arange(keys, device=device)[None, None] > at[:, :, None])[:, None], float("-inf"))
        return SlotBatch(lo, hi, width, keys, *tokens, mask)

    def _slot_attention(self, i: int, layer: dict, batch: SlotBatch, qk: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Layer i's attention over the pool's slots: qk [T, H + H_kv, head_dim] (after RoPE),
        v [T, H_kv, head_dim] -> [T, H, head_dim]."""
        heads = self.heads
        keys, values = self.pool.data[i, :, batch.lo : batch.hi]  # [B, H_kv, capacity, head_dim] each
        keys[batch.rows, :, batch.pos] = qk[:, heads:]
        values[batch.rows, :, batch.pos] = v
        q = qk.new_zeros(batch.hi - batch.lo, batch.width, heads, self.head_dim)
        q[batch.rows, batch.cols] = qk[:, :heads]
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys[:, :, : batch.keys], values[:, :, : batch.keys],
            attn_mask=batch.mask, scale=layer["scaling"], enable_gqa=self.kv_heads != heads,
        )  # [B, H, width, head_dim]
        return out.transpose(1, 2)[batch.rows, batch.cols]

    def to(self, device: torch.device) -> FastForward:
        """Move the model to `device`; for a sharded forward (see shard), whose tensors no longer
        alias the HF modules' weights. -> self"""
        self.model.to(device)
        self.lm_head = self.lm_head.to(device)
        if self.head_ids is not None:
            self.head_ids = self.head_ids.to(device)
        for layer in self.layers:
            for key in ("qkv", "qkv_bias", "o", "gate_up", "down"):
                if layer[key] is not None:
                    layer[key] = layer[key].to(device)
        if self.rope_table is not None:
            self.rope_table = tuple(t.to(device) for t in self.rope_table)
        self.pack()
        self.scripted = scripted.LAYERS is not None and torch.device(device).type == "cpu"
        self.pool = None  # the next session's cache starts a pool on `device`
        return self

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.reduce is None else self.reduce(partial)

    def shard(self, rank: int, world: int) -> None:
        """Keep this rank's 1/world of every layer (Megatron's split, as gpt-fast's `apply_tp`).

        q/k/v and gate/up are split by output columns: rank r computes heads r*H/world..
        and the matching MLP columns. o and down are split by input rows, so each rank's
        product is a partial sum of x's update and `reduce` (an all-reduce) completes it.
        lm_head is split by vocabulary columns and `gather` lays the ranks' logits side by
        side. The embedding and the norms stay whole. The HF modules' weights are emptied:
        only this forward runs a sharded model. (A tensor-parallel rank reads the same split
        straight from the checkpoint instead: loading.load_model, then `adopt_shard`.)
        """
        check_shardable(self.model.config, world)
        if self.world != 1:
            raise ValueError(f"this forward is sharded over {self.world} ranks already")

        def cols(w: torch.Tensor, size: int) -> torch.Tensor:  # [in, size] block of rank r
            return w[..., rank * size : (rank + 1) * size]

        for layer in self.layers:
            q, k, v = layer["qkv"].split(layer["sizes"], dim=-1)
            sizes = [s // world for s in layer["sizes"]]
            layer["qkv"] = torch.cat([cols(q, sizes[0]), cols(k, sizes[1]), cols(v, sizes[2])], dim=-1)
            if layer["qkv_bias"] is not None:
                bq, bk, bv = layer["qkv_bias"].split(layer["sizes"])
                layer["qkv_bias"] = torch.cat([cols(bq, sizes[0]), cols(bk, sizes[1]), cols(bv, sizes[2])])
            layer["sizes"] = sizes
            layer["o"] = layer["o"][rank * sizes[0] : (rank + 1) * sizes[0]].contiguous()
            gate, up = layer["gate_up"].split(layer["half"], dim=-1)
            half = layer["half"] // world
            layer["gate_up"] = torch.cat([cols(gate, half), cols(up, half)], dim=-1)
            layer["half"] = half
            layer["down"] = layer["down"][rank * half : (rank + 1) * half].contiguous()
        vocab = self.lm_head.shape[1]
        width = -(-vocab // world)  # ceil: the last rank's block is padded with zero columns
        head = torch.zeros(self.lm_head.shape[0], width, dtype=self.lm_head.dtype, device=self.lm_head.device)
        block = self.lm_head[:, rank * width : (rank + 1) * width]
        head[:, : block.shape[1]] = block
        self.lm_head = head
        self.adopt_shard(world, vocab)
        for layer in self.model.model.layers:
            for module in (*layer.self_attn.children(), *layer.mlp.children()):
                if isinstance(module, torch.nn.Linear):
                    module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
        head_module = self.model.get_output_embeddings()
        if head_module.weight.data_ptr() != self.embed.data_ptr():
            head_module.weight.data = torch.empty(0, dtype=self.lm_head.dtype, device=self.lm_head.device)
        self.pack()

    def adopt_shard(self, world: int, vocab: int) -> None:
        """Count heads as one rank of `world` does, for a model whose weights hold that rank's split
        already: made by `shard`, or loaded so (loading.load_model). `vocab`: the whole output
        layer's width, which `gather` cuts the ranks' padded logits back to."""
        self.world, self.vocab_size = world, vocab
        self.heads //= world
        self.kv_heads //= world
        self.pool = None  # caches made from now on hold this rank's heads

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return scripted.rms_norm(x, weight, self.eps)


def check_shardable(config, world: int) -> None:
    """Raise ValueError unless the model's heads and MLP columns split evenly over `world` ranks."""
    heads = config.num_attention_heads
    for count, what in ((heads, "attention heads"), (getattr(config, "num_key_value_heads", None) or heads,
                        "key/value heads"), (config.intermediate_size, "MLP columns")):
        if count % world:
            raise ValueError(f"tensor-parallel size {world} does not divide the model's {count} {what}")


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
