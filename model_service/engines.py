"""The draft and target engines: what each model service computes per call.

Engines are synchronous and run on their service's model thread; they validate
their input before touching a session, so a bad request leaves no trace.
DraftEngine is the model drafting method (the contract: drafting.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from speculative.errors import CapacityExceeded, InvalidRequest, SessionNotFound
from speculative.lookup import LOOKUP_SIZES, NgramIndex
from speculative.protocol import MAX_TOP_LOGPROBS, Cost, Features, Logprobs, Proposal, ProposeCall, Verdict, VerifyCall
from speculative.sampling import (
    ProbRows,
    check_supports,
    draft_token,
    encode_supports,
    greedy_verify,
    one_hot_supports,
    rejection_sample,
    supports_to_tensors,
)

from . import features, grammar, q4_kernel
from .batcher import UNFINISHED, Unfinished, prefill_chunk_for
from .drafting import advance, one_result
from .model_runner import ModelRunner, Timer
from .sessions import Session, SessionTable

class RunnerEngine:
    """What a model service asks of its engine besides the per-round calls (drafting.py's
    "Serving"), for an engine over one ModelRunner: its sessions, info, release; and the
    structured-output constraints its sessions follow (grammar.py)."""

    def __init__(self, runner: ModelRunner, max_tokens: int = 16):
        self.runner = runner
        self.max_tokens = max_tokens
        self.grammars = grammar.Grammars(runner.tokenizer, runner.vocab_size, runner.eos_token_ids)

    @property
    def sessions(self) -> SessionTable:
        return self.runner.sessions

    @property
    def at_work(self) -> int:
        return self.runner.at_work

    def info(self) -> dict:
        return self.runner.info()

    def release(self, session_id: str) -> bool:
        """A request's end: its session goes, its cache kept for a prompt that begins with its tokens (prefix reuse)."""
        with self.runner.lock:
            return self.runner.sessions.release(session_id, keep=True)

    def evict_idle(self) -> int:
        with self.runner.lock:
            return self.runner.sessions.evict_idle()

    def tokenizer_files(self) -> list[tuple[str, bytes]]:
        return self.runner.tokenizer_files()


class DraftEngine(RunnerEngine):
    """A drafting method (drafting.py): a small model proposes K tokens per call, each sampled
    from its q, the model's p cut to its top `max_support` tokens.

    `propose_many` drafts for several sessions at once: each step is one forward pass
    over every session still drafting (sessions may ask for different K).
    """

    method = "model"  # ModelInfo.draft_method

    def __init__(self, runner: ModelRunner, max_support: int = 64, max_tokens: int = 16,
                 acceptance_prior: float = 0.0):
        super().__init__(runner, max_tokens)
        self.max_support = max_support
        self.acceptance_prior = acceptance_prior  # ModelInfo.acceptance_prior (0: not known)
        self._support = q4_kernel.draft_support_on(runner.device)  # a sampled token's q in one kernel call

    def info(self) -> dict:
        return {**self.runner.info(), "draft_method": self.method, "acceptance_prior": self.acceptance_prior}

    def propose(self, call: ProposeCall) -> tuple[Proposal, Cost]:
        return one_result(self.propose_many([call]))

    def propose_many(self, calls: list[ProposeCall]) -> list[tuple[Proposal, Cost] | Exception]:
        """-> per call, (proposal, the pass's cost) or the error that call alone met. Distinct sessions only."""
        with self.runner.lock:
            timer = Timer()
            results: list = [None] * len(calls)
            live: list[tuple[int, ProposeCall, Session]] = []
            pending = 0  # tokens the calls admitted so far will draft (the KV-token cap counts them)
            for i, call in enumerate(calls):
                try:
                    live.append((i, call, advance(call, self.max_tokens, self.runner, pending, self.grammars)))
                    pending += call.k
                except Exception as exc:
                    results[i] = exc
            try:
                drafted = self._draft(live)
            except Exception as exc:
                for i, call, _ in live:
                    self.runner.sessions.release(call.session_id)  # caches may be half-written
                    results[i] = exc
                return results
            for (i, _, session), (tokens, q_ids, q_probs) in zip(live, drafted):
                session.proposed += len(tokens)
                if q_ids is None:  # greedy: q is one-hot at each token
                    sizes, ids_bytes, probs_bytes = one_hot_supports(tokens)
                else:
                    sizes, ids_bytes, probs_bytes = encode_supports(q_ids, q_probs)
                results[i] = Proposal(tokens, sizes, ids_bytes, probs_bytes)
            ms = timer.ms
            cost = Cost(ms, batch_size=len(live), batch_tokens=sum(len(t) for t, _, _ in drafted), pass_ms=ms)
            return [(r, cost) if isinstance(r, Proposal) else r for r in results]

    def _draft(self, live: list[tuple[int, ProposeCall, Session]]) -> list[tuple[list[int], list, list]]:
        """Sample each session's k tokens autoregressively, each from its q; one forward per step
        for all sessions still drafting. -> per session (tokens, q_ids, q_probs)."""
        runner = self.runner
        vocab = runner.vocab_size  # ids the tokenizer can produce
        out = [([], None, None) if call.params.greedy else ([], [], []) for _, call, _ in live]
        # sessions asking for no tokens only need their new tokens cached (prefill): first pass
        drafting = [j for j, (_, call, session) in enumerate(live) if call.k > 0 or len(session.tokens) > session.cached]
        while drafting:
            logits = runner.forward_many([(live[j][2], 1) for j in drafting])
            masks = grammar.next_masks(self.grammars, [live[j][2] for j in drafting])  # q over what a constraint allows
            still = []
            for j, row, mask in zip(drafting, logits, masks):
                _, call, session = live[j]
                if call.k == 0:
                    continue
                tokens, q_ids, q_probs = out[j]
                row = row[-1:, :vocab] if mask is None else grammar.apply(row[-1:, :vocab], mask[None])
                drawn = draft_token(row[0], call.params, call.p_min, self.max_support, session.generator,
                                    self._support)
                if drawn is None:
                    continue
                x, ids, q = drawn
                if ids is not None:
                    q_ids.append(ids)
                    q_probs.append(q)
                tokens.append(x)
                session.tokens.append(x)  # the last one is fed on the next call, if accepted
                if len(tokens) < call.k:
                    still.append(j)
            drafting = still
        return out


