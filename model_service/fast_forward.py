"""A lean decoder forward for Llama-family models (Llama, Mistral, Qwen2, Qwen3, Phi-3, Granite, SmolLM3), over a
preallocated KV cache.

    fast = FastForward.build(model, max_context)     # None: the model keeps transformers' forward
    cache = fast.new_cache()
    logits = fast(prompt_ids, cache, 1)              # [1, V]; then a step: fast([token], cache, 1)
    fast.many([(ids_a, cache_a, 1), (ids_b, cache_b, 5)])   # one pass over several sequences

At the sizes speculative decoding runs, a transformers forward costs more in Python than in
arithmetic (module dispatch, mask building, cache bookkeeping), most of all for the draft. This
forward runs the same weights with the fewest torch calls: q/k/v and gate/up each in one matmul
(the HF modules' weights become views into the fused tensors, so nothing is stored twice), RMSNorm
as one `F.rms_norm`, attention as one `scaled_dot_product_attention` over a KV cache that grows in
place and rolls back by moving an index; on CPU the layer loop runs in TorchScript (scripted.py).

It takes the rotary embedding from the HF model itself, so every RoPE variant transformers
implements is computed the same way; where it rotates part of each head (Phi-4-mini), q's and k's
dimensions are kept in an order in which rotating the whole head computes it (head_order); a layer
without RoPE (SmolLM3's every fourth: its attention's use_rope) rotates nothing. Under a
sliding window (Mistral, Phi-3: every layer's) each query sees the last `window` keys up to its own.
Architectures it does not know, or features it does not implement (sliding windows on some layers
only, attention soft-capping...), keep the transformers forward: `FastForward.build`
returns None for them and `ModelRunner` falls back.

Beside it: int4.py quantizes its weights (--quantize int4), sharding.py splits them over
tensor-parallel ranks, slot_attention.py runs a pass's attention over a KV pool's slots,
cuda_graphs.py replays one session's passes of a few tokens from CUDA graphs on a GPU, and
kv_cache.py holds the caches.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import ClassVar

import torch
import torch.nn.functional as F

from . import scripted
from .int4 import Int4, Q4Tiles, pack_int4
from .kv_cache import POOL_CAPACITY, KVCache, KVPool
from .q4_kernel import Panels
from .slot_attention import SlotBatch, slot_attention, slot_batch, visible

# weights kept in a kernel's own layout, which scripted.mm runs for every row (int4.quantize, pack)
KERNEL_LAYOUTS = (Int4, Q4Tiles, Panels)
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # --dtype

SUPPORTED = {"llama", "mistral", "qwen2", "qwen3", "phi3", "granite", "smollm3"}
# families whose transformers forward rotates part of each head where the config says so (partial_rotary_factor)
PARTIAL_ROTARY = {"phi3"}
# families whose transformers forward attends over config.sliding_window keys in every layer (FastForward.window)
SLIDING = {"mistral", "phi3"}
# families whose checkpoints hold q/k/v in one qkv_proj and gate/up in one gate_up_proj (FastForward.FUSED_PARTS)
FUSED_FAMILIES = {"phi3"}
# weights with fewer elements stay unpacked (see FastForward.pack): oneDNN's fixed cost per call
# (tens of us) outweighs what packing gains on them (docs/performance.md)
PACK_MIN_ELEMENTS = 1 << 18


def rotary_dims(config, head_dim: int) -> int:
    """How many of each head's dimensions RoPE rotates (partial_rotary_factor, as transformers reads it)."""
    rope = getattr(config, "rope_parameters", None)
    partial = rope.get("partial_rotary_factor") if isinstance(rope, dict) else None
    if partial is None:
        partial = getattr(config, "partial_rotary_factor", None)
    return head_dim if partial is None else int(head_dim * partial)


def head_order(head_dim: int, rotated: int) -> torch.Tensor | None:
    """Where RoPE rotates only the first `rotated` of a head's dimensions (Phi-4-mini: 96 of 128), the
    order in which the lean forward keeps a q or k head's dimensions: position j holds dimension
    order[j]. transformers pairs dimension i with i + rotated/2; the lean forward rotates every
    position j with j + head_dim/2, so the rotated pairs move there and the others fill the gaps,
    where the RoPE table holds cos 1 and sin 0 (they pass unrotated). q and k are both kept in
    this order, so their dot products are the same sums; None where RoPE rotates the whole head."""
    if rotated == head_dim:
        return None
    r, p = rotated // 2, (head_dim - rotated) // 2
    dims = torch.arange(head_dim)
    return torch.cat([dims[:r], dims[rotated : rotated + p], dims[r:rotated], dims[rotated + p :]])


