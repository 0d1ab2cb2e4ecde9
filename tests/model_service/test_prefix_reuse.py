"""Prefix reuse (model_service/sessions.py): a finished request's session keeps its KV cache, and a
later prompt that begins with its tokens (a chat's next turn) takes it and computes only the rest,
with the output of a prompt computed whole; the kept caches stay within their budget, give way to
live sessions under --max-kv-tokens, go to one session each and never to a prompt that shares only
a little of them."""

from __future__ import annotations

import random

import pytest
import torch

from model_service.engines import DraftEngine, TargetEngine
from model_service.model_runner import ModelRunner
from model_service.sessions import MIN_REUSE, SessionTable, shared_prefix
from speculative.errors import CapacityExceeded
from speculative.protocol import Proposal, ProposeCall, SamplingParams, VerifyCall

GREEDY = SamplingParams(0.0)


class Cache:
    """A stand-in KV cache: how many positions it holds."""

    def __init__(self):
        self.length = 0

    def crop(self, n: int) -> None:  # (crop(-n) drops the last n, as DynamicCache's)
        assert n < 0
        self.length += n

    def get_seq_length(self) -> int:
        return self.length


def held(table: SessionTable, session_id: str, tokens: list[int]):
    """A session of `table` whose cache holds `tokens` (all but a last one the next pass feeds)."""
    session = table.create(session_id, torch.Generator())
    session.tokens = list(tokens)
    session.cached = session.cache.length = len(tokens) - 1
    return session


def test_the_shared_prefix_is_found_at_any_length():
    rng = random.Random(0)
    for _ in range(300):
        a = [rng.randrange(3) for _ in range(rng.randrange(0, 40))]
        b = a[: rng.randrange(0, len(a) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(0, 10))]
        most = rng.randrange(0, 50)
        naive = 0
        while naive < min(len(a), len(b), most) and a[naive] == b[naive]:
            naive += 1
        assert shared_prefix(a, b, most) == naive


def test_a_finished_session_is_kept_and_taken_by_the_prompt_that_continues_it():
    table = SessionTable(8, 600.0, Cache, keep_positions=1000)
    turn = list(range(100, 160))  # 60 tokens, 59 cached
    held(table, "a", turn)
    assert table.release("a", keep=True) and len(table) == 0 and table.kept == 1
    assert table.kept_positions == 59
    # the next turn: the whole conversation so far and more
    later = table.create("b", torch.Generator())
    assert table.reuse(later, turn + [7, 8, 9]) == 59
    assert later.cached == later.cache.length == 59 and table.kept == 0 and table.kept_positions == 0
    assert (table.reuses, table.reused_positions) == (1, 59)
    # the very same prompt again: its last token is fed again (its logits come from the pass)
    held(table, "c", turn)
    table.release("c", keep=True)
    again = table.create("d", torch.Generator())
    assert table.reuse(again, turn[:-1]) == len(turn) - 2 and again.cache.length == len(turn) - 2
    # a kept cache goes to one session only
    assert table.reuse(table.create("e", torch.Generator()), turn + [1]) == 0


def test_a_prompt_sharing_little_of_a_kept_cache_leaves_it_alone():
    table = SessionTable(8, 600.0, Cache, keep_positions=1000)
    system = list(range(MIN_REUSE))
    held(table, "a", system + list(range(500, 560)))
    table.release("a", keep=True)
    # the same system prompt, another conversation: less than half of the cache
    other = table.create("b", torch.Generator())
    assert table.reuse(other, system + [9] * 40) == 0 and table.kept == 1
    # fewer than MIN_REUSE positions, though all of a short cache
    held(table, "c", list(range(MIN_REUSE - 1)) + [3])
    table.release("c", keep=True)
    assert table.kept == 1  # (too short to keep)
    # the longest of several kept caches wins
    held(table, "d", system + list(range(500, 530)) + [1])
    table.release("d", keep=True)
    longest = table.create("e", torch.Generator())
    assert table.reuse(longest, system + list(range(500, 600))) == MIN_REUSE + 60 - 1 - 0  # all "a" cached
    assert table.kept == 1 and "d" in table._kept


class CopyingCache(Cache):
    """A stand-in for the lean forward's KVCache, which copies another's first positions."""

    def __init__(self):
        super().__init__()
        self.copied_from = None

    def copy_prefix(self, source: "CopyingCache", length: int) -> None:
        self.copied_from, self.length = (source, length), length


