"""A long prompt fed in parts (TargetEngine.prefill_chunk): other sessions' calls run between its parts,
and what it answers is what one pass over the whole prompt answers."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from model_service import features
from model_service.batcher import PREFILL_CHUNK, UNFINISHED, Batcher, Batching, Waiting, prefill_chunk_for
from model_service.engines import TargetEngine
from model_service.model_runner import ModelRunner
from model_service.threads import ModelThread
from speculative.errors import SessionNotFound
from speculative.protocol import Proposal, SamplingParams, VerifyCall

GREEDY = SamplingParams(0.0)
PROMPT = [(11 * i) % 250 + 3 for i in range(50)]
LAYERS = (0, 1)


@pytest.fixture(scope="module")
def runner(pair):
    return ModelRunner(pair[1])


def start(session_id: str, prompt: list[int] = PROMPT, **kw) -> VerifyCall:
    return VerifyCall(session_id, True, prompt, Proposal(), GREEDY, **kw)


def step(session_id: str, append: list[int] = ()) -> VerifyCall:
    return VerifyCall(session_id, False, list(append), Proposal(), GREEDY)


def counting(runner: ModelRunner) -> list[int]:
    """-> a list that grows by one at each of the runner's passes."""
    passes: list[int] = []
    runner.on_forward = lambda: passes.append(1)
    return passes


def whole_and_in_parts(runner, busy) -> tuple[list, list]:
    """The same start verified by an engine feeding it whole and by one feeding 8 tokens a pass (each
    call passed in again while it comes back UNFINISHED), then 3 decode steps each. -> (whole's results,
    parts' results), each the start's Verdict and the steps' tokens"""
    out = []
    for session_id, chunk in (("whole", 0), ("parts", 8)):
        engine = TargetEngine(runner, prefill_chunk=chunk)
        call = start(session_id, feature_layers=LAYERS)
        while (result := engine.verify_many([call], busy, in_parts=True)[0]) is UNFINISHED:
            pass
        verdict, _ = result
        tokens = [engine.verify(step(session_id))[0].token for _ in range(3)]
        runner.sessions.release(session_id)
        out.append((verdict, tokens))
    return out[0], out[1]


def test_a_prompt_in_parts_answers_as_one_pass_over_it(runner):
    passes = counting(runner)
    try:
        (whole, whole_steps), (parts, parts_steps) = whole_and_in_parts(runner, lambda: True)
    finally:
        runner.on_forward = None
    assert (parts.token, parts_steps) == (whole.token, whole_steps)
    # its feature rows: every position of the prompt, as the one pass gave them, in order
    assert (parts.features.start, parts.features.rows) == (whole.features.start, whole.features.rows) == (0, 50)
    assert torch.allclose(features.unpack(parts.features), features.unpack(whole.features), atol=2e-2)
    # whole: 1 pass + 3 steps; parts: 8 tokens a pass while more than 8 wait before the row it verifies
    # (0..48 in 6 passes, then the last 2), + 3 steps
    assert len(passes) == (1 + 3) + (7 + 3)


def test_with_nobody_waiting_the_parts_go_on_in_one_call(runner):
    passes = counting(runner)
    try:
        engine = TargetEngine(runner, prefill_chunk=8)
        result = engine.verify_many([start("alone")], lambda: False, in_parts=True)[0]
        assert result is not UNFINISHED and result[0].accepted == 0
        assert len(passes) == 7 and runner.sessions.get("alone").cached == len(PROMPT)
        for call in (start("direct"), start("direct-many")):  # (a call's own verify: no parts)
            passes.clear()
            engine.verify(call) if call.session_id == "direct" else engine.verify_many([call])
            assert len(passes) == 1
    finally:
        runner.on_forward = None
        for session_id in ("alone", "direct", "direct-many"):
            runner.sessions.release(session_id)


