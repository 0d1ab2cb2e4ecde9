"""Many requests at once through the three services: batched verification and drafting must not
change a single token. Greedy outputs equal the same requests run one at a time; seeded sampling
gives the same tokens under concurrency as alone."""

from __future__ import annotations

import random

import grpc
import pytest

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc


def requests(temperature: float) -> list[pb.GenerateRequest]:
    rng = random.Random(11)
    out = []
    for i in range(10):
        prompt = [rng.randrange(1, 250) for _ in range(rng.choice([1, 4, 17, 40]))]
        out.append(pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=rng.randint(8, 40),
                                      temperature=temperature, num_speculative_tokens=rng.choice([0, 1, 3, 6]),
                                      seed=1000 + i))
    return out


def run_all(stub, reqs, concurrent: bool) -> list[pb.GenerateResponse]:
    if not concurrent:
        return [stub.Generate(r, timeout=120) for r in reqs]
    futures = [stub.Generate.future(r, timeout=120) for r in reqs]
    return [f.result() for f in futures]


def check_concurrent_equals_one_at_a_time(addr: str) -> None:
    """The requests' outputs together equal those alone (greedy and seeded sampling), and the
    concurrent ones shared passes."""
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for temperature in (0.0, 0.8):
            reqs = requests(temperature)
            alone = run_all(stub, reqs, concurrent=False)
            together = run_all(stub, reqs, concurrent=True)
            if temperature == 0:
                assert [list(r.token_ids) for r in together] == [list(r.token_ids) for r in alone]
            else:  # a round that went on without a late draft draws other numbers (exact all the same: a
                # loaded machine): a seeded request replays token for token where none did
                same = [(list(a.token_ids), list(t.token_ids)) for a, t in zip(alone, together)
                        if a.stats.lost_draft_rounds == t.stats.lost_draft_rounds == 0]
                assert len(same) >= len(reqs) // 2 and all(a == t for a, t in same), same
            assert max(r.stats.mean_verify_batch for r in alone) == 1.0
            assert max(r.stats.mean_verify_batch for r in together) > 1.5  # they did share passes


def test_concurrent_equals_one_at_a_time(stack):
    check_concurrent_equals_one_at_a_time(stack.addr)


@pytest.mark.parametrize("calls, target_replicas", [pytest.param("batch", 2, marks=pytest.mark.slow), ("each", 1)])
def test_lockstep_equals_one_at_a_time(pair, calls, target_replicas):
    """--lockstep (calls reach the models in turns) changes when calls run, not a token. The
    services serve each turn in one pass without being told to wait: a turn's calls to a service
    come as one batch RPC (split between the two target replicas), or each says its turn."""
    from coordinator.launch import LocalStack

    from runtime.ports import free_port
    from tests.services.test_metrics import scrape, value

    draft, target = pair
    port, draft_port = free_port(), free_port()
    with LocalStack(draft, target, target_replicas=target_replicas, draft_args=["--metrics-port", str(draft_port)],
                    # (a draft turn is late for all its calls: a loaded machine's stall would lose their rounds)
                    coordinator_args=["--lockstep", "--num-speculative-tokens", "3", "--lockstep-calls", calls,
                                      "--metrics-port", str(port), "--draft-late-floor", "30"]) as stack:
        check_concurrent_equals_one_at_a_time(stack.addr)
        samples = scrape(port)
        batches = value(scrape(draft_port), "specdec_batch_rpcs_total", method="propose")
    assert (batches > 0) == (calls == "batch"), batches
    # every call went through exactly one turn; the concurrent ones shared turns. A draft call the
    # round stopped waiting for (late: a loaded machine) may not have answered yet: its time is not
    # observed when the metrics are read
    late = value(samples, "specdec_late_draft_calls_total")
    for model, count in (("draft", "specdec_propose_seconds_count"), ("target", "specdec_verify_seconds_count")):
        turns = sum(value(samples, "specdec_lockstep_turns_total", model=model, start=start)
                    for start in ("all_waiting", "hold_expired"))
        assert turns == value(samples, "specdec_lockstep_turn_calls_count", model=model) > 0
        let_through, observed = value(samples, "specdec_lockstep_turn_calls_sum", model=model), value(samples, count)
        assert observed <= let_through <= observed + (late if model == "draft" else 0), (model, late)
        assert value(samples, count) > turns, (model, samples)
    assert value(samples, "specdec_lockstep_turns_total", model="target", start="all_waiting") > 0


def test_lockstep_flags_are_checked():
    from coordinator.__main__ import parse_args

    assert parse_args(["--lockstep", "--num-speculative-tokens", "4"]).lockstep
    assert parse_args(["--lockstep", "--num-speculative-tokens", "4"]).lockstep_calls == "batch"
    for bad in (["--lockstep"], ["--lockstep", "--num-speculative-tokens", "4", "--predraft"],
                ["--lockstep", "--num-speculative-tokens", "4", "--lockstep-calls", "some"],
                ["--lockstep", "--num-speculative-tokens", "4", "--lockstep-hold-ms", "0"]):
        with pytest.raises(SystemExit):
            parse_args(bad)
