"""A coordinator in front of pools: 2 draft and 2 target replicas on loopback. Requests spread over
the replicas with outputs identical to a single-replica stack; a replica added at run time gets
traffic; a replica removed gets none."""

from __future__ import annotations

import time

import grpc
import pytest

from coordinator.launch import LocalStack
from coordinator.pool import unlike
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.faults.hook import wait_until

PROMPTS = [[5 + i, 17, 42 + 3 * i, 9] for i in range(8)]


@pytest.fixture(scope="module")
def cluster(pair, request):
    draft, target = pair
    stack = LocalStack(draft, target, draft_replicas=2, target_replicas=2, discovery_files=True).start()
    request.addfinalizer(stack.stop)
    return stack


def generate_all(addr: str, n: int = 24, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        futures = [stub.Generate.future(pb.GenerateRequest(prompt_token_ids=p, max_new_tokens=n, temperature=0.0,
                                                           num_speculative_tokens=3), timeout=120) for p in prompts]
        return [list(f.result().token_ids) for f in futures]


def replicas(addr: str) -> dict[str, pb.ReplicaInfo]:
    with grpc.insecure_channel(addr) as channel:
        return {r.address: r for r in pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest()).replicas}


def wait_for(addr: str, check, timeout: float = 30.0) -> dict[str, pb.ReplicaInfo]:
    deadline = time.monotonic() + timeout
    while True:
        seen = replicas(addr)
        if check(seen):
            return seen
        assert time.monotonic() < deadline, seen
        time.sleep(0.2)


def test_requests_spread_and_outputs_match_one_replica(cluster, stack):
    wait_for(cluster.addr, lambda seen: len(seen) == 4 and all(r.state == "serving" for r in seen.values()))
    assert generate_all(cluster.addr) == generate_all(stack.addr)
    # each lease is given back once its session is released: after the answer where a release outlasts RELEASE_WAIT
    seen = wait_for(cluster.addr, lambda seen: all(r.outstanding == 0 for r in seen.values()))
    assert {r.role for r in seen.values()} == {"draft", "target"} and len(seen) == 4
    for r in seen.values():
        assert r.state == "serving" and r.served >= 2, r  # 8 requests over 2 replicas


def target_served(addr: str) -> dict[str, int]:
    return {a: r.served for a, r in replicas(addr).items() if r.role == "target"}


def test_a_chats_next_turn_goes_to_the_target_replica_that_held_the_last(cluster):
    """Requests one after another alternate between idle replicas; a prompt continuing a finished
    request's sequence goes where that sequence's cache is kept (prefix reuse)."""
    wait_for(cluster.addr, lambda seen: len(seen) == 4 and all(r.state == "serving" for r in seen.values()))
    prompt, holders = [(3 * i) % 300 + 20 for i in range(70)], []
    with grpc.insecure_channel(cluster.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for turn in range(4):
            before = target_served(cluster.addr)
            reply = stub.Generate(pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=12, temperature=0.0,
                                                     num_speculative_tokens=3), timeout=120)
            after = target_served(cluster.addr)
            holders += [a for a in after if after[a] > before.get(a, 0)]
            prompt = [*prompt, *reply.token_ids, 40 + turn, 41 + turn]
        # unrelated prompts, one after another, alternate (what the turns above would have done)
        others = []
        for first in (9, 10):
            before = target_served(cluster.addr)
            stub.Generate(pb.GenerateRequest(prompt_token_ids=[first, 8, 7, 6] * 20, max_new_tokens=4,
                                             temperature=0.0), timeout=120)
            after = target_served(cluster.addr)
            others += [a for a in after if after[a] > before[a]]
    assert len(holders) == 4 and len(set(holders)) == 1, holders
    assert len(set(others)) == 2, others