def test_other_sessions_are_answered_between_the_parts(runner):
    engine = TargetEngine(runner, prefill_chunk=16)
    engine.verify(start("short", PROMPT[:5]))
    long_call, short_call = start("long"), step("short")
    results = engine.verify_many([long_call, short_call], lambda: True, in_parts=True)
    assert results[0] is UNFINISHED and results[1][0].accepted == 0
    assert runner.sessions.get("long").cached == 16  # its first part
    results = engine.verify_many([long_call, step("short")], lambda: True, in_parts=True)
    assert results[0] is UNFINISHED and runner.sessions.get("long").cached == 32
    results = engine.verify_many([long_call], lambda: True, in_parts=True)  # 33 left: 16 + its last 1
    assert results[0] is UNFINISHED
    (verdict, cost), = engine.verify_many([long_call], lambda: True, in_parts=True)
    assert cost.batch_tokens == 2 and runner.sessions.get("long").part is None
    reference = TargetEngine(runner, prefill_chunk=0)
    assert verdict.token == reference.verify(start("reference"))[0].token
    for session_id in ("short", "long", "reference"):
        runner.sessions.release(session_id)


def test_a_session_whose_call_in_parts_was_given_up_takes_the_next_call_as_if_it_never_came(runner):
    engine = TargetEngine(runner, prefill_chunk=8)
    for session_id in ("gave-up", "never"):
        engine.verify(start(session_id, PROMPT[:6]))
    given_up = step("gave-up", PROMPT[6:40])
    assert engine.verify_many([given_up], lambda: True, in_parts=True)[0] is UNFINISHED
    assert runner.sessions.get("gave-up").cached > 6
    got = [engine.verify(step(session_id, [7, 8]))[0].token for session_id in ("gave-up", "never")]
    assert got[0] == got[1]
    assert runner.sessions.get("gave-up").tokens == runner.sessions.get("never").tokens
    assert runner.sessions.get("gave-up").part is None
    for session_id in ("gave-up", "never"):
        runner.sessions.release(session_id)


def test_a_call_whose_session_is_released_between_its_parts_is_not_begun_again(runner):
    """A session released while its call is fed in parts (a client that gave up: its Release may run before
    the call's cancel lands): the call passed in again is refused, NOT_FOUND, not fed afresh into a new
    session that nobody would release; and a call whose part was rolled back likewise."""
    engine = TargetEngine(runner, prefill_chunk=8)
    call = start("released")
    assert engine.verify_many([call], lambda: True, in_parts=True)[0] is UNFINISHED
    engine.release("released")
    [result] = engine.verify_many([call], lambda: True, in_parts=True)
    assert isinstance(result, SessionNotFound) and "fed in parts" in str(result)
    assert runner.sessions.find("released") is None
    engine.verify(start("rolled", PROMPT[:6]))
    given_up = step("rolled", PROMPT[6:40])
    assert engine.verify_many([given_up], lambda: True, in_parts=True)[0] is UNFINISHED
    engine.verify(step("rolled", [7, 8]))  # (rolls the part back)
    held = list(runner.sessions.get("rolled").tokens)
    assert isinstance(engine.verify_many([given_up], lambda: True, in_parts=True)[0], SessionNotFound)
    assert runner.sessions.get("rolled").tokens == held
    runner.sessions.release("rolled")


@pytest.mark.parametrize("chunk", [0, 8])
def test_the_batcher_answers_a_waiting_call_before_a_long_prompt_in_parts(runner, chunk):
    """Through the service's Batcher and model thread: a long prompt and a short session's step queued
    together; in parts the step is answered after the first part, the prompt after its last."""
    engine = TargetEngine(runner, prefill_chunk=chunk)
    engine.verify(start("step", PROMPT[:5]))
    settled: list[str] = []
    passes: list[int] = []

    async def main():
        thread = ModelThread()
        batcher = Batcher(thread, lambda calls: engine.verify_many(calls, thread.waiting, in_parts=True),
                          Batching(), on_pass=passes.append)
        futures = batcher.enqueue([("long", start("long")), ("step", step("step"))])
        for name, future in zip(("long", "step"), futures):
            future.add_done_callback(lambda _, name=name: settled.append(name))
        return await asyncio.wait_for(asyncio.gather(*futures), 120)

    (long_verdict, _), (step_verdict, _) = asyncio.run(main())
    assert settled == (["step", "long"] if chunk else ["long", "step"])
    assert len(passes) == (2 if chunk else 1)  # (alone after its first part, its parts go on in one call)
    assert runner.sessions.get("long").cached == len(PROMPT)
    for session_id in ("long", "step"):
        runner.sessions.release(session_id)


