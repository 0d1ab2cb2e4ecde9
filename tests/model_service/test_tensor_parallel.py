"""Tensor parallelism in one process (rank 0 here, rank 1 a Ray actor): the sharded forward
computes the unsharded one's logits, through rollbacks and ragged batches; wrong sizes fail
fast and clearly."""

from __future__ import annotations

import gc
import os
import time
from datetime import timedelta

import pytest
import torch

from model_service.model_runner import ModelRunner
from speculative.tiny import make_model, make_tokenizer

ATOL = 1e-4  # float32 partial sums added in another order


# first, before the module's Ray instance exists: these check that a failed start stops its own

@pytest.mark.parametrize("size, what", [(3, "4 attention heads"), (4, "2 key/value heads")])
def test_a_size_that_does_not_divide_the_model_fails_before_ray_starts(pair, size, what):
    import ray

    _, target = pair
    with pytest.raises(ValueError, match=f"tensor-parallel size {size} does not divide the model's {what}"):
        ModelRunner(target, "cpu", tensor_parallel=size)
    assert not ray.is_initialized()


class FakeRay:
    """ray.init failing with the given errors first (None: success); counts shutdowns."""

    def __init__(self, *errors):
        self.errors, self.inits, self.shutdowns = list(errors), 0, 0

    def init(self, **kwargs):
        self.inits += 1
        error = self.errors.pop(0) if self.errors else None
        if error is not None:
            raise error

    def shutdown(self):
        self.shutdowns += 1


TIMED_OUT = "The current node timed out during startup. This could happen because some of the raylet failed"


