"""Losing a replica mid-request: a draft replica killed mid-stream, then a target replica killed
mid-stream (two of each to start with). The streams go on without an error and the greedy output
is token for token what a stack that lost nothing produces."""

from __future__ import annotations

import signal

import grpc
import pytest

from coordinator.launch import LocalStack
from coordinator.pool import Pool, Replica
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.faults.hook import FaultHook, hooked_stack, wait_until

PROMPT = [5, 17, 42, 9, 100, 3]
REQUEST = dict(prompt_token_ids=PROMPT, max_new_tokens=120, temperature=0.0, num_speculative_tokens=1)
# the request's call to its victim that meets the kill: the 5th after the session's start, of the
# 60 or more a 120-token request makes at K = 1 (one draft and one target call a round)
STRUCK_CALL = 5


@pytest.fixture(scope="module")
def cluster(pair):
    with hooked_stack(pair, draft_replicas=2, target_replicas=2) as made:
        yield made


def arm_kill(stack: LocalStack, hook: FaultHook, role: str) -> None:
    """Kill (SIGKILL) the `role` replica the next request is on while its STRUCK_CALL-th call
    there after the session's start is sent and its answer awaited: the coordinator holds the call
    until the kill is over, so the request meets it mid-stream however fast or slow the machine."""

    def kill(address: str) -> None:
        proc = stack.procs[next(name for name, a in stack.addresses.items() if a == address)]
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)

    hook.arm(role, "read", False, STRUCK_CALL, kill)


def struck(hook: FaultHook) -> str:
    """The address the armed kill struck (it must have)."""
    hook.disarm()
    assert hook.struck, "the armed moment never came: the request ended before its call"
    assert hook.done.wait(60) and not hook.errors, hook.errors
    return hook.struck


