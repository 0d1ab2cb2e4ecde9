"""End to end over real gRPC: three processes on 127.0.0.1, greedy exactness, streaming,
stop strings, seeds, token-id prompts."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from transformers import AutoTokenizer

from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

PROMPTS = [
    "def speculative_round(draft, target):",
    "for i in range(10):\n    print(",
    "The draft proposes tokens; the target",
    "x",
]


def stub_for(stack) -> pb_grpc.GenerationStub:
    return pb_grpc.GenerationStub(grpc.insecure_channel(stack.addr))


@pytest.mark.parametrize("k", [0, 1, 3, 5, 8])
def test_greedy_equals_target_alone(client, reference, k):
    for prompt in PROMPTS:
        reply = client.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=48, temperature=0.0,
                                                   num_speculative_tokens=k))
        assert list(reply.token_ids) == reference(prompt, 48), (prompt, k)
        assert reply.stats.num_speculative_tokens == k
        assert reply.stats.generated_tokens == len(reply.token_ids)
        assert reply.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_EOS)


@pytest.mark.parametrize("k", [1, 3, 5, 8])
def test_draft_equal_to_target_accepts_everything(self_stack, reference, k):
    client = stub_for(self_stack)
    for prompt in PROMPTS[:2]:
        reply = client.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=40, temperature=0.0,
                                                   num_speculative_tokens=k))
        assert list(reply.token_ids) == reference(prompt, 40)
        s = reply.stats
        assert s.acceptance_rate == 1.0 and s.accepted_tokens == s.draft_tokens
        # every round but the last emits K + 1 tokens; a round whose draft call was late (a loaded
        # machine: the late-draft bound, coordinator/failover.py) goes on without it and drafts nothing
        n, lost = len(reply.token_ids), s.lost_draft_rounds
        assert s.draft_tokens > 0  # it drafted (acceptance 1.0 alone would hold for a request that never did)
        if lost == 0:
            assert s.rounds == -(-n // (k + 1)), (n, s.rounds)
            assert n == s.accepted_tokens + s.rounds or reply.finish_reason == pb.FINISH_REASON_EOS
        else:
            assert s.rounds - lost <= -(-n // (k + 1)) <= s.rounds, (n, s.rounds, lost)
        per_position = list(s.accepted_per_position)
        assert len(per_position) == k and sum(per_position) == s.accepted_tokens
        assert per_position[0] >= s.rounds - lost - 1 and per_position == sorted(per_position, reverse=True)


def test_adaptive_k_and_p_min_are_exact(client, reference):
    """Without num_speculative_tokens the coordinator picks K per round; p_min stops the draft
    early (1.0: before any token). Neither changes a token of the greedy output."""
    for prompt in PROMPTS[:3]:
        reply = client.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=48, temperature=0.0))
        assert reply.stats.adaptive and list(reply.token_ids) == reference(prompt, 48)
        assert reply.stats.num_speculative_tokens == 8  # adaptive K's ceiling (the default)
    reply = client.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=32, temperature=0.0,
                                               num_speculative_tokens=4, draft_p_min=1.0))
    assert not reply.stats.adaptive and list(reply.token_ids) == reference(PROMPTS[0], 32)
    assert reply.stats.draft_tokens == 0 and reply.stats.draft_calls >= reply.stats.rounds - 1  # (the last: K=0)


def test_a_disagreeing_draft_is_mostly_rejected_but_exact(client, reference):
    reply = client.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=48, temperature=0.0,
                                               num_speculative_tokens=4))
    assert reply.stats.acceptance_rate < 0.5  # different random weights
    assert list(reply.token_ids) == reference(PROMPTS[0], 48)
    s = reply.stats  # each service's time, and the part of it on its model
    assert 0 < s.target_pass_ms <= s.target_ms and 0 < s.draft_pass_ms <= s.draft_ms


def test_stream_carries_each_round_and_matches_unary(client):
    request = pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=30, temperature=0.0, num_speculative_tokens=3)
    chunks = list(client.GenerateStream(request))
    unary = client.Generate(request)
    assert [t for c in chunks for t in c.token_ids] == list(unary.token_ids)
    assert "".join(c.text for c in chunks) == unary.text
    assert chunks[-1].HasField("stats") and not any(c.HasField("stats") for c in chunks[:-1])
    assert len(chunks) == chunks[-1].stats.rounds + 1  # one per round, then the summary
    assert chunks[-1].finish_reason == unary.finish_reason


def test_seeded_sampling_is_reproducible(client):
    def run(seed):
        return client.Generate(pb.GenerateRequest(prompt=PROMPTS[2], max_new_tokens=32, temperature=1.0, top_k=50,
                                                  top_p=0.95, seed=seed, num_speculative_tokens=3))

    a, b, c = run(11), run(11), run(12)
    assert replays(a, b) and a.text == b.text or lost(a, b)
    assert list(a.token_ids) != list(c.token_ids)
    assert a.stats.seed == 11
    unseeded = client.Generate(pb.GenerateRequest(prompt=PROMPTS[2], max_new_tokens=24, num_speculative_tokens=3))
    replay = client.Generate(pb.GenerateRequest(prompt=PROMPTS[2], max_new_tokens=24, num_speculative_tokens=3,
                                                seed=unseeded.stats.seed))
    assert replays(unseeded, replay) or lost(unseeded, replay)  # the reported seed reproduces it


def lost(*replies) -> bool:
    """A round that went on without a late draft call (failover) draws other numbers, exactly all the
    same: on a loaded machine a seeded request replays token for token only where no round was lost."""
    return any(r.stats.lost_draft_rounds for r in replies)


def replays(a, b) -> bool:
    return list(a.token_ids) == list(b.token_ids)


def test_a_seeded_request_under_adaptive_k_is_reproducible_under_load(self_stack):
    """Adaptive K (no num_speculative_tokens) reads timings and the load, and what a sampled round
    draws depends on its K: a request naming its seed gets K from its own acceptance only, so it
    decodes the same alone, among other requests and streamed. (The target drafting for itself
    accepts every token, so K decides which generator draws each token.)"""
    client = stub_for(self_stack)
    request = pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=64, temperature=0.9, seed=1234)
    alone = client.Generate(request)
    assert alone.stats.adaptive and alone.stats.num_speculative_tokens > 0
    with ThreadPoolExecutor(4) as pool:
        load = [pool.submit(client.Generate, pb.GenerateRequest(prompt=p, max_new_tokens=64, temperature=t))
                for p in PROMPTS for t in (0.0, 1.0)]
        loaded = [pool.submit(client.Generate, request) for _ in range(2)]
        for f in load:
            f.result()
    chunks = list(client.GenerateStream(request))
    runs = [(list(r.token_ids), r.stats.lost_draft_rounds) for r in [alone] + [f.result() for f in loaded]]
    runs.append(([t for c in chunks for t in c.token_ids], chunks[-1].stats.lost_draft_rounds))
    same = [tokens for tokens, lost_rounds in runs if not lost_rounds]  # (lost rounds: see lost())
    assert len(same) >= 2 and all(tokens == same[0] for tokens in same), runs
    assert max(f.result().stats.mean_verify_batch for f in loaded) > 1  # they did run among the others


def test_stop_strings(client):
    full = client.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=48, temperature=0.0))
    text = full.text
    assert len(text) > 6
    stop = text[3:6]
    cut = text.index(stop)
    reply = client.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=48, temperature=0.0, stop=[stop]))
    assert reply.finish_reason == pb.FINISH_REASON_STOP
    assert reply.text == text[:cut]
    assert list(reply.token_ids) == list(full.token_ids[: len(reply.token_ids)])
    assert len(reply.token_ids) < len(full.token_ids) or full.finish_reason != pb.FINISH_REASON_LENGTH
    assert reply.stats.generated_tokens == len(reply.token_ids)
    streamed = "".join(c.text for c in client.GenerateStream(
        pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=48, temperature=0.0, stop=[stop, "never-appears"])))
    assert streamed == text[:cut]


def test_stop_token_ids_end_the_output_after_the_token(client):
    """A stop token id ends the output after its first occurrence (its id kept, not its text; FINISH_REASON_STOP),
    the tokens before it the output's own, at any K; one never produced changes nothing; ids outside the
    vocabulary are refused."""
    full = client.Generate(pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=40, temperature=0.0))
    ids = list(full.token_ids)
    stop = ids[5]
    end = ids.index(stop) + 1
    before = client.Generate(pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=end - 1, temperature=0.0))
    for k in (0, 3, 8):
        reply = client.Generate(pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=40, temperature=0.0,
                                                   stop_token_ids=[stop], num_speculative_tokens=k))
        assert list(reply.token_ids) == ids[:end] and reply.finish_reason == pb.FINISH_REASON_STOP, k
        assert reply.stats.generated_tokens == end
        assert reply.text == before.text  # the stop token's text is not the output's (vLLM's)
    streamed = [t for c in client.GenerateStream(pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=40,
                                                                    temperature=0.0, stop_token_ids=[stop]))
                for t in c.token_ids]
    assert streamed == ids[:end]
    never = next(t for t in range(300) if t not in ids)
    same = client.Generate(pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=40, temperature=0.0,
                                              stop_token_ids=[never]))
    assert list(same.token_ids) == ids and same.finish_reason == full.finish_reason
    vocab = client.GetInfo(pb.GetInfoRequest()).target.vocab_size
    for bad in ([vocab], [-1], list(range(65))):
        with pytest.raises(grpc.RpcError) as caught:
            client.Generate(pb.GenerateRequest(prompt=PROMPTS[1], max_new_tokens=4, stop_token_ids=bad))
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop token" in caught.value.details()


def test_token_id_prompt_and_info(client, pair):
    info = client.GetInfo(pb.GetInfoRequest())
    assert info.target.vocab_size == info.draft.vocab_size and info.max_context == 512
    assert info.target.tokenizer_fingerprint == info.draft.tokenizer_fingerprint
    # a draft model's tokens cost time: adaptive K grows to 8 of the 16 the services take
    # (the n-gram draft's, which cost none, to all 16: test_ngram)
    assert (info.default_speculative_tokens, info.max_speculative_tokens) == (8, 16)
    tokenizer = AutoTokenizer.from_pretrained(pair[1])
    ids = tokenizer(PROMPTS[0])["input_ids"]
    by_ids = client.Generate(pb.GenerateRequest(prompt_token_ids=ids, max_new_tokens=16, temperature=0.0))
    by_text = client.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=16, temperature=0.0))
    assert list(by_ids.token_ids) == list(by_text.token_ids)
    assert by_ids.stats.prompt_tokens == len(ids)


def sessions_held(stack, wait: float = 30.0) -> tuple[int, int]:
    """(draft, target) sessions held, once they reach 0 or `wait` seconds have passed."""
    import time

    draft = pb_grpc.DraftStub(grpc.insecure_channel(stack.draft_addr))
    target = pb_grpc.TargetStub(grpc.insecure_channel(stack.target_addr))
    deadline = time.monotonic() + wait
    while True:
        held = (draft.GetModelInfo(pb.ModelInfoRequest()).active_sessions,
                target.GetModelInfo(pb.ModelInfoRequest()).active_sessions)
        if held == (0, 0) or time.monotonic() > deadline:
            return held
        time.sleep(0.05)


def test_cancelled_stream_releases_its_sessions(stack):
    stub = stub_for(stack)
    call = stub.GenerateStream(pb.GenerateRequest(prompt_token_ids=[5] * 8, max_new_tokens=400, temperature=1.0,
                                                  seed=3, num_speculative_tokens=1))
    next(call)  # the first round arrived: both sessions exist
    call.cancel()
    assert sessions_held(stack) == (0, 0)


def test_client_deadline_stops_the_work_and_frees_the_sessions(stack):
    import time

    stub = stub_for(stack)
    # greedy: this prompt's continuation runs past the deadline (no EOS), whatever the seeding
    request = pb.GenerateRequest(prompt_token_ids=[5] * 8, max_new_tokens=500, temperature=0.0,
                                 num_speculative_tokens=1)
    full = stub.Generate(request)
    assert len(full.token_ids) == 500 and full.stats.rounds >= 250  # K = 1: two tokens a round at most
    start = time.monotonic()
    with pytest.raises(grpc.RpcError) as err:
        for _ in stub.GenerateStream(request, timeout=0.1):
            pass
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() - start < 5
    assert sessions_held(stack) == (0, 0)
    # still fine (greedy, the prompt above: a sampled request on random weights may meet EOS at once)
    again = stub.Generate(pb.GenerateRequest(prompt_token_ids=[5] * 8, max_new_tokens=4, temperature=0.0))
    assert list(again.token_ids) == list(full.token_ids[:4]) and again.stats.generated_tokens == 4


def test_unary_peer_calls_give_the_same_output(pair, reference):
    from coordinator.launch import LocalStack

    draft, target = pair
    with LocalStack(draft, target, coordinator_args=["--peer-calls", "unary"]) as stack:
        client = stub_for(stack)
        for k in (0, 3):
            reply = client.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=32, temperature=0.0,
                                                       num_speculative_tokens=k))
            assert list(reply.token_ids) == reference(PROMPTS[0], 32)
        assert sessions_held(stack) == (0, 0)  # released by the Release RPCs (a request waits 1 s at most for them)


def test_a_dropped_stream_releases_its_sessions(stack):
    """If the coordinator dies mid-generation, its streams end and the services free the sessions."""
    import time

    channel = grpc.insecure_channel(stack.target_addr)
    target = pb_grpc.TargetStub(channel)
    before = target.GetModelInfo(pb.ModelInfoRequest()).active_sessions
    import threading

    hang = threading.Event()

    def requests():
        yield pb.VerifyRequest(session_id="dropped", start=True, append=[1, 2, 3], sampling=pb.SamplingParams(top_p=1))
        hang.wait(30)  # keep the stream open, as a live coordinator would

    call = target.VerifyStream(requests())
    next(call)
    assert target.GetModelInfo(pb.ModelInfoRequest()).active_sessions == before + 1
    call.cancel()
    hang.set()
    deadline = time.monotonic() + 30
    while target.GetModelInfo(pb.ModelInfoRequest()).active_sessions != before:
        assert time.monotonic() < deadline, "the dropped stream's session is still held"
        time.sleep(0.05)


def test_a_stop_inside_a_round_counts_the_tokens_returned(self_stack):
    """With every draft token accepted a round commits K + 1 tokens, so a stop string mostly ends
    a request inside a round: the stats (and the generated-tokens metric fed from them) count
    the tokens returned, not the rest of that round."""
    stub = stub_for(self_stack)
    full = stub.Generate(pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=48, temperature=0.0))
    cut_inside = 0
    for start in range(1, min(len(full.text) - 2, 12)):
        request = pb.GenerateRequest(prompt=PROMPTS[0], max_new_tokens=48, temperature=0.0, num_speculative_tokens=6,
                                     stop=[full.text[start:start + 2]])
        unary = stub.Generate(request)
        last = list(stub.GenerateStream(request))[-1]
        assert unary.finish_reason == pb.FINISH_REASON_STOP
        for stats in (unary.stats, last.stats):
            assert stats.generated_tokens == len(unary.token_ids)
        cut_inside += unary.stats.accepted_tokens + unary.stats.rounds > len(unary.token_ids)
    assert cut_inside > 0
