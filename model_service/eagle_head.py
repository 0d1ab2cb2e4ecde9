"""An EAGLE-3 draft head in the checkpoint layout of vLLM and the `speculators` library.

    head = Eagle3Head.load("models/eagle", target_dir="models/target")
    cache = head.new_cache()
    hidden = head.fuse(features)                            # features: [S, len(aux) * Ht] -> [S, H]
    out_hidden, logits = head.step(next_ids, hidden, positions, cache)
    tokens = head.draft_to_target(logits.argmax(-1))

The words, once:
  feature     the target's hidden states at the aux layers, concatenated: features[t] =
              cat(h_i[t] for i in aux_layer_ids), where h_i is the INPUT of the target's decoder layer i
              (transformers' output_hidden_states[i]; vLLM collects `hidden_states + residual` before layer i).
  row         one input of the head's decoder layer: row t pairs the (fused) feature of target position t
              with the embedding of token t+1, at position t; its logits predict token t+2.
  draft step  the next rows are the head's own: its out_hidden (pre-norm) with the embedding of the token
              it proposed, one position further; a row attends to the cache (earlier rows) and causally
              to the rows given with it.
  d2t, t2d    the draft vocabulary (the lm_head's rows): target_id = draft_id + d2t[draft_id];
              t2d[target_id] is True where the target id has a draft id.

The layer (EAGLE-3, as vLLM's llama_eagle3.py and speculators' Eagle3 first layer):
  x = cat(input_layernorm(embed), hidden_norm(hidden))              # [S, 2H] into q/k/v
  h = residual + o_proj(attention(x))                               # residual = hidden, or hidden_norm(hidden)
  out = h + mlp(post_attention_layernorm(h))                        #   where norm_before_residual
  logits = lm_head(norm(out))

Checkpoint (speculators): config.json with speculators_model_type "eagle3", transformer_layer_config
(a one-layer Llama config), draft_vocab_size, norm_before_residual, target_hidden_size,
eagle_aux_hidden_state_layer_ids; model.safetensors with fc.weight, layers.0.* (or midlayer.*),
norm.weight, lm_head.weight, d2t, t2d and, optionally, embed_tokens.weight. vLLM's older flat configs
(architectures LlamaForCausalLMEagle3 / Eagle3LlamaForCausalLM) load too.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import LlamaConfig
from transformers.activations import ACT2FN
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

LAYER_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
              "rms_norm_eps", "max_position_embeddings", "hidden_act", "attention_bias", "vocab_size")


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's and speculators' default: early, middle and late (2, L // 2, L - 3)."""
    return [2, num_layers // 2, num_layers - 3]


@dataclass
class Eagle3Config:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: list[int] | None  # None: the target's defaults, resolved at load
    target_hidden_size: int | None = None  # None: hidden_size
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # as transformers' legacy rope_scaling (llama3, yarn, linear...)
    max_position_embeddings: int = 8192
    hidden_act: str = "silu"
    attention_bias: bool = False
    norm_before_residual: bool = False
    verifier: str | None = None  # the target's name or path
    speculative_tokens: int = 3
    extra: dict = field(default_factory=dict)  # the rest of transformer_layer_config, kept as read

    @property
    def fused_size(self) -> int:
        return len(self.aux_layer_ids or [0, 0, 0]) * (self.target_hidden_size or self.hidden_size)

    def llama_config(self) -> LlamaConfig:
        return LlamaConfig(**{**self.extra, **{k: getattr(self, k) for k in LAYER_KEYS}, "num_hidden_layers": 1,
                              "rope_theta": self.rope_theta,
                              "rope_scaling": dict(self.rope_scaling) if self.rope_scaling else None})  # it is edited

    @classmethod
    def from_dict(cls, d: dict) -> Eagle3Config:
        """A speculators config (speculators_model_type eagle3), or vLLM's older flat Llama-style one."""
        if d.get("speculators_model_type", "eagle3") != "eagle3":
            raise ValueError(f"not an EAGLE-3 config: speculators_model_type {d['speculators_model_type']!r}")
        speculators = "transformer_layer_config" in d
        layer = d["transformer_layer_config"] if speculators else d
        for key, ok in (("num_hidden_layers", 1), ("mlp_bias", False)):
            if layer.get(key, ok) != ok:
                raise ValueError(f"an EAGLE-3 head with {key} {layer[key]} is not supported (one layer, no MLP bias)")
        if d.get("norm_before_fc"):
            raise ValueError("an EAGLE-3 head with norm_before_fc (input_norm before fc) is not supported")
        lc = LlamaConfig(**{k: v for k, v in layer.items() if k not in ("architectures", "draft_vocab_size")})
        rope = dict(lc.rope_parameters or {})
        theta = rope.pop("rope_theta", 10000.0)
        scaling = rope if rope.get("rope_type", "default") != "default" else None
        aux = d.get("eagle_aux_hidden_state_layer_ids") or (d.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids")
        spec = d.get("speculators_config") or {}
        methods = spec.get("proposal_methods") or [{}]
        return cls(
            **{k: getattr(lc, k) for k in LAYER_KEYS}, draft_vocab_size=d.get("draft_vocab_size") or lc.vocab_size,
            aux_layer_ids=list(aux) if aux else None, target_hidden_size=d.get("target_hidden_size"),
            rope_theta=theta, rope_scaling=scaling,
            # vLLM reads a speculators config without the key as True, an older flat one as False
            norm_before_residual=d.get("norm_before_residual", speculators),
            verifier=(spec.get("verifier") or {}).get("name_or_path"),
            speculative_tokens=methods[0].get("speculative_tokens", 3),
            extra={k: v for k, v in layer.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")},
        )

    def to_dict(self) -> dict:
        layer = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], **self.extra,
                 **{k: getattr(self, k) for k in LAYER_KEYS}, "num_hidden_layers": 1, "rope_theta": self.rope_theta,
                 "rope_scaling": self.rope_scaling, "tie_word_embeddings": False}
        return {
            "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
            "speculators_config": {
                "algorithm": "eagle3", "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": self.speculative_tokens,
                                      "verifier_accept_k": 1, "accept_tolerance": 0.0}],
                "verifier": {"name_or_path": self.verifier, "architectures": ["LlamaForCausalLM"]},
            },
            "transformer_layer_config": layer, "draft_vocab_size": self.draft_vocab_size,
            "norm_before_residual": self.norm_before_residual, "target_hidden_size": self.target_hidden_size,
            "eagle_aux_hidden_state_layer_ids": self.aux_layer_ids, "torch_dtype": "bfloat16",
        }