class TargetEngine(RunnerEngine):
    """Verifies proposals and applies rejection sampling: `verify_many` scores the proposals of
    several sessions (any lengths, any K) in one forward pass; calls with no proposal may go on
    decoding on their own (`steps`), one pass per token over those still decoding.

    A pass's calls are answered together, so decoding on never holds back another session: it
    runs only where every call of the pass asked for it (a call in a pass with draft tokens to
    verify gets its one token), and stops early once `busy()` says other calls wait for the model
    (they join the next pass, not the end of this call's steps). A call always gets at least its
    first token; the coordinator asks again for the rest.

    Prompt lookup (`VerifyCall.lookup`): a call with no proposal that decodes steps may have each of
    its passes verify, beside the token it decodes, up to `lookup` tokens copied from the session's
    own context: what followed the most recent earlier occurrence of its last 2-4 tokens
    (speculative/lookup.py's matching, on an index the session keeps: Session.lookup). A copied
    token x is verified as a draft token whose q is one-hot at x (ngram.py's "q and exactness"):
    accepted with probability p(x), else the token comes from p without x,
    renormalised, so each token the call returns is still drawn from p, and under greedy params it is
    the argmax, as decoding it alone would give. Copies stop short of an end-of-sequence token, of
    the call's `steps` (its tokens stay within them) and of the context. Where the context repeats
    itself (input-grounded requests) a pass then commits several tokens.

    A session with a constraint copies what its grammar forces (llguidance's fast-forward tokens: the
    JSON's keys and punctuation, a tool's name once begun...), as many as the call's steps leave room
    for, not only `lookup`; where it forces nothing, the context's copy as far as the grammar allows
    it. Each is verified as a copy is, its row masked as any, so the output is what decoding them one
    by one gives. A JSON answer then comes several tokens a pass where its schema fixes them, or where
    it copies its values from the prompt."""

    def __init__(self, runner: ModelRunner, max_tokens: int = 16, prefill_chunk: int | None = None):
        super().__init__(runner, max_tokens)
        if prefill_chunk is None:
            prefill_chunk = prefill_chunk_for(runner.device, runner.pass_cost.per_token, runner.pass_cost.fixed)
        if prefill_chunk < 0:
            raise ValueError(f"prefill_chunk must be >= 0, not {prefill_chunk}")
        # most tokens of a long feed a pass takes while others wait (0: all; None: by the calibrated pass cost)
        self.prefill_chunk = prefill_chunk
        # the calls that came back UNFINISHED, by id, while they live (VerifyCall is unhashable): one passed
        # in again whose session is gone or rolled back was given up (_resume), not a call to begin afresh
        self._parted: weakref.WeakValueDictionary[int, VerifyCall] = weakref.WeakValueDictionary()
        # a sampled row's p and a draw from it in one kernel call each where the rows are on the CPU
        self._to_probs, self._draw = q4_kernel.sampling_on(runner.device)

    def verify(self, call: VerifyCall) -> tuple[Verdict, Cost]:
        return one_result(self.verify_many([call]))

    def verify_many(self, calls: list[VerifyCall], busy: Callable[[], bool] | None = None,
                    in_parts: bool = False) -> list[tuple[Verdict, Cost] | Exception | Unfinished]:
        """-> per call, (verdict, the pass's cost) or the error that call alone met. Distinct sessions only.
        busy() -> whether other calls wait for the model (the service's model thread): decoding on stops.
        in_parts: a call with more than `prefill_chunk` tokens to feed before its rows (a long prompt) feeds
        that many a pass and comes back UNFINISHED while others' calls wait, to be passed in again (the
        service's Batcher does so) with the calls waiting then; with nobody waiting its parts go on here."""
        while True:
            results = self._verify_pass(calls, busy, in_parts)
            if not all(result is UNFINISHED for result in results) or (busy is not None and busy()):
                return results

    def _verify_pass(self, calls: list[VerifyCall], busy: Callable[[], bool] | None,
                     in_parts: bool) -> list[tuple[Verdict, Cost] | Exception | Unfinished]:
        runner = self.runner
        with runner.lock:
            timer = Timer()
            results: list = [None] * len(calls)
            live = []
            for i, call in enumerate(calls):
                try:
                    # each call adds its sampled token after the pass: the KV-token cap counts those
                    live.append((i, call, *(self._resume(call) or self._advance(call, pending=len(live)))))
                except Exception as exc:
                    results[i] = exc
            # a long feed's part: this pass feeds its session's tokens up to `end` only (no rows verified)
            parts = {i: end for i, call, session, _, drafted, *_ in live
                     if in_parts and (end := self._part_end(call, session, len(drafted) + 1))}
            masks = self._verify_masks([entry for entry in live if entry[0] not in parts], results)
            live = [entry for entry in live if results[entry[0]] is None]
            capture = _feature_layers([session for _, _, session, *_ in live])
            # the tokens the pass feeds: each session's uncached ones (a prompt, a catch-up), at least its rows
            fed = sum((parts[i] if i in parts else max(len(session.tokens), session.cached + len(drafted) + 1))
                      - session.cached for i, _, session, _, drafted, *_ in live)
            # a prompt scored (VerifyCall.prompt_logprobs) takes an output row a token: this pass scores
            # prompts while their rows add up to LOGPROB_ROWS, passes of their own before it the rest
            ahead: dict[int, tuple[Logprobs, list[torch.Tensor]]] = {}
            room = LOGPROB_ROWS
            for i, call, session, *_ in live:
                if (scored := _scored_prompt(call)) and scored > room:
                    try:
                        ahead[i] = self._score_ahead(session, call, capture)
                    except Exception as exc:
                        runner.sessions.release(call.session_id)
                        results[i] = exc
                elif scored:
                    room -= scored
            live = [entry for entry in live if results[entry[0]] is None]
            extra = {i: 0 if i in ahead else _scored_prompt(call) for i, call, *_ in live}  # its rows in this pass
            whole = {}  # a part's session's tokens, while the pass sees those up to the part's end
            for i, _, session, *_ in live:
                if i in parts:
                    whole[i], session.tokens = session.tokens, session.tokens[: parts[i]]
            try:
                logits, states = runner.forward_capturing([(session, 1 if i in parts else len(drafted) + 1 + extra[i])
                                                           for i, call, session, _, drafted, *_ in live], capture)
            except Exception as exc:
                for i, call, *_ in live:
                    runner.sessions.release(call.session_id)  # its cache may be half-written
                    results[i] = exc
                return results
            finally:
                for i, _, session, *_ in live:
                    if i in whole:
                        session.tokens = whole[i]
            layers = [capture] * len(live)  # the layers of each feed's states
            for j, (i, call, session, *advanced) in enumerate(live):
                if i in ahead and capture:  # the feature rows of the prompt's own passes first
                    states[j] = (0, torch.cat([*ahead[i][1], states[j][1]]))
                if i in parts or session.part is not None:
                    part = session.part or Part(call, (session, *advanced), states[j][0] if capture else 0)
                    if session.feature_layers and capture:  # its own layers' rows (a pass captures any asked)
                        part.states.append(_own_layers(session, capture, states[j][1]))
                    if i in parts:
                        session.part = part
                        self._parted[id(call)] = call
                        results[i] = UNFINISHED
                    else:  # its last pass: the rows of its parts first
                        session.part = None
                        layers[j] = session.feature_layers
                        if part.states:
                            states[j] = (part.start, torch.cat(part.states))
            for j, ((i, call, session, committed, drafted, q_ids, q_probs), rows) in enumerate(zip(live, logits)):
                if i in parts:
                    continue
                # rows: positions of x_1..x_K and the bonus, over the ids the tokenizer can produce (an
                # output layer padded past the vocabulary scores ids no text maps to and no draft holds)
                rows = rows[:, : runner.vocab_size]
                prompt_rows, rows = rows[: extra[i]], rows[extra[i] :]
                if i in masks:  # the constraint's mask at each position (a forbidden draft token has p = 0)
                    rows = grammar.apply(rows, masks[i])
                scored = rows  # (logprobs: the model's, before penalties and biases)
                if call.params.shapes_logits:
                    rows = shaped(rows, session.tokens[session.output_from : committed], drafted, call.params,
                                  prompt_ids(session), runner.eos_token_ids)
                try:
                    accepted, token = self._check(rows, drafted, q_ids, q_probs, call.params, session)
                    if call.prompt_logprobs is not None:
                        prompt = ahead[i][0] if i in ahead else token_logprobs(prompt_rows, call.append[1:],
                                                                               call.prompt_logprobs)
                except Exception as exc:
                    runner.sessions.release(call.session_id)
                    results[i] = exc
                    continue
                session.truncate(committed + accepted)  # roll back the rejected draft tokens
                session.tokens.append(token)  # sampled here; enters the cache next call
                kept = [*drafted[:accepted], token]
                if call.proposal.tokens:
                    results[i] = Verdict(accepted, token)
                else:  # the call proposed nothing: what it copied and kept is the target's own
                    results[i] = Verdict(0, kept[0], kept[1:], copied=accepted)
                results[i].features = _committed_features(session, layers[j], states, j)
                results[i].cached = session.reused if call.start else 0
                if call.params.logprobs is not None:
                    results[i].logprobs = token_logprobs(scored, kept, call.params.logprobs)
                if call.prompt_logprobs is not None:
                    results[i].prompt_logprobs = prompt
            pass_ms = timer.ms
            if live and not parts and all(call.steps > 1 for _, call, *_ in live):  # (a part's feed goes on first)
                self._decode_on([(i, call, session) for i, call, session, *_ in live], results, busy)
            for i, call, session, *_ in live:
                if isinstance(results[i], Verdict) and results[i].features is not None:
                    results[i].features = _sent(session, results[i].features, runner.sessions.keep_positions > 0)
            cost = Cost(timer.ms, batch_size=len(live), batch_tokens=fed, pass_ms=pass_ms)
            return [(r, cost) if isinstance(r, Verdict) else r for r in results]

    def _score_ahead(self, session: Session, call: VerifyCall,
                     capture: tuple[int, ...]) -> tuple[Logprobs, list[torch.Tensor]]:
        """Score a starting session's prompt in passes of its own, LOGPROB_ROWS tokens each, before the
        call's pass, which then feeds its last token and the draft tokens. -> (the prompt's Logprobs, each
        pass's states at the `capture` layers)"""
        runner, whole = self.runner, session.tokens
        parts, states = [], []
        while session.cached < (scored := _scored_prompt(call)):
            end = min(session.cached + LOGPROB_ROWS, scored)
            rows = end - session.cached
            session.tokens = whole[:end]  # (the pass feeds up to `end`: the rest stays unfed)
            try:
                logits, captured = runner.forward_capturing([(session, rows)], capture)
            finally:
                session.tokens = whole
            parts.append(token_logprobs(logits[0][:, : runner.vocab_size], whole[end - rows + 1 : end + 1],
                                        call.prompt_logprobs))
            if capture:
                states.append(captured[0][1])
        return Logprobs.join(parts), states

    def _resume(self, call: VerifyCall) -> tuple | None:
        """A call fed in parts (Part), passed in again: its session and what _advance made of it, or None
        for a call new to the engine. A session whose part belongs to another call (its caller gave up
        on one fed in parts) is rolled back to before that call's tokens first."""
        session = self.runner.sessions.find(call.session_id)
        part = session.part if session is not None else None
        if part is not None and part.call is call:
            self.runner.sessions.get(call.session_id)  # (in use)
            return part.advanced
        if self._parted.get(id(call)) is call:  # (not begun again on a new session: it is given up)
            raise SessionNotFound(f"session {call.session_id!r} was released while its tokens were fed in parts")
        if part is not None:
            session.part = None
            session.truncate(part.base)
        return None

    def _part_end(self, call: VerifyCall, session: Session, rows: int) -> int:
        """Where this pass's feed of `session` ends when it feeds a part only (0: it feeds all): while more
        than `prefill_chunk` tokens wait before the call's `rows`, it feeds that many (not a scored prompt,
        whose own passes come first)."""
        if not self.prefill_chunk or _scored_prompt(call):
            return 0
        end = session.cached + self.prefill_chunk
        return end if len(session.tokens) - rows > end else 0

    def _check(self, rows: torch.Tensor, drafted: list[int], q_ids, q_probs, params,
               session: Session) -> tuple[int, int]:
        """Rejection sampling of `drafted` against the pass's rows [len(drafted) + 1, V] (greedy: the
        argmax test). -> (accepted, recovered or bonus token)"""
        if params.greedy:
            return greedy_verify(rows, drafted)
        draft = torch.tensor(drafted, dtype=torch.long, device=self.runner.device)
        return rejection_sample(ProbRows(rows, params, self._to_probs), draft, q_ids, q_probs, session.generator,
                                self._draw)

    def _copy(self, session: Session, lookup: int, left: int, stops: tuple[int, ...] = ()) -> list[int]:
        """Tokens the pass verifies beside the one it decodes, `left` the call's steps after that one:
        up to `lookup` copied from the session's context (prompt lookup, the class docstring); for a
        session with a constraint, what its grammar forces (up to `left`), or where it forces nothing
        the context's copy as far as the grammar allows it; none where lookup is 0 (the call must not
        copy). They stop short of an end-of-sequence token, of the request's `stops` and of the context
        (the token the pass samples after them must fit too)."""
        room = self.runner.max_context - len(session.tokens) - 1
        if min(lookup, left, room) <= 0:
            return []
        copy = []
        if session.grammar is not None:
            try:
                session.grammar.follow(session.tokens)
            except InvalidRequest:  # (its verify refuses it)
                return []
            copy = session.grammar.forced(min(left, room))
        if not copy:
            index = session.lookup
            if index is None or len(index.tokens) > len(session.tokens):
                index = session.lookup = NgramIndex(LOOKUP_SIZES)  # (only truncate shrinks `tokens`, and crops it)
            index.extend(session.tokens[len(index.tokens):])
            copy = index.continuation(min(lookup, left, room))
            if session.grammar is not None:
                copy = copy[: session.grammar.prefix(copy)]  # (what it forbids would only be rejected)
        eos = self.runner.eos_token_ids
        for n, token in enumerate(copy):
            if token in eos or token in stops:
                return copy[:n]
        return copy

    def _one_hot(self, tokens: list[int], params) -> tuple[list, list]:
        """q of copied tokens: one-hot at each (greedy: not needed)."""
        if params.greedy or not tokens:
            return [], []
        device = self.runner.device
        return ([torch.tensor([t], dtype=torch.long, device=device) for t in tokens],
                [torch.ones(1, dtype=torch.float32, device=device) for _ in tokens])

    def _verify_masks(self, live: list, results: list) -> dict[int, torch.Tensor]:
        """The constrained sessions' masks for this pass: call index -> bool [K + 1, V], row i what
        the constraint allows after the committed tokens and the first i draft tokens. A session
        whose committed tokens the constraint forbids gets the error (and is dropped)."""
        rows, owners = [], []
        for i, call, session, committed, drafted, *_ in live:
            if session.grammar is None:
                continue
            try:
                session.grammar.follow(session.tokens[:committed])
            except InvalidRequest as exc:
                self.runner.sessions.release(call.session_id)
                results[i] = exc
                continue
            rows.append((session.grammar, drafted))  # (the proposal's tokens, or what the call copies)
            owners.append((i, call))
        masks = {}
        for (i, call), (ruled, _), mask in zip(owners, rows, self.grammars.masks(rows)):
            if ruled.error is not None:  # it allows nothing more: refused, not ended as if complete
                self.runner.sessions.release(call.session_id)
                results[i] = ruled.failed()
            else:
                masks[i] = mask
        return masks

    def _decode_on(self, calls: list[tuple[int, VerifyCall, Session]], results: list,
                   busy: Callable[[], bool] | None) -> None:
        """Go on decoding for the calls that asked for more than one token (no proposal): one pass
        per step over the sessions still decoding, each token drawn as a call with no proposal
        draws its own (the bonus of greedy_verify / rejection_sample with nothing proposed, on the
        session's generator), so a seeded request decodes the same tokens one call or several at a
        time. A session stops after an EOS or one of its request's stop token ids (where the output
        ends), at its step count, at the context or at the KV cap."""
        runner = self.runner
        eos = set(runner.eos_token_ids)

        def more(i: int, call: VerifyCall) -> int:  # tokens the call may still take
            return call.steps - 1 - len(results[i].decoded)

        def ended(token: int, call: VerifyCall) -> bool:
            return token in eos or token in call.params.stop_token_ids

        decoding = [(i, call, session) for i, call, session in calls if isinstance(results[i], Verdict)
                    and not ended((results[i].decoded or [results[i].token])[-1], call) and more(i, call) > 0]
        while decoding and not (busy is not None and busy()):
            fits = []  # sessions with room for one more token, and the tokens each copied
            pending = 0  # the tokens those will add
            for i, call, session in decoding:
                held = len(session.tokens)
                copy = self._copy(session, call.lookup, more(i, call) - 1, call.params.stop_token_ids)
                try:
                    try:
                        runner.check_context(call.session_id, held + 1 + len(copy), held, pending)
                    except (InvalidRequest, CapacityExceeded):
                        if not copy:
                            raise
                        copy = []  # room for the token, not for the copy
                        runner.check_context(call.session_id, held + 1, held, pending)
                except (InvalidRequest, CapacityExceeded):
                    continue
                fits.append((i, call, session, copy))
                pending += 1 + len(copy)
            if not fits:
                return
            for _, _, session, copy in fits:
                session.tokens.extend(copy)
            capture = _feature_layers([session for _, _, session, _ in fits])
            try:
                logits, states = runner.forward_capturing([(session, 1 + len(copy)) for _, _, session, copy in fits],
                                                          capture)
            except Exception as exc:
                for i, call, *_ in fits:
                    runner.sessions.release(call.session_id)  # its cache may be half-written
                    results[i] = exc
                return
            ruled, stuck = [], set()
            for _, _, session, copy in fits:
                if session.grammar is None:
                    continue
                try:
                    # its own tokens, each drawn under the mask, up to what it copies (its forced tokens)
                    session.grammar.follow(session.tokens[: len(session.tokens) - len(copy)])
                    ruled.append((session.grammar, copy))
                except InvalidRequest:  # its matcher stopped on an error: the next call's verify refuses it
                    stuck.add(id(session))
            masks = iter(self.grammars.masks(ruled))
            decoding = []
            for j, ((i, call, session, copy), rows) in enumerate(zip(fits, logits)):
                rows = rows[:, : runner.vocab_size]
                if id(session) in stuck:
                    continue
                if session.grammar is not None:  # a row per copied token, and the next
                    allowed = next(masks)
                    if session.grammar.error is not None:  # nothing allowed: the next call's verify refuses it
                        continue
                    rows = grammar.apply(rows, allowed)
                scored = rows
                if call.params.shapes_logits:
                    output = session.tokens[session.output_from : len(session.tokens) - len(copy)]
                    rows = shaped(rows, output, copy, call.params, prompt_ids(session), runner.eos_token_ids)
                accepted, token = self._check(rows, copy, *self._one_hot(copy, call.params), call.params, session)
                session.truncate(len(session.tokens) - len(copy) + accepted)
                session.tokens.append(token)
                results[i].decoded.extend([*copy[:accepted], token])
                results[i].copied += accepted
                if call.params.logprobs is not None:
                    results[i].logprobs = Logprobs.join(
                        [results[i].logprobs, token_logprobs(scored, [*copy[:accepted], token], call.params.logprobs)])
                step = _committed_features(session, capture, states, j)
                if step is not None:
                    results[i].features = Features.join([results[i].features, step]) if results[i].features else step
                if more(i, call) > 0 and not ended(token, call):
                    decoding.append((i, call, session))

    def _advance(self, call: VerifyCall, pending: int = 0):
        """Validate a call; append its new tokens and the draft tokens to its session. pending:
        tokens the calls admitted before it to the pass will add beyond what they hold (their sampled
        ones); the KV-token cap counts the call's own sampled token beside them.
        -> (session, committed length, the tokens to verify (the proposal's, or a lookup call's
        copy), q_ids, q_probs)"""
        runner, proposal = self.runner, call.proposal
        runner.check_session_id(call.session_id)
        call.params.validate()
        k = len(proposal.tokens)
        if k > self.max_tokens:
            raise InvalidRequest(f"at most {self.max_tokens} draft tokens per call, got {k}")
        if call.steps > self.max_tokens:
            raise InvalidRequest(f"decode_steps must lie in [0, {self.max_tokens}], not {call.steps}")
        if call.steps > 1 and k:
            raise InvalidRequest(f"decode_steps={call.steps} asks the target to decode on its own: a call with "
                                 f"draft tokens verifies them and returns one token")
        runner.check_tokens(call.append, "appended")
        runner.check_tokens(proposal.tokens, "draft")
        supports = check_supports(list(proposal.tokens), list(proposal.support_sizes), proposal.support_ids,
                                  proposal.support_probs, runner.vocab_size)
        # greedy verification needs only the tokens (see greedy_verify)
        q_ids, q_probs = (None, None) if call.params.greedy else supports_to_tensors(*supports, runner.device)
        if call.prompt_logprobs is not None:
            if not call.start:
                raise InvalidRequest("prompt_logprobs scores a session's prompt: it is asked on the session's start")
            if not 0 <= call.prompt_logprobs <= MAX_TOP_LOGPROBS:
                raise InvalidRequest(f"prompt_logprobs' top tokens must lie in [0, {MAX_TOP_LOGPROBS}], not"
                                     f" {call.prompt_logprobs}")
            if (outside := next((t for t in call.append if t >= runner.vocab_size), None)) is not None:
                raise InvalidRequest(f"prompt_logprobs: the prompt's token {outside} lies outside the vocabulary"
                                     f" [0, {runner.vocab_size}) the target scores")
        if call.start:
            if not call.append:
                raise InvalidRequest("a new session needs its prompt in `append`")
            layers = features.check_layers(tuple(call.feature_layers), runner.num_hidden_layers)
            runner.check_context(call.session_id, len(call.append) + k, pending=pending, sampled=1)
            ruled = self.grammars.session(call.constraint) if call.constraint is not None else None
            if not 0 <= call.output_from <= len(call.append):
                raise InvalidRequest(f"output_from ({call.output_from}) must lie within the {len(call.append)}"
                                     f" tokens appended")
            # a prompt scored needs every position's logits: no prefix reuse (feature rows: SessionTable.reuse)
            reusable = call.prompt_logprobs is None
            session = runner.start_session(call.session_id, call.params.seed, call.append if reusable else None,
                                           layers)
            session.feature_layers = layers
            session.grammar = ruled
            session.output_from = call.output_from
        else:
            session = runner.sessions.get(call.session_id)
            runner.check_context(call.session_id, len(session.tokens) + len(call.append) + k, len(session.tokens),
                                 pending, sampled=1)
            if call.drop_features:
                session.feature_layers = ()
        committed = len(session.tokens) + len(call.append)
        session.tokens.extend(call.append)
        drafted = list(proposal.tokens)
        if not k and call.steps > 1 and call.lookup > 0:
            copy = self._copy(session, call.lookup, call.steps - 1, call.params.stop_token_ids)
            try:
                runner.check_context(call.session_id, committed + len(copy), committed, pending, sampled=1)
                drafted = copy
                q_ids, q_probs = self._one_hot(copy, call.params)
            except (InvalidRequest, CapacityExceeded):
                pass  # room for the token, not for the copy
        session.tokens.extend(drafted)
        return session, committed, drafted, q_ids, q_probs