@pytest.mark.parametrize("role", ["draft", "target"])
def test_a_replica_killed_mid_stream_costs_nothing(cluster, stack, role):
    hooked, hook = cluster
    with grpc.insecure_channel(stack.addr) as channel:
        expected = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(**REQUEST)).token_ids)
    with grpc.insecure_channel(hooked.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        arm_kill(hooked, hook, role)
        chunks = list(stub.GenerateStream(pb.GenerateRequest(**REQUEST), timeout=120))  # no error: moved on
        victim = struck(hook)
        tokens = [t for chunk in chunks for t in chunk.token_ids]
        assert tokens == expected and chunks[-1].stats.generated_tokens == len(expected)
        log = hooked.logs["coordinator"].read_text()
        # the coordinator met the kill: a failed call (a draft's may instead run past its bound: late)
        assert f"{role} call failed" in log or f"{role} replica {victim} is late" in log, log[-3000:]

        def state() -> str:
            return {r.address: r.state for r in stub.GetInfo(pb.GetInfoRequest()).replicas}[victim]

        wait_until("the killed replica taken out", lambda: state() != "serving")
        # the next request goes to the replica left
        again = stub.Generate(pb.GenerateRequest(**REQUEST), timeout=120)
        assert list(again.token_ids) == expected


def test_a_sampled_request_survives_its_target(pair, stack):
    """Sampling through a target loss: the stream goes on, what was sent before the kill is what a
    faultless run with the same seed sends, and the count adds up (no token lost or repeated).
    After the loss the new target session is seeded afresh: the rest is target-distributed, but
    not token for token the faultless run's."""
    sampled = dict(REQUEST, temperature=1.0, top_p=0.95, seed=7)
    with grpc.insecure_channel(stack.addr) as channel:
        faultless = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(**sampled)).token_ids)
    with hooked_stack(pair, target_replicas=2) as (two, hook), grpc.insecure_channel(two.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        arm_kill(two, hook, "target")
        chunks = list(stub.GenerateStream(pb.GenerateRequest(**sampled), timeout=120))
        struck(hook)
        before = list(chunks[0].token_ids)  # the start's verdict, answered before the struck call was sent
        tokens = [t for chunk in chunks for t in chunk.token_ids]
        assert before and before == faultless[: len(before)]
        assert chunks[-1].stats.generated_tokens == len(tokens)
        assert len(tokens) == sampled["max_new_tokens"] or chunks[-1].finish_reason == pb.FINISH_REASON_EOS
        assert "target call failed" in two.logs["coordinator"].read_text()


def test_a_draft_lost_on_a_pre_draft_costs_nothing(pair):
    """In one process: the draft replica a --predraft request is on fails (UNAVAILABLE) on a
    pre-draft call, which drafts on from proposals the target has not verified yet. The request
    moves to the other replica without carrying those proposals as its prompt (the next round's
    rollback would reach past what the new session proposed: INVALID_ARGUMENT) and decodes what a
    faultless run decodes."""
    import asyncio

    from coordinator.failover import FailoverDraft, FailoverTarget
    from coordinator.peers import PeerError
    from model_service.engines import DraftEngine, TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from model_service.model_runner import ModelRunner
    from speculative.round import generate
    from speculative.protocol import SamplingParams

    draft_dir, target_dir = pair  # a draft that mostly disagrees: rounds roll proposals back

    class Flaky(LocalDraft):
        def __init__(self, address: str, fail_on: int | None):
            super().__init__(DraftEngine(ModelRunner(draft_dir)))
            self.address, self.name, self.pre_drafts, self.fail_on = address, "draft", 0, fail_on

        async def propose(self, call, *, turn=(0, 0)):
            if not call.start and not call.rollback and not call.append:
                self.pre_drafts += 1
                if self.pre_drafts == self.fail_on:
                    raise PeerError(self, grpc.StatusCode.UNAVAILABLE, "killed")
            return await super().propose(call)

    target = LocalTarget(TargetEngine(ModelRunner(target_dir)))
    target.address, target.name = "t0", "target"

    async def run(fail_on: int | None) -> list[int]:
        replicas = [Flaky("d0", fail_on), Flaky("d1", None)]
        out = []
        async for new in generate(FailoverDraft(local_pool("draft", replicas)),
                                  FailoverTarget(local_pool("target", [target])),
                                  PROMPT, max_new_tokens=60, k=3, params=SamplingParams(0.0), max_context=512,
                                  predraft=True, max_call_tokens=16):
            out += new
        # the replica it left still held its session (a failed unary call frees nothing): released too
        assert [len(r.engine.runner.sessions) for r in replicas] == [0, 0]
        return out

    expected = asyncio.run(run(None))
    assert len(expected) == 60
    for fail_on in (1, 2, 5):
        assert asyncio.run(run(fail_on)) == expected


@pytest.mark.parametrize("after_chunks", [2])
def test_the_lone_draft_killed_mid_stream_falls_back_to_the_target(pair, stack, after_chunks):
    """One draft replica, SIGKILLed while a greedy stream runs (its next call is a write on a
    stream whose RPC has ended): the stream goes on, target alone, and its tokens are the same."""
    draft, target = pair
    with grpc.insecure_channel(stack.addr) as channel:
        expected = list(pb_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(**REQUEST)).token_ids)
    lone = LocalStack(draft, target).start()
    try:
        with grpc.insecure_channel(lone.addr) as channel:
            stub = pb_grpc.GenerationStub(channel)
            stream = stub.GenerateStream(pb.GenerateRequest(**REQUEST), timeout=120)
            head = [next(stream) for _ in range(after_chunks)]
            lone.procs["draft"].send_signal(signal.SIGKILL)
            lone.procs["draft"].wait(10)
            rest = list(stream)  # no error: a draft is never needed for the answer
            tokens = [t for chunk in head + rest for t in chunk.token_ids]
            assert tokens == expected and rest[-1].stats.generated_tokens == len(expected)
            again = stub.Generate(pb.GenerateRequest(**REQUEST), timeout=120)  # served by the target alone
            assert list(again.token_ids) == expected and again.stats.draft_tokens == 0
    finally:
        lone.stop()


class LocalPool(Pool):
    """A pool of in-process peers: no health checks, a replica is healthy until the failover says not."""

    async def refresh(self, resolve: bool = True) -> None:
        pass


def local_pool(name: str, peers, late_floor: float | None = None) -> Pool:
    """A pool of in-process peers, every one healthy (`late_floor`: the pool's, as --draft-late-floor sets it)."""
    made = LocalPool(name, "127.0.0.1:1", lambda address, server_name: None, late_floor=late_floor)
    for peer in peers:
        peer.info = None
        made.replicas[peer.address] = Replica(peer, made.late_floor)
        made.replicas[peer.address].healthy = True
    return made