class RMSNorm(nn.Module):
    """as Llama's: normalised in float32, scaled in the input's dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(size)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (one fused op where torch has one, instead of the five of x * rsqrt(mean(x^2) + eps); no
        # conversions dispatched where x is float32 already)
        y = F.rms_norm(x if x.dtype == torch.float32 else x.float(), self.weight.shape, eps=self.eps)
        return self.weight * (y if y.dtype == x.dtype else y.to(x.dtype))


class Eagle3Layer(nn.Module):
    """The one decoder layer, in two halves around attention (the serving step and training's
    multi-step attention share them): project -> (q, k, v, residual); finish(attention, residual)."""

    def __init__(self, c: Eagle3Config):
        super().__init__()
        H, hd, bias = c.hidden_size, c.head_dim, c.attention_bias
        self.heads, self.kv_heads, self.head_dim, self.norm_before_residual = (c.num_attention_heads,
                                                                             c.num_key_value_heads, hd,
                                                                             c.norm_before_residual)
        self.self_attn = nn.ModuleDict({"q_proj": nn.Linear(2 * H, self.heads * hd, bias=bias),
                                        "k_proj": nn.Linear(2 * H, self.kv_heads * hd, bias=bias),
                                        "v_proj": nn.Linear(2 * H, self.kv_heads * hd, bias=bias),
                                        "o_proj": nn.Linear(self.heads * hd, H, bias=bias)})
        self.mlp = nn.ModuleDict({"gate_proj": nn.Linear(H, c.intermediate_size, bias=False),
                                  "up_proj": nn.Linear(H, c.intermediate_size, bias=False),
                                  "down_proj": nn.Linear(c.intermediate_size, H, bias=False)})
        self.act = ACT2FN[c.hidden_act]
        self.input_layernorm, self.hidden_norm, self.post_attention_layernorm = (
            RMSNorm(H, c.rms_norm_eps) for _ in range(3))
        self.qkv_proj: nn.Linear | None = None      # (fuse_projections: serving's joined linears)
        self.gate_up_proj: nn.Linear | None = None

    def fuse_projections(self) -> None:
        """q/k/v as one linear and gate/up as one (serving: a step makes 5 linear calls instead of 8;
        on the int8 head, measured, ~55 us less a step); the arithmetic per output is unchanged. The
        separate ones are dropped (one copy of the weights): the head is then for serving only, not
        for training or `save`, which read the speculators layout's separate linears."""
        def joined(names: list[str], linears: nn.ModuleDict) -> nn.Linear:
            """One linear of `names`' outputs in order; the separate ones leave `linears`."""
            parts = [linears.pop(n) for n in names]
            bias = parts[0].bias is not None
            out = nn.Linear(parts[0].in_features, sum(p.out_features for p in parts), bias=bias,
                            device=parts[0].weight.device, dtype=parts[0].weight.dtype)
            with torch.no_grad():
                out.weight.copy_(torch.cat([p.weight for p in parts]))
                if bias:
                    out.bias.copy_(torch.cat([p.bias for p in parts]))
            return out.requires_grad_(False)

        self.qkv_proj = joined(["q_proj", "k_proj", "v_proj"], self.self_attn)
        self.gate_up_proj = joined(["gate_proj", "up_proj"], self.mlp)

    def project(self, embeds, hidden, cos, sin):
        """embeds, hidden: [B, S, H]; cos, sin: [B, S, hd] -> q [B, heads, S, hd], k, v [B, kv, S, hd], residual."""
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)  # [B, S, 2H]
        B, S, _ = x.shape
        a = self.self_attn
        if self.qkv_proj is not None:
            q, k, v = self.qkv_proj(x).split([self.heads * self.head_dim] + 2 * [self.kv_heads * self.head_dim], -1)
        else:
            q, k, v = a["q_proj"](x), a["k_proj"](x), a["v_proj"](x)
        q = q.reshape(B, S, self.heads, self.head_dim).transpose(1, 2)
        k = k.reshape(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        v = v.reshape(B, S, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        return q, k, v, residual

    def finish(self, attention: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attention: [B, heads, S, hd] -> out_hidden [B, S, H] (pre-norm)."""
        B, _, S, _ = attention.shape
        h = residual + self.self_attn["o_proj"](attention.transpose(1, 2).reshape(B, S, -1))
        m, x = self.mlp, self.post_attention_layernorm(h)
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = m["gate_proj"](x), m["up_proj"](x)
        return h + m["down_proj"](self.act(gate) * up)


@dataclass
class HeadCache:
    """One session's keys and values of the head's layer: k, v [kv_heads, T_alloc, head_dim], rows [0, length)."""
    k: torch.Tensor
    v: torch.Tensor
    length: int = 0

    def crop(self, length: int) -> None:
        self.length = max(0, min(length, self.length))

    def append(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [kv_heads, S, head_dim]."""
        end = self.length + k.shape[1]
        self.reserve(end, k.dtype)
        self.k[:, self.length : end], self.v[:, self.length : end] = k, v
        self.length = end

    def reserve(self, end: int, dtype: torch.dtype) -> None:
        """Room for rows [0, end) in `dtype`; the allocation doubles when full."""
        if end > self.k.shape[1] or self.k.dtype != dtype:
            size = max(end, 2 * self.k.shape[1])
            grown = [torch.zeros(t.shape[0], size, t.shape[2], dtype=dtype, device=t.device) for t in (self.k, self.v)]
            for new, old in zip(grown, (self.k, self.v)):
                new[:, : self.length] = old[:, : self.length]
            self.k, self.v = grown


class Eagle3Head(nn.Module):
    def __init__(self, config: Eagle3Config):
        super().__init__()
        c = self.config = config
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)  # the target's
        self.embeddings_from_target = False
        self.fc = nn.Linear(c.fused_size, c.hidden_size, bias=False)
        self.layers = nn.ModuleList([Eagle3Layer(c)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        self.rotary = LlamaRotaryEmbedding(c.llama_config())
        self._rope_rows: tuple[torch.Tensor, torch.Tensor] | None = None  # cos, sin by position (rope)
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.long))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self.t2d[: c.draft_vocab_size] = True
        self._q4_step: tuple | None = None  # (norms, tiles, outs) of the fused int4 step (quantize_int4)

    @property
    def dtype(self) -> torch.dtype:
        """The activations' dtype (the norms': the linears may be quantized, quantize_int8)."""
        return self.norm.weight.dtype

    @property
    def layer(self) -> Eagle3Layer:
        return self.layers[0]

    def set_vocab(self, target_ids: torch.Tensor) -> None:
        """The draft vocabulary: draft id i scores target id target_ids[i] (ascending ids, by convention)."""
        target_ids = target_ids.long().to(self.d2t.device)
        self.d2t.copy_(target_ids - torch.arange(len(target_ids), device=target_ids.device))
        self.t2d.zero_()
        self.t2d[target_ids] = True

    def draft_to_target(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def new_cache(self) -> HeadCache:
        c, p = self.config, self.norm.weight
        empty = torch.zeros(c.num_key_value_heads, 64, c.head_dim, dtype=p.dtype, device=p.device)
        return HeadCache(empty, empty.clone())

    def fuse(self, features: torch.Tensor) -> torch.Tensor:
        """features: [S, len(aux) * Ht] -> [S, H]."""
        return self.fc(features.to(self.dtype))

    def rope(self, x: torch.Tensor, positions: torch.Tensor, end: int | None = None):
        """positions: [B, S] (all below `end` where given: no device sync to find it) -> cos, sin
        [B, S, head_dim] in x's dtype: rows of a table of every position
        so far, made by the rotary module itself and doubled as positions pass it (a step indexes two
        rows instead of recomputing them); RoPE variants whose frequencies depend on the sequence's
        length (dynamic, longrope) call the module."""
        rope_type = getattr(self.rotary, "rope_type", "default")
        if not isinstance(rope_type, str) or rope_type in ("dynamic", "longrope"):
            return self.rotary(x, positions)
        if end is None:
            end = int(positions.max()) + 1 if positions.numel() else 0
        rows = self._rope_table(end, positions.device)
        cos, sin = rows[0][positions], rows[1][positions]
        return (cos, sin) if x.dtype == cos.dtype else (cos.to(x.dtype), sin.to(x.dtype))

    def _rope_table(self, end: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """rope's table: cos, sin [size >= end, head_dim] float32, grown (doubled) as positions pass it."""
        rows = self._rope_rows
        if rows is None or rows[0].shape[0] < end or rows[0].device != torch.device(device):
            size = max(end, 2 * rows[0].shape[0] if rows is not None else 256)
            probe = torch.zeros(1, 1, self.config.head_dim, device=device)
            with torch.inference_mode(False), torch.no_grad():  # (a plain tensor: training reads it too)
                cos, sin = self.rotary(probe, torch.arange(size, device=device)[None])
            rows = self._rope_rows = cos[0], sin[0]  # float32, [size, head_dim]
        return rows

    def step(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, cache: HeadCache,
             end: int | None = None, logits: bool = True):
        """input_ids [S], hidden [S, H], positions [S] (below `end`, if given) -> (out_hidden [S, H], logits
        [S, Vd], or None where not `logits`); the rows attend to the cache's rows and causally to each
        other, then their k/v are appended to the cache."""
        if self._q4_step is not None:
            return self._step_q4(input_ids, hidden, positions, [cache], [len(input_ids)], end, logits)
        S, past = len(input_ids), cache.length
        hidden = hidden.to(self.dtype)[None]
        cos, sin = self.rope(hidden, positions[None], end)
        q, k, v, residual = self.layer.project(self.embed_tokens(input_ids)[None].to(hidden.dtype), hidden, cos, sin)
        cache.append(k[0], v[0])
        mask = None  # one row sees every row before it and itself
        if S > 1:
            mask = torch.ones(S, past + S, dtype=torch.bool, device=hidden.device)
            mask[:, past:] = torch.ones(S, S, dtype=torch.bool, device=hidden.device).tril()
        attention = F.scaled_dot_product_attention(q, cache.k[None, :, : past + S], cache.v[None, :, : past + S],
                                                   attn_mask=mask, enable_gqa=True)
        out = self.layer.finish(attention, residual)[0]
        return out, self.lm_head(self.norm(out)) if logits else None

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """lm_head(norm(out)) for out_hidden rows [S, H] -> [S, Vd]: in one call where the fused step
        runs (q4_kernel's q4_output, the step's own arithmetic for its logits), else two torch calls."""
        if self._q4_step is not None:
            norms, tiles, outs = self._q4_step
            return torch.ops.specdec.q4_output(out.float(), norms[3], tiles[4], outs[4], self.config.rms_norm_eps)
        return self.lm_head(self.norm(out))

    def step_many(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                  caches: list[HeadCache], end: int | None = None):
        """One row for each of B sessions at once: input_ids [B], hidden [B, H], positions [B], each
        row attending to its own session's cache -> (out_hidden [B, H], logits [B, Vd]); the linear
        layers run once for all rows (step's arithmetic, row by row)."""
        if self._q4_step is not None:
            return self._step_q4(input_ids, hidden, positions, caches, [1] * len(caches), end, True)
        hidden = hidden.to(self.dtype)[:, None]  # [B, 1, H]
        cos, sin = self.rope(hidden, positions[:, None], end)
        q, k, v, residual = self.layer.project(self.embed_tokens(input_ids)[:, None].to(hidden.dtype), hidden, cos, sin)
        outs = []
        for b, cache in enumerate(caches):  # q [B, heads, 1, hd]; each row sees its cache and itself
            cache.append(k[b], v[b])
            outs.append(F.scaled_dot_product_attention(q[b : b + 1], cache.k[None, :, : cache.length],
                                                       cache.v[None, :, : cache.length], enable_gqa=True))
        out = self.layer.finish(torch.cat(outs), residual)[:, 0]
        return out, self.lm_head(self.norm(out))

    @property
    def fuses_draft(self) -> bool:
        """Whether draft_fused runs: the fused int4 step (quantize_int4, a CPU kernel) with float32 embeddings."""
        return self._q4_step is not None and self.embed_tokens.weight.dtype == torch.float32

    def draft_fused(self, hidden: torch.Tensor, positions: list[int], caches: list[HeadCache], ks: list[int],
                    p_mins: list[float], known: torch.Tensor | None, target_ids: torch.Tensor,
                    params: list | None = None, uniforms: torch.Tensor | None = None,
                    max_support: int = 64) -> list[tuple[list[int], torch.Tensor, list]] | None:
        """Up to ks[s] tokens for each of S sessions in one call (q4_kernel's q4_eagle_draft: the fused
        step's head, the first from the logits of hidden [S, H], each session's last out_hidden, at
        `positions`; over the draft ids `known` allows (None: all), mapped by target_ids): greedy, the
        argmax, stopping where its probability is under p_mins[s]; sampled (params[s]: SamplingParams,
        None or greedy ones draw nothing), speculative.sampling.draft_token's draw at its temperature,
        top-k and top-p with q over at most `max_support` ids, the t-th token's uniform uniforms[s, t]
        (float64 [S, max k]). -> per session, (its target token ids, the out_hidden [n, H] of the rows
        its steps appended: one fewer than its tokens, or none, and per sampled token (its support's
        target ids, q)), or None where the fused step does not run (EagleDraft then drafts step by
        step: step_many)."""
        if not self.fuses_draft:
            return None
        c = self.config
        norms, tiles, outs = self._q4_step
        table = self._rope_table(max(p + max(k - 1, 0) for p, k in zip(positions, ks)) + 1, hidden.device)
        for cache, k in zip(caches, ks):
            cache.reserve(cache.length + max(k - 1, 0), torch.float32)
        params = params or [None] * len(caches)
        sampled = [p is not None and not p.greedy for p in params]
        tokens, rows, steps, support, q = torch.ops.specdec.q4_eagle_draft(
            hidden.float(), self.embed_tokens.weight, table[0], table[1], [cache.k for cache in caches],
            [cache.v for cache in caches], [cache.length for cache in caches], positions, ks, p_mins, known,
            target_ids, c.num_attention_heads, c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.head_dim ** -0.5,
            c.norm_before_residual, norms, tiles, outs,
            [float(p.temperature) if s else 0.0 for p, s in zip(params, sampled)],
            [int(p.top_k) if s else 0 for p, s in zip(params, sampled)],
            [float(p.top_p) if s else 1.0 for p, s in zip(params, sampled)],
            [float(p.min_p) if s else 0.0 for p, s in zip(params, sampled)], max_support,
            uniforms if any(sampled) else None)
        drafted = []
        sizes = (support >= 0).sum(-1).tolist() if any(sampled) else None
        for s, (cache, n, ids) in enumerate(zip(caches, steps.tolist(), tokens.tolist())):
            cache.length += n
            ids = ids[: ids.index(-1)] if -1 in ids else ids
            supports = [(support[s, t, :size], q[s, t, :size]) for t, size in enumerate(sizes[s][: len(ids)])] \
                if sampled[s] else []
            drafted.append((ids, rows[s, :n], supports))
        return drafted

    def quantize_int8(self) -> "Eagle3Head":
        """The decoder layer's linears and lm_head as int8 with dynamic activation scales (torch's
        CPU dynamic quantization): a draft step reads about a third of the weight bytes, which on
        a CPU is most of its time. fc stays float: its input is the target's hidden states side
        by side, whose few huge channels (a middle layer's outliers) would take one per-row int8
        scale and crush the rest (measured on the default pair's head, K = 4, 16 chat prompts x 64
        tokens: acceptance 0.069 with fc in int8, 0.102 without). The head is then another,
        slightly different drafter; the output stays the target's (q is what the head sampled from)."""
        import warnings

        linears = {name for name, module in self.named_modules() if isinstance(module, nn.Linear) and name != "fc"}
        with warnings.catch_warnings():  # (torch marks its quantized tensors deprecated; they still run)
            warnings.simplefilter("ignore")
            # a scale per output row (not one per matrix): the joined q/k/v and gate/up quantize as
            # the separate ones would, and a row's error is its own range's (the same speed, measured)
            qconfig = torch.ao.quantization.per_channel_dynamic_qconfig
            return torch.ao.quantization.quantize_dynamic(self, {name: qconfig for name in linears})

    def quantize_int4(self) -> "Eagle3Head":
        """fc, the decoder layer's linears and lm_head through specdec's int4 kernel (int4.Q4Linear:
        4-bit groups of 32 inputs, each group's range fitted; activations in int8 blocks of 32): a
        step reads about half quantize_int8's bytes and its products run 2-4x faster here. The
        activations' scales are per block of 32, not per row, so fc's outlier channels (see
        quantize_int8) crush only their own block: fc in int4 kept the acceptance fc in float had.
        Needs the kernel built (q4_kernel.available()). Another, slightly different drafter; the
        output stays the target's."""
        from .int4 import Q4Linear

        for name, module in list(self.named_modules()):
            if isinstance(module, nn.Linear):
                self.set_submodule(name, Q4Linear(module))
        self._q4_step = self._q4_step_weights()
        return self

    def _q4_step_weights(self) -> tuple | None:
        """What the fused step (q4_kernel's q4_eagle_step: the layer, the norm and lm_head in one
        call instead of ~60 torch ops) reads, where this head can take it: a float32 head on CPU
        with fused projections (EagleDraft.load), every linear of the step in Q4Linear without a
        bias, SiLU, and RoPE from the table (`rope`). Else None: step runs op by op."""
        from .int4 import Q4Linear

        layer, c = self.layer, self.config
        linears = [layer.qkv_proj, layer.self_attn["o_proj"], layer.gate_up_proj, layer.mlp["down_proj"], self.lm_head]
        rope_type = getattr(self.rotary, "rope_type", "default")
        if (self.dtype != torch.float32 or self.norm.weight.device.type != "cpu" or c.hidden_act != "silu"
                or not isinstance(rope_type, str) or rope_type in ("dynamic", "longrope")
                or not all(isinstance(m, Q4Linear) and m.bias is None for m in linears)):
            return None
        norms = [layer.input_layernorm.weight, layer.hidden_norm.weight, layer.post_attention_layernorm.weight,
                 self.norm.weight]
        return ([w.detach().contiguous() for w in norms], [m.tiles for m in linears], [m.out_features for m in linears])

    def _step_q4(self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                 caches: list[HeadCache], lengths: list[int], end: int | None, logits: bool):
        """step / step_many through q4_eagle_step: each cache's next lengths[s] rows are the call's
        rows in order (the same arithmetic, each linear once over all the rows)."""
        c = self.config
        norms, tiles, outs = self._q4_step
        hidden = hidden.float()
        cos, sin = self.rope(hidden, positions, end)
        for cache, n in zip(caches, lengths):
            cache.reserve(cache.length + n, torch.float32)
        out, scores = torch.ops.specdec.q4_eagle_step(
            self.embed_tokens(input_ids).float(), hidden, cos, sin, [cache.k for cache in caches],
            [cache.v for cache in caches], [cache.length for cache in caches], lengths, c.num_attention_heads,
            c.num_key_value_heads, c.head_dim, c.rms_norm_eps, c.head_dim ** -0.5, c.norm_before_residual, norms,
            tiles, outs, logits)
        for cache, n in zip(caches, lengths):
            cache.length += n
        return out, scores if logits else None

    # ------------------------------------------------------------------ checkpoints

    @classmethod
    def load(cls, directory, target_dir=None, device="cpu", dtype=torch.float32) -> Eagle3Head:
        directory = Path(directory)
        if not (directory / "config.json").is_file():
            raise FileNotFoundError(f"{directory} is not an EAGLE head's directory (no config.json)")
        config = Eagle3Config.from_dict(json.loads((directory / "config.json").read_text()))
        if target_dir and not Path(target_dir).is_dir():  # (else the head's missing embedding is what it would name)
            raise FileNotFoundError(f"the target's directory {target_dir} is not a directory")
        target_dir = Path(target_dir) if target_dir else (Path(config.verifier) if config.verifier else None)
        if config.aux_layer_ids is None:
            if target_dir is None or not (target_dir / "config.json").exists():
                raise ValueError(f"{directory}: no eagle_aux_hidden_state_layer_ids and no target to default them")
            config.aux_layer_ids = default_aux_layer_ids(
                json.loads((target_dir / "config.json").read_text())["num_hidden_layers"])
        state = {}
        single = directory / "model.safetensors"
        if not single.is_file() and (directory / "model.safetensors.int8").is_file():
            raise ValueError(f"{directory} holds its weights packed: unpack them first (make setup, or"
                             f" python -m assets.packed unpack {directory})")
        for path in [single] if single.is_file() else sorted(directory.glob("*.safetensors")):
            with safe_open(path, "pt") as f:
                state.update({k.replace("midlayer.", "layers.0.").removeprefix("model."): f.get_tensor(k)
                              for k in f.keys()})  # noqa: SIM118 (a safe_open handle)
        head = cls(config)
        if "embed_tokens.weight" not in state:
            if target_dir is None or not target_dir.is_dir():
                raise ValueError(f"{directory} has no embed_tokens.weight: give the target's directory")
            state["embed_tokens.weight"] = read_target_tensor(target_dir, "model.embed_tokens.weight")
            head.embeddings_from_target = True
        state.setdefault("d2t", head.d2t)  # none: the draft vocabulary is the target's
        if "t2d" not in state:
            state["t2d"] = torch.zeros(config.vocab_size, dtype=torch.bool)
            state["t2d"][state["d2t"] + torch.arange(len(state["d2t"]))] = True
        state["t2d"] = state["t2d"].bool()
        missing, unexpected = head.load_state_dict(state, strict=False)
        if [m for m in missing if not m.startswith("rotary.")] or unexpected:
            raise ValueError(f"{directory}: missing {missing}, unexpected {unexpected}")
        head = head.to(device=device, dtype=dtype).eval()
        head.rotary = LlamaRotaryEmbedding(config.llama_config()).to(device)  # inv_freq stays float32
        return head

    def save(self, directory, dtype=torch.bfloat16, embeddings: bool | None = None) -> None:
        """config.json + model.safetensors; the embedding only where it did not come from the target
        (embeddings=None) or where asked."""
        if self.layer.qkv_proj is not None:
            raise ValueError("a head joined for serving (fuse_projections) has no speculators layout: save it unjoined")
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        keep = (not self.embeddings_from_target) if embeddings is None else embeddings
        state = {k: (v.to(dtype) if v.is_floating_point() else v).contiguous() for k, v in self.state_dict().items()
                 if not k.startswith("rotary.") and (keep or k != "embed_tokens.weight")}
        save_file(state, directory / "model.safetensors", metadata={"format": "pt"})
        (directory / "config.json").write_text(json.dumps(self.config.to_dict(), indent=1) + "\n")


def read_target_tensor(target_dir, name: str) -> torch.Tensor:
    """One tensor of a transformers checkpoint (read alone with safe_open); for tied-embedding
    targets lm_head.weight is model.embed_tokens.weight."""
    target_dir = Path(target_dir)
    for path in sorted(target_dir.glob("*.safetensors")):
        with safe_open(path, "pt") as f:
            if name in f.keys():  # noqa: SIM118 (a safe_open handle)
                return f.get_tensor(name)
    if name == "lm_head.weight":
        return read_target_tensor(target_dir, "model.embed_tokens.weight")
    raise KeyError(f"{target_dir}: no tensor {name}")