def shaped(rows: torch.Tensor, output: list[int], tokens: list[int], params,
           prompt: torch.Tensor | None = None, ends: tuple[int, ...] | list[int] = ()) -> torch.Tensor:
    """Rows [len(tokens) + 1 or more, V] of logits with params' penalties and bias: row i follows the
    session's `output` so far and tokens[:i] (draft tokens or copies), after its prompt, whose token
    ids `prompt` holds (prompt_ids: read for repetition_penalty alone). A token in the prompt or the
    output has its logit divided by repetition_penalty where positive, multiplied where not; then a
    row is lowered by frequency_penalty for each time a token occurs in the output and by
    presence_penalty for a token that does, and raised by logit_bias (ids past the vocabulary are
    none of its tokens: ignored), last (vLLM adds a bias before its penalties). Rows deciding one of
    the first params.min_tokens output tokens give `ends` (the model's end-of-sequence tokens) and
    params.stop_token_ids -inf. Only the columns of the tokens concerned are computed (a few hundred
    of a vocabulary's tens of thousands); the rows are copied, not changed."""
    n, vocab = rows.shape
    out = rows.to(torch.float32, copy=True)
    if (early := min(params.min_tokens - len(output), n)) > 0:  # row i decides output token len(output) + i
        out[:early, sorted({t for t in (*ends, *params.stop_token_ids) if t < vocab})] = float("-inf")
    output = torch.tensor(output, dtype=torch.long)
    output = output[output < vocab]
    drafted = [(i, token) for i, token in enumerate(tokens[: n - 1]) if token < vocab]  # row i + 1 follows tokens[i]
    bias = [(token, value) for token, value in params.logit_bias if token < vocab]
    repeat = params.repetition_penalty != 1.0
    prompt = prompt[prompt < vocab] if repeat and prompt is not None else torch.zeros(0, dtype=torch.long)
    named = torch.cat([output, torch.tensor([t for _, t in drafted] + [t for t, _ in bias], dtype=torch.long), prompt])
    if not len(named):
        return out
    columns, column = torch.unique(named, return_inverse=True)  # (sorted) and each name's column
    a, b = len(output), len(output) + len(drafted)
    counts = torch.zeros(len(columns)).index_add_(0, column[:a], torch.ones(a)).repeat(n, 1)
    for (i, _), j in zip(drafted, column[a:b].tolist()):
        counts[i + 1 :, j] += 1
    device = rows.device
    counts, columns = counts.to(device), columns.to(device)
    part = out[:, columns]
    if repeat:  # every token seen: the prompt's and the output's
        seen = counts > 0
        seen[:, column[b + len(bias) :].to(device)] = True
        r = params.repetition_penalty
        part = torch.where(seen, torch.where(part > 0, part / r, part * r), part)
    part = part - counts * params.frequency_penalty - (counts > 0).float() * params.presence_penalty
    if bias:
        part[:, column[b : b + len(bias)].to(device)] += torch.tensor([v for _, v in bias], device=device)
    out[:, columns] = part
    return out