def test_the_pool_prefers_the_replica_holding_most_of_a_prompt_within_a_slack():
    from coordinator.pool import AFFINITY_BLOCK, AFFINITY_SLACK, Pool, PrefixAffinity, Replica

    affinity = PrefixAffinity(entries=6)
    sequence = list(range(100))  # 3 whole blocks of 32
    affinity.note(sequence, "b")
    assert affinity.find(sequence + [1, 2]) == ("b", 3 * AFFINITY_BLOCK)
    assert affinity.find(sequence[:40] + [7] * 40) == ("b", AFFINITY_BLOCK)
    assert affinity.find([7] * 64) is None and affinity.find(sequence[:31]) is None
    affinity.note(list(range(500, 600)), "a")  # 3 more: the first noted go first
    assert affinity.find(sequence) == ("b", AFFINITY_BLOCK * 3) and len(affinity.where) == 6
    affinity.note(list(range(700, 800)), "a")
    assert affinity.find(sequence) is None

    pool = Pool("target", "a,b", lambda address, server_name: None)
    a, b = (pool.replicas.setdefault(name, Replica(type("Peer", (), {"address": name})())) for name in ("a", "b"))
    for replica in (a, b):
        replica.healthy = True
    pool.affinity.note(sequence, "b")
    b.outstanding = AFFINITY_SLACK
    assert pool.acquire(prompt=sequence + [5] * 10) is b  # within the slack
    assert pool.acquire(prompt=sequence + [5] * 10) is a  # past it: the least busy
    a.outstanding = b.outstanding = 0
    # a prompt less than half of which was held: the least busy, in turn
    assert {pool.acquire(prompt=sequence[:40] + [5] * 60) for _ in range(2)} == {a, b}
    a.outstanding = b.outstanding = 0
    assert {pool.acquire() for _ in range(2)} == {a, b}


def test_added_replica_gets_traffic_and_removed_one_none(cluster, stack):
    expected = generate_all(stack.addr)
    name = cluster.add_replica("target")
    new = cluster.addresses[name]
    wait_for(cluster.addr, lambda seen: new in seen and seen[new].state == "serving")
    assert generate_all(cluster.addr) == expected
    assert replicas(cluster.addr)[new].served >= 1

    gone = cluster.addresses["draft-1"]
    cluster.remove_replica("draft-1")
    wait_for(cluster.addr, lambda seen: gone not in seen)
    before = {a: r.served for a, r in replicas(cluster.addr).items()}
    assert generate_all(cluster.addr) == expected
    after = replicas(cluster.addr)
    drafts = [a for a, r in after.items() if r.role == "draft"]
    assert drafts == [cluster.addresses["draft"]] and after[drafts[0]].served == before[drafts[0]] + len(PROMPTS)


def test_a_coordinator_serves_without_drafting_until_its_draft_pool_has_a_replica(pair, stack):
    """A coordinator started while its draft pool is empty (scaled to zero, crashing) serves the target's
    output, drafting nothing, once --draft-wait has passed; a draft replica listed later makes it draft."""
    draft, target = pair
    alone = LocalStack(draft, target, discovery_files=True, coordinator_args=["--draft-wait", "0"])
    alone.discovery["draft"].write_text("")  # the draft service runs, unlisted
    alone.start()
    try:
        expected = generate_all(stack.addr, prompts=PROMPTS[:2])
        with grpc.insecure_channel(alone.addr) as channel:
            stub = pb_grpc.GenerationStub(channel)
            assert not stub.GetInfo(pb.GetInfoRequest()).HasField("draft")
            replies = [stub.Generate(pb.GenerateRequest(prompt_token_ids=p, max_new_tokens=24, temperature=0.0,
                                                        num_speculative_tokens=3), timeout=120) for p in PROMPTS[:2]]
            assert [list(r.token_ids) for r in replies] == expected
            assert all(r.stats.draft_tokens == 0 for r in replies)
            alone.discovery["draft"].write_text(alone.draft_addr + "\n")
            wait_until("the listed draft replica taken up", lambda: stub.GetInfo(pb.GetInfoRequest()).HasField("draft"),
                       timeout=60)
            replies = [stub.Generate(pb.GenerateRequest(prompt_token_ids=p, max_new_tokens=24, temperature=0.0,
                                                        num_speculative_tokens=3), timeout=120) for p in PROMPTS[:2]]
            assert [list(r.token_ids) for r in replies] == expected
            assert all(r.stats.draft_tokens > 0 for r in replies)
    finally:
        alone.stop()