class HeldPasses:
    """A batcher's run_many over string calls: "long" comes back UNFINISHED twice, the others answered; the
    first pass is held until `release` is set (`started` says it runs); `passes` records each pass's calls."""

    def __init__(self):
        self.passes: list[list[str]] = []
        self.left = {"long": 2}
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, calls):
        self.passes.append(list(calls))
        if len(self.passes) == 1:
            self.started.set()
            assert self.release.wait(60)
        out = []
        for call in calls:
            if self.left.get(call, 0):
                self.left[call] -= 1
                out.append(UNFINISHED)
            else:
                out.append((call, None))
        return out


def run_held(batching: Batching, first: list, later: list, turn: tuple[int, int] = (0, 0)) -> tuple[list, list]:
    """`first` queued (of `turn`), its pass held while `later` is queued. -> (the calls' results, the passes)"""
    run_many = HeldPasses()

    async def main():
        batcher = Batcher(ModelThread(), run_many, batching)
        queued = batcher.enqueue(first, turn=turn)
        assert await asyncio.to_thread(run_many.started.wait, 60)  # the first pass runs (held)
        waiting = batcher.enqueue(later)  # they wait while the first pass runs
        run_many.release.set()
        return await asyncio.wait_for(asyncio.gather(*queued, *waiting), 60)

    return [result for result, _ in asyncio.run(main())], run_many.passes


def test_the_batcher_queues_an_unfinished_call_again_first():
    """A call answered UNFINISHED is passed in again at the next pass, before calls that came later, and
    its caller hears of it only when it is answered."""
    results, passes = run_held(Batching(max_batch=2), [("l", "long"), ("a", "a1")], [("b", "b1"), ("c", "c1")])
    assert results == ["long", "a1", "b1", "c1"]
    assert passes == [["long", "a1"], ["long", "b1"], ["long", "c1"]]


def test_an_unfinished_call_of_a_lockstep_turn_is_not_held_for_its_turn_mates():
    """A lockstep turn's call answered UNFINISHED comes back in its turn (its next parts take the turn's calls
    not yet served, none of another), but the pass for its next part does not wait for turn-mates: those it
    shared its first pass with have their answers."""
    results, passes = run_held(Batching(max_batch=2, turn_wait=1.0), [("l", "long"), ("a", "a1"), ("c", "c1")],
                               [("b", "b1")], turn=(1, 3))
    assert results == ["long", "a1", "c1", "b1"]
    assert passes == [["long", "a1"], ["long", "c1"], ["long"], ["b1"]]
    batcher = Batcher(ModelThread(), lambda calls: calls, Batching(turn_wait=1.0))
    part = Waiting("l", "long", None, None, 1, 3)
    future = type("Pending", (), {"done": lambda self: False})()
    batcher.waiting.append(part._replace(future=future, again=True))
    assert isinstance(batcher.ready(now=0.0), list)  # taken at once
    batcher.waiting.append(part._replace(future=future))
    assert batcher.ready(now=0.0) == 1.0  # a turn's first call waits for its mates


def test_the_target_service_feeds_long_prompts_in_parts(runner):
    """--prefill-chunk reaches the engine, and the target servicer's passes take its parts."""
    from target_service.__main__ import make_engine, parse_args
    from target_service.servicer import TargetServicer

    assert parse_args([]).prefill_chunk == "auto"
    assert make_engine(lambda: runner, 16).prefill_chunk == prefill_chunk_for(runner.device) == PREFILL_CHUNK["cpu"]
    for bad in ("-1", "half", ""):
        with pytest.raises(SystemExit):
            parse_args(["--prefill-chunk", bad])
    servicer = TargetServicer(ModelThread())
    servicer.engine = make_engine(lambda: runner, 16, parse_args(["--prefill-chunk", "8"]).prefill_chunk)
    servicer.engine.verify(start("served-step", PROMPT[:5]))
    results = servicer.run_many([start("served-long"), step("served-step")])
    assert results[0] is UNFINISHED and runner.sessions.get("served-long").cached == 8
    assert results[1][0].accepted == 0
    for session_id in ("served-long", "served-step"):
        runner.sessions.release(session_id)


