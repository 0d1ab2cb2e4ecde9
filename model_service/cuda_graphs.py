"""One session's one-token decode step replayed from a CUDA graph (FastForward's, on a GPU).

    steps = GraphedSteps(fast)            # fast: a FastForward on cuda (capture=False: the same body, eager)
    logits = steps(token, cache)          # [1, V]; cache.length grows by one

A small model's decode step on a GPU is bound by kernel launches, not arithmetic: a 16-layer
step dispatches ~250 kernels from Python, each a few microseconds of host time against well
under one of GPU work. A CUDA graph records them once and replays them in one launch. A graph
is bound to the addresses it recorded, so the step's body has static shapes: the token and
its position live in two device tensors the replay reads, the new key and value are written
into the cache at that position (`index_copy_`), and attention runs over the cache's whole
capacity under a mask of the positions up to it (the keys past it are masked out, so the
result is the eager step's, up to the order of the reductions). One graph per cache storage
(a pool's slot, or a cache of its own, at its capacity): a cache that moves or grows is
captured again. The graphs share one memory pool (they replay one at a time, under the
runner's lock) and at most MAX_GRAPHS are kept, the least recently used dropped first.

Multi-token passes (verify, prefill) and several sessions at once run FastForward's eager
forward. With capture=False the same static body runs eagerly: how the tests check it on a
machine with no GPU.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .fast_forward import _rotate_half
from .kv_cache import KVCache

MAX_GRAPHS = 64


@dataclass
class _Step:
    data: torch.Tensor  # the cache storage the step writes (kept: the graph holds its address)
    inputs: torch.Tensor  # [2] long: the token, its position (the replay reads them)
    logits: torch.Tensor | None = None  # [1, V]: the replay writes here
    graph: torch.cuda.CUDAGraph | None = None


class GraphedSteps:
    """FastForward's one-token, one-session step through CUDA graphs (see the module)."""

    def __init__(self, fast, capture: bool = True, max_graphs: int = MAX_GRAPHS):
        if fast.reduce is not None or fast.int4_group or fast.rope_table is None:
            raise ValueError("graphed steps need an unsharded float forward with a fixed RoPE table")
        self.fast, self.capture, self.max_graphs = fast, capture, max_graphs
        self.steps: OrderedDict[tuple, _Step] = OrderedDict()
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.captures = 0  # graphs recorded so far (a test and the bench read it)

    def __call__(self, token: int, cache: KVCache) -> torch.Tensor:
        """Feed `token` at position cache.length; -> its logits [1, V] (the graph's own output
        tensor: read it before the next step)."""
        data = cache.data  # [layers, 2, 1, kv_heads, capacity, head_dim]
        if cache.length >= data.shape[4]:
            cache.reserve(cache.length + 1)
            data = cache.data
        key = (data.data_ptr(), data.shape, data.stride())
        step = self.steps.get(key)
        if step is None:
            step = self._new(key, data, cache.length)
        else:
            self.steps.move_to_end(key)
        step.inputs.copy_(torch.tensor([token, cache.length], dtype=torch.long), non_blocking=True)
        if step.graph is None:
            step.logits = self._body(step.data, step.inputs)
        else:
            step.graph.replay()
        cache.length += 1
        return step.logits

    def _new(self, key: tuple, data: torch.Tensor, length: int) -> _Step:
        step = _Step(data, torch.zeros(2, dtype=torch.long, device=data.device))
        # the step's attention reads every position of the storage (masked past its own): a masked
        # score still multiplies its value, and 0 x a NaN left in fresh memory is NaN
        data[:, :, :, :, length:].nan_to_num_(0.0, 0.0, 0.0)
        if self.capture:
            # warm up on a side stream, as torch.cuda.graphs asks, at the step's own position (which the
            # replay that follows writes again), then record
            step.inputs.copy_(torch.tensor([0, length], dtype=torch.long))
            stream = torch.cuda.Stream(data.device)
            stream.wait_stream(torch.cuda.current_stream(data.device))
            with torch.cuda.stream(stream):
                self._body(data, step.inputs)
            torch.cuda.current_stream(data.device).wait_stream(stream)
            step.graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(step.graph, pool=self.pool):
                step.logits = self._body(data, step.inputs)
            self.captures += 1
        while len(self.steps) >= self.max_graphs:
            self.steps.popitem(last=False)
        self.steps[key] = step
        return step

    def _body(self, data: torch.Tensor, inputs: torch.Tensor) -> torch.Tensor:
        """The step with static shapes: every tensor it reads or writes is `data`, `inputs` or a weight."""
        fast = self.fast
        heads, kv_heads, head_dim = fast.heads, fast.kv_heads, fast.head_dim
        token, position = inputs[:1], inputs[1:]
        capacity = data.shape[4]
        x = F.embedding(token, fast.embed)  # [1, D]
        cos, sin = fast.rope_table[0][position][:, None], fast.rope_table[1][position][:, None]  # [1, 1, hd]
        mask = (torch.arange(capacity, device=data.device) <= position)[None, None]  # [1, 1, capacity]
        for i, layer in enumerate(fast.layers):
            h = fast._norm(x, layer["in_norm"])
            qkv = fast._mm(h, layer["qkv"], None, layer["qkv_bias"])
            qk = qkv[:, : (heads + kv_heads) * head_dim].view(1, heads + kv_heads, head_dim)
            qk = qk * cos + _rotate_half(qk) * sin
            v = qkv[:, (heads + kv_heads) * head_dim :].view(1, kv_heads, head_dim)
            keys, values = data[i, 0], data[i, 1]  # [1, H_kv, capacity, hd]
            keys.index_copy_(2, position, qk[:, heads:].transpose(0, 1)[None])
            values.index_copy_(2, position, v.transpose(0, 1)[None])
            q = qk[:, :heads].transpose(0, 1)[None]  # [1, H, 1, hd]
            att = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[None], scale=layer["scaling"],
                                                 enable_gqa=kv_heads != heads)
            x = x + fast._mm(att[0].transpose(0, 1).reshape(1, -1), layer["o"], None)
            h = fast._norm(x, layer["post_norm"])
            gate, up = fast._mm(h, layer["gate_up"], None).split(layer["half"], dim=-1)
            x = x + fast._mm(F.silu(gate) * up, layer["down"], None)
        logits = fast._mm(fast._norm(x, fast.final_norm.weight), fast.lm_head, None)
        if fast.head_ids is not None:
            logits = logits.new_full((1, fast.vocab_size), float("-inf")).index_copy_(1, fast.head_ids, logits)
        return logits