def test_a_late_draft_gives_way(pair):
    """In one process: the lone draft replica stops answering mid-generation (its call never
    returns). The round goes on at the replica's bound with a plain target step and the output is
    what a faultless run decodes, without waiting for the call; the request leaves the replica
    alone while it owes the answer. When the answer comes it is dropped and the session it was
    for released. A replica late three requests in a row is taken out of the pool."""
    import asyncio

    from coordinator.failover import FORGETTING, MISSES, FailoverDraft, FailoverTarget
    from model_service.engines import DraftEngine, TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from model_service.model_runner import ModelRunner
    from speculative.protocol import SamplingParams
    from speculative.round import Stats, generate

    draft_dir, target_dir = pair

    class Hanging(LocalDraft):
        """Answers its first `answered` calls, then none until `wake` is set."""

        def __init__(self, answered: int | None):
            super().__init__(DraftEngine(ModelRunner(draft_dir)))
            self.address, self.name, self.answered, self.calls = "d0", "draft", answered, 0
            self.wake = asyncio.Event()

        async def propose(self, call, *, turn=(0, 0)):
            self.calls += 1
            if self.answered is not None and self.calls > self.answered:
                await self.wake.wait()
            return await super().propose(call)

    target = LocalTarget(TargetEngine(ModelRunner(target_dir)))
    target.address, target.name = "t0", "target"
    # only the hung calls late: a tiny model's answered call is ~1-3 ms, but one caught by a loaded machine's
    # stall could pass the 50 ms floor and count as a miss of its own
    floor = 0.5

    async def run(draft: Hanging, pools=None) -> tuple[list[int], Stats]:
        draft_pool, target_pool = pools or (local_pool("draft", [draft], floor), local_pool("target", [target]))
        out, stats = [], Stats()
        failover = FailoverDraft(draft_pool)
        async for new in generate(failover, FailoverTarget(target_pool), PROMPT, max_new_tokens=60, k=3,
                                  params=SamplingParams(0.0), max_context=512, stats=stats):
            out += new
        failover.close()
        return out, stats

    async def go():
        expected, _ = await run(Hanging(None))
        # 12 calls answered: the replica's bound is now its own (4 x p99, at least the floor), not the first 1 s
        hung = Hanging(12)
        pools = local_pool("draft", [hung], floor), local_pool("target", [target])
        # (the 13th call's answer never comes before `wake`: a run that waited for it would not end)
        tokens, stats = await asyncio.wait_for(run(hung, pools), 120)
        assert tokens == expected and len(expected) == 60
        assert hung.calls == 13  # one late call (one bound waited), then the request left the replica alone
        assert stats.draft_calls >= 12
        replica = pools[0].replicas["d0"]
        assert replica.missed == 1 and replica.healthy
        hung.wake.set()  # the late answer comes: dropped, its session released
        await asyncio.gather(*FORGETTING)
        assert len(hung.engine.runner.sessions) == 0 and len(target.engine.runner.sessions) == 0

        # late at every start: three requests in a row take the replica out; the next goes without it
        stuck = Hanging(0)
        pools = local_pool("draft", [stuck], floor), local_pool("target", [target])
        replica = pools[0].replicas["d0"]
        replica.recent.starts.extend([1e-4] * replica.recent.MIN_CALLS)  # a history: bound the floor
        for i in range(MISSES):
            assert replica.healthy
            tokens, stats = await asyncio.wait_for(run(stuck, pools), 120)
            assert tokens == expected and stats.draft_tokens == 0
        assert not replica.healthy and replica.missed == MISSES and stuck.calls == MISSES
        stuck.wake.set()
        await asyncio.gather(*FORGETTING)
        assert len(stuck.engine.runner.sessions) == 0

    asyncio.run(go())


def test_a_request_replaying_its_seed_waits_for_a_late_draft(pair):
    """A sampled request under a fixed K draws its tokens from its seed and the proposals: one whose round
    went on without a late draft call would give another output under load than alone. Such a request
    (patient) waits for the call (up to PATIENT_BOUND) and gives the faultless run's tokens; the replica
    is not counted late."""
    import asyncio

    from coordinator.failover import FORGETTING, FailoverDraft, FailoverTarget
    from model_service.engines import DraftEngine, TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from model_service.model_runner import ModelRunner
    from speculative.protocol import SamplingParams
    from speculative.round import generate

    draft_dir, target_dir = pair

    class Slow(LocalDraft):
        """Answers its 13th call late (past its bound of ~50 ms), if `late`: a second after it came, or, `held`,
        once `wake` is set."""

        def __init__(self, late: bool, held: bool):
            super().__init__(DraftEngine(ModelRunner(draft_dir)))
            self.address, self.name, self.calls, self.late, self.held = "d0", "draft", 0, late, held
            self.wake = asyncio.Event()

        async def propose(self, call, *, turn=(0, 0)):
            self.calls += 1
            if self.calls == 13 and self.late:
                if not self.held:
                    asyncio.get_running_loop().call_later(1.0, self.wake.set)
                await self.wake.wait()
            return await super().propose(call)

    target = LocalTarget(TargetEngine(ModelRunner(target_dir)))
    target.address, target.name = "t0", "target"

    async def run(patient: bool, late: bool = True, held: bool = False) -> tuple[list[int], object]:
        draft_pool = local_pool("draft", [Slow(late, held)])
        draft = FailoverDraft(draft_pool, patient=patient)
        out = []
        async for new in generate(draft, FailoverTarget(local_pool("target", [target])), PROMPT, max_new_tokens=60,
                                  k=3, params=SamplingParams(0.9, seed=7), max_context=512):
            out += new
        draft.close()
        return out, draft_pool.replicas["d0"]

    async def go():
        expected, _ = await run(patient=False, late=False)
        tokens, replica = await asyncio.wait_for(run(patient=True), 120)
        assert tokens == expected and replica.peer.calls > 13 and replica.healthy
        # waited for, and late all the same in the replica's record: the bound it missed, not the second it took
        assert max(replica.recent.steps) < 0.5
        # held until the request has ended: an answer that came while it ran on (its rest taking over a second on a
        # loaded machine) would let it draft again, an on-time call resetting the count
        hasty, replica = await asyncio.wait_for(run(patient=False, held=True), 120)
        assert replica.missed == 1  # (the same call, late for a request that does not replay)
        replica.peer.wake.set()  # the late answer comes: dropped, its session released
        await asyncio.gather(*FORGETTING)

    asyncio.run(go())