def test_auto_takes_a_part_of_about_the_same_time_whatever_the_model(runner):
    """auto: a part's pass ~PREFILL_PART_MS at the calibrated cost of a token (int4 SmolLM2 on 2 CPU cores,
    ~0.65 ms a token: 128), its fixed cost at most a tenth of it, within PREFILL_CHUNK_RANGE; by the device
    where no pass was timed."""
    from model_service.batcher import PREFILL_CHUNK_RANGE
    from speculative.protocol import PassCost

    assert prefill_chunk_for("cpu", 0.65, 5.4) == 128 and prefill_chunk_for("cpu", 1.5) == 48
    assert prefill_chunk_for("cpu", 1.07, 20.5) == 160  # (a pass's fixed cost at most a tenth of it)
    assert prefill_chunk_for("cuda:0", 8.0) == PREFILL_CHUNK_RANGE[0]
    assert prefill_chunk_for("cuda:0", 1e-4) == PREFILL_CHUNK_RANGE[1]
    assert prefill_chunk_for("cuda:0") == PREFILL_CHUNK["cuda"] and prefill_chunk_for("cpu") == PREFILL_CHUNK["cpu"]
    timed, runner.pass_cost = runner.pass_cost, PassCost(5.0, 0.3)
    try:
        assert TargetEngine(runner).prefill_chunk == 288 and TargetEngine(runner, prefill_chunk=0).prefill_chunk == 0
    finally:
        runner.pass_cost = timed


def test_a_session_released_in_the_middle_of_its_parts_keeps_no_cache_for_reuse(pair):
    """A cache kept for prefix reuse holds rows its answers carried; one released between its parts does not."""
    engine = TargetEngine(ModelRunner(pair[1], prefix_cache_mb=64), prefill_chunk=8)
    prompt = [(7 * i) % 200 + 5 for i in range(40)]
    call = start("halfway", prompt)
    for _ in range(3):  # 24 positions cached (at least MIN_REUSE)
        assert engine.verify_many([call], lambda: True, in_parts=True)[0] is UNFINISHED
    engine.release("halfway")
    assert engine.verify(start("after-halfway", prompt))[0].cached == 0
    engine.release("after-halfway")  # (whole: kept)
    assert engine.verify(start("after-whole", prompt))[0].cached > 0
    engine.release("after-whole")


def test_a_pass_with_a_part_does_not_decode_on(runner):
    """A call asking to decode several tokens gets its first only while a long prompt's part shares its pass
    (the part's next pass comes first); alone it decodes on."""
    engine = TargetEngine(runner, prefill_chunk=8)
    engine.verify(start("on", PROMPT[:5]))
    steps = VerifyCall("on", False, [], Proposal(), GREEDY, steps=4)
    results = engine.verify_many([start("part", steps=4), steps], lambda: False, in_parts=True)
    assert results[0] is UNFINISHED and results[1][0].decoded == []
    assert len(engine.verify_many([VerifyCall("on", False, [], Proposal(), GREEDY, steps=4)],
                                  lambda: False, in_parts=True)[0][0].decoded) == 3
    for session_id in ("on", "part"):
        runner.sessions.release(session_id)


@pytest.mark.parametrize("params", [GREEDY, SamplingParams(0.9, seed=5)], ids=["greedy", "sampled"])
def test_a_constrained_prompt_in_parts_decodes_as_one_pass(runner, params):
    """A start with a structured-output constraint, decoding on (steps) and sampled or greedy: its parts
    leave its mask, its draws and its decoded tokens as feeding it whole does."""
    from speculative.protocol import Constraint

    got = []
    for session_id, chunk in (("ruled-whole", 0), ("ruled-parts", 8)):
        engine = TargetEngine(runner, prefill_chunk=chunk)
        call = VerifyCall(session_id, True, PROMPT, Proposal(), params, steps=4,
                          constraint=Constraint("regex", r"[0-9]{2,6}", len(PROMPT)))
        verdict, _ = engine.verify_many([call], lambda: False, in_parts=True)[0]  # (its parts go on in the call)
        got.append([verdict.token, *verdict.decoded])
        runner.sessions.release(session_id)
    tokenizer = runner.tokenizer
    assert got[0] == got[1] and len(got[0]) >= 2 and tokenizer.decode(got[0], skip_special_tokens=True).isdigit()
