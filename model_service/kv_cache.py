"""KV caches for the lean forward: each session's own growing cache (KVCache), or a slot of one
shared tensor (KVPool) so a pass over several sessions runs attention once per layer."""

from __future__ import annotations

import heapq
import threading
import weakref

import torch

POOL_SLOTS = 8  # a KVPool's first (and least) number of slots
POOL_CAPACITY = 1024  # positions a pooled session may hold; a longer one moves to storage of its own
# past POOL_FLOOR_BYTES, a pool grows only while it holds at most POOL_WASTE x the positions its
# sessions use; a session it will not grow for keeps a cache of its own
POOL_FLOOR_BYTES = 256 << 20
POOL_WASTE = 2.0


def _doubled(capacity: int, length: int) -> int:
    """`capacity` doubled until it holds `length` positions."""
    while capacity < length:
        capacity *= 2
    return capacity


class KVPool:
    """The KV caches of a forward's sessions as the slots of one tensor, so that a pass over
    several sessions runs attention as one call over their slots instead of one per session.

    `data` is [layers, 2 (keys, values), slots, kv_heads, capacity, head_dim]: it holds slots x
    capacity positions, what one attention call over padded slots costs in memory. A session
    takes the lowest free slot, so the sessions at work sit side by side. The slots double when
    none is free, the capacity doubles when a session outgrows it (up to `max_capacity`), and
    past `POOL_FLOOR_BYTES` either grows only while the pool stays within `POOL_WASTE` x the
    positions its sessions hold; a session the pool will not grow for keeps a cache of its own
    (see KVCache). At each `take` the pool halves its slots while their upper half is free and
    its capacity while every session fits in a quarter of it.

    Resizing replaces `data`, so it happens only in the thread that runs the passes, between
    them (`take`, `fits`). `give` runs in a cache's finalizer, which the garbage collector may
    call from any thread at any allocation, even inside `take`: it only queues the slot, and
    `take` and `fits` collect the queue under the lock.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 max_capacity: int, slots: int = POOL_SLOTS, capacity: int = 256):
        self.max_capacity = max_capacity
        self.min_slots, self.min_capacity = slots, min(capacity, max_capacity)
        # zeros, not empty: one call over several slots reads positions past a slot's length (masked),
        # and a masked score still multiplies its value: 0 x a NaN left in free memory is NaN
        self.data = torch.zeros((layers, 2, slots, kv_heads, self.min_capacity, head_dim), dtype=dtype, device=device)
        self.position_bytes = self.data[:, :, 0, :, 0].numel() * self.data.element_size()
        self.free = list(range(slots))  # a heap: the lowest free slot first
        self.members: dict[int, weakref.ref] = {}  # slot -> its cache
        self.returned: list[int] = []  # slots given back, not yet free (see give)
        self.lock = threading.Lock()

    @property
    def slots(self) -> int:
        return self.data.shape[2]

    @property
    def capacity(self) -> int:
        return self.data.shape[4]

    def take(self, cache: KVCache) -> int:
        """A free slot for `cache`, or -1 where the pool will not grow for it."""
        with self.lock:
            self._collect()
            slots, capacity = self.slots, self.capacity
            # halve while the upper half is free and a slot stays free below it (else the take
            # would double it straight back)
            while (slots > self.min_slots and all(s in self.free for s in range(slots // 2, slots))
                   and any(s < slots // 2 for s in self.free)):
                slots //= 2
            longest = max(self._lengths(), default=0)
            while capacity > self.min_capacity and 4 * longest <= capacity:
                capacity = max(capacity // 2, self.min_capacity)
            if (slots, capacity) != (self.slots, self.capacity):
                self._resize(slots, capacity)
            if not self.free:
                if not self._allowed(2 * self.slots, self.capacity):
                    return -1
                self._resize(2 * self.slots, self.capacity)
            slot = heapq.heappop(self.free)
            # what an earlier session left there is read (masked) by one-call attention: a NaN or
            # inf in it would reach this session's rows (0 x NaN), so the slot starts at zero
            with torch.inference_mode():
                self.data[:, :, slot].zero_()
            self.members[slot] = weakref.ref(cache)
            return slot

    def give(self, slot: int) -> None:
        self.returned.append(slot)  # no lock: see the class docstring

    def _collect(self) -> None:
        while self.returned:
            slot = self.returned.pop()
            self.members.pop(slot, None)
            heapq.heappush(self.free, slot)

    def fits(self, length: int, held: int = 0) -> bool:
        """Room for `length` positions in every slot, the capacity grown for it if need be; False
        where the pool will not grow that far (past max_capacity or POOL_WASTE). `held`: what the
        asking cache holds now (counted among the sessions' positions already)."""
        if length <= self.capacity:
            return True
        if length > self.max_capacity:
            return False
        capacity = min(_doubled(self.capacity, length), self.max_capacity)
        with self.lock:
            self._collect()
            if not self._allowed(self.slots, capacity, length - held):
                return False
            self._resize(self.slots, capacity)
        return True

    def _lengths(self) -> list[int]:
        return [c.length for c in (ref() for ref in self.members.values()) if c is not None]

    def _allowed(self, slots: int, capacity: int, extra: int = 0) -> bool:
        if slots * capacity * self.position_bytes <= POOL_FLOOR_BYTES:
            return True
        return slots * capacity <= POOL_WASTE * (sum(self._lengths()) + extra)

    @torch.inference_mode()
    def _resize(self, slots: int, capacity: int) -> None:
        """A new `data` of `slots` x `capacity` holding what the old one held (slots cut off are free)."""
        old = self.slots
        shape = list(self.data.shape)
        shape[2], shape[4] = slots, capacity
        data = torch.zeros(shape, dtype=self.data.dtype, device=self.data.device)
        kept, held = min(slots, old), min(capacity, self.capacity)
        data[:, :, :kept, :, :held] = self.data[:, :, :kept, :, :held]
        self.data = data
        self.free = [s for s in self.free if s < slots] + list(range(old, slots))
        heapq.heapify(self.free)


class KVCache:
    """One session's keys and values: a slot of a `KVPool`, or storage of its own, grown by
    doubling. `data` is [layers, 2, 1, kv_heads, capacity, head_dim] either way.

    Speaks the part of `DynamicCache`'s interface sessions use: `crop` and
    `get_seq_length`.
    """

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 256, pool: KVPool | None = None):
        self.pool, self.slot, self.own = pool, -1, None
        self.length = 0
        if pool is not None:
            self.slot = pool.take(self)
        if self.slot < 0:
            # zeros, not empty, as a pool's: a graphed pass (cuda_graphs.py) reads every position of the
            # storage, masked past its own, and 0 x a NaN left in recycled memory is NaN; it cleans a
            # storage it has not seen, but one allocated where a freed one of the same shape was looks seen
            self.own = torch.zeros((layers, 2, 1, kv_heads, capacity, head_dim), dtype=dtype, device=device)
        else:
            self._give_back = weakref.finalize(self, pool.give, self.slot)

    @property
    def data(self) -> torch.Tensor:
        if self.own is not None:
            return self.own
        return self.pool.data[:, :, self.slot : self.slot + 1]

    @property
    def pooled(self) -> bool:
        return self.own is None

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` positions; a negative value drops that many from the end."""
        if max_length < 0:
            max_length = self.length + max_length
        length = max(0, min(self.length, max_length))
        if self.own is None and length < self.length:
            # one-call attention reads past a slot's length (masked): what is dropped becomes zeros,
            # not values a NaN or inf at a rejected token could leave there (see KVPool.take)
            with torch.inference_mode():
                self.data[:, :, :, :, length : self.length].zero_()
        self.length = length

    def copy_prefix(self, source: "KVCache", length: int) -> None:
        """Hold `source`'s first `length` positions, this cache empty: a prefix another session computed
        (sessions.py's prefix reuse)."""
        self.reserve(length)
        with torch.inference_mode():
            self.data[:, :, :, :, :length] = source.data[:, :, :, :, :length]
        self.length = length

    def reserve(self, length: int) -> None:
        if self.own is None:
            if self.pool.fits(length, self.length):
                return
            self.own = self.data[..., : max(self.length, 1), :].clone()  # out of the pool, into its own
            self._give_back()
            self.slot = -1
        if length <= self.own.shape[4]:
            return
        capacity = _doubled(self.own.shape[4], length)
        grown = torch.zeros(self.own.shape[:4] + (capacity,) + self.own.shape[5:], dtype=self.own.dtype,
                            device=self.own.device)  # (zeros: see __init__)
        grown[:, :, :, :, : self.length] = self.own[:, :, :, :, : self.length]
        self.own = grown