def test_which_requests_wait_for_a_late_draft():
    from types import SimpleNamespace

    from coordinator.adaptive import AcceptanceK, AdaptiveK
    from coordinator.generation import patient
    from speculative.protocol import SamplingParams
    from speculative.round import FixedK

    def plan(policy, temperature):
        return SimpleNamespace(policy=policy, params=SamplingParams(temperature))

    adaptive = AdaptiveK.__new__(AdaptiveK)  # (its class's replays is what is read)
    assert patient(plan(FixedK(4), 0.8), gated=False)  # sampled, a fixed K: replays from its seed
    assert patient(plan(AcceptanceK(8), 0.8), gated=False)  # a seeded sampled request under adaptive K
    assert not patient(plan(FixedK(4), 0.0), gated=False)  # greedy: its output does not depend on drafts
    assert not patient(plan(adaptive, 0.8), gated=False)  # unseeded adaptive: K follows the load anyway
    assert not patient(plan(FixedK(4), 0.8), gated=True)  # a call held in the lockstep gate holds everyone


def test_a_draft_with_no_room_is_left_alone_not_the_request_failed(pair, monkeypatch):
    """A draft replica whose sessions are all in use answers a start RESOURCE_EXHAUSTED: drafting is
    optional, so the request drafts on another replica, or goes on without drafts and asks the full
    one again only after FULL_WAIT; its output is what a faultless run decodes. (It failed the request.)"""
    import asyncio

    import grpc

    from coordinator import failover
    from coordinator.failover import FailoverDraft, FailoverTarget
    from coordinator.peers import PeerError
    from model_service.engines import DraftEngine, TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from model_service.model_runner import ModelRunner
    from speculative.protocol import SamplingParams
    from speculative.round import Stats, generate

    draft_dir, target_dir = pair
    monkeypatch.setattr(failover, "FULL_WAIT", 3600.0)  # (no second try within a run, however slow the machine)

    class Draft(LocalDraft):
        def __init__(self, address: str, full: bool):
            super().__init__(DraftEngine(ModelRunner(draft_dir)))
            self.address, self.name, self.full, self.calls = address, "draft", full, 0

        async def propose(self, call, *, turn=(0, 0)):
            self.calls += 1
            if self.full:
                raise PeerError(self, grpc.StatusCode.RESOURCE_EXHAUSTED, "all 1 sessions are in use")
            return await super().propose(call)

    target = LocalTarget(TargetEngine(ModelRunner(target_dir)))
    target.address, target.name = "t0", "target"

    async def run(*drafts: Draft) -> tuple[list[int], Stats]:
        out, stats = [], Stats()
        draft = FailoverDraft(local_pool("draft", drafts))
        async for new in generate(draft, FailoverTarget(local_pool("target", [target])), PROMPT, max_new_tokens=40,
                                  k=3, params=SamplingParams(0.0), max_context=512, stats=stats):
            out += new
        draft.close()
        return out, stats

    async def go():
        expected, clean = await run(Draft("d0", False))
        assert clean.draft_tokens > 0
        full = Draft("d1", True)
        tokens, stats = await run(full)
        assert tokens == expected and stats.draft_tokens == 0 and full.calls == 1
        full, room = Draft("d1", True), Draft("d2", False)
        tokens, stats = await run(full, room)
        assert tokens == expected and stats.draft_tokens > 0 and full.calls <= 1 and room.calls > 1

    asyncio.run(go())


