"""Attention over a KV pool's slots: one call per layer for a pass over several pooled sessions.

    batch = slot_batch(pool, feeds, spans)            # None: attention per session pays better
    att = slot_attention(pool.data[i], batch, qk, v, heads, scaling)   # layer i, [T, H, head_dim]

Where the sessions of a pass hold slots of one pool (kv_cache.KVPool), their keys and values sit
side by side in one tensor, so a layer's attention can be one `scaled_dot_product_attention` over
the slots lo..hi-1 they span instead of one call per session: the sessions' new tokens become a
batch of hi - lo rows of `width` queries each (the longest feed's), padded where a feed has fewer
tokens or a slot between them has no feed. Each padding query sees what its row's last query sees
(key 0 in a slot no feed has); its output is dropped. The padding is the price: the call is taken
only where its work stays within POOL_PADDING times the feeds' own. FastForward.many runs this
(its eager loop here, its TorchScript loop with the same SlotBatch in scripted.LAYERS_BATCHED).
Why it pays (fewer dispatched calls, more threads busy on one call): docs/performance.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .kv_cache import KVPool

# one call over the slots when its padded work (slots spanned x longest feed x furthest position) is
# at most this many times the feeds' own (each feed's tokens x its positions); else per session
POOL_PADDING = 2.0


def visible(key: torch.Tensor, position: torch.Tensor, window: int | None) -> torch.Tensor:
    """Whether a query at `position` sees the key at `key` (broadcast): keys up to its own position, and
    under a sliding window only the last `window` of them (transformers': key > position - window)."""
    seen = key <= position
    return seen if window is None else seen & (key > position - window)


@dataclass
class SlotBatch:
    """One attention call over a pool's slots lo..hi-1 (see slot_batch)."""
    lo: int
    hi: int
    width: int  # queries per row
    keys: int  # positions each row's keys span
    rows: torch.Tensor  # [T]: each new token's row (its slot - lo)
    cols: torch.Tensor  # [T]: its query within the row
    pos: torch.Tensor  # [T]: its position
    mask: torch.Tensor  # [B, 1, width, keys]: 0 where a query sees a key, -inf elsewhere


def slot_batch(pool: KVPool | None, feeds, spans, window: int | None = None) -> SlotBatch | None:
    """How one attention call per layer covers these feeds (input_ids, cache, num_logits), or None
    where it would not pay or they are not all slots of `pool`. spans: each feed's [a, b) rows of
    the pass and [start, end) positions.

    Query j of a feed that starts at position `start` sees keys 0..start+j (the last `window` of them,
    where given); padding queries see what their row's last query sees, or key 0 in a slot no feed has.
    """
    if len(feeds) < 2 or pool is None or not all(c.pooled and c.pool is pool for _, c, _ in feeds):
        return None
    taken = [c.slot for _, c, _ in feeds]
    lo, hi = min(taken), max(taken) + 1
    width = max(b - a for a, b, _, _ in spans)
    keys = max(end for _, _, _, end in spans)
    # the call's work, queries x keys, against the feeds' own
    if (hi - lo) * width * keys > POOL_PADDING * sum((b - a) * end for a, b, _, end in spans):
        return None
    device = pool.data.device
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
    mask = torch.zeros(hi - lo, 1, width, keys, dtype=pool.data.dtype, device=device)
    unseen = ~visible(torch.arange(keys, device=device)[None, None], at[:, :, None], window)
    mask.masked_fill_(unseen[:, None], float("-inf"))
    return SlotBatch(lo, hi, width, keys, *tokens, mask)


def slot_attention(kv: torch.Tensor, batch: SlotBatch, qk: torch.Tensor, v: torch.Tensor, heads: int,
                   scaling: float | None) -> torch.Tensor:
    """One layer's attention over the slots: kv the pool's layer [2, slots, H_kv, capacity, head_dim]
    (the new keys and values are written into it), qk [T, H + H_kv, head_dim] (after RoPE), v [T, H_kv,
    head_dim] -> [T, H, head_dim]."""
    keys, values = kv[:, batch.lo : batch.hi]  # [B, H_kv, capacity, head_dim] each
    keys[batch.rows, :, batch.pos] = qk[:, heads:]
    values[batch.rows, :, batch.pos] = v
    q = qk.new_zeros(batch.hi - batch.lo, batch.width, heads, qk.shape[-1])
    q[batch.rows, batch.cols] = qk[:, :heads]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys[:, :, : batch.keys], values[:, :, : batch.keys],
        attn_mask=batch.mask, scale=scaling, enable_gqa=v.shape[1] != heads,
    )  # [B, H, width, head_dim]
    return out.transpose(1, 2)[batch.rows, batch.cols]
