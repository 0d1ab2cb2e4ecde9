"""Structured output: a session's constraint (speculative/protocol.py's Constraint) as a grammar
matcher that follows the session's tokens and masks the model's scores.

The engine is llguidance (a maintained Rust library, no other dependency; vLLM and SGLang ship it
as a backend): JSON schemas, any JSON object, regular expressions, Lark and GBNF grammars and
choices compile to one grammar, matched against the service's own tokenizer.

Exactness. The target masks p at every position it samples (each verified draft token's, the
recovered or bonus token's, each decoded step's) with the state reached through the tokens before
it, then samples as usual: every emitted token is one the constraint allows, drawn from the
target's p renormalised over the allowed tokens (greedy: their argmax). A draft token the grammar
forbids has p = 0 there and is rejected. The draft masks its q the same way, so that it proposes
only tokens the target can accept; the target's rejection sampling keeps the output exact whatever
the draft does. End-of-sequence is allowed only where the output is complete.

State. A session's matcher follows its tokens from `output_from` on (the prompt before it is not
constrained): `follow(tokens)` rolls back what a rejection or a rollback removed and consumes what
is new, so that no layer has to tell the grammar about a rollback. Masks for a row of draft tokens
are computed in one call (the state after each of them, then rolled back).

Cost and bounds. A compiled constraint is cached per service (LRU, its text at most
MAX_CONSTRAINT_BYTES) and each session starts from a copy of it; compilation and each mask are
bounded by llguidance's parser limits (lexer fuel, Earley items), so a hostile schema gets an
error, not a stalled model thread. `ms` counts the time spent computing masks (metrics, bench).
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict

import llguidance
import llguidance.hf
import numpy as np
import torch

from speculative.constraints import grammar_text, limits
from speculative.errors import InvalidRequest
from speculative.protocol import Constraint


class Grammars:
    """A service's grammar compiler: its tokenizer as llguidance sees it (built on first use,
    ~1 s), and the constraints compiled so far (LRU of `cache_size`)."""

    def __init__(self, tokenizer, vocab_size: int, eos_token_ids, cache_size: int = 64):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # ids the model scores and the tokenizer can produce
        self.eos_token_ids = sorted(eos_token_ids)
        self.cache_size = cache_size
        self._ll = None
        self._compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._lock = threading.Lock()
        self._building = threading.Lock()  # the tokenizer is built once (the servicer's thread or the model's)
        self.compiled = 0  # constraints compiled (cache misses)
        self.ms = 0.0      # time computing masks

    def _tokenizer(self):
        with self._building:
            return self._build_tokenizer()

    def _build_tokenizer(self):
        if self._ll is None:
            eos = self.eos_token_ids or None
            try:
                self._ll = llguidance.hf.from_tokenizer(self.tokenizer, n_vocab=self.vocab_size, eos_token=eos)
            except Exception:  # a decoder llguidance cannot read (or a slow tokenizer): each token's own text
                try:
                    self._ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_TokenTexts(self.tokenizer,
                                                      self.vocab_size)), n_vocab=self.vocab_size, eos_token=eos)
                except Exception as e:
                    raise InvalidRequest(f"structured output is not available with this model's tokenizer: {e}") from e
        return self._ll

    def compile(self, constraint: Constraint):
        """The constraint compiled for this tokenizer, from the cache or now (a refusal is cached
        too). The servicer calls it off the model thread as a start call arrives, so that a new
        constraint's compilation (~0.4 s for a small JSON schema on SmolLM2's vocabulary) and its
        first mask do not hold up the pass the session's first call rides in. InvalidRequest with the
        compiler's reason, or the matcher's where its first mask stops on an error."""
        key = (constraint.kind, constraint.text)
        with self._lock:
            found = self._compiled.get(key)
            if found is not None:
                self._compiled.move_to_end(key)
        if found is None:
            try:
                constraint.validate()
                grammar = grammar_text(constraint)
                tokenizer = self._tokenizer()
                error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer, limits=limits())
                if error:
                    raise InvalidRequest(f"the {constraint.kind} constraint does not compile: {error.strip()}")
                found = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=limits())
                if found.is_error():
                    raise InvalidRequest(f"the {constraint.kind} constraint does not compile: {found.get_error()}")
                # its first mask, here: the lexer's first states are built once for every copy (a{655000}:
                # ~0.4 s, a JSON schema of 40 fields ~4 ms), not on the model thread while every session
                # waits; a grammar no text completes stops on its error here, refused before its first pass
                first = found.deep_copy()
                first.compute_bitmask()
                if first.is_error():
                    raise InvalidRequest(f"the {constraint.kind} constraint cannot be followed: the matcher stopped"
                                         f" with {first.get_error().splitlines()[0]!r}")
            except InvalidRequest as e:
                found = e
            with self._lock:
                self.compiled += 1
                self._compiled[key] = found
                while len(self._compiled) > self.cache_size:
                    self._compiled.popitem(last=False)
        if isinstance(found, InvalidRequest):
            raise InvalidRequest(str(found))
        return found

    def session(self, constraint: Constraint) -> "SessionGrammar":
        """A matcher for one session, at the start of its output. InvalidRequest where the constraint
        does not compile (with the compiler's reason)."""
        return SessionGrammar(self, self.compile(constraint).deep_copy(), constraint.output_from)

    def masks(self, rows: list[tuple["SessionGrammar", list[int]]]) -> list[torch.Tensor]:
        """For each (session grammar, draft tokens): bool [len(draft) + 1, vocab_size], row i the
        tokens allowed after the session's output and the first i draft tokens (rows after a token
        the grammar forbids allow everything: nothing is sampled there). The matchers are left
        where they were; one llguidance call for all of them, on its threads."""
        if not rows:
            return []
        start = time.perf_counter()
        words = (self.vocab_size + 31) // 32
        offsets, total = [], 0
        for _, draft in rows:
            offsets.append(total)
            total += len(draft) + 1
        bitmask = torch.full((total, words), -1, dtype=torch.int32)
        executor = _executor()
        plain = [(g.matcher, offset) for (g, draft), offset in zip(rows, offsets) if not draft]
        drafted = [(g.matcher, offset, list(draft)) for (g, draft), offset in zip(rows, offsets) if draft]
        if plain:
            executor.unsafe_compute_mask_ptr(plain, bitmask.data_ptr(), words * 4, total)
        if drafted:
            executor.unsafe_compute_mask_ptr_with_draft_token(drafted, bitmask.data_ptr(), words * 4, total)
        allowed = unpack(bitmask)[:, : self.vocab_size]
        out = []
        for (g, draft), offset in zip(rows, offsets):
            part = allowed[offset : offset + len(draft) + 1]
            empty = ~part.any(-1)
            if empty.any():  # nothing allowed (a matcher in error, SessionGrammar.error: its callers refuse it)
                part[empty.nonzero()[:, 0].unsqueeze(-1), torch.tensor(self.eos_token_ids or [0])] = True
            out.append(part)
        self.ms += (time.perf_counter() - start) * 1e3
        return out


class _TokenTexts:
    """A tokenizer as llguidance's TokenizerWrapper reads one: each id's bytes (its own decoded
    text), the special ids, and encoding."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id
        self.bos_token_id = tokenizer.bos_token_id
        self.special_token_ids = sorted(i for i in tokenizer.all_special_ids if i < vocab_size)
        self.tokens = [tokenizer.decode([i]).encode() for i in range(vocab_size)]

    def __call__(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)


_EXECUTOR = None


def _executor():
    global _EXECUTOR
    if _EXECUTOR is None:
        _EXECUTOR = llguidance.LLExecutor(num_threads=2)
    return _EXECUTOR


class SessionGrammar:
    """One session's matcher, following its tokens from `output_from` on (the module docstring)."""

    def __init__(self, grammars: Grammars, matcher, output_from: int):
        self.grammars = grammars
        self.matcher = matcher
        self.output_from = output_from
        self.consumed: list[int] = []  # the output tokens the matcher has consumed

    def follow(self, tokens: list[int]) -> None:
        """Bring the matcher to the session's output `tokens[output_from:]`: roll back the tokens that
        are no longer there, consume the new ones. InvalidRequest where an output token is one the
        constraint forbids (tokens committed under another constraint)."""
        out = tokens[self.output_from :]
        have = self.consumed
        same = min(len(have), len(out))
        if out[:same] != have[:same]:
            same = next(i for i, (a, b) in enumerate(zip(have, out)) if a != b)
        if same < len(have):
            self.matcher.rollback(len(have) - same)
            del have[same:]
        new = out[same:]
        if new:
            taken = self.matcher.try_consume_tokens(new)
            have.extend(new[:taken])
            if self.error is not None:
                raise self.failed()
            if taken < len(new):
                raise InvalidRequest(f"output token {new[taken]} at position {self.output_from + len(have)} is not"
                                     f" one the constraint allows")

    @property
    def error(self) -> str | None:
        """The matcher's error where it has stopped on one (llguidance's parser limits met, or a
        grammar no text completes): it allows nothing after, and the output cannot go on under it."""
        return self.matcher.get_error().split("\n", 1)[0] if self.matcher.is_error() else None  # (not its dump)

    def failed(self) -> InvalidRequest:
        return InvalidRequest(f"the constraint cannot be followed past {len(self.consumed)} output tokens: the matcher"
                              f" stopped with {self.error!r} (a constraint too complex for the parser's limits, or"
                              f" one that no text completes)")

    def mask(self, tokens: list[int]) -> torch.Tensor:
        """bool [vocab_size]: the tokens allowed after the session's `tokens`."""
        self.follow(tokens)
        return self.grammars.masks([(self, [])])[0][0]

    def prefix(self, tokens: list[int]) -> int:
        """How many of `tokens`, in a row after those followed, the constraint allows (none consumed)."""
        return self.matcher.validate_tokens(list(tokens)) if tokens else 0

    def forced(self, most: int) -> list[int]:
        """Up to `most` tokens the constraint forces next, after those followed (llguidance's
        fast-forward tokens: where only one text may come, its canonical tokens), none consumed; none
        where the output is complete."""
        return [] if most <= 0 or self.matcher.is_stopped() else list(self.matcher.compute_ff_tokens()[:most])

    @property
    def done(self) -> bool:
        """The output is complete and nothing more may follow but end-of-sequence."""
        return self.matcher.is_stopped()


def next_masks(grammars: Grammars | None, sessions: list) -> list[torch.Tensor | None]:
    """Per session (drafting.py's Session): bool [vocab_size], the tokens its constraint allows after
    its tokens, or None where it has none; one llguidance call for all. A session whose tokens its
    constraint cannot follow loses it and drafts unmasked (the target rejects what it forbids)."""
    rows = []
    for session in sessions:
        if session.grammar is not None:
            try:
                session.grammar.follow(session.tokens)
                rows.append((session.grammar, []))
            except InvalidRequest:
                session.grammar = None
    if not rows:
        return [None] * len(sessions)
    masks = iter(grammars.masks(rows))
    return [next(masks)[0] if session.grammar is not None else None for session in sessions]


def unpack(bitmask: torch.Tensor) -> torch.Tensor:
    """llguidance's bitmask (int32 [n, words], bit j of word w: token 32 w + j) as bool [n, 32 words]."""
    bits = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")
    return torch.from_numpy(bits).bool()


def apply(rows: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """rows [n, V] of logits with the tokens `allowed` [n', V'] forbids at -inf (ids past V' also;
    rows past n' untouched)."""
    n, width = min(rows.shape[0], allowed.shape[0]), min(rows.shape[-1], allowed.shape[-1])
    rows = rows.clone()
    rows[:n, :width].masked_fill_(~allowed[:n, :width].to(rows.device), float("-inf"))
    rows[:n, width:] = float("-inf")
    return rows