def test_a_target_with_no_room_for_a_start_passes_it_to_another(pair, monkeypatch):
    """A target replica whose sessions are all in use (another coordinator's, say) refuses a start
    RESOURCE_EXHAUSTED: the start goes to a replica with room, and the request's output is what a faultless
    run decodes; the refusal stands (429 over HTTP) only where no replica has room. (It failed the request.)"""
    import asyncio

    from coordinator import failover
    from coordinator.failover import FailoverDraft, FailoverTarget
    from coordinator.peers import PeerError
    from model_service.engines import DraftEngine, TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from model_service.model_runner import ModelRunner
    from speculative.protocol import SamplingParams
    from speculative.round import generate

    draft_dir, target_dir = pair
    draft = LocalDraft(DraftEngine(ModelRunner(draft_dir)))
    draft.address, draft.name = "d0", "draft"

    class Target(LocalTarget):
        def __init__(self, address: str, full: bool):
            super().__init__(TargetEngine(ModelRunner(target_dir)))
            self.address, self.name, self.full, self.starts = address, "target", full, 0

        async def verify(self, call, *, turn=(0, 0)):
            self.starts += call.start
            if self.full and call.start:
                raise PeerError(self, grpc.StatusCode.RESOURCE_EXHAUSTED, "all 2 sessions are in use; retry later")
            return await super().verify(call)

    async def run(*targets: Target) -> list[int]:
        out, failover_draft = [], FailoverDraft(local_pool("draft", [draft]))
        failover_target = FailoverTarget(local_pool("target", targets))
        try:
            async for new in generate(failover_draft, failover_target, PROMPT, max_new_tokens=24, k=3,
                                      params=SamplingParams(0.0), max_context=512):
                out += new
        finally:
            for failover in (failover_draft, failover_target):
                failover.close()
        return out

    async def go():
        expected = await run(Target("t0", False))
        full, room = Target("t1", True), Target("t2", False)
        for _ in range(3):  # whichever the pool leases first
            assert await run(full, room) == expected
        assert full.starts <= 3 and room.starts == 3
        with pytest.raises(PeerError) as refused:
            await run(Target("t3", True))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "sessions are in use" in refused.value.details
        # each full replica is asked once a start, however long its refusal takes (past FULL_WAIT here)
        monkeypatch.setattr(failover, "FULL_WAIT", 0.0)
        both = Target("t4", True), Target("t5", True)
        with pytest.raises(PeerError) as refused:
            await asyncio.wait_for(run(*both), 60)
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and [t.starts for t in both] == [1, 1]

    asyncio.run(go())


def test_the_late_bound_follows_the_replica():
    """A draft call is late past 4 x the 99th percentile of the replica's recent calls of its kind, at
    least 50 ms (the floor, --draft-late-floor); a start's bound grows with the prefix it carries; with no
    history yet, 1 s (or the floor where it is longer)."""
    from coordinator.pool import RecentLatency

    recent = RecentLatency()
    assert recent.bound(False, 0) == recent.bound(True, 500) == 1.0
    for i in range(100):
        recent.add(0.010 + (0.090 if i == 50 else 0.0), False, 0)  # one stall of 100 ms among 10 ms calls
        recent.add(0.002 * 20, True, 20)  # 2 ms per prefix token
    assert recent.bound(False, 0) == pytest.approx(0.05)  # 4 x 10 ms, raised to the floor: the stall is the 1 %
    recent.add(0.100, False, 0)
    assert recent.bound(False, 0) == pytest.approx(0.4)  # two stalls in a hundred: they are the 99th percentile
    assert recent.bound(True, 500) == pytest.approx(4 * 0.002 * 500)
    raised = RecentLatency(floor=2.0)  # (--draft-late-floor 2: the pool's replicas')
    assert raised.bound(False, 0) == 2.0
    for _ in range(100):
        raised.add(0.010, False, 0)
    assert raised.bound(False, 0) == 2.0 and RecentLatency(floor=0.01).bound(False, 0) == 1.0
    assert Replica(object(), late_floor=2.0).recent.bound(False, 0) == 2.0  # (a pool's late_floor, its replicas')


