"""Prefix reuse through the three services under concurrency: chats whose turns run side by side
(batched passes mixing sessions that took kept caches, copied a shared beginning or computed
everything, two chats alike racing for one kept cache) answer exactly as a stack that keeps
nothing, and the services say what they took cached."""

from __future__ import annotations

import grpc
import pytest

from coordinator.launch import LocalStack
from runtime.ports import free_port
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from tests.services.test_metrics import scrape, value

SYSTEM = [(13 * i) % 300 + 7 for i in range(24)]  # what every chat begins with (a system prompt)


@pytest.fixture(scope="module")
def stacks(pair, request):
    ports = {role: free_port() for role in ("draft", "target")}
    kept = LocalStack(*pair, draft_args=["--metrics-port", str(ports["draft"])],
                      target_args=["--metrics-port", str(ports["target"])]).start()
    request.addfinalizer(kept.stop)
    off = LocalStack(*pair, draft_args=["--prefix-cache-mb", "0"], target_args=["--prefix-cache-mb", "0"]).start()
    request.addfinalizer(off.stop)
    return kept, off, ports


def chats(addr: str, turns: int = 3, cached: list | None = None) -> list[list[list[int]]]:
    """Six chats, each turn of all of them at once; chat 3 goes on from the middle of each answer (its
    prompt parts from the kept tokens inside them); chats 4 and 5 are chat 0 again (they race for its
    kept caches). -> per chat, each turn's output; `cached` gets (prompt length, the prompt's last
    length, the prompt tokens each answer says came cached)"""
    prompts = [[*SYSTEM, 40 + c, 41 + c, 42 + c] for c in range(4)] + [[*SYSTEM, 40, 41, 42]] * 2
    last = [0] * len(prompts)
    said: list[list[list[int]]] = [[] for _ in prompts]
    with grpc.insecure_channel(addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        for turn in range(turns):
            futures = [stub.Generate.future(pb.GenerateRequest(prompt_token_ids=p, max_new_tokens=10, temperature=0.0,
                                                               num_speculative_tokens=3), timeout=120) for p in prompts]
            for c, future in enumerate(futures):
                reply = future.result()
                out = list(reply.token_ids)
                said[c].append(out)
                if cached is not None:
                    cached.append((len(prompts[c]), last[c], reply.stats.cached_prompt_tokens))
                last[c] = len(prompts[c])
                prompts[c] = [*prompts[c], *(out[: len(out) // 2] if c == 3 else out), 60 + turn, 61 + turn]
    return said


def test_concurrent_chats_answer_as_a_stack_that_keeps_nothing(stacks):
    kept, off, ports = stacks
    cached, none = [], []
    assert chats(kept.addr, cached=cached) == chats(off.addr, cached=none)
    assert all(n == 0 for _, _, n in none)
    # each later turn took at least half its last prompt cached (chat 3: half its last answer dropped), never
    # the prompt's last token
    later = cached[6:]
    assert all(last // 2 <= n < length for length, last, n in later) and sum(n for _, _, n in later) > 0, cached
    for role in ("target", "draft"):
        samples = scrape(ports[role])
        assert value(samples, "specdec_prefix_cache_hits_total") >= 6, role  # (the later turns at least)
        assert value(samples, "specdec_prefix_cache_hit_tokens_total") >= 6 * len(SYSTEM), role