@pytest.mark.parametrize("errors, inits, raised", [
    ((), 1, None),
    ((Exception(TIMED_OUT),), 2, None),  # a raylet that missed Ray's 30 s: started again
    ((RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_y"),), 2, None),  # the GCS's
    ((Exception(TIMED_OUT), Exception(TIMED_OUT)), 2, TIMED_OUT),  # not forever
    ((RuntimeError("no such address"),), 1, "no such address"),  # anything else at once
])
def test_a_local_ray_whose_raylet_timed_out_is_started_again(errors, inits, raised):
    from model_service.tensor_parallel import Placement

    placement = object.__new__(Placement)  # only the start of Ray, no cluster
    placement.ray = FakeRay(*errors)
    if raised is None:
        placement._start_local_ray()
    else:
        with pytest.raises(Exception, match=raised):
            placement._start_local_ray()
    assert placement.ray.inits == inits
    assert placement.ray.shutdowns == inits - 1  # each failed start is stopped before the next


@pytest.mark.slow  # ~10 s: starts a Ray cluster of its own
def test_more_ranks_than_the_cluster_holds_fail_clearly(tmp_path):
    import ray

    # a model every size up to 2 x the cores divides, so only the placement can fail
    size = 2 * (os.cpu_count() or 1)
    model = make_model(tmp_path / "wide", make_tokenizer(tmp_path / "tok", "chars"), hidden=8 * size, layers=1,
                       heads=size, kv_heads=size)
    with pytest.raises(RuntimeError, match=f"cannot place {size} tensor-parallel ranks .* within 3 s"):
        ModelRunner(model, "cpu", tensor_parallel=size, tp_timeout=3)
    assert not ray.is_initialized()  # the local instance was stopped again


# seconds: the idle test waits longer than this between passes; every other test's collectives must end within it
# (rank 1 a Ray actor on the same 2 loaded cores: 6, not 3, leaves room for a stall)
COLLECTIVE_TIMEOUT = 6.0


@pytest.fixture(scope="module")
def runners(pair):
    from model_service import tensor_parallel

    _, target = pair
    whole = ModelRunner(target, "cpu")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tensor_parallel, "PG_TIMEOUT", timedelta(seconds=COLLECTIVE_TIMEOUT))
        sharded = ModelRunner(target, "cpu", tensor_parallel=2, tp_timeout=60)
    yield whole, sharded
    sharded.close()


def both(runners, session_id: str, tokens: list[int]):
    pair = []
    for runner in runners:
        session = runner.start_session(session_id, 0)
        session.tokens = list(tokens)
        pair.append(session)
    return pair


def test_logits_equal_through_rollbacks(runners):
    whole, sharded = runners
    a, b = both(runners, "rollback", list(range(3, 40)))
    assert torch.allclose(whole.forward(a, 5), sharded.forward(b, 5), atol=ATOL)
    generator = torch.Generator().manual_seed(0)
    for step in range(6):  # verify-like steps: append K + 1 tokens, score them, roll some back
        keep = len(a.tokens) - int(torch.randint(0, 4, (), generator=generator))
        new = torch.randint(0, whole.vocab_size, (1 + step % 4,), generator=generator).tolist()
        for session in (a, b):
            session.truncate(keep)
            session.tokens.extend(new)
        x, y = whole.forward(a, len(new)), sharded.forward(b, len(new))
        assert x.shape == y.shape == (len(new), whole.logits_size)
        assert (x - y).abs().max().item() < ATOL, step
    for runner in runners:
        runner.sessions.release("rollback")


def test_ragged_batches_of_mixed_lengths(runners):
    whole, sharded = runners
    sessions = [both(runners, f"batch-{i}", [(5 * i + j) % 300 for j in range(4 + 7 * i)]) for i in range(4)]
    wanted = [1, 3, 2, 4]
    xs = whole.forward_many([(a, n) for (a, _), n in zip(sessions, wanted)])
    ys = sharded.forward_many([(b, n) for (_, b), n in zip(sessions, wanted)])
    for x, y, n in zip(xs, ys, wanted):
        assert x.shape == y.shape == (n, whole.logits_size)
        assert (x - y).abs().max().item() < ATOL
    for runner in runners:
        for i in range(4):
            runner.sessions.release(f"batch-{i}")


def worker_holds(sharded) -> set[int]:
    import ray

    return set(ray.get(sharded.tp.placement.workers[0].held.remote(), timeout=30))


def test_released_caches_are_dropped_on_every_rank(runners):
    _, sharded = runners
    session = sharded.start_session("dropped", 0)
    session.tokens = [1, 2, 3]
    sharded.forward(session)
    key = session.cache.key
    assert key in worker_holds(sharded)
    sharded.sessions.release("dropped")
    del session
    gc.collect()
    assert list(sharded.tp._dropped) == [key]  # waits for the next pass's plan
    other = sharded.start_session("next", 0)
    other.tokens = [4, 5]
    sharded.forward(other)
    assert not sharded.tp._dropped
    held = worker_holds(sharded)
    assert key not in held and other.cache.key in held
    live = {s.cache.key for s in sharded.sessions._sessions.values()}
    assert held == live  # rank 1 holds exactly rank 0's sessions
    sharded.sessions.release("next")


def test_idle_longer_than_the_collective_timeout(runners):
    """Waiting for the next pass is not a collective timing out: the ranks wait as long as it takes."""
    whole, sharded = runners
    a, b = both(runners, "idle", [9, 8, 7])
    assert torch.allclose(whole.forward(a), sharded.forward(b), atol=ATOL)
    time.sleep(COLLECTIVE_TIMEOUT + 2)
    for session in (a, b):
        session.tokens.append(5)
    assert torch.allclose(whole.forward(a), sharded.forward(b), atol=ATOL)
    assert sharded.tp.failed is None
    for runner in runners:
        runner.sessions.release("idle")


def test_info_reports_the_size(runners):
    whole, sharded = runners
    assert whole.info()["tensor_parallel_size"] == 1 and sharded.info()["tensor_parallel_size"] == 2
    assert sharded.info()["num_parameters"] == whole.info()["num_parameters"]  # the model's, not a shard's
    assert "tensor-parallel x2" in sharded.forward_kind
    # each rank's load, rank 0 first (test_tp_load measures them)
    assert len(whole.info()["rank_loads"]) == 1 and len(sharded.info()["rank_loads"]) == 2
    assert all(load["load_seconds"] > 0 for load in sharded.info()["rank_loads"])


def test_features_are_the_whole_models_through_rollbacks(runners):
    """Rank 0 copies the feature layers' inputs out of its pass (ShardedForward.many_capturing): the
    residual stream is whole on every rank, so they are the unsharded forward's, row for row."""
    whole, sharded = runners
    a, b = both(runners, "features", list(range(3, 30)))
    layers = (1, 0, 1)
    generator = torch.Generator().manual_seed(1)
    for step in range(4):
        (_, [(start_a, x)]), (_, [(start_b, y)]) = (runner.forward_capturing([(s, 1)], layers)
                                                    for runner, s in zip(runners, (a, b)))
        assert start_a == start_b and x.shape == y.shape == (len(a.tokens) - start_a, 3, whole.hidden_size)
        assert (x - y).abs().max().item() < ATOL, step
        keep = len(a.tokens) - int(torch.randint(0, 3, (), generator=generator))
        new = torch.randint(0, whole.vocab_size, (1 + step,), generator=generator).tolist()
        for session in (a, b):
            session.truncate(keep)
            session.tokens.extend(new)
    for runner in runners:
        runner.sessions.release("features")


def test_an_eagle_head_drafts_for_a_sharded_target_as_for_a_whole_one(runners, pair, tmp_path):
    """The round with an EAGLE head reading a tensor-parallel target's features: greedy, the
    output the unsharded target gives with the same head, rollbacks included."""
    import asyncio

    from model_service.eagle import EagleDraft
    from model_service.engines import TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from speculative.protocol import SamplingParams
    from speculative.round import Stats, generate
    from tests.model_service.test_eagle import make_head

    whole, sharded = runners
    _, target_dir = pair
    head = make_head(target_dir, tmp_path / "head", std=0.5)

    def run(runner: ModelRunner, stats: Stats) -> list[int]:
        eagle = EagleDraft.load(head, target_dir, "cpu", lookup=range(0))

        async def go() -> list[int]:
            out = []
            async for new in generate(LocalDraft(eagle), LocalTarget(TargetEngine(runner)), [5, 17, 42, 9, 100, 7],
                                      max_new_tokens=40, k=3, params=SamplingParams(0.0), max_context=256,
                                      stats=stats, feature_layers=eagle.layers):
                out += new
            return out

        return asyncio.run(go())

    expected, got = Stats(), Stats()
    assert run(sharded, got) == run(whole, expected)
    assert got.feature_bytes > 0 and got.draft_tokens > 0 and got.rejected_rounds > 0
    assert len(sharded.sessions) == 0