def test_a_release_on_a_hung_replica_is_made_again_once_it_serves(monkeypatch):
    """The release of a session left on a replica that hung (a stopped process: the call times out)
    waits for the replica's health check to pass again and is made once more, so the woken replica
    does not keep the session until its idle timeout. A replica removed from the pool meanwhile is
    let go."""
    import asyncio

    import coordinator.failover as failover
    from coordinator.failover import _Failover
    from coordinator.peers import PeerError
    from coordinator.pool import Replica

    monkeypatch.setattr(failover, "FORGET_POLL", 0.01)

    class Watched(Replica):
        """A replica whose health the release's wait reads: `looked` is set once it has read it thrice."""

        def __init__(self, peer):
            self.looks, self.looked = 0, asyncio.Event()
            super().__init__(peer)

        @property
        def healthy(self) -> bool:
            self.looks += 1
            if self.looks >= 3:
                self.looked.set()
            return self._healthy

        @healthy.setter
        def healthy(self, value: bool) -> None:
            self._healthy = value

    class Peer:
        address, name = "t0", "target"

        def __init__(self):
            self.hung, self.released, self.calls = True, [], 0

        async def release(self, session):
            self.calls += 1
            if self.hung:
                raise PeerError(self, grpc.StatusCode.DEADLINE_EXCEEDED, "no answer")
            self.released.append(session)

    async def go():
        peer = Peer()
        replica = Watched(peer)  # taken out of the pool by the failed call: not healthy
        forgetting = asyncio.ensure_future(_Failover._forget(replica, "s.1"))
        await asyncio.wait_for(replica.looked.wait(), 30)  # it waits for the health check, looking again and again
        assert not forgetting.done() and peer.calls == 1 and not peer.released  # ... and does not hammer
        peer.hung, replica.healthy = False, True  # woken up; its health check passes
        await asyncio.wait_for(forgetting, 30)
        assert peer.released == ["s.1"] and peer.calls == 2

        gone = Peer()
        replica = Watched(gone)
        forgetting = asyncio.ensure_future(_Failover._forget(replica, "s.2"))
        await asyncio.wait_for(replica.looked.wait(), 30)  # waiting for the health check
        replica.removed = True
        await asyncio.wait_for(forgetting, 30)
        assert gone.calls == 1 and not gone.released

    asyncio.run(go())


def holding(kind, peer) -> tuple[Replica, object]:
    """(a replica of `peer`, healthy, and a FailoverDraft or FailoverTarget (`kind`) holding session s.1 there)."""
    pool = Pool(peer.name, peer.address, lambda address, server_name: peer)
    replica = pool.replicas[peer.address] = Replica(peer)
    replica.healthy, replica.outstanding = True, 1
    made = kind(pool)
    made.replica, made.session = replica, "s.1"
    return replica, made


def test_a_release_that_fails_at_the_end_of_a_request_is_made_again(monkeypatch):
    """A request's own release at its end that fails (the replica too loaded to answer within the
    call's timeout) is made again in the background until it is answered, not left to the
    replica's idle timeout."""
    import asyncio

    import coordinator.failover as failover
    from coordinator.failover import FORGETTING, FailoverDraft
    from coordinator.peers import PeerError

    monkeypatch.setattr(failover, "FORGET_POLL", 0.01)

    class Peer:
        address, name = "d0", "draft"

        def __init__(self):
            self.refusals, self.released = 2, []

        async def release(self, session):
            if self.refusals:
                self.refusals -= 1
                raise PeerError(self, grpc.StatusCode.DEADLINE_EXCEEDED, "no answer in 10 s")
            self.released.append(session)

    async def go():
        peer = Peer()
        replica, draft = holding(FailoverDraft, peer)
        await draft.release("s")  # the first try fails: the request ends all the same
        assert replica.outstanding == 0 and draft.replica is None
        await asyncio.wait_for(asyncio.gather(*FORGETTING), 30)
        return peer

    peer = asyncio.run(go())
    assert peer.released == ["s.1"] and peer.refusals == 0


def test_a_request_ends_without_waiting_out_a_release_its_replica_does_not_answer(monkeypatch):
    """A request's release on a replica that does not answer (stopped: the call would wait its 10 s timeout) holds
    the request's end RELEASE_WAIT at most, not the call's timeout (a cancelled background response answered its
    cancel after 10 s); the release goes on in the background, where a stopping coordinator waits for it."""
    import asyncio

    import coordinator.failover as failover
    from coordinator.failover import FailoverTarget

    monkeypatch.setattr(failover, "RELEASE_WAIT", 0.01)

    class Peer:
        address, name = "t0", "target"

        def __init__(self):
            self.answer, self.released = asyncio.Event(), []

        async def release(self, session):
            await self.answer.wait()  # (hung until the test lets it answer)
            self.released.append(session)

    async def go():
        peer = Peer()
        replica, target = holding(FailoverTarget, peer)
        pool = target.pool
        await asyncio.wait_for(target.release("s"), 30)  # (before: it waited for the answer, which never came)
        [releasing] = pool.releasing
        assert target.replica is None and not peer.released and replica.outstanding == 1
        peer.answer.set()
        await asyncio.wait_for(releasing, 30)
        assert peer.released == ["s.1"] and replica.outstanding == 0

    asyncio.run(go())