def test_a_shared_beginning_is_copied_where_the_cache_can_and_the_kept_cache_stays():
    table = SessionTable(8, 600.0, CopyingCache, keep_positions=1000)
    system = list(range(MIN_REUSE + 4))
    kept = held(table, "a", system + list(range(500, 560)))
    table.release("a", keep=True)
    other = table.create("b", torch.Generator())
    assert table.reuse(other, system + [9] * 40) == len(system)
    assert other.cache.copied_from == (kept.cache, len(system)) and other.cached == len(system)
    assert table.kept == 1 and kept.cache.length == len(system) + 59  # (left as it was, for the next)
    again = table.create("c", torch.Generator())
    assert table.reuse(again, system + [8] * 40) == len(system) and table.kept == 1
    # its own conversation's next turn still takes it whole
    turn = table.create("d", torch.Generator())
    assert table.reuse(turn, kept.tokens + [1, 2]) == len(kept.tokens) and table.kept == 0
    assert turn.cache is kept.cache and table.reuses == 3


def test_only_a_requests_end_keeps_a_cache():
    table = SessionTable(8, 600.0, Cache, keep_positions=1000)
    held(table, "a", list(range(40)))
    table.release("a")  # (a failure: the cache may be half-written)
    assert table.kept == 0
    assert SessionTable(8, 600.0, Cache).release("x") is False
    off = SessionTable(8, 600.0, Cache)  # keep_positions 0: off
    held(off, "a", list(range(40)))
    off.release("a", keep=True)
    assert off.kept == 0


def test_kept_caches_stay_within_their_budget_least_recent_first():
    table = SessionTable(8, 600.0, Cache, keep_positions=100)
    for name, first in (("a", 0), ("b", 1000), ("c", 2000)):
        held(table, name, list(range(first, first + 41)))  # 40 cached each
        table.release(name, keep=True)
    assert list(table._kept) == ["b", "c"] and table.kept_positions == 80
    held(table, "big", list(range(5000, 5102)))  # 101 positions: more than the budget, not kept
    table.release("big", keep=True)
    assert list(table._kept) == ["b", "c"]
    # idle as long as a session may be: dropped with the idle sessions
    table._kept["b"].last_used -= 1000
    table.evict_idle()
    assert list(table._kept) == ["c"] and table.kept_positions == 40


def test_kept_caches_give_way_to_live_sessions_under_the_kv_cap():
    table = SessionTable(8, 600.0, Cache, keep_positions=1000)
    for name, first in (("a", 0), ("b", 1000)):
        held(table, name, list(range(first, first + 41)))
        table.release(name, keep=True)
    # a cap of 100: a new 50-token session fits once the older kept cache goes
    table.check_room("new", 50, 4096, 100, sampled=1)
    assert list(table._kept) == ["b"]
    table.check_room("new", 99, 4096, 100, sampled=1)
    assert table.kept == 0
    with pytest.raises(CapacityExceeded):  # (the live sessions alone past the cap: as before)
        table.check_room("new", 101, 4096, 100, sampled=1)


# ------------------------------------------------------------------ a model's passes


@pytest.fixture(scope="module")
def runners(pair):
    draft, target = pair
    return (ModelRunner(target, prefix_cache_mb=64), ModelRunner(target), ModelRunner(draft, prefix_cache_mb=64))


def greedy_turn(target: TargetEngine, session_id: str, prompt: list[int], tokens: int) -> tuple[list[int], int]:
    """Greedy decoding of `tokens` tokens on a new session, then its release. -> (the tokens, those the
    first pass fed)"""
    verdict, cost = target.verify(VerifyCall(session_id, True, prompt, Proposal(), GREEDY, steps=tokens))
    out = [verdict.token, *verdict.decoded]
    fed = cost.batch_tokens
    while len(out) < tokens:
        verdict, _ = target.verify(VerifyCall(session_id, False, [], Proposal(), GREEDY, steps=tokens - len(out)))
        out += [verdict.token, *verdict.decoded]
    target.release(session_id)
    return out[:tokens], fed