def prompt_ids(session: Session) -> torch.Tensor:
    """The distinct token ids of a session's prompt (its tokens before output_from), worked out once."""
    if session.prompt_ids is None:
        session.prompt_ids = torch.tensor(sorted(set(session.tokens[: session.output_from])), dtype=torch.long)
    return session.prompt_ids


def token_logprobs(rows: torch.Tensor, tokens: list[int], top: int) -> Logprobs:
    """Logprobs of `tokens`, token i scored by row i of a pass's rows (its position's logits, masked by a
    constraint), with the `top` most likely tokens of each row. (A prompt's rows come at most LOGPROB_ROWS
    a pass: verify_many.)"""
    lp = torch.log_softmax(rows[: len(tokens)].float(), dim=-1)
    values = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0]
    if not top:
        return Logprobs(0, values.tolist())
    best = lp.topk(min(top, lp.shape[-1]), dim=-1)
    return Logprobs(best.values.shape[-1], values.tolist(), best.indices.flatten().tolist(),
                    best.values.flatten().tolist())


LOGPROB_ROWS = 256  # a pass's output rows for prompts scored, at most (SmolLM2's: 50 MB of float32 logits)


@dataclass
class Part:
    """A verify call whose session had more tokens to feed than a pass takes (TargetEngine.prefill_chunk): fed
    over several passes, the rows it verifies in the last. Kept in its Session until then."""

    call: VerifyCall
    advanced: tuple  # what _advance returned: (session, committed, drafted, q_ids, q_probs)
    start: int  # the position of its first fed token (its feature rows begin there)
    states: list[torch.Tensor] = field(default_factory=list)  # each pass's feature rows, in the session's layers

    @property
    def base(self) -> int:
        """The session's tokens before the call's."""
        return self.advanced[1] - len(self.call.append)


