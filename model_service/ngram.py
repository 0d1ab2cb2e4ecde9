"""The n-gram drafting method (prompt lookup): drafts by copying from the context, with no model.

Input-grounded work (editing code, summarising, answering from a document) repeats its context:
where the context's last few tokens occurred before, what followed them then is a good guess of
what follows now. The method needs a tokenizer only (for GetModelInfo's pairing fields and
GetTokenizer), runs on the CPU in microseconds per call, and holds no weights.

    python -m draft_service --method ngram [--ngram-max 4 --ngram-min 2] [--tokenizer DIR]

Matching. The context is the session's sequence: its committed tokens and its unconfirmed
proposals after them (drafting.py), so a call appending nothing copies on after its own last
proposal. For n from ngram_max down to ngram_min, the first n whose suffix (the context's last
n tokens) occurred earlier wins, longest first since a longer match predicts better: at its most
recent earlier occurrence, propose the k tokens that followed it. The copy may run on into the
tokens it is copying (after "a b a b", the suffix "a b" matched at 0 copies "a b a b ..."), so a
match always yields k tokens. No n matches: the proposal is empty, and the round is a plain
target step.

q and exactness (speculative/sampling.py's terms). The copied token x is proposed with q one-hot
at x: the choice is a function of the context, so a point mass is exactly the distribution x was
drawn from. The target accepts x with probability min(1, p(x) / q(x)) = p(x); at a rejection the
recovered token comes from norm(max(0, p - q)), which is p without x, renormalised: y != x with
probability p(y) / (1 - p(x)). So the emitted token is x with probability p(x) and any y != x
with probability (1 - p(x)) p(y) / (1 - p(x)) = p(y): exactly p, whatever was copied. Under
greedy params the target compares tokens only. p_min never stops a copy: q's top probability is 1.

Index. A session's cache (sessions.Session.cache, a KV cache for a model) is its NgramIndex:
where each n-gram of tokens[:cached] starts, for every n in [ngram_min, ngram_max]. A call indexes
the tokens new since the last (appended ones and kept proposals), looks the suffix up in a
dictionary, and a rollback crops the index: a call costs O(n_max x (new tokens + k)), never a
scan of the context. Rejected proposals were never indexed, so rolling them back costs nothing.

Costs: info()'s pass_ms_* are 0, so adaptive K (coordinator/adaptive.py) counts the draft as
free and weighs only the target's extra verify tokens and the call.
"""

from __future__ import annotations

from pathlib import Path

from speculative.errors import InvalidRequest
from speculative.lookup import NgramIndex
from speculative.protocol import Cost, PassCost, Proposal, ProposeCall
from speculative.sampling import one_hot_supports

from .drafting import MethodSessions, advance
from .grammar import Grammars
from .model_runner import Timer, saved_tokenizer_files, tokenizer_fields
from .sessions import Session, SessionTable

# tokens a session may hold where neither --max-context nor the model's config says (past the draft's context
# the coordinator drafts no more: speculative.round.generate's draft_context); from a model's directory its
# context, as the target's sessions (a peer's session of 1M tokens held ~590 MB and the model thread ~7 s)
NGRAM_CONTEXT = 1 << 20


def allowed_copy(session: Session, copy: list[int]) -> list[int]:
    """A copy cut where the session's structured output would stop it (all of it without one); a
    session whose tokens its constraint cannot follow loses it and copies uncut (the target rejects
    what the constraint forbids)."""
    if session.grammar is None or not copy:
        return copy
    try:
        session.grammar.follow(session.tokens)
        return copy[: session.grammar.prefix(copy)]
    except InvalidRequest:
        session.grammar = None
        return copy


