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

import torch
import torch.nn.functional as F

SUPPORTED = {"llama", "mistral", "qwen2"}


class KVCache:
    """Keys and values of every layer, preallocated and grown by doubling.

    Speaks the part of `DynamicCache`'s interface sessions use: `crop` and
    `get_seq_length`.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256):
        self.shape = (layers, 2, 1, kv_heads, capacity, head_dim)
        self.data = torch.empty(self.shape, dtype=dtype, device=device)
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` positions; a negative value drops that many from the end."""
        if max_length < 0:
            max_length = self.length + max_length
        self.length = max(0, min(self.length, max_length))

    def reserve(self, length: int) -> None:
        capacity = self.data.shape[4]
        if length <= capacity:
            return
        while capacity < length:
            capacity *= 2
        grown = torch.empty(self.shape[:4] + (capacity,) + self.shape[5:], dtype=self.data.dtype,
                            device=self.data.device)
        grown[:, :, :, :, : self.length] = self.data[:, :, :, :, : self.length]
        self.data = grown


class FastForward:
    """The forward pass of one loaded HF Llama/Mistral/Qwen2 causal LM."""

    def __init__(self, model):
        config = model.config
        self.model = model
        self.rotary = model.model.rotary_emb
        self.embed = model.model.embed_tokens.weight
        self.final_norm = model.model.norm
        self.lm_head = model.get_output_embeddings().weight
        self.eps = config.rms_norm_eps
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.layers = [self._fuse(layer) for layer in model.model.layers]

    @classmethod
    def build(cls, model, max_context: int) -> FastForward | None:
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
        return cls(model)

    def new_cache(self) -> KVCache:
        return KVCache(len(self.layers), self.kv_heads, self.head_dim, self.embed.dtype, self.embed.device)

    @staticmethod
    def _fuse(layer) -> dict:
        """Concatenate q/k/v and gate/up; point the HF modules at views of the fused weights."""
        attn, mlp = layer.self_attn, layer.mlp
        parts = [attn.q_proj, attn.k_proj, attn.v_proj]
        qkv = torch.cat([p.weight.data for p in parts])
        sizes = [p.weight.shape[0] for p in parts]
        for p, view in zip(parts, qkv.split(sizes)):
            p.weight.data = view
        qkv_bias = None
        if attn.q_proj.bias is not None:
            qkv_bias = torch.cat([p.bias.data for p in parts])
            for p, view in zip(parts, qkv_bias.split(sizes)):
                p.bias.data = view
        gate_up = torch.cat([mlp.gate_proj.weight.data, mlp.up_proj.weight.data])
        half = mlp.gate_proj.weight.shape[0]
        mlp.gate_proj.weight.data, mlp.up_proj.weight.data = gate_up[:half], gate_up[half:]
        return {
            "in_norm": layer.input_layernorm.weight, "post_norm": layer.post_attention_layernorm.weight,
            "qkv": qkv, "qkv_bias": qkv_bias, "sizes": sizes, "o": attn.o_proj.weight,
            "gate_up": gate_up, "half": half, "down": mlp.down_proj.weight,
            "scaling": getattr(attn, "scaling", None),
        }

    def __call__(self, input_ids: list[int], cache: KVCache, num_logits: int) -> torch.Tensor:
        """Append `input_ids` to `cache`; -> logits of the last `num_logits` of them, [num_logits, V]."""
        return self.many([(input_ids, cache, num_logits)])[0]

    @torch.inference_mode()
    def many(self, feeds: list[tuple[list[int], KVCache, int]]) -> list[torch.Tensor]:
        """One forward pass over several sequences, each (input_ids, its cache, num_logits).

        The sequences' new tokens are laid end to end ("ragged" batching: no padding), so
        every matrix multiply runs once for all of them; only attention runs per sequence,
        each over its own cache with its own positions. -> each feed's [num_logits, V].
        """
        device = self.embed.device
        spans, positions, masks, ids = [], [], [], []
        offset = 0
        for input_ids, cache, _ in feeds:
            n, start = len(input_ids), cache.length
            cache.reserve(start + n)
            spans.append((offset, offset + n, start, start + n))
            positions.append(torch.arange(start, start + n, device=device))
            # query i sits at position start+i and sees keys 0..start+i
            masks.append(torch.ones(n, start + n, dtype=torch.bool, device=device).tril(diagonal=start) if n > 1 else None)
            ids.extend(input_ids)
            offset += n
        total = offset
        x = F.embedding(torch.tensor(ids, dtype=torch.long, device=device), self.embed)[None]  # [1, T, D]
        cos, sin = self.rotary(x, (positions[0] if len(feeds) == 1 else torch.cat(positions))[None])
        cos, sin = cos[:, None], sin[:, None]  # [1, 1, T, head_dim]
        for i, layer in enumerate(self.layers):
            h = self._norm(x, layer["in_norm"])
            qkv = F.linear(h, layer["qkv"], layer["qkv_bias"])
            q, k, v = qkv.split(layer["sizes"], dim=-1)
            q = q.view(1, total, self.heads, self.head_dim).transpose(1, 2)
            k = k.view(1, total, self.kv_heads, self.head_dim).transpose(1, 2)
            v = v.view(1, total, self.kv_heads, self.head_dim).transpose(1, 2)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            outs = []
            for (_, cache, _), (a, b, start, end), mask in zip(feeds, spans, masks):
                keys, values = cache.data[i, 0], cache.data[i, 1]
                keys[:, :, start:end] = k[:, :, a:b]
                values[:, :, start:end] = v[:, :, a:b]
                outs.append(F.scaled_dot_product_attention(
                    q[:, :, a:b], keys[:, :, :end], values[:, :, :end], attn_mask=mask, scale=layer["scaling"],
                    enable_gqa=self.kv_heads != self.heads,
                ))
            att = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)  # [1, H, T, head_dim]
            x = x + F.linear(att.transpose(1, 2).reshape(1, total, -1), layer["o"])
            h = self._norm(x, layer["post_norm"])
            gate, up = F.linear(h, layer["gate_up"]).split(layer["half"], dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        for (_, cache, _), (_, _, _, end) in zip(feeds, spans):
            cache.length = end
        if len(feeds) == 1:
            picked = x[0, total - feeds[0][2] :]
        else:
            picked = x[0, torch.cat([torch.arange(b - n, b, device=device) for (_, _, n), (_, b, _, _) in zip(feeds, spans)])]
        logits = F.linear(self._norm(picked, self.final_norm.weight), self.lm_head)
        return list(logits.split([n for _, _, n in feeds]))

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm as transformers computes it: in float32, scaled by the weight in the model's dtype."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, x.shape[-1:], weight, self.eps)
        return weight * F.rms_norm(x.float(), x.shape[-1:], None, self.eps).to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)