def _own_layers(session: Session, capture: tuple[int, ...], rows: torch.Tensor) -> torch.Tensor:
    """States [fed, len(capture), D] of a pass -> those of the session's feature layers, in its order."""
    order = [capture.index(layer) for layer in session.feature_layers]
    return rows if order == list(range(len(capture))) else rows[:, order]


def _scored_prompt(call: VerifyCall) -> int:
    """The rows a call's pass scores its prompt with, before the rows it verifies (VerifyCall.prompt_logprobs)."""
    return len(call.append) - 1 if call.start and call.prompt_logprobs is not None else 0


def _feature_layers(sessions: list[Session]) -> tuple[int, ...]:
    """The layers a pass captures: every one some session of it asks for (usually all the same)."""
    layers: dict[int, None] = {}
    for session in sessions:
        layers.update(dict.fromkeys(session.feature_layers))
    return tuple(layers)


def _sent(session: Session, rows: Features, keep: bool) -> Features:
    """An answer's feature rows: after a reused prefix's (Session.resend: a new session's first answer),
    the last that fit a message; noted in the session where its cache may be kept for reuse."""
    if session.resend is not None:
        rows = Features.join([session.resend, rows])
        rows = rows.last(min(rows.rows, max(1, features.MAX_FEATURE_BYTES // rows.row_bytes)))
        session.resend = None
    if keep:  # (parts merged as a binary counter merges: O(log) parts, each row copied O(log) times)
        parts = session.sent_features
        parts.append(rows)
        while len(parts) > 1 and 2 * parts[-1].rows >= parts[-2].rows:
            parts[-2:] = [Features.join(parts[-2:])]
    return rows


def _committed_features(session: Session, capture: tuple[int, ...], states: list, j: int) -> Features | None:
    """The feature rows of feed j's session for the positions the pass fed and the session kept
    (all its tokens but the last, which was sampled and is fed next call), in its layers' order."""
    if not session.feature_layers:
        return None
    start, captured = states[j]  # [fed, len(capture), D]
    kept = min(captured.shape[0], len(session.tokens) - 1 - start)
    return features.pack(start, _own_layers(session, capture, captured[: max(kept, 0)]))
