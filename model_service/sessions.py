"""Per-session state of a model service: the sequence, its KV cache, its generator.

A session's `tokens` is the sequence the service holds; `tokens[:cached]` are in
the KV cache, the rest (at most a couple of tokens) are fed on the next forward.
Rollback crops the cache in O(1) and never re-runs the prefix.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from speculative.errors import ROOM_LATER, CapacityExceeded, InvalidRequest, SessionExists, SessionNotFound

MAX_SESSION_ID = 256  # characters (the coordinator's ids have 32)


def check_session_id(session_id: str) -> None:
    """A session id is echoed in error messages, which travel in gRPC metadata (8 KiB at most)."""
    if len(session_id) > MAX_SESSION_ID:
        raise InvalidRequest(f"session_id has {len(session_id)} characters; at most {MAX_SESSION_ID}")


@dataclass
class Session:
    id: str
    cache: DynamicCache  # or fast_forward.KVCache
    generator: torch.Generator
    tokens: list[int] = field(default_factory=list)
    cached: int = 0
    proposed: int = 0  # draft only: tokens of the last proposal, which a rollback may drop
    feature_layers: tuple[int, ...] = ()  # target only: the layers whose hidden states its answers return
    grammar: Any = None  # a structured-output constraint's matcher (grammar.SessionGrammar), if it has one
    lookup: Any = None  # target only: an index of a prefix of `tokens` its copies come from (lookup.NgramIndex)
    output_from: int = 0  # target only: where the output begins in `tokens` (the prompt before it: penalties)
    prompt_ids: Any = None  # target only: the prompt's distinct token ids (engines.prompt_ids), once asked for
    last_used: float = field(default_factory=time.monotonic)

    def truncate(self, length: int) -> None:
        """Roll the session back to its first `length` tokens."""
        del self.tokens[length:]
        if self.lookup is not None and len(self.lookup.tokens) > length:
            self.lookup.crop(length)
        if self.cached > length:
            self.cache.crop(length - self.cached)  # crop(-n) drops the last n positions
            self.cached = length


class SessionTable:
    """Sessions by id, with a cap; sessions idle past `idle_timeout` are evicted.

    Not thread-safe: a service touches it from its one model thread only.
    """

    def __init__(self, max_sessions: int, idle_timeout: float, new_cache=DynamicCache):
        self.new_cache = new_cache  # () -> an empty KV cache with crop() and get_seq_length()
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        return session_id in self._sessions

    def __iter__(self) -> Iterator[Session]:
        """The sessions held now (a snapshot: safe to read from another thread)."""
        return iter(list(self._sessions.values()))

    def check_room(self, session_id: str, length: int, max_context: int, max_kv_tokens: int, held: int = 0,
                   pending: int = 0, sampled: int = 0) -> None:
        """Refuse a call that would grow a session (holding `held` tokens now) to `length` tokens past
        `max_context`, or all sessions past `max_kv_tokens` (0: no cap); `pending`: tokens the calls
        already admitted to the same pass will add beyond what their sessions hold now; `sampled`: tokens
        the call adds after its pass beyond `length` (a target's sampled token, which its next pass feeds:
        a call that appends nothing and verifies nothing still grows its session by it)."""
        if length > max_context:
            raise InvalidRequest(f"session {session_id!r} would hold {length} tokens, beyond the context of"
                                 f" {max_context}")
        if max_kv_tokens and length + sampled > held:
            if length + sampled > max_kv_tokens:  # (no other session's end makes room for it)
                raise CapacityExceeded(f"session {session_id!r} would hold {length + sampled} tokens, more than this"
                                       f" service's cap of {max_kv_tokens} for all sessions together (--max-kv-tokens)")
            total = sum(len(s.tokens) for s in self._sessions.values()) - held + length + sampled + pending
            if total > max_kv_tokens:
                raise CapacityExceeded(f"the sessions would hold {total} tokens, beyond this service's cap of"
                                       f" {max_kv_tokens} {ROOM_LATER}; retry later")

    def create(self, session_id: str, generator: torch.Generator) -> Session:
        if session_id in self._sessions:
            raise SessionExists(f"session {session_id!r} already exists")
        if len(self._sessions) >= self.max_sessions:
            self.evict_idle()
        if len(self._sessions) >= self.max_sessions:
            raise CapacityExceeded(f"all {self.max_sessions} sessions are in use; retry later")
        session = Session(session_id, self.new_cache(), generator)
        self._sessions[session_id] = session
        return session

    def get(self, session_id: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"unknown session {session_id!r} (never started, released or evicted)")
        session.last_used = time.monotonic()
        self._sessions.move_to_end(session_id)
        return session

    def recently_used(self, window: float, now: float | None = None) -> int:
        """How many sessions were used within the last `window` seconds."""
        now = time.monotonic() if now is None else now
        count = 0
        for session in reversed(self._sessions.values()):  # most recently used first
            if now - session.last_used > window:
                break
            count += 1
        return count

    def release(self, session_id: str) -> bool:
        return self._sessions.pop(session_id, None) is not None

    def evict_idle(self, now: float | None = None) -> int:
        """Drop sessions idle longer than idle_timeout (abandoned by a dead client)."""
        now = time.monotonic() if now is None else now
        stale = [sid for sid, s in self._sessions.items() if now - s.last_used > self.idle_timeout]
        for sid in stale:
            del self._sessions[sid]
        return len(stale)
