"""A late draft gives way (coordinator/failover.py): the lone draft hung (SIGSTOP) mid-stream, with
the coordinator's default per-call deadline (60 s). The stream completes with the faultless
tokens at about the target-alone rate: the round waits the draft's bound (a few times its recent
calls' 99th percentile, at least 50 ms), not the deadline, once: then the request leaves the hung
draft alone; a request started while the draft still hangs is not held up either."""

from __future__ import annotations

import signal
import time

from coordinator import failover
from specdec.v1 import specdec_pb2 as pb

from .conftest import PROMPT, FaultStack

NEW_TOKENS = 120
# over the target-alone time: a bound waited (a few times a draft call's time) and a loaded
# machine's noise; a round that waited the call's deadline (60 s) is far past it
SLACK_S = 15.0


def draft_calls(moments) -> int:
    """Calls to the draft among the fault hook's moments (one `write` each)."""
    return sum(1 for role, point, _ in moments if role == "draft" and point == "write")


def test_a_hung_lone_draft_costs_no_more_than_the_target_alone(pair):
    fs = FaultStack(pair, 1, "stream", call_timeout=60.0)
    draft = fs.stack.procs["draft"]
    try:
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0)
        alone = fs.stream(pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=NEW_TOKENS, temperature=0.0,
                                             num_speculative_tokens=0))
        assert alone.error is None and len(alone.tokens) == NEW_TOKENS
        fs.hook.arm("draft", "read", False, 3, lambda address: fs.strike("stop", address))
        hung = fs.stream(request)
        assert fs.hook.struck == fs.stack.addresses["draft"]
        heard = len(fs.hook.heard)
        again = fs.stream(request)  # the draft still hangs
        # after the strike each request meets the hung draft once at most (the struck call's answer
        # may have come before the stop landed), then leaves it alone: it waits no bound per round
        assert draft_calls(fs.hook.heard[fs.hook.struck_at + 1 : heard]) <= 1
        assert draft_calls(fs.hook.heard[heard:]) <= 1
        timings = f"target alone {alone.seconds:.2f} s, draft hung mid-stream {hung.seconds:.2f} s, " \
                  f"the next request {again.seconds:.2f} s"
        print(timings)
        for o in (hung, again):
            assert o.error is None and o.tokens == alone.tokens, o.error
            assert o.seconds < alone.seconds + SLACK_S, timings
    finally:
        draft.send_signal(signal.SIGCONT)
    try:
        fs.settle()  # the late answers dropped, their sessions released
    finally:
        fs.close()


HOLD_S = 1.5  # each held call's extra time: past its bound (~50 ms here; 1 s before a replica has 8 calls),
#               within a seeded request's patience (failover.PATIENT_BOUND, 10 s)


def test_a_seeded_request_keeps_its_output_through_a_draft_grown_slow(pair):
    """A draft late MISSES calls in a row (each answered, past its bound) is taken out for new requests;
    a seeded sampled request waiting on it keeps its session there, and so its output: one drafted
    elsewhere, or not at all, would draw other numbers."""
    fs = FaultStack(pair, 1, "stream", call_timeout=60.0)
    try:
        request = pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=NEW_TOKENS, temperature=1.0,
                                     seed=11, num_speculative_tokens=2, min_tokens=NEW_TOKENS)
        calm = fs.stream(request)
        assert calm.error is None and len(calm.tokens) == NEW_TOKENS
        held = []

        def hold(address: str) -> None:  # the hook answers this call's `read` moment HOLD_S late
            held.append(address)
            if len(held) < failover.MISSES:
                fs.hook.arm("draft", "read", False, 1, hold)
            time.sleep(HOLD_S)

        fs.hook.arm("draft", "read", False, 2, hold)
        slowed = fs.stream(request)
        assert len(held) == failover.MISSES
        assert slowed.error is None and slowed.tokens == calm.tokens
        assert slowed.last.stats.draft_tokens == calm.last.stats.draft_tokens  # it drafted every round, as before
    finally:
        fs.hook.disarm()
    try:
        fs.settle()
    finally:
        fs.close()
