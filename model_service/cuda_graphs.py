"""One session's passes of a few tokens replayed from CUDA graphs (FastForward's, on a GPU): a
draft's steps and a target's decode steps (one token), a target's verify passes (K + 1 tokens).

    graphs = GraphedPasses(fast)                        # fast: a FastForward on cuda (capture=False: eager)
    logits, states = graphs(tokens, cache, capture)    # [n, V], [n, len(capture), D] or None

A pass of a few tokens on a GPU is bound by kernel launches, not arithmetic: a 32-layer pass
dispatches ~500 kernels from Python, each a few microseconds of host time against well under one of
GPU work. A CUDA graph records them once and replays them in one launch. A graph is bound to the
addresses it recorded, so the pass's body has static shapes: the n tokens and their positions live
in one device tensor the replay reads, the new keys and values are written into the cache at those
positions (`index_copy_`), and attention runs over the cache's whole capacity under a mask of the
positions up to each query's (the keys past it are masked out, so the result is the eager pass's, up
to the order of the reductions). One graph per (cache storage, tokens, captured layers): a pool's
slot or a cache of its own at its capacity, n from 1 to MAX_TOKENS (a verify pass of K + 1); a cache
that moves or grows is captured again. The graphs share one memory pool (they replay one at a time,
under the runner's lock, and each output is copied out before the next replay) and at most
MAX_GRAPHS are kept, the least recently used dropped first.

Longer passes (prefill) and several sessions at once run FastForward's eager forward. With
capture=False the same static body runs eagerly: how the tests check it on a machine with no GPU.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import scripted
from .fast_forward import _rotate_half
from .kv_cache import KVCache
from .slot_attention import visible

MAX_GRAPHS = 128
MAX_TOKENS = 17  # the longest pass graphed: a verify of 16 draft tokens (the services' most per call)


@dataclass
class _Pass:
    inputs: torch.Tensor  # [2n] long: the tokens, then their positions (the replay reads them)
    logits: torch.Tensor | None = None  # [n, V]: the replay writes here
    states: torch.Tensor | None = None  # [n, len(capture), D]: the captured layers' inputs, or None
    graph: torch.cuda.CUDAGraph | None = None


class GraphedPasses:
    """FastForward's pass of one session over 1..MAX_TOKENS tokens through CUDA graphs (see the module)."""

    def __init__(self, fast, capture: bool = True, max_graphs: int = MAX_GRAPHS, max_tokens: int = MAX_TOKENS):
        if fast.reduce is not None or fast.int4_group or fast.rope_table is None:
            raise ValueError("graphed passes need an unsharded float forward with a fixed RoPE table")
        self.fast, self.capture, self.max_graphs, self.max_tokens = fast, capture, max_graphs, max_tokens
        self.passes: OrderedDict[tuple, _Pass] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0  # graphs recorded so far (a test and the bench read it)
        self.replays = 0   # passes run through it

    def takes(self, tokens: int) -> bool:
        return 1 <= tokens <= self.max_tokens

    def __call__(self, tokens: list[int], cache: KVCache, capture: tuple[int, ...] = ()
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Feed `tokens` at positions cache.length.. -> (their logits [n, V], the `capture` layers'
        inputs [n, len(capture), D] or None), copies the caller keeps. cache.length grows by n."""
        n = len(tokens)
        data = cache.data  # [layers, 2, 1, kv_heads, capacity, head_dim]
        if cache.length + n > data.shape[4]:
            cache.reserve(cache.length + n)
            data = cache.data
        key = (data.data_ptr(), data.shape, data.stride(), n, capture)
        # (a graph holds no reference to the storage: one that is freed, a cache grown or a pool
        # resized, is not kept alive by it; a replay writes where the live cache's storage is, since
        # the key is that storage's address, shape and strides)
        step = self.passes.get(key)
        if step is None:
            step = self._new(key, data, cache.length, n, capture)
        else:
            self.passes.move_to_end(key)
        inputs = torch.tensor([*tokens, *range(cache.length, cache.length + n)], dtype=torch.long)
        step.inputs.copy_(inputs, non_blocking=True)
        if step.graph is None:
            step.logits, step.states = self._body(data, step.inputs, n, capture)
        else:
            step.graph.replay()
        cache.length += n
        self.replays += 1
        return step.logits.clone(), None if step.states is None else step.states.clone()

    def _new(self, key: tuple, data: torch.Tensor, length: int, n: int, capture: tuple[int, ...]) -> _Pass:
        step = _Pass(torch.zeros(2 * n, dtype=torch.long, device=data.device))
        # the pass's attention reads every position of the storage (masked past its own): a masked
        # score still multiplies its value, and 0 x a NaN left in fresh memory is NaN
        data[:, :, :, :, length:].nan_to_num_(0.0, 0.0, 0.0)
        if self.capture:
            # warm up on a side stream, as torch.cuda.graphs asks, at the pass's own positions (which the
            # replay that follows writes again), then record
            step.inputs.copy_(torch.tensor([0] * n + list(range(length, length + n)), dtype=torch.long))
            stream = torch.cuda.Stream(data.device)
            stream.wait_stream(torch.cuda.current_stream(data.device))
            with torch.cuda.stream(stream):
                self._body(data, step.inputs, n, capture)
            torch.cuda.current_stream(data.device).wait_stream(stream)
            step.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step.graph, pool=self.pool):
                step.logits, step.states = self._body(data, step.inputs, n, capture)
            self.captures += 1
        while len(self.passes) >= self.max_graphs:
            self.passes.popitem(last=False)
        self.passes[key] = step
        return step

    def _body(self, data: torch.Tensor, inputs: torch.Tensor, n: int, capture: tuple[int, ...]
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The pass with static shapes: every tensor it reads or writes is `data`, `inputs` or a weight."""
        fast = self.fast
        heads, kv_heads, head_dim = fast.heads, fast.kv_heads, fast.head_dim
        tokens, position = inputs[:n], inputs[n:]  # [n], [n]
        capacity = data.shape[4]
        x = F.embedding(tokens, fast.embed)  # [n, D]
        cos, sin = fast.rope_table[0][position][:, None], fast.rope_table[1][position][:, None]  # [n, 1, hd]
        # query i sees the keys at positions up to its own (the last fast.window of them, under a sliding window)
        mask = visible(torch.arange(capacity, device=data.device)[None], position[:, None], fast.window)[None, None]
        states = {}
        for i, layer in enumerate(fast.layers):
            if i in capture:
                states[i] = x.clone()
            h = fast._norm(x, layer["in_norm"])
            qkv = fast._mm(h, layer["qkv"], None, layer["qkv_bias"])
            qk = qkv[:, : (heads + kv_heads) * head_dim].view(n, heads + kv_heads, head_dim)
            qk = scripted.qk_norm(qk, layer["qk_norm"], heads, fast.eps)
            if layer["rope"]:
                qk = qk * cos + _rotate_half(qk) * sin
            v = qkv[:, (heads + kv_heads) * head_dim :].view(n, kv_heads, head_dim)
            keys, values = data[i, 0], data[i, 1]  # [1, H_kv, capacity, hd]
            keys.index_copy_(2, position, qk[:, heads:].transpose(0, 1)[None])
            values.index_copy_(2, position, v.transpose(0, 1)[None])
            q = qk[:, :heads].transpose(0, 1)[None]  # [1, H, n, hd]
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=layer["scaling"],
                                                 enable_gqa=kv_heads != heads)
            x = x + fast._mm(att[0].transpose(0, 1).reshape(n, -1), layer["o"], None)
            h = fast._norm(x, layer["post_norm"])
            gate, up = fast._mm(h, layer["gate_up"], None).split(layer["half"], dim=-1)
            x = x + fast._mm(F.silu(gate) * up, layer["down"], None)
        logits = fast._mm(fast._norm(x, fast.final_norm.weight), fast.lm_head, None)
        if fast.head_ids is not None:
            logits = logits.new_full((n, fast.vocab_size), float("-inf")).index_copy_(1, fast.head_ids, logits)
        return logits, torch.stack([states[i] for i in capture], dim=1) if capture else None
