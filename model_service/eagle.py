"""The EAGLE drafting method: an EAGLE-3 head drafts from the target's own hidden states, which the
target sends across machines (speculative/protocol.py's Features).

    python -m draft_service --method eagle --model HEAD_DIR --target-model TARGET_DIR

The head (eagle_head.py: one decoder layer over a fusion of three target layers, the checkpoint
layout vLLM and the speculators library use) is small; what makes it agree with the target is
that it reads the target's hidden states, not text alone. The target session, asked for the
head's feature layers (ModelInfo.feature_layers) when it starts, returns with every answer the
rows of the positions it committed, and the coordinator hands them over with the next call's
tokens: only what is new crosses the wire.

Rows (eagle_head.py's words). Row p of a session pairs a hidden state for position p with the
embedding of token p + 1, at position p; its logits predict token p + 2. The hidden state is the
fused target feature of position p where the target has sent it (rows base .. featured - 1), and
otherwise the head's own out_hidden of row p - 1 (the chain: rows for tokens the target has not
scored yet, and for the tokens it drafts). A session keeps its rows' keys and values (HeadCache)
and out_hidden, so that

  rollback   drops the rows that read a rolled-back token (row p reads token p + 1);
  features   replace the chain's rows from their first position on: a row the target has scored
             is recomputed from its feature, once;
  drafting   extends the chain to the last token, then drafts k tokens, a head step each.

A session drafts only from features: none held (a session started before the target's first
pass) proposes nothing. A session started again on another replica gets the last window of
rows (speculative/round.py's FeatureLog) and attends to those only (`base`); so does one whose
rows come after a gap (a long prompt's prefill sends its last rows only, features.py).

Prefix reuse (`keep_positions`: rows), as a model's sessions do (sessions.py): a session released at its
request's end keeps its featured rows, and a new session whose prompt begins with its tokens
takes them (row p while token p + 1 is shared), so the target's rows for those positions, which
come again with the new session's first call, are not computed again: a chat's next turn takes in
its new message's rows only. The same rule as the model's: at least MIN_REUSE rows and half of
what was kept; the least recently released go first past `keep_positions` rows or MAX_KEPT sessions,
and all after the sessions' idle timeout.

Lookup (prompt lookup beside the head, on by default: `lookup`). Where the context's last n tokens
(n from the longest of `lookup` down to its shortest) occurred earlier in it, the session proposes
the k tokens that followed them there instead of drafting (ngram.py's copy, from its NgramIndex of
the session's tokens): input-grounded work (editing code, answering from a document) repeats its
context, and a copy costs no head step. In specdec's round (training.acceptance, greedy, K = 4,
the float32 target) the shipped head accepted 0.295 of its tokens on the bench's chat prompts
and 0.323 on the grounded ones; with the lookup (n >= 3) 0.303 and 0.558. A copied token's q is
one-hot (the choice is a function of the context): exact as ngram.py says.

q and exactness (speculative/sampling.py's terms): the head scores its draft vocabulary only
(d2t maps a draft id to the target's), each token is drawn from the head's p over it after the
request's temperature / min-p / top-k / top-p, cut to its top `max_support` and renormalised, and ships
exactly that q (greedy: one-hot), so the target's rejection sampling keeps the output exact
whatever the head is.
"""

from __future__ import annotations

import json
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

import torch

from speculative.errors import InvalidRequest
from speculative.lookup import NgramIndex
from speculative.protocol import Cost, PassCost, Proposal, ProposeCall
from speculative.sampling import argmax_rows, draft_token, encode_supports, one_hot_supports

from . import features as wire
from . import q4_kernel
from .drafting import MethodSessions, advance, one_result
from .eagle_head import Eagle3Head, HeadCache
from .grammar import Grammars, next_masks
from .model_runner import BUSY_WINDOW, Timer, fastest_ms, saved_tokenizer_files, tokenizer_fields
from .ngram import allowed_copy
from .sessions import MAX_KEPT, MIN_REUSE, Session, SessionTable, shared_prefix
from .threads import pass_threads

# the most chain rows (a head step each, no feature row) a call extends a session's rows by to reach its last
# token: past them it drafts nothing until features come. The coordinator's calls chain one or two (the tokens
# committed since the target's last features); a peer's start of 8,000 tokens with one feature row held the
# model thread for 2.8 s of head steps (the tiny test head), every other session's call waiting
CHAIN_MAX = 64