def unsupported(config, max_context: int) -> str | None:
    """What of a model's config the fast forward does not compute as transformers does (FastForward.build:
    then None), None where nothing."""
    if config.model_type not in SUPPORTED:
        return f"its architecture is {config.model_type} (the lean forward's: {', '.join(sorted(SUPPORTED))})"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rotated = rotary_dims(config, head_dim)
    if rotated != head_dim and config.model_type not in PARTIAL_ROTARY:
        return (f"it rotates {rotated} of each head's {head_dim} dimensions, which transformers' {config.model_type}"
                " does not")
    if rotated % 2 or (head_dim - rotated) % 2:
        return f"it rotates {rotated} of each head's {head_dim} dimensions (the lean forward's RoPE: an even split)"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"its activation is {config.hidden_act} (the lean forward's: silu)"
    if getattr(config, "attention_bias", False) and config.model_type != "qwen2":
        return "its attention projections have biases"
    if getattr(config, "mlp_bias", False):
        return "its MLP projections have biases"
    if getattr(config, "pretraining_tp", 1) > 1:
        return f"its pretraining_tp is {config.pretraining_tp}"
    if sliding_window(config, max_context) is not None and config.model_type not in SLIDING:
        return (f"it attends over a sliding window of {config.sliding_window} tokens, less than its context of"
                f" {max_context} (the lean forward's sliding windows: {', '.join(sorted(SLIDING))}'s)")
    return None


def sliding_window(config, max_context: int) -> int | None:
    """The keys each query sees, the last ones up to its own (config.sliding_window), where fewer than the
    context; None where it sees them all. A layer slides where use_sliding_window is on (Qwen2's, Qwen3's,
    SmolLM3's; Mistral and Phi-3 have no such flag) or where layer_types says "sliding_attention" (those
    families' transformers forward reads only that)."""
    window = getattr(config, "sliding_window", None)
    slides = getattr(config, "use_sliding_window", True) or "sliding_attention" in (getattr(config, "layer_types",
                                                                                             None) or ())
    if window is None or not slides or window >= max_context:
        return None
    return int(window)


def causal_mask(start: int, end: int, window: int | None, device) -> torch.Tensor | None:
    """[end - start, end] bool: query i (position start + i) sees keys 0 .. start + i, the last `window` of
    them under a sliding window (transformers': key j where j > position - window); None for one query
    that sees every key up to its own (attention's default)."""
    if end - start == 1 and (window is None or end <= window):
        return None
    return visible(torch.arange(end, device=device)[None], torch.arange(start, end, device=device)[:, None], window)


class WholeHeadRotary(torch.nn.Module):
    """A partial-RoPE model's rotary module, its cos and sin [..., rotated] given as [..., head_dim]
    in head_order: cos 1 and sin 0 at the dimensions it does not rotate (as they are where it rotates
    the whole head). FastForward puts it in the HF model's place once it keeps q's and k's heads in
    head_order (_fuse, whose weights the HF modules' are views of): the HF forward then rotates those
    heads whole, computing what it did, and the lean forward reads its tables from the same module.
    Its presence also says that the weights are in that order already (a second FastForward.build)."""

    def __init__(self, inner: torch.nn.Module, order: torch.Tensor):
        super().__init__()
        self.inner = inner
        self.register_buffer("order", order, persistent=False)
        self.rope_type = getattr(inner, "rope_type", "default")

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.inner(x, position_ids)
        pad = self.order.numel() - cos.shape[-1]
        return (torch.cat([cos, cos.new_ones(*cos.shape[:-1], pad)], -1)[..., self.order],
                torch.cat([sin, sin.new_zeros(*sin.shape[:-1], pad)], -1)[..., self.order])


def fold_multipliers(model) -> dict[str, float]:
    """Granite's multipliers, taken into its weights: the embedding's into the embedding table, the
    residual's (each attention's and MLP's output, before it joins the residual stream) into o_proj
    and down_proj, the logits' divisor into the final norm's weight (with the embedding's undone
    there where the output layer is the embedding table). The hidden states are then Llama's
    computation of the same values, and the HF model's own multipliers are set to 1 so that its
    forward computes what it did. -> the factor each fused linear's weights took ("o", "down"),
    for weights that come in another form (int4.quantize's Q4_1 blocks); {} for other families.
    Once per model: a second call returns the first's factors (kept on the model)."""
    if model.config.model_type != "granite":
        return {}
    if hasattr(model, "specdec_folded"):
        return dict(model.specdec_folded)
    inner, head = model.model, model.get_output_embeddings()
    embedding, logits = float(inner.embedding_multiplier), float(model.config.logits_scaling)
    residual = {float(layer.residual_multiplier) for layer in inner.layers}
    if len(residual) != 1:
        raise ValueError(f"residual multipliers differ by layer: {sorted(residual)}")
    (residual,) = residual
    tied = head.weight.data_ptr() == inner.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        inner.embed_tokens.weight.mul_(embedding)
        for layer in inner.layers:
            layer.self_attn.o_proj.weight.mul_(residual)
            layer.mlp.down_proj.weight.mul_(residual)
            layer.residual_multiplier = 1.0
        inner.norm.weight.div_(logits * (embedding if tied else 1.0))
    inner.embedding_multiplier = 1.0
    model.config.logits_scaling = 1.0
    model.specdec_folded = {"o": residual, "down": residual}
    return dict(model.specdec_folded)