def test_a_chats_next_turn_computes_only_what_is_new_and_answers_as_computed_whole(runners):
    reusing, whole, _ = runners
    kept, plain = TargetEngine(reusing), TargetEngine(whole)
    first = [5, 17, 42, 9, 100, *range(200, 240)]
    answer, fed = greedy_turn(kept, "t1", first, 12)
    assert fed == len(first) and answer == greedy_turn(plain, "p1", first, 12)[0]
    second = [*first, *answer, 77, 78, 79, 80]
    again, fed = greedy_turn(kept, "t2", second, 12)
    # the first turn's prompt and answer came cached, but its last answer token (never fed in that turn)
    assert fed == len(second) - (len(first) + len(answer) - 1)
    assert reusing.sessions.reuses == 1
    assert again == greedy_turn(plain, "p2", second, 12)[0]
    # sampled, seeded: the same draws as the prompt computed whole
    sampled = SamplingParams(0.9, seed=3)
    made = []
    for engine, name in ((kept, "s"), (plain, "q")):
        engine.verify(VerifyCall(f"{name}0", True, second + again, Proposal(), sampled, steps=6))
        engine.release(f"{name}0")
        verdict, _ = engine.verify(VerifyCall(f"{name}1", True, second + again + [3, 4], Proposal(), sampled, steps=6))
        made.append([verdict.token, *verdict.decoded])
        engine.release(f"{name}1")
    assert made[0] == made[1] and reusing.sessions.reuses >= 2


def test_conversations_beginning_alike_copy_the_shared_positions_and_answer_as_computed_whole(runners):
    """An application's system prompt (or tools' instructions) begins every conversation: a new one
    copies those positions from a kept cache, which stays for the next; features too."""
    reusing, whole, _ = runners
    kept, plain = TargetEngine(reusing), TargetEngine(whole)
    system = [(11 * i) % 300 + 5 for i in range(40)]
    kept.verify(VerifyCall("s0", True, [*system, *range(100, 160)], Proposal(), GREEDY, steps=6, feature_layers=(1,)))
    kept.release("s0")
    before = reusing.sessions.reuses
    for n, message in enumerate(([21, 22, 23], [31, 32, 33, 34, 35])):
        prompt = [*system, *message]
        answers = []
        for engine, name in ((kept, f"c{n}"), (plain, f"w{n}")):
            verdict, cost = engine.verify(VerifyCall(name, True, prompt, Proposal(), GREEDY, steps=5,
                                                     feature_layers=(1,)))
            assert verdict.cached == (len(system) if engine is kept else 0)  # (what it says it took)
            answers.append(([verdict.token, *verdict.decoded], verdict.features, cost.batch_tokens))
            engine.release(name)
        (said, rows, fed), (alone, whole_rows, _) = answers
        assert said == alone and rows.data == whole_rows.data and rows.start == 0
        assert fed == len(message)  # the system prompt's 40 positions came copied
    assert reusing.sessions.reuses == before + 2


def test_requests_beginning_alike_at_once_compute_the_beginning_once(runners):
    """A request's n choices of a chat's next turn start together: the first takes the kept cache, the
    others copy it from that live session; and a session still running lends its beginning to a new
    one that shares it, before anything was kept."""
    reusing, whole, _ = runners
    kept, plain = TargetEngine(reusing), TargetEngine(whole)
    first = [(17 * i) % 300 + 3 for i in range(50)]
    answer, _ = greedy_turn(kept, "n0", first, 8)
    later = [*first, *answer, 90, 91]
    calls = [VerifyCall(f"n{i}", True, later, Proposal(), SamplingParams(0.8, seed=i), steps=4) for i in range(1, 5)]
    before = reusing.sessions.reuses
    made = kept.verify_many(calls)
    assert reusing.sessions.reuses == before + 4
    assert made[0][1].batch_tokens == 4 * (len(later) - (len(first) + len(answer) - 1))  # (the pass fed these)
    alone = plain.verify_many([VerifyCall(f"w{i}", True, later, Proposal(), SamplingParams(0.8, seed=i), steps=4)
                               for i in range(1, 5)])
    assert [[v.token, *v.decoded] for v, _ in made] == [[v.token, *v.decoded] for v, _ in alone]
    for i in range(1, 5):
        kept.release(f"n{i}")
        plain.release(f"w{i}")
    # nothing kept that begins so: a running session lends its first positions
    running = [(29 * i) % 300 + 1 for i in range(40)]
    kept.verify(VerifyCall("r0", True, running, Proposal(), GREEDY))
    verdict, cost = kept.verify(VerifyCall("r1", True, [*running[:30], 5, 6], Proposal(), GREEDY))
    assert cost.batch_tokens == 2 and verdict.token == plain.verify(
        VerifyCall("w", True, [*running[:30], 5, 6], Proposal(), GREEDY))[0].token
    for name in ("r0", "r1"):
        kept.release(name)
    plain.release("w")


def test_a_scored_prompt_is_computed_whole(runners):
    reusing, _, _ = runners
    target = TargetEngine(reusing)
    prompt = list(range(300, 340))
    greedy_turn(target, "f0", prompt, 4)
    before = reusing.sessions.reuses
    verdict, cost = target.verify(VerifyCall("f1", True, prompt + [1, 2], Proposal(), GREEDY, prompt_logprobs=0))
    assert cost.batch_tokens == len(prompt) + 2 and len(verdict.prompt_logprobs) == len(prompt) + 1
    target.release("f1")
    assert reusing.sessions.reuses == before