def test_requests_that_fill_the_target_give_its_room_back_and_finish_as_alone(pair):
    """Two greedy requests (K = 2) on a target whose --max-kv-tokens holds either alone, not both: the
    one refused mid-request (RESOURCE_EXHAUSTED) gives its session's room back and starts it again
    once there is room; both decode what each decodes alone, and the cap holds throughout. A request's
    first start is refused at once (admission), and so is one that may not wait (a replaying or a gated
    one); while a request waits, new ones are refused; a replica with room is found among full ones."""
    import asyncio

    from coordinator.failover import FailoverDraft, FailoverTarget
    from coordinator.peers import PeerError
    from model_service.engines import DraftEngine, TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from model_service.model_runner import ModelRunner
    from speculative.errors import CapacityExceeded
    from speculative.protocol import Proposal, SamplingParams, VerifyCall
    from speculative.round import generate

    draft_dir, target_dir = pair
    cap = len(PROMPT) + 50

    class Capped(LocalTarget):
        """The service's answer to a full cache as gRPC gives it; the most tokens its sessions held."""

        def __init__(self, address: str = "t0"):
            super().__init__(TargetEngine(ModelRunner(target_dir)))
            self.engine.runner.max_kv_tokens = cap
            self.address, self.name, self.most, self.refused = address, "target", 0, []

        async def verify(self, call, *, turn=(0, 0)):
            try:
                return await super().verify(call)
            except CapacityExceeded as e:
                self.refused.append(call.start)
                raise PeerError(self, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e)) from e
            finally:
                self.most = max(self.most, sum(len(s.tokens) for s in self.engine.runner.sessions))

    def draft_pool():
        draft = LocalDraft(DraftEngine(ModelRunner(draft_dir)))
        draft.address, draft.name = "d0", "draft"
        return local_pool("draft", [draft])

    async def run(target_pool, prompt: list[int], wait: bool = True) -> list[int]:
        out = []
        async for new in generate(FailoverDraft(draft_pool()), FailoverTarget(target_pool, wait_for_room=wait),
                                  prompt, max_new_tokens=40, k=2, params=SamplingParams(0.0), max_context=512):
            out += new
        return out

    other = [7, 8, 9, 10, 11, 12]
    target = Capped()
    pool = local_pool("target", [target])

    async def go():
        alone = [await run(pool, PROMPT), await run(pool, other)]
        assert target.refused == []
        both = await asyncio.wait_for(asyncio.gather(run(pool, PROMPT), run(pool, other)), 120)
        return alone, both

    alone, both = asyncio.run(go())
    assert both == alone and len(alone[0]) == len(alone[1]) == 40
    assert False in target.refused and target.most <= cap  # (one gave its room back; the cap held)
    assert len(target.engine.runner.sessions) == 0 and pool.room_waiters == 0
    target.engine.verify(VerifyCall("holder", True, list(range(1, 40)), Proposal(), SamplingParams(0.0)))
    for wait in (True, False):  # no room for the prompt: refused at once (one call), as before
        target.refused.clear()
        with pytest.raises(PeerError) as refused:
            asyncio.run(run(pool, PROMPT * 3, wait))
        assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and target.refused == [True]
    target.refused.clear()
    with pytest.raises(PeerError) as refused:  # mid-request, a request that may not wait fails there
        asyncio.run(run(pool, PROMPT, wait=False))
    assert refused.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and target.refused == [False]
    pool.room_waiters = 1  # while a request waits for room, a new one is refused before any call
    target.refused.clear()
    with pytest.raises(PeerError, match="wait for room"):
        asyncio.run(run(pool, [3, 4]))
    assert target.refused == []
    pool.room_waiters = 0
    # two replicas, the one with fewer requests in flight full: a session given back starts on the other
    full, roomy = Capped("t1"), Capped("t2")
    full.engine.verify(VerifyCall("holder", True, list(range(1, cap - 2)), Proposal(), SamplingParams(0.0)))
    pair_pool = local_pool("target", [full, roomy])
    pair_pool.replicas["t2"].outstanding = 5  # (busier: acquire picks t1 first)
    waiting = FailoverTarget(pair_pool)
    waiting.gave_room = True
    verdict, _ = asyncio.run(asyncio.wait_for(waiting.verify(VerifyCall("r", True, PROMPT * 3, Proposal(),
                                                                        SamplingParams(0.0))), 5))
    assert full.refused == [True] and roomy.refused == [] and len(roomy.engine.runner.sessions) == 1