def test_a_draft_that_comes_late_and_cannot_pair_leaves_the_coordinator_serving_without(pair, stack,
                                                                                      other_tokenizer_model):
    """A draft replica of another tokenizer, the first ready after start-up: the pool refuses it, saying why,
    and the coordinator goes on serving the target's output without drafting (at start-up the pair is
    refused); a draft replica that pairs, listed after it, is taken up."""
    draft, target = pair
    alone = LocalStack(draft, target, discovery_files=True, coordinator_args=["--draft-wait", "0"])
    alone.discovery["draft"].write_text("")
    alone.start()
    try:
        expected = generate_all(stack.addr, prompts=PROMPTS[:2])
        odd = alone.addresses[alone.add_replica("draft", model=other_tokenizer_model)]
        seen = wait_for(alone.addr, lambda seen: odd in seen and seen[odd].state == "refused")
        assert "cannot be paired" in seen[odd].detail, seen[odd].detail
        with grpc.insecure_channel(alone.addr) as channel:
            stub = pb_grpc.GenerationStub(channel)

            def generate() -> list[pb.GenerateResponse]:
                return [stub.Generate(pb.GenerateRequest(prompt_token_ids=p, max_new_tokens=24, temperature=0.0,
                                                         num_speculative_tokens=3), timeout=120) for p in PROMPTS[:2]]
            replies = generate()
            assert [list(r.token_ids) for r in replies] == expected
            assert all(r.stats.draft_tokens == 0 for r in replies)
            assert not stub.GetInfo(pb.GetInfoRequest()).HasField("draft")
            with alone.discovery["draft"].open("a") as f:
                f.write(alone.draft_addr + "\n")
            wait_for(alone.addr, lambda seen: seen[odd].state == "refused"
                     and seen.get(alone.draft_addr, seen[odd]).state == "serving")
            wait_until("the draft that pairs taken up", lambda: stub.GetInfo(pb.GetInfoRequest()).HasField("draft"),
                       timeout=60)
            replies = generate()
            assert [list(r.token_ids) for r in replies] == expected
            assert all(r.stats.draft_tokens > 0 for r in replies)
    finally:
        alone.stop()


def test_a_replica_of_another_model_is_refused(cluster, stack, other_tokenizer_model):
    name = cluster.add_replica("draft", model=other_tokenizer_model)
    odd = cluster.addresses[name]
    seen = wait_for(cluster.addr, lambda seen: odd in seen and seen[odd].state == "refused")
    assert "model" in seen[odd].detail or "serves" in seen[odd].detail
    assert generate_all(cluster.addr) == generate_all(stack.addr)
    assert replicas(cluster.addr)[odd].served == 0
    # restarted at the same address with the pool's model it serves; with another again, it is refused
    cluster.restart_replica(name, model=cluster.draft_model)
    wait_for(cluster.addr, lambda seen: seen[odd].state == "serving")
    cluster.restart_replica(name, model=other_tokenizer_model)
    wait_for(cluster.addr, lambda seen: seen[odd].state == "refused")
    assert generate_all(cluster.addr) == generate_all(stack.addr)


def test_a_target_replica_with_a_shorter_context_is_refused(cluster, stack):
    """The coordinator admits requests by the context its pool's first target replica said; a replica
    started with less would fail the longer requests leased to it, so it gets none."""
    name = cluster.add_replica("target", args=["--max-context", "32"])
    short = cluster.addresses[name]
    seen = wait_for(cluster.addr, lambda seen: short in seen and seen[short].state == "refused")
    assert "context is 32 tokens" in seen[short].detail, seen[short].detail
    long_prompts = [[5 + i % 50 for i in range(j, j + 40)] for j in range(6)]  # past the refused one's 32
    assert generate_all(cluster.addr, 8, long_prompts) == generate_all(stack.addr, 8, long_prompts)
    assert replicas(cluster.addr)[short].served == 0