def test_a_reused_session_sends_its_prefixs_feature_rows_first(runners):
    """An EAGLE draft reads the target's feature rows of every position: the next turn's first answer
    carries the kept ones, then its own, as the prompt computed whole gives them."""
    reusing, whole, _ = runners
    answers = []
    for runner, name in ((reusing, "r"), (whole, "w")):
        target = TargetEngine(runner)
        prompt = list(range(120, 170))
        first, _ = target.verify(VerifyCall(f"{name}0", True, prompt, Proposal(), GREEDY, steps=6,
                                            feature_layers=(0, 1)))
        said = [first.token, *first.decoded]
        more, _ = target.verify(VerifyCall(f"{name}0", False, [], Proposal(), GREEDY, steps=3))
        said += [more.token, *more.decoded]
        target.release(f"{name}0")
        later = [*prompt, *said, 9, 10]
        verdict, cost = target.verify(VerifyCall(f"{name}1", True, later, Proposal(), GREEDY, feature_layers=(0, 1)))
        target.release(f"{name}1")
        answers.append((verdict.features, cost.batch_tokens, len(later)))
    (kept, fed, length), (computed, fed_whole, _) = answers
    assert fed == 3 and fed_whole == length  # (the last answer token and the two new ones)
    assert (kept.start, kept.rows) == (0, length) == (computed.start, computed.rows)  # (every prompt position)
    assert kept.data == computed.data
    # a session asking for other layers does not take a cache whose rows it cannot send
    target = TargetEngine(reusing)
    target.verify(VerifyCall("o0", True, list(range(60, 100)), Proposal(), GREEDY, feature_layers=(0,)))
    target.release("o0")
    before = reusing.sessions.reuses
    verdict, _ = target.verify(VerifyCall("o1", True, list(range(60, 101)), Proposal(), GREEDY, feature_layers=(1,)))
    assert reusing.sessions.reuses == before and verdict.features.start == 0
    target.release("o1")


def test_a_draft_models_next_turn_reuses_its_cache_and_drafts_as_computed_whole(runners, pair):
    _, _, draft_runner = runners
    draft = DraftEngine(draft_runner)
    prompt = list(range(100, 150))
    proposal, _ = draft.propose(ProposeCall("d0", True, 0, prompt, 4, GREEDY))
    draft.release("d0")
    later = [*prompt, *proposal.tokens, 5, 6]
    reused, _ = draft.propose(ProposeCall("d1", True, 0, later, 4, GREEDY))
    # the prompt and the three proposals its drafting fed came cached
    assert draft_runner.sessions.reuses == 1 and draft_runner.sessions.reused_positions == len(prompt) + 3
    draft.release("d1")
    fresh = DraftEngine(ModelRunner(pair[0]))
    assert fresh.propose(ProposeCall("x", True, 0, later, 4, GREEDY))[0].tokens == reused.tokens


def test_the_metrics_say_what_was_reused():
    from model_service.metrics import ModelMetrics

    table = SessionTable(8, 600.0, Cache, keep_positions=1000)
    metrics = ModelMetrics()
    metrics.watch(table)
    held(table, "a", list(range(100, 141)))
    table.release("a", keep=True)
    value = lambda name: metrics.registry.get_sample_value(name)  # noqa: E731
    assert value("specdec_prefix_cache_positions") == 40 and value("specdec_prefix_cache_hits_total") == 0
    table.reuse(table.create("b", torch.Generator()), list(range(100, 150)))
    assert value("specdec_prefix_cache_positions") == 0
    assert (value("specdec_prefix_cache_hits_total"), value("specdec_prefix_cache_hit_tokens_total")) == (1, 40)
    assert ModelMetrics().registry.get_sample_value("specdec_prefix_cache_hits_total") is None  # (off: none)


def test_a_model_whose_cache_size_cannot_be_read_keeps_nothing_and_serves(pair, monkeypatch, caplog):
    def unknown(self):
        raise AttributeError("no num_attention_heads")

    monkeypatch.setattr(ModelRunner, "kv_position_bytes", unknown)
    runner = ModelRunner(pair[1], prefix_cache_mb=64)
    assert runner.sessions.keep_positions == 0 and "keeps no finished sessions' caches" in caplog.text
    out, _ = greedy_turn(TargetEngine(runner), "u", list(range(100, 140)), 3)
    assert len(out) == 3
