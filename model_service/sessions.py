"""Per-session state of a model service: the sequence, its KV cache, its generator.

A session's `tokens` is the sequence the service holds; `tokens[:cached]` are in
the KV cache, the rest (at most a couple of tokens) are fed on the next forward.
Rollback crops the cache in O(1) and never re-runs the prefix.

Prefix reuse (`keep_positions`): a session released at the end of its request keeps its cache for
a while (least recently released dropped first, within `keep_positions` positions), and a new
session whose prompt begins with a kept session's tokens takes that cache, cropped to the shared
prefix, instead of computing the prefix again: the next turn of a chat, whose prompt is the last
turn's prompt and answer and a new message, computes only the new message. A prompt that shares at
least half of what a kept cache holds continues it: the cache moves to the new session. One that
shares less, but at least MIN_REUSE positions (a system prompt, the tools' instructions, a few-shot
preamble: what every conversation of an application begins with), gets a copy of those positions
where the cache can copy them (`copy_prefix`: the lean forward's KVCache), and the kept cache
stays for others. Where caches copy, a live session is a source too (copied, never moved): requests
that begin alike at the same time (a request's n choices, users of one long system prompt before any
has finished) compute their shared beginning once. The prompt's last token is always fed again (its
logits come from the pass).
Kept caches count towards `max_kv_tokens`, and are dropped first when a call needs the room.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from speculative.protocol import Features
from speculative.errors import ROOM_LATER, CapacityExceeded, InvalidRequest, SessionExists, SessionNotFound

MAX_SESSION_ID = 256  # characters (the coordinator's ids have 32)
MIN_REUSE = 16  # positions a new session must share with a kept cache to take it
MAX_KEPT = 64  # released sessions kept for reuse at most (each a prompt compared per new session)


def check_session_id(session_id: str) -> None:
    """A session id names one session (not empty), and is echoed in error messages, which travel in gRPC metadata
    (8 KiB at most)."""
    if not session_id:
        raise InvalidRequest("session_id is empty: a call names its session")
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
    # target only, where caches are kept for reuse: the feature rows its answers carried (Features, in order), and
    # those of a reused prefix its first answer carries before its own (a draft reading them starts from 0)
    sent_features: list = field(default_factory=list)
    resend: Any = None
    reused: int = 0  # the positions it started with cached (prefix reuse)
    part: Any = None  # target only: its call fed over several passes, until its last (engines.Part)
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

    def __init__(self, max_sessions: int, idle_timeout: float, new_cache=DynamicCache, keep_positions: int = 0):
        self.new_cache = new_cache  # () -> an empty KV cache with crop() and get_seq_length()
        self.max_sessions = max_sessions
        self.idle_timeout = idle_timeout
        self._sessions: OrderedDict[str, Session] = OrderedDict()  # least recently used first
        self.keep_positions = keep_positions  # positions released sessions' caches may hold for reuse (0: none)
        self._kept: OrderedDict[str, Session] = OrderedDict()  # released, their caches kept: least recent first
        self.kept_positions = 0
        self.reused_positions = 0  # positions new sessions took from kept caches, in all (not computed again)
        self.reuses = 0  # new sessions that took a kept cache

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
            while total + self.kept_positions > max_kv_tokens and self._kept:  # (kept caches make room first)
                self._drop_kept(next(iter(self._kept)))
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

    def find(self, session_id: str) -> Session | None:
        """The session, if there is one (not counted as a use)."""
        return self._sessions.get(session_id)

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

    def pop(self, session_id: str) -> Session | None:
        """Drop a session and give it back (None: not held), for a method that keeps what it holds itself."""
        return self._sessions.pop(session_id, None)

    def release(self, session_id: str, keep: bool = False) -> bool:
        """Drop a session; `keep` (a request's end, not a failure that may have left its cache half-written):
        its cache is kept for reuse where keep_positions allows."""
        session = self._sessions.pop(session_id, None)
        if session is None:
            return False
        # (not one whose call was fed in part: its cache holds rows its answers have not carried)
        if keep and session.part is None and MIN_REUSE <= session.cached <= self.keep_positions:
            self._keep(session)
        return True

    def _keep(self, session: Session) -> None:
        del session.tokens[session.cached :]  # (the key: what the cache holds)
        session.grammar = session.lookup = session.prompt_ids = session.resend = None
        sent = Features.join(session.sent_features) if session.feature_layers else None
        session.sent_features = [sent] if sent is not None else []
        session.proposed = 0
        session.last_used = time.monotonic()
        if session.id in self._kept:
            self._drop_kept(session.id)
        self._kept[session.id] = session
        self.kept_positions += session.cached
        while self.kept_positions > self.keep_positions or len(self._kept) > MAX_KEPT:
            self._drop_kept(next(iter(self._kept)))

    def _drop_kept(self, session_id: str) -> Session:
        session = self._kept.pop(session_id)
        self.kept_positions -= session.cached
        return session

    @property
    def kept(self) -> int:
        """Released sessions whose caches are kept for reuse."""
        return len(self._kept)

    def reuse(self, session: Session, prompt: list[int], feature_layers: tuple[int, ...] = ()) -> int:
        """Give a starting session (nothing cached) the kept cache whose tokens share the longest prefix
        with `prompt` (the module docstring's rule), cropped to it: `prompt`'s last token stays to be
        fed. A session asking for `feature_layers` takes only a cache whose session asked for the same,
        as far as its answers' feature rows go, and has those rows to send first (`resend`).
        -> the positions it took (0: none)"""
        copies = hasattr(session.cache, "copy_prefix")
        if not self.keep_positions or session.cached or not (self._kept or copies):
            return 0
        best, length = None, 0
        live = [s for s in self._sessions.values() if s is not session] if copies else []
        for source in [*reversed(self._kept.values()), *reversed(live)]:  # (the most recent kept first)
            if feature_layers and source.feature_layers != feature_layers:  # (rows it cannot send first)
                continue
            most = min(len(prompt) - 1, source.cached)
            if feature_layers:  # (as far as the rows it sent go, each row a position's: the last part's end)
                most = min(most, source.sent_features[-1].end if source.sent_features else 0)
            shared = shared_prefix(source.tokens, prompt, most)
            kept = source.id in self._kept and self._kept[source.id] is source
            if shared > length and shared >= MIN_REUSE and (copies or 2 * shared >= source.cached):
                best, length, moves = source, shared, kept and 2 * shared >= source.cached
        if best is None:
            return 0
        if feature_layers:
            sent = Features.join(best.sent_features)
            kept_rows = max(0, length - sent.start)
            session.resend = Features(sent.start, kept_rows, sent.width, sent.dtype,
                                      sent.data[: kept_rows * sent.row_bytes])
        if moves:  # a continuation of a kept cache: it moves
            self._drop_kept(best.id)
            best.truncate(length)
            session.cache, session.cached = best.cache, best.cached
        else:  # a shared beginning, or a live session's: its positions are copied, the source stays
            session.cache.copy_prefix(best.cache, length)
            session.cached = length
            if best.id in self._kept and self._kept[best.id] is best:
                best.last_used = time.monotonic()
                self._kept.move_to_end(best.id)
        self.reuses += 1
        self.reused_positions += length
        session.reused = length
        return length

    def evict_idle(self, now: float | None = None) -> int:
        """Drop sessions idle longer than idle_timeout (abandoned by a dead client), and kept caches
        released as long ago."""
        now = time.monotonic() if now is None else now
        stale = [sid for sid, s in self._sessions.items() if now - s.last_used > self.idle_timeout]
        for sid in stale:
            del self._sessions[sid]
        for sid in [sid for sid, s in self._kept.items() if now - s.last_used > self.idle_timeout]:
            self._drop_kept(sid)
        return len(stale)


def shared_prefix(a: list[int], b: list[int], most: int) -> int:
    """How many first tokens `a` and `b` share, at most `most` (a binary search over slices: C-speed compares)."""
    low, high = 0, min(len(a), len(b), most)
    if high <= 0 or a[0] != b[0]:
        return 0
    while low < high:
        mid = (low + high + 1) // 2
        if a[:mid] == b[:mid]:
            low = mid
        else:
            high = mid - 1
    return low