@dataclass
class Rows:
    """A session's rows (the module docstring): keys and values in `cache`, row p at index p - base."""

    cache: HeadCache
    base: int = 0          # the position of the first row held
    featured: int = 0      # rows base .. featured - 1 read the target's features
    hidden: list[torch.Tensor] = field(default_factory=list)  # out_hidden [H] of each row held
    lookup: NgramIndex | None = None  # the session's tokens up to its last call's, indexed (the lookup's)

    @property
    def end(self) -> int:
        """The position after the last row held."""
        return self.base + len(self.hidden)

    def crop(self, end: int) -> None:
        """Keep the rows before position `end`."""
        keep = max(0, min(end, self.end) - self.base)
        del self.hidden[keep:]
        self.cache.crop(keep)
        self.featured = min(self.featured, self.base + keep)

    def get_seq_length(self) -> int:  # (the SessionTable's cache interface)
        return len(self.hidden)


class EagleDraft:
    """A drafting method (drafting.py): an EAGLE-3 head reading the target's hidden states."""

    method = "eagle"  # ModelInfo.draft_method
    fused_draft = True  # sessions draft in one call of the head where they can (_draft_fused); False: step by step

    def __init__(self, head: Eagle3Head, tokenizer, logits_size: int | None = None, *, max_support: int = 64,
                 max_tokens: int = 16, max_sessions: int = 256, idle_timeout: float = 600.0,
                 max_context: int | None = None, acceptance_prior: float = 0.0, name: str = "eagle",
                 quantization: str = "none", threads: int = 0, batched_threads: int = 0,
                 lookup: range = range(3, 5), max_kv_tokens: int = 0, prefix_cache_mb: float = 0.0):
        """threads / batched_threads: torch threads for a call while its session is the one at work /
        for the rest (0: leave torch's as the process set them). With the int8 head a lone session's
        call ran ~20% faster on 2 threads than on 1 (SmolLM2's head, 65 calls replayed: 5.85 -> 4.64
        ms). Through the services on the same 2 cores as the target (draft --threads 2
        --batched-threads 1 against 1 and 1): one stream +7% tokens/s, 8 streams -8% with the int8
        head; +4% and -5% with the int4 one (medians of 6 alternating runs): the service's default
        stays one thread. lookup: the suffix lengths the lookup tries (the module docstring; empty:
        the head always drafts). max_kv_tokens: the tokens all sessions may hold together (0: no cap).
        prefix_cache_mb: memory finished sessions' rows may keep for a prompt that begins with their
        tokens (the module docstring's prefix reuse; 0: none)."""
        self.head = head
        self.threads, self.batched_threads = threads, batched_threads
        self.quantization = quantization
        c = head.config  # (counted from the shapes: a quantized linear holds no parameters)
        attention = (2 * c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
                     + c.num_attention_heads * c.head_dim * c.hidden_size)
        self.num_parameters = (c.fused_size * c.hidden_size + attention + 3 * c.hidden_size * c.intermediate_size
                               + c.draft_vocab_size * c.hidden_size + 4 * c.hidden_size)
        self.device = head.norm.weight.device
        self._support = q4_kernel.draft_support_on(self.device)  # a sampled token's q in one kernel call
        self.tokenizer = tokenizer
        self.logits_size = logits_size or head.config.vocab_size
        self.pairing = tokenizer_fields(tokenizer, self.logits_size)
        self.vocab_size = self.pairing["vocab_size"]
        self.max_support = max_support
        self.max_tokens = max_tokens
        self.max_context = max_context or head.config.max_position_embeddings
        self.acceptance_prior = acceptance_prior
        self.name = name
        self.layers = tuple(head.config.aux_layer_ids)
        self.width = head.config.fused_size
        self.sessions = SessionTable(max_sessions, idle_timeout,
                                     lambda: Rows(head.new_cache(), lookup=NgramIndex(lookup) if lookup else None))
        row_bytes = (2 * c.num_key_value_heads * c.head_dim + c.hidden_size) * head.norm.weight.element_size()
        self.keep_positions = int(prefix_cache_mb * 2**20 // row_bytes)  # rows finished sessions may keep (0: none)
        # (tokens, rows, when released): the least recently released first
        self._kept: OrderedDict[str, tuple[list[int], Rows, float]] = OrderedDict()
        self.kept_positions = 0
        self.reuses = self.reused_positions = 0  # sessions that took kept rows; the rows they took
        self.host = MethodSessions(self.sessions, self.vocab_size, self.max_context, self.device, max_kv_tokens)
        eos = tokenizer.eos_token_id
        self.grammars = Grammars(tokenizer, self.vocab_size, [] if eos is None else [eos])
        # per draft id, its target id, on the host (masks come in target ids; a drafted token is mapped
        # without a device round trip)
        self._target_ids = head.d2t.cpu() + torch.arange(len(head.d2t))
        self._to_target: list[int] = self._target_ids.tolist()
        known = self._target_ids < self.vocab_size  # draft ids the tokenizer has a token for (None: all)
        self._known: torch.Tensor | None = None if known.all() else known.to(self.device)
        self.at_work = 0
        self.copied = 0  # tokens the lookup proposed (the rest of a proposal's tokens the head drafted)
        self.pass_cost = PassCost()
        self._tokenizer_files: list[tuple[str, bytes]] | None = None

    @classmethod
    def load(cls, head_dir: str | Path, target_dir: str | Path | None = None, device: str | None = None,
             dtype: torch.dtype = torch.float32, quantize: str = "none", **kwargs) -> "EagleDraft":
        """The head of `head_dir`; the tokenizer (and, where the head has none, the embeddings) from
        the target's directory (the head's own directory where it holds a tokenizer). quantize
        int8: its layer's linears and lm_head in int8 (Eagle3Head.quantize_int8; CPU); int4: fc, those
        and lm_head through specdec's int4 kernel (Eagle3Head.quantize_int4; CPU)."""
        from transformers import AutoConfig, AutoTokenizer

        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        head = Eagle3Head.load(head_dir, target_dir, device=device, dtype=dtype)
        head.layer.fuse_projections()
        if quantize in ("int8", "int4"):
            if torch.device(device).type != "cpu" or dtype != torch.float32:
                raise ValueError(f"--head-quantize {quantize} runs on the CPU, in float32")
            if quantize == "int8":
                head = head.quantize_int8()
                kwargs["quantization"] = "int8 (the layer's linears and lm_head, dynamic activation scales; fc float)"
            else:
                head = head.quantize_int4()
                kwargs["quantization"] = ("int4 (specdec's kernel: fc, the layer's linears and lm_head; int8"
                                          " activation blocks)")
        source = Path(head_dir) if (Path(head_dir) / "tokenizer_config.json").is_file() else Path(target_dir or "")
        if not (source / "tokenizer_config.json").is_file():
            raise ValueError(f"no tokenizer in {head_dir} or the target directory {target_dir!r}: give --target-model")
        tokenizer = AutoTokenizer.from_pretrained(source, local_files_only=True)
        logits_size = None
        if target_dir and (Path(target_dir) / "config.json").is_file():
            logits_size = AutoConfig.from_pretrained(target_dir, local_files_only=True).get_text_config().vocab_size
        card = Path(head_dir) / "eagle.json"
        if "acceptance_prior" not in kwargs and card.is_file():
            kwargs["acceptance_prior"] = acceptance_of(json.loads(card.read_text()))
        return cls(head, tokenizer, logits_size, name=Path(head_dir).name, **kwargs)

    # ------------------------------------------------------------ drafting.py's contract

    def propose(self, call: ProposeCall) -> tuple[Proposal, Cost]:
        return one_result(self.propose_many([call]))

    @torch.inference_mode()
    def propose_many(self, calls: list[ProposeCall]) -> list[tuple[Proposal, Cost] | Exception]:
        """-> per call, (proposal, cost) or the error that call alone met. Each session takes its
        delta in (its features' rows in one head step), then the sessions draft together, one
        head step for all of them per drafted token."""
        timer = Timer()
        results: list = [None] * len(calls)
        staged = []
        pending = 0  # tokens the calls admitted so far will draft (the KV-token cap counts them)
        for i, call in enumerate(calls):
            try:
                rows = self._check_features(call)
                held = None if call.start else len(self.sessions.get(call.session_id).tokens) - call.rollback
                session = advance(call, self.max_tokens, self.host, pending, grammars=self.grammars)
                if call.start:
                    self._reuse(session)
                pending += call.k
            except Exception as exc:
                results[i] = exc
                continue
            staged.append((i, call, session, rows, held))
        self.at_work = self.sessions.recently_used(BUSY_WINDOW)  # (drafting.py's; this call's sessions included)
        if self.threads and self.batched_threads:  # as ModelRunner.forward_many chooses for a pass
            pass_threads(self.threads if len(staged) == 1 and self.at_work <= 1 else self.batched_threads)
        live: list[tuple[int, ProposeCall, Session]] = []
        for i, call, session, rows, held in staged:
            try:
                self._take_in(session, call, rows, held)
            except Exception as exc:
                self.sessions.release(call.session_id)  # its rows may be half-written
                results[i] = exc
                continue
            live.append((i, call, session))
        try:
            drafted = self._draft(live)
        except Exception as exc:
            for i, call, _ in live:
                self.sessions.release(call.session_id)
                results[i] = exc
            return results
        for (i, _, _), proposal in zip(live, drafted):
            results[i] = proposal
        ms = timer.ms
        cost = Cost(ms, batch_size=len(live), batch_tokens=sum(len(p.tokens) for p in drafted), pass_ms=ms)
        return [(r, cost) if isinstance(r, Proposal) else r for r in results]

    def _check_features(self, call: ProposeCall) -> torch.Tensor | None:
        """The call's feature rows as a tensor [rows, width], checked against the head and the
        session before the session is touched."""
        f = call.features
        if f is None or not f.rows:
            return None
        f.check()
        if f.width != self.width:
            raise InvalidRequest(f"features have {f.width} values a row; this head reads {self.width}"
                                 f" (layers {list(self.layers)})")
        if call.start:
            committed = len(call.append)
        else:  # tokens that may be committed: rows for the proposals kept say the target took them
            session = self.sessions.get(call.session_id)
            committed = len(session.tokens) - call.rollback + len(call.append)
        if f.end > committed - 1:
            raise InvalidRequest(f"features reach position {f.end - 1}, past the committed tokens' last but one"
                                 f" ({committed - 2})")
        return wire.unpack(f, self.device, self.head.dtype)

    def _take_in(self, session: Session, call: ProposeCall, features: torch.Tensor | None, held: int | None) -> None:
        """The delta into the session's rows: drop those that read a rolled-back token, compute the
        features' rows (replacing the chain's from their first position on), extend the chain to
        the last token."""
        head, state, tokens = self.head, session.cache, session.tokens
        if held is not None:
            state.crop(held - 1)  # row p reads token p + 1: those that read a rolled-back token go
        f = call.features
        if features is not None:
            if not state.hidden or f.start > state.featured:  # none held, or a gap: the rows start again here
                state.crop(state.base)
                state.base = state.featured = f.start
            first = max(f.start, state.featured)
            new = features[first - f.start :]
            if len(new):
                state.crop(first)  # the chain's rows from there on are recomputed from the features
                positions = torch.arange(first, first + len(new), device=self.device)
                ids = torch.tensor(tokens[first + 1 : first + 1 + len(new)], device=self.device)
                out, _ = head.step(ids, head.fuse(new), positions, state.cache, first + len(new), logits=False)
                state.hidden.extend(out)
                state.featured = state.end
        if call.k and state.hidden and len(tokens) - 1 - state.end <= CHAIN_MAX:
            while state.end < len(tokens) - 1:  # row p from row p - 1's out_hidden and token p + 1
                self._step(state, tokens[state.end + 1])
        if state.lookup is not None:  # it held a prefix of what the session held: keep what is left of it
            index = state.lookup
            index.crop(min(index.get_seq_length(), len(tokens) if held is None else held))
            index.extend(tokens[index.get_seq_length() :])

    def _draft(self, live: list[tuple[int, ProposeCall, Session]]) -> list[Proposal]:
        """Each session's up to k tokens, each drawn from the head's distribution after its last
        row; one head step for every session still drafting per token. -> per session, its proposal."""
        head = self.head
        picked: list[tuple[list[int], list, list]] = [([], [], []) for _ in live]
        copied = {j for j, (_, call, session) in enumerate(live) if self._copy(call, session, picked[j][0])}
        drafting = [j for j, (_, call, session) in enumerate(live)  # (rows up to its last token: _take_in)
                    if call.k and session.cache.hidden and session.cache.end >= len(session.tokens) - 1
                    and j not in copied]
        if drafting and self.fused_draft:
            drafting = self._draft_fused(live, drafting, picked)
        logits = head.logits(torch.stack([live[j][2].cache.hidden[-1] for j in drafting])) if drafting \
            else None  # each session's last row: the token after its last
        while drafting:
            still = []
            for j, row, allowed in zip(drafting, logits, self._masks([live[j][2] for j in drafting])):
                _, call, session = live[j]
                tokens, q_ids, q_probs = picked[j]
                if allowed is not None:  # q over the tokens the constraint (and the tokenizer) allows
                    if allowed is not self._known and not allowed.any():
                        continue  # none in the draft vocabulary: nothing to propose
                    row = row.masked_fill(~allowed, float("-inf"))
                drawn = draft_token(row, call.params, call.p_min, self.max_support, session.generator, self._support)
                if drawn is None:
                    continue
                x, ids, q = drawn
                if ids is not None:
                    q_ids.append(head.draft_to_target(ids))
                    q_probs.append(q)
                token = self._to_target[x]
                tokens.append(token)
                session.tokens.append(token)
                if len(tokens) < call.k:
                    still.append(j)
            if not still:
                break
            states = [live[j][2].cache for j in still]
            ends = [state.end for state in states]
            out, logits = head.step_many(torch.tensor([picked[j][0][-1] for j in still], device=self.device),
                                         torch.stack([state.hidden[-1] for state in states]),
                                         torch.tensor(ends, device=self.device), [state.cache for state in states],
                                         max(ends) + 1)
            for state, row in zip(states, out):
                state.hidden.append(row)
            drafting = still
        proposals = []
        for (_, call, session), (tokens, q_ids, q_probs) in zip(live, picked):
            session.proposed += len(tokens)
            proposals.append(Proposal(tokens, *one_hot_supports(tokens)) if call.params.greedy or not q_ids
                             else Proposal(tokens, *encode_supports(q_ids, q_probs)))
        return proposals

    def _draft_fused(self, live: list[tuple[int, ProposeCall, Session]], drafting: list[int],
                     picked: list) -> list[int]:
        """The draft loop's tokens, q and rows for the `drafting` sessions free of a constraint, greedy or
        sampled, in one call of the head (Eagle3Head.draft_fused: its fused int4 step): the loop's own
        arithmetic without its Python between the steps (SmolLM2's int4 head, K = 4, 2 Xeon cores: a greedy
        call 1.70 -> 1.49 ms in one process). A sampled session's uniforms are drawn from its generator up
        front, and it is left having given as many as the tokens it drew, one a token as the loop draws.
        -> the sessions left to the loop (those with a constraint; all where the fused step does not run)."""
        fused = [j for j in drafting if live[j][2].grammar is None]
        if not fused or not self.head.fuses_draft:  # (before any uniform is drawn: a CUDA session's generator)
            return drafting
        calls, sessions = [live[j][1] for j in fused], [live[j][2] for j in fused]
        kmax = max(call.k for call in calls)
        uniforms, generator_states = None, {}
        if not all(call.params.greedy for call in calls):
            uniforms = torch.zeros(len(fused), kmax, dtype=torch.float64)
            for s, (call, session) in enumerate(zip(calls, sessions)):
                if not call.params.greedy:
                    generator_states[s] = session.generator.get_state()
                    uniforms[s, : call.k] = torch.rand(call.k, dtype=torch.float64, generator=session.generator)
        states = [session.cache for session in sessions]
        drafted = self.head.draft_fused(torch.stack([state.hidden[-1] for state in states]),
                                        [state.end for state in states], [state.cache for state in states],
                                        [call.k for call in calls], [call.p_min for call in calls], self._known,
                                        self._target_ids, [call.params for call in calls], uniforms, self.max_support)
        for s, (j, session, state, (tokens, rows, supports)) in enumerate(zip(fused, sessions, states, drafted)):
            picked[j][0].extend(tokens)
            for ids, q in supports:
                picked[j][1].append(ids)
                picked[j][2].append(q)
            session.tokens.extend(tokens)
            state.hidden.extend(rows)
            if s in generator_states:  # the uniforms it used, as the loop draws them
                session.generator.set_state(generator_states[s])
                torch.rand(len(tokens), dtype=torch.float64, generator=session.generator)
        return [j for j in drafting if live[j][2].grammar is not None]

    def _copy(self, call: ProposeCall, session: Session, tokens: list[int]) -> bool:
        """The lookup (the module docstring): up to k tokens copied into `tokens` and the session,
        cut where a structured output's constraint would stop them. -> whether it copied any."""
        index = session.cache.lookup
        copy = allowed_copy(session, index.continuation(call.k)) if index is not None else []
        tokens.extend(copy)
        session.tokens.extend(copy)
        self.copied += len(copy)
        return bool(copy)

    def _masks(self, sessions: list[Session]) -> list[torch.Tensor | None]:
        """Per session: the draft ids it may draw next, or None where any will do. Ids that map to no
        token of the tokenizer (a head over a target whose output layer is padded past it) are never
        drawn; a session with a structured output draws what its constraint allows (one that cannot
        follow its tokens drafts unmasked: the target rejects what it forbids)."""
        if all(session.grammar is None for session in sessions):
            return [self._known] * len(sessions)
        masks = next_masks(self.grammars, sessions)
        ids = self._target_ids.clamp(max=self.vocab_size - 1)
        known = True if self._known is None else self._known  # (ids past the tokenizer: clamped above)
        return [self._known if mask is None else mask[ids].to(self.device) & known for mask in masks]

    def _step(self, state: Rows, token: int) -> None:
        """One chain row: the last row's out_hidden with `token`'s embedding (its logits are not
        needed: _draft scores the last row)."""
        head, position = self.head, state.end
        out, _ = head.step(torch.tensor([token], device=self.device), state.hidden[-1][None],
                           torch.tensor([position], device=self.device), state.cache, position + 1, logits=False)
        state.hidden.append(out[0])

    def release(self, session_id: str) -> bool:
        """A request's end: its session goes, its featured rows kept for reuse (the module docstring)."""
        session = self.sessions.pop(session_id)
        if session is None:
            return False
        rows = session.cache
        end = rows.featured  # (the chain's rows past them are the head's own: a new session's come from features)
        if self.keep_positions and MIN_REUSE <= end - rows.base and end <= self.keep_positions:
            rows.crop(end)
            self._drop_kept(session_id)
            self._kept[session_id] = (session.tokens[: end + 1], rows, time.monotonic())  # (row p reads token p + 1)
            self.kept_positions += end - rows.base
            while self.kept_positions > self.keep_positions or len(self._kept) > MAX_KEPT:
                self._drop_kept(next(iter(self._kept)))
        return True

    def _drop_kept(self, key: str) -> Rows | None:
        _, rows, _ = self._kept.pop(key, (None, None, None))
        if rows is not None:
            self.kept_positions -= rows.end - rows.base
        return rows

    def _reuse(self, session: Session) -> None:
        """A starting session takes the kept rows whose tokens share the longest prefix with its prompt
        (at least MIN_REUSE rows and half of those kept), cropped to the rows whose next token is shared."""
        best, most = None, 0
        for key, (tokens, rows, _) in reversed(self._kept.items()):  # (the most recent first: a tie goes to it)
            end = shared_prefix(tokens, session.tokens, len(session.tokens)) - 1
            if end - rows.base > most and end - rows.base >= MIN_REUSE and 2 * (end + 1) >= len(tokens):
                best, most = key, end - rows.base
        if best is None:
            return
        rows = self._drop_kept(best)
        rows.crop(rows.base + most)
        rows.lookup = session.cache.lookup  # (the new session's own: its tokens are indexed as it takes them in)
        session.cache = rows
        self.reuses += 1
        self.reused_positions += most

    def info(self) -> dict:
        eos = self.tokenizer.eos_token_id
        return {
            "model_name": self.name,
            "draft_method": self.method,
            **self.pairing,
            "max_context": self.max_context,
            "max_kv_tokens": self.host.max_kv_tokens,
            "eos_token_ids": [] if eos is None else [eos],
            "device": str(self.device),
            "dtype": str(self.head.dtype).removeprefix("torch."),
            "kv_dtype": str(self.head.dtype).removeprefix("torch."),  # (the head layer's keys and values: HeadCache)
            "num_parameters": self.num_parameters,
            "quantization": self.quantization,
            "logits_size": self.logits_size,
            "active_sessions": len(self.sessions),
            "max_sessions": self.sessions.max_sessions,
            **self.pass_cost.info(),
            "tensor_parallel_size": 1,
            "acceptance_prior": self.acceptance_prior,
            "feature_layers": list(self.layers),
            "feature_width": self.width,
        }

    @torch.inference_mode()
    def calibrate(self, context: int = 64, reps: int = 5, sessions: int = 4) -> PassCost:
        """Time head steps on scratch sessions of `context` rows. Adaptive K prices each drafted
        token as one draft pass (coordinator/adaptive.py: k x (fixed / sessions + per_token +
        per_session)), and for this method a drafted token is one head step of every session
        drafting (step_many, its logits and the pick): fixed is that step for one session,
        per_session what each further session adds (from a step of `sessions`). The rows a call
        takes in (the features of the ~1-5 tokens committed since the last) cost about one step
        more, which the fit leaves to the call's overhead. (A call feeding all `context` rows is
        ~9 ms on SmolLM2's head against ~1.3 ms a step: charged for every drafted token, it would
        keep adaptive K from drafting.) Timed at the batched threads: a lone session's calls, on more,
        run faster than this, which the coordinator's measured scale picks up."""
        head = self.head
        if self.batched_threads:
            pass_threads(self.batched_threads)
        states = [Rows(head.new_cache()) for _ in range(sessions)]
        features = head.fuse(torch.zeros(context, self.width, dtype=head.dtype, device=self.device))
        ids = torch.zeros(context, dtype=torch.long, device=self.device)
        for state in states:
            out, _ = head.step(ids, features, torch.arange(context, device=self.device), state.cache, context,
                               logits=False)
            state.hidden.extend(out)

        def prepare(batch: int) -> None:  # the first `batch` sessions back at `context` rows
            for state in states[:batch]:
                state.crop(context)

        def step(batch: int) -> None:  # one head step of them: step_many, its logits and the pick
            chosen = states[:batch]
            out, logits = head.step_many(torch.zeros(batch, dtype=torch.long, device=self.device),
                                         torch.stack([state.hidden[-1] for state in chosen]),
                                         torch.full((batch,), context, device=self.device),
                                         [state.cache for state in chosen], context + 1)
            argmax_rows(logits)
            for state, row in zip(chosen, out):
                state.hidden.append(row)

        times = fastest_ms([1, sessions] if sessions > 1 else [1], prepare, step, self.device, reps)
        one = times[1]
        per_session = max(0.0, (times[sessions] - one) / (sessions - 1)) if sessions > 1 else 0.0
        self.pass_cost = PassCost(fixed=max(0.0, one - per_session), per_session=per_session)
        return self.pass_cost

    # ------------------------------------------------------------ serving (drafting.py)

    def evict_idle(self) -> int:
        """Idle sessions, and rows kept as long as a session may idle."""
        stale = time.monotonic() - self.sessions.idle_timeout
        for key in [key for key, (_, _, released) in self._kept.items() if released < stale]:
            self._drop_kept(key)
        return self.sessions.evict_idle()

    def tokenizer_files(self) -> list[tuple[str, bytes]]:
        if self._tokenizer_files is None:
            self._tokenizer_files = saved_tokenizer_files(self.tokenizer)
        return self._tokenizer_files


def acceptance_of(card: dict) -> float:
    """The acceptance (alpha) a head's card (eagle.json) measured against its target in specdec's
    round (training.acceptance --write), else its held-out agreement one step ahead (training
    eagle's); 0 where it has neither."""
    measured = (card.get("acceptance") or {}).get("alpha_pooled")
    if measured:
        return float(measured)
    return float((card.get("heldout") or {}).get("agree_0") or 0.0)