class NgramDraft:
    """A drafting method (drafting.py) with no model: copies what followed the context's last
    n-gram earlier in it (the module docstring)."""

    method = "ngram"  # ModelInfo.draft_method

    def __init__(self, tokenizer, logits_size: int | None = None, *, ngram_max: int = 4, ngram_min: int = 2,
                 max_tokens: int = 16, max_sessions: int = 256, idle_timeout: float = 600.0,
                 max_context: int = NGRAM_CONTEXT, max_kv_tokens: int = 0):
        """logits_size: the output width of the model the tokenizer belongs to, if known (a
        model's vocab_size is the smaller of the two); max_context: tokens a session may hold;
        max_kv_tokens: all sessions together (0: no cap)."""
        if not 1 <= ngram_min <= ngram_max:
            raise ValueError(f"need 1 <= --ngram-min <= --ngram-max, not {ngram_min} and {ngram_max}")
        self.tokenizer = tokenizer
        self.logits_size = logits_size or len(tokenizer)
        self.pairing = tokenizer_fields(tokenizer, self.logits_size)
        self.vocab_size = self.pairing["vocab_size"]  # ids it accepts (and so copies)
        self.sizes = range(ngram_min, ngram_max + 1)
        self.max_tokens = max_tokens
        self.max_context = max_context
        self.sessions = SessionTable(max_sessions, idle_timeout, lambda: NgramIndex(self.sizes))
        self.host = MethodSessions(self.sessions, self.vocab_size, max_context, max_kv_tokens=max_kv_tokens)
        eos = tokenizer.eos_token_id
        self.grammars = Grammars(tokenizer, self.vocab_size, [] if eos is None else [eos])
        self.at_work = 0  # a call costs microseconds: the batcher never waits for others
        self._tokenizer_files: list[tuple[str, bytes]] | None = None

    @classmethod
    def load(cls, directory: str | Path, max_context: int | None = None, **kwargs) -> "NgramDraft":
        """From a tokenizer directory, or a model's (whose config.json gives the output width and, where
        max_context is not given, the context: a session holds no more than the target's would;
        NGRAM_CONTEXT without one)."""
        from transformers import AutoConfig, AutoTokenizer

        path = Path(directory)
        if not path.is_dir():  # (HF would read it as a hub repo id, and say that is malformed)
            raise FileNotFoundError(f"{path} is not a tokenizer or model directory")
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        logits_size, context = None, None
        if (path / "config.json").is_file():
            config = AutoConfig.from_pretrained(path, local_files_only=True)
            logits_size, context = getattr(config, "vocab_size", None), getattr(config, "max_position_embeddings", None)
        return cls(tokenizer, logits_size, max_context=max_context or context or NGRAM_CONTEXT, **kwargs)

    # ------------------------------------------------------------ drafting.py's contract

    def propose_many(self, calls: list[ProposeCall]) -> list[tuple[Proposal, Cost] | Exception]:
        """-> per call, (proposal, cost) or the error that call alone met."""
        timer = Timer()
        results: list = []
        for call in calls:
            try:
                session = advance(call, self.max_tokens, self.host, grammars=self.grammars)
            except Exception as exc:
                results.append(exc)
                continue
            index: NgramIndex = session.cache
            index.extend(session.tokens[session.cached :])
            session.cached = len(session.tokens)
            tokens = allowed_copy(session, index.continuation(call.k))
            session.tokens.extend(tokens)  # unconfirmed: indexed next call, if kept
            session.proposed += len(tokens)
            results.append(Proposal(tokens, *one_hot_supports(tokens)))
        ms = timer.ms
        live = [r for r in results if isinstance(r, Proposal)]
        cost = Cost(ms, batch_size=len(live), batch_tokens=sum(len(p.tokens) for p in live), pass_ms=ms)
        return [(r, cost) if isinstance(r, Proposal) else r for r in results]

    def release(self, session_id: str) -> bool:
        return self.sessions.release(session_id)

    def info(self) -> dict:
        eos = self.tokenizer.eos_token_id
        return {
            "model_name": "ngram",
            "draft_method": self.method,
            **self.pairing,
            "max_context": self.max_context,
            "max_kv_tokens": self.host.max_kv_tokens,
            "eos_token_ids": [] if eos is None else [eos],
            "device": "cpu",
            "num_parameters": 0,
            "logits_size": self.logits_size,
            "active_sessions": len(self.sessions),
            "max_sessions": self.sessions.max_sessions,
            **PassCost().info(),
            "tensor_parallel_size": 1,
        }

    # ------------------------------------------------------------ serving (drafting.py)

    def evict_idle(self) -> int:
        return self.sessions.evict_idle()

    def tokenizer_files(self) -> list[tuple[str, bytes]]:
        if self._tokenizer_files is None:
            self._tokenizer_files = saved_tokenizer_files(self.tokenizer)
        return self._tokenizer_files