def test_sessions_started_after_output_seed_from_where_they_start(pair):
    """A sampled request whose target and draft sessions are lost mid-request starts each again seeded
    from the request's seed and the position it starts at: seeded as its first start was, it would draw
    again the numbers that drew the output so far. First starts keep the request's seed; the run with
    its faults at the same places is the same run."""
    import asyncio

    from model_service.engines import DraftEngine, TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from model_service.model_runner import ModelRunner
    from speculative.protocol import SamplingParams
    from speculative.round import SEED_STEP, SessionLost, generate

    draft_dir, target_dir = pair

    def losing(base, lose: int):
        class Losing(base):
            """Loses its session at its `lose`-th call; records the starts' (position, seed)."""

            def __init__(self, engine):
                super().__init__(engine)
                self.calls, self.starts = 0, []

            async def _once(self, call, answer):
                self.calls += 1
                if call.start:
                    self.starts.append((len(call.append), call.params.seed))
                if self.calls == lose:
                    self.engine.release(call.session_id)
                    raise SessionLost(call.session_id)
                return await answer(call)

        return Losing

    class Target(losing(LocalTarget, 4)):
        async def verify(self, call, *, turn=(0, 0)):
            return await self._once(call, super().verify)

    class Draft(losing(LocalDraft, 6)):
        async def propose(self, call, *, turn=(0, 0)):
            return await self._once(call, super().propose)

    def run(seed: int):
        target, draft = Target(TargetEngine(ModelRunner(target_dir))), Draft(DraftEngine(ModelRunner(draft_dir)))

        async def go():
            out = []
            async for new in generate(draft, target, PROMPT, max_new_tokens=30, k=2,
                                      params=SamplingParams(1.0, seed=seed), max_context=512):
                out += new
            return out

        return asyncio.run(go()), target.starts, draft.starts

    out, target_starts, draft_starts = run(11)
    for starts in (target_starts, draft_starts):
        assert len(starts) == 2 and starts[0] == (len(PROMPT), 11) and starts[1][0] > len(PROMPT)
        assert starts[1][1] == (11 + SEED_STEP * starts[1][0]) % 2**64
    assert run(11)[0] == out and len(out) == 30


def test_a_request_waiting_for_room_pauses_once_every_replica_refused(monkeypatch):
    """A session given back with every replica full: each replica is tried once, then a pause (doubling)
    before each is tried again, until ROOM_WAIT; refusals slower than the pause do not make it spin.
    Nothing of the wait is left after it (the pool's count of waiting requests, the replicas' marks).
    On the failover's own clock, which the replicas' answers and its pauses move (no time passes)."""
    import asyncio
    from types import SimpleNamespace

    import coordinator.failover as failover
    from coordinator.failover import FailoverTarget
    from coordinator.peers import PeerError
    from speculative.errors import ROOM_LATER
    from speculative.protocol import Proposal, SamplingParams, VerifyCall

    clock, pauses, real_sleep = [0.0], [], asyncio.sleep

    async def pause(seconds: float) -> None:
        clock[0] += seconds
        pauses.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(failover, "ROOM_WAIT", 0.5)
    monkeypatch.setattr(failover, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    monkeypatch.setattr(failover, "asyncio", SimpleNamespace(**{**vars(asyncio), "sleep": pause}))

    class Full:
        """A replica whose sessions fill its cap, answering each call in 30 ms (above the first pause)."""

        def __init__(self, address: str):
            self.address, self.name, self.calls = address, "target", 0

        async def verify(self, call, *, turn=(0, 0)):
            self.calls += 1
            clock[0] += 0.03  # (its service time)
            raise PeerError(self, grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"the sessions would hold 9 tokens, beyond this service's cap of 8 {ROOM_LATER}")

        async def release(self, session_id):
            pass

    replicas = [Full("t1"), Full("t2")]
    pool = local_pool("target", replicas)
    waiting = FailoverTarget(pool)
    waiting.gave_room = True

    async def go():
        with pytest.raises(PeerError) as refused:
            await waiting.verify(VerifyCall("r", True, [1, 2], Proposal(), SamplingParams(0.0)))
        return refused.value

    refused = asyncio.run(go())
    assert ROOM_LATER in refused.details and pool.room_waiters == 0 and not waiting.full
    # t1 0.03, t2 0.06, pause 0.02; 0.11, 0.14, pause 0.04; 0.21, 0.24, pause 0.08; t1 0.35: 0.35 + 0.16 > 0.5
    assert [r.calls for r in replicas] == [4, 3] and pauses == [0.02, 0.04, 0.08]
    assert all(r.outstanding == 0 for r in pool.replicas.values())
