"""Batched serving computes what one-at-a-time serving computes: mixed prompt lengths, mixed K,
greedy and seeded sampling, and an error in one call that leaves the others alone."""

from __future__ import annotations

import argparse
import asyncio
import logging
import random
import threading
import time

import grpc
import pytest

from model_service.engines import DraftEngine, TargetEngine
from speculative.errors import InvalidRequest
from model_service.model_runner import ModelRunner
from speculative.protocol import PassCost, Proposal, ProposeCall, VerifyCall
from speculative.protocol import SamplingParams
from model_service import threads
from model_service.batcher import Batcher, Batching, Waiting
from model_service.service import auto_wait_ms, sweep_idle_sessions, wait_ms
from model_service.servicer import status_of
from model_service.threads import ModelThread, ModelThreadStopped


def engines(pair):
    draft_dir, target_dir = pair
    return DraftEngine(ModelRunner(draft_dir)), TargetEngine(ModelRunner(target_dir))


def rounds(draft, target, prompts, ks, params, batched: bool, n_rounds: int = 6):
    """Drive every session through n_rounds rounds, all sessions per round in one batch (or one
    call at a time). -> per session, its committed tokens after each round."""
    state = [{"tokens": list(p), "draft_seen": 0, "unconfirmed": 0, "target_seen": 0} for p in prompts]
    history = [[] for _ in prompts]
    for r in range(n_rounds):
        calls = [ProposeCall(f"s{i}", s["draft_seen"] == 0, s["unconfirmed"], s["tokens"][s["draft_seen"]:],
                             ks[i][r % len(ks[i])], params[i]) for i, s in enumerate(state)]
        proposals = draft.propose_many(calls) if batched else [draft.propose_many([c])[0] for c in calls]
        vcalls = [VerifyCall(f"s{i}", s["target_seen"] == 0, s["tokens"][s["target_seen"]:], p, params[i])
                  for i, (s, (p, _)) in enumerate(zip(state, proposals))]
        verdicts = target.verify_many(vcalls) if batched else [target.verify_many([c])[0] for c in vcalls]
        if batched:
            assert {cost.batch_size for _, cost in verdicts} == {len(prompts)}
        for i, (s, (p, _), (v, _)) in enumerate(zip(state, proposals, verdicts)):
            s["draft_seen"] = len(s["tokens"]) + v.accepted
            s["unconfirmed"] = len(p.tokens) - v.accepted
            s["tokens"] += p.tokens[: v.accepted] + [v.token]
            s["target_seen"] = len(s["tokens"])
            history[i].append(list(s["tokens"]))
    return history


@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_batched_rounds_equal_one_at_a_time(pair, temperature):
    rng = random.Random(5)
    prompts = [[rng.randrange(1, 300) for _ in range(n)] for n in (1, 7, 30, 64, 12)]
    ks = [[0, 2], [4], [1, 8, 3], [6], [5, 0, 2]]  # mixed K within a batch and across rounds
    params = [SamplingParams(temperature, seed=100 + i) for i in range(len(prompts))]
    one = rounds(*engines(pair), prompts, ks, params, batched=False)
    many = rounds(*engines(pair), prompts, ks, params, batched=True)
    assert one == many


def test_a_bad_call_fails_alone(pair):
    draft, target = engines(pair)
    greedy = SamplingParams(0.0)
    good = VerifyCall("good", True, [5, 6, 7], Proposal(), greedy)
    bad = VerifyCall("bad", False, [], Proposal(), greedy)  # no such session
    out_of_vocab = VerifyCall("oov", True, [10 ** 6], Proposal(), greedy)
    results = target.verify_many([bad, good, out_of_vocab])
    assert isinstance(results[0], Exception) and isinstance(results[2], InvalidRequest)
    verdict, cost = results[1]
    assert cost.batch_size == 1 and "good" in target.runner.sessions and "oov" not in target.runner.sessions
    results = draft.propose_many([ProposeCall("d", True, 0, [5, 6], 3, greedy),
                                  ProposeCall("e", True, 0, [5, 6], 99, greedy)])
    assert len(results[0][0].tokens) == 3 and isinstance(results[1], InvalidRequest)