def test_a_replica_is_refused_for_limits_under_the_pools_or_other_weights():
    base = dict(model_name="m", num_parameters=10, tokenizer_fingerprint="f", vocab_size=99, max_context=512,
                max_tokens_per_call=16, dtype="float32", quantization="none")
    target = pb.ModelInfo(**base)
    head = pb.ModelInfo(**base, draft_method="eagle", feature_layers=[2, 5, 8], feature_width=3 * 64)
    assert unlike(pb.ModelInfo(**base), target) == ""
    assert unlike(pb.ModelInfo(**{**base, "max_context": 1024}), target) == ""  # more than the pool's: fine
    assert unlike(pb.ModelInfo(**{**base, "max_tokens_per_call": 0}), target) == ""  # 0: no limit
    assert "'n'" in unlike(pb.ModelInfo(**{**base, "model_name": "n"}), target)
    assert "context is 256 tokens" in unlike(pb.ModelInfo(**{**base, "max_context": 256}), target)
    assert "8 tokens a call" in unlike(pb.ModelInfo(**{**base, "max_tokens_per_call": 8}), target)
    assert "at most 300 tokens, the pool's any number (--max-kv-tokens)" in unlike(
        pb.ModelInfo(**{**base, "max_kv_tokens": 300}), target)  # the pool's admits what it cannot hold
    capped = pb.ModelInfo(**{**base, "max_kv_tokens": 400})
    assert "at most 300 tokens, the pool's 400" in unlike(pb.ModelInfo(**{**base, "max_kv_tokens": 300}), capped)
    assert unlike(target, capped) == "" and unlike(pb.ModelInfo(**{**base, "max_kv_tokens": 500}), capped) == ""
    assert "16 tokens a call" in unlike(target, pb.ModelInfo(**{**base, "max_tokens_per_call": 0}))
    assert "bfloat16" in unlike(pb.ModelInfo(**{**base, "dtype": "bfloat16"}), target)
    assert unlike(pb.ModelInfo(**{**base, "quantization": ""}), target) == ""  # a service that says nothing: none
    # int4 against float weights, or int4 of another group size, but not the instruction set its kernel was built for
    int4 = "int4 (weights in groups of {}, specdec's kernel ({}), float16 d and m, int8 activation blocks)"
    avx2 = pb.ModelInfo(**{**base, "quantization": int4.format(32, "avx2")})
    assert "int4" in unlike(avx2, target)
    assert unlike(pb.ModelInfo(**{**base, "quantization": int4.format(32, "avx512_vnni")}), avx2) == ""
    assert "groups of 64" in unlike(pb.ModelInfo(**{**base, "quantization": int4.format(64, "avx2")}), avx2)
    # int4 over float16 caches (its default) against float32 ones: other answers
    halves = pb.ModelInfo(**{**base, "quantization": int4.format(32, "avx2"), "kv_dtype": "float16"})
    assert "float16 keys and values" in unlike(avx2, halves)
    assert unlike(pb.ModelInfo(**{**base, "kv_dtype": "float32"}), target) == ""  # as its weights: said or not
    # a draft's weights are its own business (its q is exact whatever it is); the layers it reads are not
    assert unlike(pb.ModelInfo(**{**base, "quantization": "int4"}, draft_method="eagle", feature_layers=[2, 5, 8],
                               feature_width=3 * 64), head) == ""
    assert "layers [1, 5, 8]" in unlike(pb.ModelInfo(**base, draft_method="eagle", feature_layers=[1, 5, 8],
                                                     feature_width=3 * 64), head)