class FastForward:
    """The forward pass of one loaded HF Llama/Mistral/Qwen2/Qwen3/Phi-3/Granite/SmolLM3 causal LM.

    Weights are kept as [in, out] (transposed) and applied as `x @ w`: for the few rows a
    decode or verify step multiplies, that runs faster than `F.linear` on the [out, in]
    layout on the CPUs measured, and no slower for many rows. The HF modules' weights become
    views of these tensors, so nothing is stored twice.
    """

    def __init__(self, model, max_context: int, pool_capacity: int = POOL_CAPACITY, float_kernel: str = "auto"):
        config = model.config
        self.model = model
        self.folded = fold_multipliers(model)  # Granite's multipliers, in the weights
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
        self.window = sliding_window(config, max_context)  # (Mistral, Phi-3) the keys a query sees, the last ones
        self.PARTS = self.FUSED_PARTS if config.model_type in FUSED_FAMILIES else type(self).PARTS
        # each q and k head's dimensions in this order, where RoPE rotates part of a head (head_order)
        self.head_order = head_order(self.head_dim, rotary_dims(config, self.head_dim))
        self.rotary = model.model.rotary_emb
        # whether to put the weights in head_order (not where an earlier build of this model did: WholeHeadRotary)
        self._reorder = self.head_order is not None and not isinstance(self.rotary, WholeHeadRotary)
        if self._reorder:
            self.rotary = model.model.rotary_emb = WholeHeadRotary(self.rotary, self.head_order.to(self.embed.device))
        self.layers = [self._fuse(layer) for layer in model.model.layers]
        # tensor parallelism (sharding.py): the ranks the weights are split over, the sum of the ranks'
        # partial products, the ranks' logits side by side
        self.world = 1
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.gather: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.rope_table = self._rope_table(max_context)
        self.lm_head_packed: torch.Tensor | None = None
        self.head_ids: torch.Tensor | None = None  # restrict_head: the ids the output layer scores, [N]
        self.pack_min = PACK_MIN_ELEMENTS
        self.packed_rows = 2  # pack(): the rows from which the packed copies are used (scripted.mm)
        self.int4_group = 0  # int4.quantize: weight-only int4 in groups of this many inputs (0: off)
        self.int4_kernel = "torch"  # int4.quantize: whose kernel runs it, "specdec" (q4_kernel) or "torch"
        # float32 on CPU: whose products, "specdec" (q4_kernel's panels, where it builds) or "onednn"
        # (oneDNN's packed weights, MKL's x @ w for one row where faster); "auto" (pack) picks specdec's;
        # "none" elsewhere (CUDA, half precision: torch's products)
        self.float_kernel = float_kernel
        self.float_kernel_asked = float_kernel  # (pack resolves float_kernel; a move to a GPU packs again)
        # with specdec's kernel, a pass's layers (one sequence or several) run in its C++ loop
        # (q4_kernel: q4_layers) rather than TorchScript's; off: TorchScript's loop over the same
        # products (A/B, tests)
        self.fused_layers = True
        # in the C++ loop, the feature layers' inputs copied out by the one call (q4_layers_capturing);
        # off: a call per segment between them, as TorchScript's loop runs (A/B, tests)
        self.capture_in_loop = True
        # in the C++ loop, the final RMSNorm and the output layer run by the loop's call (its last
        # segment's) where the output layer is in tiles or panels; off: by two more torch calls (A/B, tests)
        self.head_in_loop = True
        # in the C++ loop's one call, the rows' embeddings and RoPE rows looked up by the call from the
        # token ids (where the RoPE table is fixed); off: by torch calls before it (A/B, tests)
        self.lookup_in_loop = True
        # the layer loop through TorchScript (scripted.py) on CPU; CUDA keeps the eager
        # loop, which has not been measured against it there
        self.scripted = scripted.LAYERS is not None and self.embed.device.type == "cpu"
        self._script_args: tuple | None = None  # its weight lists, made by the first pass that uses them
        self._all_tiles = False  # made with them: every linear in specdec's int4 tiles, float32 activations
        # one session's passes of a few tokens through CUDA graphs (cuda_graphs.py; use_graphs), None: eager
        self.graphs = None
        self.pack()
        self.pool_capacity = pool_capacity  # 0: every session's cache on its own (no batched attention)
        self.pool: KVPool | None = None  # made by the first new_cache (after to() and sharding)
        self.kv_dtype: torch.dtype | None = None  # the caches' dtype where not the weights' (set_kv_dtype)

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
    def build(cls, model, max_context: int, pool_capacity: int = POOL_CAPACITY,
              float_kernel: str = "auto") -> FastForward | None:
        """The fast forward for `model`, or None where it would not compute the same thing.
        float_kernel: whose products run its float32 weights on CPU (auto, specdec or onednn; pack)."""
        if unsupported(model.config, max_context) is not None:
            return None
        return cls(model, max_context, pool_capacity, float_kernel)

    def pack(self) -> None:
        """On CPU, also keep the weights (each layer's linears, lm_head) in a layout for the few rows of
        a pass: specdec's float32 panels (float_kernel "specdec"; "auto" where q4_kernel builds), else
        oneDNN's packed one.

        specdec's panels (q4_kernel.panel, csrc/q4_mm.cpp: f32_mm) stream the weights once for all
        the rows of a call, prefetched ahead, and compute a row the same way whatever it is batched
        with; with every linear in panels a pass runs its layers in the kernel's C++ loop (as int4
        does), not TorchScript's. A pass over five tokens of SmolLM2-135M then costs ~1.1x one
        (oneDNN's packed product: ~1.4x), and one token less than either did (docs/performance.md).

        Otherwise: MKL's sgemm is slow for the few rows of a verify step, and oneDNN's packed product faster
        there for every layer linear and the output layer. For one row it depends on the machine:
        `x @ w` was faster on the CPUs first measured, the packed product 1.45x faster for a whole
        decode pass of SmolLM2 on an AMD EPYC with AVX-512; so the pack times both on one row
        (_one_row_path) and sets `packed_rows`, the rows from which scripted.mm takes the packed
        copy (1 or 2). The cost is a second copy of these weights in memory.
        Weights under `pack_min` elements stay unpacked (see PACK_MIN_ELEMENTS). Elsewhere (CUDA,
        no oneDNN, half precision) nothing is packed; once quantized (int4.quantize) the linears are
        packed in int4 instead. Measurements: docs/performance.md.
        """
        if self.graphs is not None:  # they recorded the weights' addresses: new ones (none for int4)
            self.graphs = None if self.int4_group else self.use_graphs(self.graphs.capture)
        if self.int4_group:
            pack_int4(self)
            return
        cpu = self.embed.device.type == "cpu" and self.embed.dtype == torch.float32
        if not cpu:  # (CUDA, half precision): torch's own products, nothing packed
            if self.float_kernel_asked in ("specdec", "onednn"):
                raise ValueError(f"float_kernel {self.float_kernel_asked} runs float32 weights on CPU; these are "
                                 f"{str(self.embed.dtype).removeprefix('torch.')} on {self.embed.device.type}")
            self.float_kernel = "none"
        if cpu and self.float_kernel in ("auto", "specdec"):
            from . import q4_kernel

            if q4_kernel.load():
                self.float_kernel = "specdec"
                with torch.inference_mode():
                    for layer in self.layers:
                        for name in self.PARTS:
                            layer[f"{name}_packed"] = q4_kernel.panel(layer[name])
                    self.lm_head_packed = q4_kernel.panel(self.lm_head)
                self.packed_rows = 1
                self._script_args = None
                return
            if self.float_kernel == "specdec":
                raise ValueError(f"float_kernel specdec: the kernel is not built here ({q4_kernel.path()})")
        if cpu:
            self.float_kernel = "onednn"
        on = cpu and torch.backends.mkldnn.is_available()
        with torch.inference_mode():
            def packed(w: torch.Tensor) -> torch.Tensor | None:  # w [in, out]
                if not on or w.numel() < self.pack_min:
                    return None
                return torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), 16)

            for layer in self.layers:
                for name in ("qkv", "o", "gate_up", "down"):
                    layer[f"{name}_packed"] = packed(layer[name])
            self.lm_head_packed = packed(self.lm_head)
        self.packed_rows = self._one_row_path() if on else 2
        self._script_args = None  # (the TorchScript loop's weight lists hold the packed copies)

    @torch.inference_mode()
    def _one_row_path(self, reps: int = 5) -> int:
        """1 where one row through the packed weights beats `x @ w` over a decode pass's products
        (the output layer and the first layer's four, times the layers; medians of `reps` after
        two warm-ups, at this process's threads), else 2. A few tens of ms, at each pack."""
        import statistics
        import time

        def ms(run) -> float:
            samples = []
            for rep in range(reps + 2):
                start = time.perf_counter()
                run()
                if rep >= 2:
                    samples.append(time.perf_counter() - start)
            return statistics.median(samples)

        first = self.layers[0]
        weights = [(self.lm_head, self.lm_head_packed, 1)] + [
            (first[name], first.get(f"{name}_packed"), len(self.layers)) for name in ("qkv", "o", "gate_up", "down")]
        plain = packed = 0.0
        for w, p, times in weights:
            if p is None:
                continue
            x = torch.randn(1, w.shape[0], dtype=w.dtype)
            plain += times * ms(lambda: x @ w)
            packed += times * ms(lambda: torch.ops.mkldnn._linear_pointwise(x, p, None, "none", [], ""))
        return 1 if packed and packed < plain else 2

    # the transformers weights each fused linear of layer i is made of (_fuse), in order; an instance's
    # are FUSED_PARTS where its family's checkpoints hold q/k/v and gate/up fused already (Phi-3)
    PARTS: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o": ("self_attn.o_proj",),
        "gate_up": ("mlp.gate_proj", "mlp.up_proj"), "down": ("mlp.down_proj",)}
    FUSED_PARTS: ClassVar[dict[str, tuple[str, ...]]] = {
        "qkv": ("self_attn.qkv_proj",), "o": ("self_attn.o_proj",), "gate_up": ("mlp.gate_up_proj",),
        "down": ("mlp.down_proj",)}

    def use_graphs(self, capture: bool = True):
        """Run one session's passes of up to cuda_graphs.MAX_TOKENS tokens (decode steps, verify
        passes) through CUDA graphs (cuda_graphs.GraphedPasses; capture False: the same static-shape
        pass, eager, as tests run it without a GPU)."""
        from .cuda_graphs import GraphedPasses

        self.graphs = GraphedPasses(self, capture)
        return self.graphs

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
        def size(w: torch.Tensor | Int4 | Q4Tiles | Panels | None) -> int:
            if isinstance(w, Int4):
                return size(w.weight) + size(w.scales_and_zeros)
            if isinstance(w, (Q4Tiles, Panels)):
                return size(w.tiles)
            return 0 if w is None else w.numel() * w.element_size()

        total = self.embed.shape[1] * self.embed.element_size() + size(self.final_norm.weight)
        for layer in self.layers:
            for name in ("qkv", "o", "gate_up", "down"):
                packed = layer.get(f"{name}_packed")
                total += size(packed if isinstance(packed, KERNEL_LAYOUTS) else layer[name])
            total += sum(size(layer[name]) for name in ("in_norm", "post_norm", "qkv_bias", "qk_norm"))
        return total + size(self.lm_head_packed if isinstance(self.lm_head_packed, KERNEL_LAYOUTS)
                            else self.lm_head)

    @staticmethod
    def _mm(x: torch.Tensor, w: torch.Tensor, packed: torch.Tensor | Int4 | Q4Tiles | Panels | None,
            bias: torch.Tensor | None = None, packed_rows: int = 2) -> torch.Tensor:
        """x @ w (+ bias): x [rows, in], w [in, out]; through `packed` (w's oneDNN-packed copy, if any)
        for several rows; through an Int4, Q4Tiles (int4.quantize) or Panels (pack) for every row
        (scripted.mm, which both loops run)."""
        if isinstance(packed, (Q4Tiles, Panels)):
            return scripted.mm(x, w, None, packed.tiles, None, 32, packed.out, bias)
        if isinstance(packed, Int4):
            return scripted.mm(x, w, None, packed.weight, packed.scales_and_zeros, packed.group, packed.out, bias)
        return scripted.mm(x, w, packed, None, None, 0, 0, bias, packed_rows)

    def set_kv_dtype(self, dtype: torch.dtype) -> None:
        """Keep keys and values in `dtype`: the weights' own, or float16 where every pass runs
        in specdec's C++ layer loop (float32 or int4 weights on a CPU, _runs_q4_layers), the one
        path that reads a cache of another dtype (each key and value rounded to nearest even as it
        is stored, read back as float32). Before the first cache."""
        if self.pool is not None:
            raise RuntimeError("the KV dtype is set before the first cache")
        if dtype == self.embed.dtype:
            self.kv_dtype = None
            return
        if dtype != torch.float16 or not self.runs_c_loop():
            raise ValueError(f"--kv-dtype {str(dtype).removeprefix('torch.')} needs specdec's C++ layer loop (float32"
                             " or int4 weights through specdec's kernels, on a CPU, one rank); this forward keeps"
                             f" {str(self.embed.dtype).removeprefix('torch.')} keys and values")
        self.kv_dtype = dtype

    def new_cache(self) -> KVCache:
        args = (len(self.layers), self.kv_heads, self.head_dim, self.kv_dtype or self.embed.dtype, self.embed.device)
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

    def _fuse(self, layer) -> dict:
        """Fuse q/k/v and gate/up (where the checkpoint has them apart), transpose every weight (see the
        class docstring)."""
        attn, mlp = layer.self_attn, layer.mlp
        parts = [layer.get_submodule(name) for name in self.PARTS["qkv"]]
        sizes = [p.weight.shape[0] for p in parts]
        if len(parts) == 1:  # one qkv_proj: q's heads, then k's and v's (as many rows as its checkpoint holds:
            # all of them, or a tensor-parallel rank's share of each, loading.py)
            kv = sizes[0] * self.kv_heads // (self.heads + 2 * self.kv_heads)
            sizes = [sizes[0] - 2 * kv, kv, kv]
        qkv_bias = None
        if parts[0].bias is not None:
            qkv_bias = torch.cat([p.bias.data for p in parts])
            for p, view in zip(parts, qkv_bias.split([p.weight.shape[0] for p in parts])):
                p.bias.data = view
        qkv = self._transposed(parts)
        order = self.qkv_order(sizes) if self._reorder else None
        if order is not None:  # q's and k's heads in head_order (so the HF modules' views hold them so too:
            # the HF forward rotates them as the lean one does, WholeHeadRotary)
            with torch.no_grad():
                qkv.copy_(qkv[:, order])
                if qkv_bias is not None:
                    qkv_bias.copy_(qkv_bias[order])
        return {
            "in_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
            "qkv": qkv, "qkv_bias": qkv_bias, "sizes": sizes,
            "o": self._transposed([attn.o_proj]),
            "gate_up": self._transposed([layer.get_submodule(name) for name in self.PARTS["gate_up"]]),
            "half": mlp.down_proj.weight.shape[1], "down": self._transposed([mlp.down_proj]),
            "scaling": getattr(attn, "scaling", None),
            "rope": bool(getattr(attn, "use_rope", True)),  # (SmolLM3) False where the layer has no RoPE
            # (Qwen3) each q and k head's RMSNorm weight over head_dim, before RoPE: [2, head_dim], q's then k's
            "qk_norm": (torch.stack([attn.q_norm.weight.data, attn.k_norm.weight.data])[
                            :, slice(None) if self.head_order is None else self.head_order]
                        if getattr(attn, "q_norm", None) is not None else None),
        }

    def qkv_order(self, sizes: list[int]) -> torch.Tensor | None:
        """The fused q/k/v outputs (`sizes`: q's, k's, v's) in the order the lean forward keeps them:
        each q and k head in head_order, v as it is; None where that is the checkpoint's own."""
        if self.head_order is None:
            return None
        heads = (sizes[0] + sizes[1]) // self.head_dim
        qk = (torch.arange(heads)[:, None] * self.head_dim + self.head_order).flatten()
        return torch.cat([qk, torch.arange(qk.numel(), sum(sizes))])

    def __call__(self, input_ids: list[int], cache: KVCache, num_logits: int) -> torch.Tensor:
        """Append `input_ids` to `cache`; -> logits of the last `num_logits` of them, [num_logits, V]."""
        return self.many([(input_ids, cache, num_logits)])[0]

    def many(self, feeds: list[tuple[list[int], KVCache, int]]) -> list[torch.Tensor]:
        """One forward pass over several sequences, each (input_ids, its cache, num_logits).

        The sequences' new tokens are laid end to end ("ragged" batching: no padding), so
        every matrix multiply runs once for all of them. Attention runs per sequence, each
        over its own cache with its own positions, or, where the caches are slots of this
        forward's pool, as one call over those slots (slot_attention.py). -> each feed's
        [num_logits, V].
        """
        return self.many_capturing(feeds, ())[0]

    @torch.inference_mode()
    def many_capturing(self, feeds: list[tuple[list[int], KVCache, int]],
                       capture: tuple[int, ...]) -> tuple[list[torch.Tensor], torch.Tensor | None]:
        """`many`, and the hidden states at the `capture` layers for every token fed: layer i's is
        the input of decoder layer i (0: the embeddings), as EAGLE-3's feature layers are counted.
        The layers run in segments between the captured ones, each by the path it would take
        anyway. -> (each feed's logits, states [T, len(capture), D] in feed order, or None)."""
        last = len(self.layers) - 1
        wanted = sorted(set(capture))
        if wanted and not 0 <= wanted[0] <= wanted[-1] <= last:
            raise ValueError(f"feature layers must lie in [0, {last}], not {list(capture)}")
        if self.graphs is not None and len(feeds) == 1 and self.graphs.takes(len(feeds[0][0])):
            logits, states = self.graphs(feeds[0][0], feeds[0][1], tuple(wanted))
            if states is not None:  # (the graph's layers in order: as asked)
                states = states[:, [wanted.index(layer) for layer in capture]]
            return [logits[logits.shape[0] - feeds[0][2] :]], states
        device = self.embed.device
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        # specdec's C++ loop does its own attention and row bookkeeping: no slot batch, masks or kept-row index
        c_loop = self.runs_c_loop()
        # where the loop runs in one call, it looks the rows' embeddings and RoPE rows up itself (from ids)
        lookup = (c_loop and self.lookup_in_loop and self.rope_table is not None
                  and (not wanted or self.capture_in_loop))
        spans, positions, ids = [], [], []
        offset = 0
        for input_ids, cache, _ in feeds:
            n, start = len(input_ids), cache.length
            cache.reserve(start + n)
            spans.append((offset, offset + n, start, start + n))
            if not lookup:
                positions.append(torch.arange(start, start + n, device=device))
            ids.extend(input_ids)
            offset += n
        total = offset
        if self.kv_dtype is not None and not c_loop:
            raise RuntimeError("float16 keys and values are read by specdec's C++ layer loop alone (set_kv_dtype)")
        slots = None if c_loop else slot_batch(self.pool, feeds, spans, self.window)
        masks = []
        if slots is None and not c_loop:  # query i of a sequence sits at position start+i and sees keys 0..start+i
            masks = [causal_mask(start, end, self.window, device) for _, _, start, end in spans]
        if lookup:  # the tables themselves: the call indexes them by the ids and the rows' positions
            x, (cos, sin) = self.embed, self.rope_table
        else:
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
        if sum(n for _, _, n in feeds) < total and not c_loop:
            if len(feeds) == 1:
                keep = slice(total - feeds[0][2], total)
            else:
                keep = torch.tensor([r for (_, _, n), (_, b, _, _) in zip(feeds, spans) for r in range(b - n, b)],
                                    dtype=torch.long).to(device)
        states: dict[int, torch.Tensor] = {}
        captured = None
        # the C++ loop's last call returns the logits (x is then [rows, the output layer's outputs])
        head = (c_loop and self.head_in_loop and self.gather is None
                and isinstance(self.lm_head_packed, (Q4Tiles, Panels)))
        if c_loop and wanted and self.capture_in_loop:  # the C++ loop copies the layers' inputs out, one call
            x, captured = self._scripted_layers(x, cos, sin, feeds, spans, masks, slots, keep, 0, last + 1, True,
                                                capture, head, ids if lookup else None)
            layers = []
        elif self.scripted and self.reduce is None:  # the same layers, run by TorchScript (see scripted.py)
            lo = 0
            for hi in [*wanted, last + 1]:  # segments between the captured layers
                if hi > lo:
                    x = self._scripted_layers(x, cos, sin, feeds, spans, masks, slots, keep, lo, hi, hi == last + 1,
                                              head=head and hi == last + 1, ids=ids if lookup else None)
                if hi <= last:
                    states[hi] = x.clone()
                lo = hi
            layers = []  # done
        else:
            layers = self.layers
        rows = self.packed_rows
        for i, layer in enumerate(layers):
            if i in wanted:
                states[i] = x.clone()
            h = self._norm(x, layer["in_norm"])
            qkv = self._mm(h, layer["qkv"], layer["qkv_packed"], layer["qkv_bias"], rows)  # [T, (H + 2 H_kv) head_dim]
            # RoPE on q and k at once: they are the first H + H_kv heads of qkv
            qk = qkv[:, : (heads + kv_heads) * head_dim].view(total, heads + kv_heads, head_dim)
            qk = scripted.qk_norm(qk, layer["qk_norm"], heads, self.eps)
            if layer["rope"]:
                qk = qk * cos + _rotate_half(qk) * sin
            v = qkv[:, (heads + kv_heads) * head_dim :].view(total, kv_heads, head_dim)  # [T, H_kv, head_dim]
            if slots is not None:
                att = slot_attention(self.pool.data[i], slots, qk, v, heads, layer["scaling"])
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
            x = x + self._reduced(self._mm(att, layer["o"], layer.get("o_packed"), None, rows))
            h = self._norm(x, layer["post_norm"])
            gate, up = self._mm(h, layer["gate_up"], layer["gate_up_packed"], None, rows).split(layer["half"], dim=-1)
            x = x + self._reduced(self._mm(F.silu(gate) * up, layer["down"], layer.get("down_packed"), None, rows))
        for (_, cache, _), (_, _, _, end) in zip(feeds, spans):
            cache.length = end
        # x: the asked rows only (see keep), each feed's last num_logits in feed order
        if head:
            logits = x
        else:
            logits = self._mm(self._norm(x, self.final_norm.weight), self.lm_head, self.lm_head_packed, None,
                              rows)  # [rows, V / world]
        if self.gather is not None:
            logits = self.gather(logits)  # [rows, V]
        if self.head_ids is not None:  # [rows, N] -> [rows, V], -inf where the head does not score
            full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
            logits = full.index_copy_(1, self.head_ids, logits)
        if capture and captured is None:
            captured = torch.stack([states[i] for i in capture], dim=1)  # [T, layers, D]
        return list(logits.split([n for _, _, n in feeds])), captured

    def _scripted_layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, feeds, spans, masks,
                         slots: SlotBatch | None, keep, lo: int, hi: int, final: bool, capture: tuple[int, ...] = (),
                         head: bool = False, ids: list[int] | None = None):
        """Layers lo..hi-1 by TorchScript or specdec's C++ loop (scripted.py, q4_kernel.py): their
        cache and weights are the layer-sliced views of the whole model's; only the `final` segment
        keeps just the asked rows at its last layer. With `capture` (the C++ loop over every layer
        only) -> (x, the inputs of those layers [T, len(capture), D]), else x; with `head` (the C++
        loop's final segment, the output layer in tiles or panels) the kept rows' logits for x; with
        `ids` (the C++ loop in one call) x is the embedding table and cos and sin the RoPE tables,
        which the call indexes by the ids and the rows' positions."""
        heads, kv_heads, head_dim = self.heads, self.kv_heads, self.head_dim
        args = self._scripted_args()
        if lo or hi < len(self.layers):
            args = tuple(a[lo:hi] if n < 7 else a[4 * lo : 4 * hi] for n, a in enumerate(args[:-2])) + args[-2:]
        if self._runs_q4_layers():  # every sequence's rows through each linear at once, in specdec's C++ loop
            scaling, in_norm, post_norm, half, qkv_bias, qk_norm, rope, _, _, tiles, _, outs, _, _ = args
            lengths = [b - a for a, b, _, _ in spans]
            kept = [n for _, _, n in feeds] if final else lengths  # the rows each carries through its last layer
            common = (x, cos, sin, [cache.data[lo:hi] for _, cache, _ in feeds], [start for _, _, start, _ in spans],
                      lengths, kept, heads, kv_heads, head_dim, self.eps, scaling, in_norm, post_norm, half, qkv_bias,
                      tiles, outs)
            output = (self.final_norm.weight, self.lm_head_packed.tiles, self.lm_head_packed.out) if head \
                else (None, None, 0)
            norms = None if qk_norm[0] is None else torch.stack(qk_norm)  # (every layer has them or none)
            rotated = None if all(rope) else [int(r) for r in rope]
            if capture:
                return torch.ops.specdec.q4_layers_capturing(*common, list(capture), *output, ids, norms,
                                                             self.window or 0, rotated)
            return torch.ops.specdec.q4_layers(*common, *output, ids, norms, self.window or 0, rotated)
        if len(feeds) == 1:
            return scripted.LAYERS(x, cos, sin, feeds[0][1].data[lo:hi], spans[0][2], masks[0],
                                   feeds[0][2] if final else 0, heads, kv_heads, head_dim, self.eps, *args)
        keep = keep if final else None
        if slots is not None:
            return scripted.LAYERS_BATCHED(
                x, cos, sin, [], [], [], self.pool.data[lo:hi], [slots.lo, slots.hi, slots.width, slots.keys],
                [slots.rows, slots.cols, slots.pos, slots.mask], keep, heads, kv_heads, head_dim, self.eps, *args)
        return scripted.LAYERS_BATCHED(
            x, cos, sin, [cache.data[lo:hi] for _, cache, _ in feeds], [list(span) for span in spans], masks, None,
            [], [], keep, heads, kv_heads, head_dim, self.eps, *args)

    def runs_c_loop(self) -> bool:
        """Whether passes run in specdec's C++ layer loop: its layers (_runs_q4_layers), on a CPU
        (scripted), one rank (no reduce)."""
        return self.scripted and self.reduce is None and self._runs_q4_layers()

    def _runs_q4_layers(self) -> bool:
        """Whether a pass runs its layers in specdec's C++ loop (q4_kernel's q4_layers), one sequence
        or several: every linear in its int4 tiles or float32 panels, float32 activations, `fused_layers` on."""
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
                [layer["qk_norm"] for layer in self.layers], [layer["rope"] for layer in self.layers],
                [w for w, _ in linears],
                [None if isinstance(p, KERNEL_LAYOUTS) else p for _, p in linears],
                [p.weight if isinstance(p, Int4) else p.tiles if isinstance(p, (Q4Tiles, Panels)) else None
                 for _, p in linears],
                [p.scales_and_zeros if isinstance(p, Int4) else None for _, p in linears],
                [p.out if isinstance(p, KERNEL_LAYOUTS) else w.shape[1] for w, p in linears],
                self.int4_group, self.packed_rows,
            )
            self._all_tiles = self.embed.dtype == torch.float32 and all(isinstance(p, (Q4Tiles, Panels))
                                                                        for _, p in linears)
        return self._script_args

    def to(self, device: torch.device) -> FastForward:
        """Move the model to `device`; for a sharded forward (sharding.shard), whose tensors no longer
        alias the HF modules' weights. -> self"""
        self.model.to(device)
        self.lm_head = self.lm_head.to(device)
        if self.head_ids is not None:
            self.head_ids = self.head_ids.to(device)
        for layer in self.layers:
            for key in ("qkv", "qkv_bias", "qk_norm", "o", "gate_up", "down"):
                if layer[key] is not None:
                    layer[key] = layer[key].to(device)
        if self.rope_table is not None:
            self.rope_table = tuple(t.to(device) for t in self.rope_table)
        self.pack()
        self.scripted = scripted.LAYERS is not None and torch.device(device).type == "cpu"
        self.pool = None  # the next session's cache starts a pool on `device`
        if self.graphs is not None and torch.device(device).type != "cuda":
            self.graphs = None
        return self

    def _reduced(self, partial: torch.Tensor) -> torch.Tensor:
        return partial if self.reduce is None else self.reduce(partial)

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return scripted.rms_norm(x, weight, self.eps)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
