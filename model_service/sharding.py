"""Megatron's split of the lean forward's weights over tensor-parallel ranks (as gpt-fast's `apply_tp`).

    check_shardable(config, world)      # before anything loads: the split must be even
    shard(fast, rank, world)            # a whole FastForward keeps rank's 1/world of every layer
    adopt_shard(fast, world, vocab)     # or its model was loaded as that split already (loading.py)

q/k/v and gate/up are split by output columns: rank r computes heads r*H/world.. and the matching
MLP columns. o and down are split by input rows, so each rank's product is a partial sum of x's
update and the forward's `reduce` (an all-reduce) completes it. lm_head is split by vocabulary
columns and `gather` lays the ranks' logits side by side. The embedding and the norms stay whole.
The collectives themselves are the ranks' (tensor_parallel.attach); loading.py reads the same
split straight from a checkpoint.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .fast_forward import FastForward


def check_shardable(config, world: int) -> None:
    """Raise ValueError unless the model's heads and MLP columns split evenly over `world` ranks."""
    heads = config.num_attention_heads
    for count, what in ((heads, "attention heads"), (getattr(config, "num_key_value_heads", None) or heads,
                        "key/value heads"), (config.intermediate_size, "MLP columns")):
        if count % world:
            raise ValueError(f"tensor-parallel size {world} does not divide the model's {count} {what}")


def shard(fast: FastForward, rank: int, world: int) -> None:
    """Keep this rank's 1/world of every layer of `fast` (see the module docstring). The HF modules'
    weights are emptied: only this forward runs a sharded model. (A tensor-parallel rank reads the
    same split straight from the checkpoint instead: loading.load_model, then `adopt_shard`.)"""
    check_shardable(fast.model.config, world)
    if fast.world != 1:
        raise ValueError(f"this forward is sharded over {fast.world} ranks already")

    def cols(w: torch.Tensor, size: int) -> torch.Tensor:  # [in, size] block of rank r
        return w[..., rank * size : (rank + 1) * size]

    for layer in fast.layers:
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
    vocab = fast.lm_head.shape[1]
    width = -(-vocab // world)  # ceil: the last rank's block is padded with zero columns
    head = torch.zeros(fast.lm_head.shape[0], width, dtype=fast.lm_head.dtype, device=fast.lm_head.device)
    block = fast.lm_head[:, rank * width : (rank + 1) * width]
    head[:, : block.shape[1]] = block
    fast.lm_head = head
    adopt_shard(fast, world, vocab)
    for layer in fast.model.model.layers:
        for module in (*layer.self_attn.children(), *layer.mlp.children()):
            if isinstance(module, torch.nn.Linear):
                module.weight.data = torch.empty(0, dtype=module.weight.dtype, device=module.weight.device)
    head_module = fast.model.get_output_embeddings()
    if head_module.weight.data_ptr() != fast.embed.data_ptr():
        head_module.weight.data = torch.empty(0, dtype=fast.lm_head.dtype, device=fast.lm_head.device)
    fast.pack()


def adopt_shard(fast: FastForward, world: int, vocab: int) -> None:
    """Count heads as one rank of `world` does, for a forward whose weights hold that rank's split
    already: made by `shard`, or loaded so (loading.load_model). `vocab`: the whole output layer's
    width, which `gather` cuts the ranks' padded logits back to."""
    fast.world, fast.vocab_size = world, vocab
    fast.heads //= world
    fast.kv_heads //= world
    fast.pool = None  # caches made from now on hold this rank's heads
