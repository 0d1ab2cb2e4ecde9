"""The fault matrix: a draft or a target service (the lone one of its kind, or one of two) killed,
hung or restarted at the same address, at each moment of a round, with the coordinator calling
its models over streams, unary calls or lockstep batches. No request is lost or changed:

- greedy output is token for token the faultless run's; a sampled request goes on and its count
  of tokens adds up (its tokens after a lost target session are drawn afresh: coordinator/failover.py);
- the lone target killed or hung fails its requests with UNAVAILABLE naming it, the tokens
  streamed before staying valid, and the coordinator serves again as soon as it is back.

Moments (the coordinator's fault hook, coordinator/peers.py, holds the call while the strike lands):
  prefill  the call that starts a session (it carries the prompt) has been sent, its answer awaited
  write    a later call of the session is about to be sent
  read     a later call has been sent, its answer awaited
  between  a later call has been answered: the strike lands between two rounds
  idle     between two requests

The default `make test` runs DEFAULT (the cells the issue saw fail, and one of each kind of
expectation); the rest is slow-marked (`make test-all`).
"""

from __future__ import annotations

import itertools

import grpc
import pytest

from specdec.v1 import specdec_pb2 as pb

from .conftest import NEW_TOKENS, FaultStack

VICTIMS = ["draft", "target"]
REPLICAS = [1, 2]
PATHS = ["stream", "unary", "lockstep"]
MOMENTS = {  # -> (point, whether the call starts its session, which such call)
    "prefill": ("read", True, 1),
    "write": ("write", False, 3),
    "read": ("read", False, 3),
    "between": ("done", False, 3),
    "idle": None,
}
FAULTS = ["kill", "stop", "restart"]
DEFAULT = {
    ("draft", 1, "stream", "between", "kill"),   # issue 27: the write on a finished stream
    ("draft", 1, "stream", "read", "stop"),      # a hung draft gives way
    ("target", 1, "stream", "read", "kill"),     # UNAVAILABLE, then served again
    ("target", 1, "stream", "prefill", "restart"),
    ("draft", 1, "unary", "write", "restart"),
    ("target", 1, "lockstep", "between", "stop"),
}


def cells():
    # grouped by stack (replicas, path): each stack starts once
    for replicas, path, victim, moment, fault in itertools.product(REPLICAS, PATHS, VICTIMS, MOMENTS, FAULTS):
        cell = (victim, replicas, path, moment, fault)
        marks = [] if cell in DEFAULT else [pytest.mark.slow]
        yield pytest.param(*cell, marks=marks, id=f"{victim}-{'lone' if replicas == 1 else 'one_of_two'}-{path}-"
                                                 f"{moment}-{fault}")


def lost_for_good(victim: str, replicas: int, fault: str) -> bool:
    """Whether the requests must fail: their only target is gone (killed, or hung past the call deadline)."""
    return victim == "target" and replicas == 1 and fault != "restart"


def check_lost(o, address: str, reference: list[int]) -> None:
    """UNAVAILABLE naming the target; what was streamed before stays valid."""
    assert o.error is not None and o.error.code() == grpc.StatusCode.UNAVAILABLE, o.error
    assert f"target service at {address}" in o.error.details(), o.error.details()
    if o.greedy:
        assert o.tokens == reference[: len(o.tokens)]


def check_served(o, reference: list[int]) -> None:
    """Greedy: the faultless tokens; sampled: the count adds up."""
    assert o.error is None, f"{o.error.code()}: {o.error.details()}"
    assert o.last.stats.generated_tokens == len(o.tokens)
    assert len(o.tokens) == NEW_TOKENS or o.last.finish_reason == pb.FINISH_REASON_EOS
    if o.greedy:
        assert o.tokens == reference


@pytest.mark.parametrize("victim, replicas, path, moment, fault", cells())
def test_fault(stacks, victim, replicas, path, moment, fault):
    fs: FaultStack = stacks.get(replicas, path)
    fs.settle()
    if MOMENTS[moment] is None:  # idle: the strike lands between two requests
        address = fs.stack.addresses[victim]
        fs.strike(fault, address)
    else:
        point, start, nth = MOMENTS[moment]
        fs.hook.arm(victim, point, start, nth, lambda address: fs.strike(fault, address))
    try:
        outcomes = fs.run()
    finally:
        fs.hook.disarm()
    if MOMENTS[moment] is not None:
        address = fs.hook.struck
        assert address, f"the {moment} moment of a {victim} call never came"
        assert fs.hook.done.wait(60) and not fs.hook.errors, fs.hook.errors
    for o in outcomes:
        if lost_for_good(victim, replicas, fault):
            check_lost(o, address, fs.reference)
        elif victim == "target" and replicas == 1 and o.error is not None:
            # restarted: the held call meets the new service, but a call already sent to the old one
            # fails, and its request then finds no target until the new one serves
            check_lost(o, address, fs.reference)
        else:
            check_served(o, fs.reference)
    if victim == "target" and replicas == 1 and fault == "restart":
        assert any(o.error is None for o in outcomes), "the held call's request failed too"
    fs.heal(fault, address)
    if lost_for_good(victim, replicas, fault):  # served again as soon as the target is back, no restart
        again = fs.stream(fs.requests()[0])
        assert again.error is None and again.tokens == fs.reference, again.error
    fs.settle()  # and nothing is left held anywhere