def test_draft_stops_below_p_min(pair):
    draft, _ = engines(pair)
    greedy = SamplingParams(0.0)
    full, _ = draft.propose(ProposeCall("a", True, 0, [5, 6, 7], 8, greedy))
    none, _ = draft.propose(ProposeCall("b", True, 0, [5, 6, 7], 8, greedy, p_min=1.0))  # nothing is that sure
    assert len(full.tokens) == 8 and none.tokens == []
    with pytest.raises(InvalidRequest):
        draft.propose(ProposeCall("c", True, 0, [5], 2, greedy, p_min=1.5))


def recording_run_many():
    """-> (passes, run_many): a run_many answering each call with itself, recording every pass."""
    passes: list[list[str]] = []

    def run_many(calls):
        passes.append(list(calls))
        return [(c, None) for c in calls]

    return passes, run_many


def held_first_pass(run_many):
    """-> (started, release, run_many'): run_many whose first pass sets `started` and lasts until
    `release` is set, so that calls submitted meanwhile are all waiting when the model frees up."""
    started, release = threading.Event(), threading.Event()
    first = [True]

    def run(calls):
        if first[0]:
            first[0] = False
            started.set()
            assert release.wait(60)
        return run_many(calls)

    return started, release, run


async def until(condition, timeout: float = 30.0) -> None:
    """Return once condition() holds (the event a step waits for, polled), failing after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.001)


def test_batcher_joins_waiting_calls_and_keeps_one_call_per_session():
    passes, run_many = recording_run_many()
    started, release, held = held_first_pass(run_many)

    async def main():
        batcher = Batcher(ModelThread(), held, Batching(max_batch=3))
        first = asyncio.ensure_future(batcher.submit("a", "a1"))
        await until(started.is_set)  # "a1" runs alone: nothing waits for a batch to fill
        calls = [asyncio.ensure_future(batcher.submit(s, f"{s}{n}"))
                 for s, n in [("b", 1), ("c", 1), ("b", 2), ("d", 1), ("e", 1)]]
        await until(lambda: len(batcher.waiting) == 5)  # all five wait while a1's pass runs
        release.set()
        return await asyncio.gather(first, *calls)

    results = asyncio.run(main())
    assert [r for r, _ in results] == ["a1", "b1", "c1", "b2", "d1", "e1"]
    assert passes[0] == ["a1"]
    assert passes[1] == ["b1", "c1", "d1"]  # b2 waits: one call per session per pass; at most 3
    assert passes[2] == ["b2", "e1"]


def test_batcher_refuses_calls_beyond_its_queue():
    from speculative.errors import CapacityExceeded

    started, release, held = held_first_pass(lambda calls: [(c, None) for c in calls])

    async def main():
        batcher = Batcher(ModelThread(), held, Batching(max_batch=1, max_queue=2))
        first = asyncio.ensure_future(batcher.submit("s0", 0))
        await until(started.is_set)  # s0's pass runs (held): the queue is empty
        calls = [asyncio.ensure_future(batcher.submit(f"s{i}", i)) for i in range(1, 5)]
        # two wait in the queue, two were refused
        await until(lambda: len(batcher.waiting) == 2 and sum(c.done() for c in calls) == 2)
        release.set()
        return await asyncio.gather(first, *calls, return_exceptions=True)

    results = asyncio.run(main())
    assert [r for r, _ in results[:3]] == [0, 1, 2]
    assert all(isinstance(r, CapacityExceeded) and "wait" in str(r) for r in results[3:])


def test_a_full_queue_refuses_new_sessions_not_the_live_ones_next_calls():
    """--max-queue turns away calls that would start a session; a live session's next call is queued past it
    (its request was let in: refusing it would cut an answer short), and a batch's calls are refused one by
    one, the live ones among them served."""
    from types import SimpleNamespace

    from speculative.errors import CapacityExceeded

    started, release, held = held_first_pass(lambda calls: [(c.name, None) for c in calls])

    def call(name, start):
        return SimpleNamespace(name=name, start=start)

    async def main():
        batcher = Batcher(ModelThread(), held, Batching(max_batch=8, max_queue=2))
        first = asyncio.ensure_future(batcher.submit("s0", call("s0", True)))
        await until(started.is_set)  # s0's pass runs (held): the queue is empty
        live = [asyncio.ensure_future(batcher.submit(f"l{i}", call(f"l{i}", False))) for i in range(3)]
        await until(lambda: len(batcher.waiting) == 3)  # all three live calls wait, one past the cap
        new = asyncio.ensure_future(batcher.submit("n0", call("n0", True)))
        mixed = batcher.enqueue([("n1", call("n1", True)), ("l3", call("l3", False))], (7, 2))
        await until(lambda: new.done() and mixed[0].done())
        assert len(batcher.waiting) == 4 and not mixed[1].done()
        release.set()
        return await asyncio.gather(first, *live, new, *mixed, return_exceptions=True)

    results = asyncio.run(main())
    assert [r[0] for r in results[:4]] == ["s0", "l0", "l1", "l2"]
    assert all(isinstance(r, CapacityExceeded) and "--max-queue" in str(r) for r in results[4:6])
    assert results[6][0] == "l3"


def test_batcher_fails_every_call_of_a_failed_pass_and_goes_on():
    """An error out of run_many itself (not one call's) reaches each call of that pass; the
    model thread serves the next pass, and jobs, as before."""
    def run_many(calls):
        if "boom" in calls:
            raise RuntimeError("the pass broke")
        return [(c, None) for c in calls]

    async def main():
        thread = ModelThread()
        batcher = Batcher(thread, run_many, Batching(max_batch=4))
        failed = await asyncio.gather(batcher.submit("a", "boom"), return_exceptions=True)
        after = await batcher.submit("b", "fine")
        job = await thread.run(lambda x: x * 2, 21)
        with pytest.raises(ZeroDivisionError):
            await thread.run(lambda: 1 / 0)
        return failed, after, job

    failed, after, job = asyncio.run(main())
    assert isinstance(failed[0], RuntimeError) and "broke" in str(failed[0])
    assert after == ("fine", None) and job == 42


class FrozenClock:
    """The model thread's clock (model_service.threads.time), moved only by `advance`: a pass that
    waits for calls to come waits until they come, or until the test moves the clock past its
    deadline, however slow the machine. `reads` counts the thread's looks at it."""

    def __init__(self):
        self.now, self.reads = 1000.0, 0

    def monotonic(self) -> float:
        self.reads += 1
        return self.now

    def advance(self, thread: ModelThread, seconds: float) -> None:
        self.now += seconds
        with thread.cond:
            thread.cond.notify()  # look again now, not at the end of its (real) wait


@pytest.fixture
def clock(monkeypatch) -> FrozenClock:
    frozen = FrozenClock()
    monkeypatch.setattr(threads, "time", frozen)
    return frozen


@pytest.mark.parametrize("wait, at_work, first_pass", [
    (0.0, 3, ["a1"]),                # no wait: the first call runs at once, alone
    (0.3, 3, ["a1", "b1", "c1"]),    # waits for the sessions at work, which come within the wait
    (0.3, 1, ["a1"]),                # one session at work: nothing to wait for
])
def test_batcher_waits_for_sessions_at_work(wait, at_work, first_pass, clock):
    passes, run_many = recording_run_many()

    async def main():
        batcher = Batcher(ModelThread(), run_many, Batching(max_batch=8, wait=wait), at_work=lambda: at_work)
        first = asyncio.ensure_future(batcher.submit("a", "a1"))
        # the model thread has taken a1 up: its pass ran (alone), or it waits for the others
        await until(lambda: passes or batcher.deadline is not None)
        rest = [batcher.submit(s, f"{s}1") for s in ("b", "c")]
        # (the clock stands still: a pass that waited for its deadline would never come)
        return await asyncio.wait_for(asyncio.gather(first, *rest), 30)

    results = asyncio.run(main())
    assert [r for r, _ in results] == ["a1", "b1", "c1"]
    assert passes[0] == first_pass
    assert sum(map(len, passes)) == 3


@pytest.mark.parametrize("size, waits", [
    (3, False),  # a turn of three: the pass starts as the third call comes, not at the end of the wait
    (5, True),   # two of its five calls never come: it waits turn_wait, then goes with the three
])
def test_batcher_waits_for_the_rest_of_a_lockstep_turn(size, waits, clock):
    passes, run_many = recording_run_many()
    passed_at = []  # the clock at each pass

    def timed_run_many(calls):
        passed_at.append(clock.now)
        return run_many(calls)

    async def main():
        thread = ModelThread()
        # (wait and at_work are unset: only the turn holds the pass)
        batcher = Batcher(thread, timed_run_many, Batching(max_batch=8, turn_wait=0.4))
        first = asyncio.ensure_future(batcher.submit("a", "a1", (7, size)))
        await until(lambda: batcher.deadline is not None)  # a1's pass waits for the rest of its turn
        deadline = batcher.deadline
        rest = [asyncio.ensure_future(batcher.submit(s, f"{s}1", (7, size))) for s in ("b", "c")]
        if waits:
            await until(lambda: len(batcher.waiting) == 3)
            looked = clock.reads
            await until(lambda: clock.reads >= looked + 2)  # it has looked since: it waits on (a real 0.4 s)
            assert passes == []
            clock.advance(thread, 0.4)  # the turn's wait runs out: the two missing calls never come
        # (the clock stands still otherwise: a pass that waited for its deadline would never come)
        results = await asyncio.wait_for(asyncio.gather(first, *rest), 30)
        return results, deadline

    results, deadline = asyncio.run(main())
    assert [r for r, _ in results] == ["a1", "b1", "c1"]
    assert passes == [["a1", "b1", "c1"]]
    assert (passed_at[0] >= deadline) == waits


def test_a_pass_serves_one_lockstep_turn():
    """Calls of two turns (two groups of generations), and calls of none, waiting together get a
    pass each, in the order their first calls came."""
    passes, run_many = recording_run_many()
    started, release, held = held_first_pass(run_many)

    async def main():
        batcher = Batcher(ModelThread(), held, Batching(max_batch=8))
        first = asyncio.ensure_future(batcher.submit("z", "z1"))
        await until(started.is_set)  # z1's pass runs (held) while the rest queue
        calls = [asyncio.ensure_future(batcher.submit(s, f"{s}1", turn))
                 for s, turn in [("a", (5, 2)), ("c", (9, 2)), ("x", (0, 0)), ("b", (5, 2)), ("d", (9, 2))]]
        await until(lambda: len(batcher.waiting) == 5)
        release.set()
        return await asyncio.gather(first, *calls)

    results = asyncio.run(main())
    assert [r for r, _ in results] == ["z1", "a1", "c1", "x1", "b1", "d1"]
    assert passes == [["z1"], ["a1", "b1"], ["c1", "d1"], ["x1"]]


def test_auto_wait_is_half_the_calibrated_one_token_pass_up_to_8_ms():
    """--batch-wait-ms auto: half the model's one-token pass, at most 8 ms (SmolLM2 on 2 cores: its
    int4 passes, ~4 ms, wait 2; its float32 ones, ~40 ms, 8)."""
    assert auto_wait_ms(PassCost(fixed=3.0, per_token=0.8, per_session=1.0, free_rows=8)) == pytest.approx(2.0)
    assert auto_wait_ms(PassCost(fixed=30.0, per_token=2.0, per_session=10.0)) == 8.0
    assert auto_wait_ms(PassCost(fixed=0.2, multi_row=5.0)) == pytest.approx(0.1)  # one row: no multi_row
    assert wait_ms("auto") == "auto" and wait_ms("2.5") == 2.5
    with pytest.raises(argparse.ArgumentTypeError, match="a number of ms or auto"):
        wait_ms("soon")


class GivesUpWhenTaken:
    """A queued call's future whose caller gives up (a cancel, on the event loop's thread) just as the
    model thread takes it: not done when `ready` first looks, done from then on."""

    def __init__(self) -> None:
        self.looks = 0

    def done(self) -> bool:
        self.looks += 1
        return self.looks > 1


def test_a_call_given_up_as_its_pass_is_taken_is_left_out_not_an_empty_pass():
    """Seen in a make test: a draft's caller cancelled as the model thread took its pass, which then held no call;
    the thread stopped on it, and the service answered nothing more."""
    batcher = Batcher(ModelThread(), lambda calls: calls, Batching())
    batcher.waiting.append(Waiting("a", "a1", GivesUpWhenTaken(), None))
    assert batcher.ready(now=0.0) is None  # nothing left to run, not a pass of nothing
    pending = type("Pending", (), {"done": lambda self: False})()
    batcher.waiting.extend([Waiting("a", "a1", GivesUpWhenTaken(), None, 5, 1),
                            Waiting("b", "b1", pending, None)])
    assert [item.call for item in batcher.ready(now=0.0)] == ["b1"]  # the next call's pass (of another turn)


@pytest.mark.parametrize("breaking", ["ready", "pass_for"])
def test_a_model_thread_that_stops_fails_what_waits_and_what_comes_and_says_so(breaking):
    """A fault in the model thread's own work (taking a pass: choosing its calls, or making it of those
    taken) stops it: every call queued, taken ones too, and every later job or call fails at once with
    ModelThreadStopped (UNAVAILABLE), not waits for ever, and on_failure hears why (the service turns
    NOT_SERVING: tests/services)."""
    passes, run_many = recording_run_many()
    started, release, held = held_first_pass(run_many)
    told = []

    async def main():
        thread = ModelThread()
        thread.on_failure = told.append
        batcher = Batcher(thread, held, Batching())
        first = asyncio.ensure_future(batcher.submit("a", "a1"))
        await until(started.is_set)
        queued = [asyncio.ensure_future(batcher.submit(s, f"{s}1")) for s in "bc"]
        await until(lambda: len(batcher.waiting) == 2)

        def broken(*args):
            raise RuntimeError("taking a pass broke")

        setattr(batcher, breaking, broken)
        release.set()
        outcomes = await asyncio.gather(first, *queued, return_exceptions=True)
        later = await asyncio.gather(batcher.submit("d", "d1"), thread.run(lambda: 1), return_exceptions=True)
        return outcomes, later

    outcomes, later = asyncio.run(asyncio.wait_for(main(), 60))
    assert outcomes[0] == ("a1", None)  # the pass that ran is answered
    for outcome in [*outcomes[1:], *later]:
        assert isinstance(outcome, ModelThreadStopped) and "taking a pass broke" in str(outcome)
    assert passes == [["a1"]]
    assert told == ["its model thread stopped (RuntimeError: taking a pass broke)"]
    assert status_of(ModelThreadStopped("")) == grpc.StatusCode.UNAVAILABLE


def test_the_idle_sweep_goes_on_after_a_sweep_that_fails(caplog):
    """One failed eviction (an engine's bug) is logged; the sweeps go on, until the model thread stops."""
    caplog.set_level(logging.INFO, logger="specdec")
    outcomes = [RuntimeError("evicting broke"), 2, 0]

    class Engine:
        def evict_idle(self):
            outcome = outcomes.pop(0) if outcomes else 0
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

    async def main():
        thread = ModelThread()
        sweeper = asyncio.ensure_future(sweep_idle_sessions(Engine(), thread, every=0.0))
        await until(lambda: not outcomes)
        with thread.cond:
            thread.failed = RuntimeError("stopped")
        return await asyncio.wait_for(sweeper, 30)

    assert asyncio.run(main()) is None  # ended by the stopped thread
    assert "evicting idle sessions failed" in caplog.text and "evicted 2 idle sessions" in caplog.text
