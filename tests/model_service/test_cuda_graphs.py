"""Passes through cuda_graphs.GraphedPasses compute the lean forward's eager pass: decode steps and
verify-sized passes (their logits for every row, the captured layers' inputs), prompts between them
(eager), rollbacks, pool slots and caches of their own, a cache that outgrows its storage, and a
restricted output layer. Without a GPU the same static-shape
body runs eagerly (capture=False); with one (the device machine) it is captured and replayed."""

from __future__ import annotations

import json
import random

import pytest
import torch

from model_service import int4
from model_service.model_runner import ModelRunner
from speculative.tiny import make_model, make_tokenizer

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"


@pytest.fixture(scope="module", params=["llama", "qwen3", "mistral", "smollm3"])
def model_dir(tmp_path_factory, request):
    """A tiny model of each family whose layers differ in the graphed body (qwen3: each q and k head's norm;
    mistral: a sliding window of 40 keys, the mask's; smollm3: a layer without RoPE)."""
    out = tmp_path_factory.mktemp("graphs")
    made = make_model(out / "m", make_tokenizer(out / "tok"), arch=request.param, hidden=64, layers=3, heads=4,
                      kv_heads=2, max_context=1024, init_std=0.1)
    if request.param == "mistral":
        config = json.loads((made / "config.json").read_text())
        (made / "config.json").write_text(json.dumps({**config, "sliding_window": 40}))
    return made


@pytest.mark.parametrize("pool", [None, 0], ids=["pool slots", "caches of their own"])
def test_graphed_steps_compute_the_eager_steps(model_dir, pool):
    eager = ModelRunner(model_dir, DEVICE, kv_pool_capacity=pool)
    graphed = ModelRunner(model_dir, DEVICE, kv_pool_capacity=pool)
    graphed.fast.use_graphs(capture=CUDA)
    rng = random.Random(0)
    pairs = [(eager.start_session(f"s{i}", i), graphed.start_session(f"s{i}", i)) for i in range(3)]
    steps = verifies = 0
    while len(pairs[0][0].tokens) < 300:  # past a cache's first capacity (256)
        for a, b in pairs:
            size = 1 if rng.random() < 0.6 else rng.randint(2, 5) if rng.random() < 0.9 else rng.randint(18, 24)
            fed = [rng.randrange(eager.vocab_size) for _ in range(size)]
            a.tokens.extend(fed)
            b.tokens.extend(fed)
            rows = 1 if size == 1 or rng.random() < 0.3 else size  # a verify pass scores every row
            want, got = eager.forward(a, rows), graphed.forward(b, rows)
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            steps += size == 1
            verifies += 1 < size <= 17
            if rng.random() < 0.2:  # a rejected draft: roll both back
                back = rng.randint(1, 4)
                a.truncate(len(a.tokens) - back)
                b.truncate(len(b.tokens) - back)
    assert steps > 150 and verifies > 80
    passes = graphed.fast.graphs.passes
    assert {key[3] for key in passes} > {1, 2}  # one-token steps and longer passes went through it
    assert graphed.fast.graphs.replays == steps + verifies  # and the prompts of over 17 tokens did not
    if pool == 0:
        assert pairs[0][1].cache.data.shape[4] >= 512  # grown once at least
    if CUDA:
        assert graphed.fast.graphs.captures >= 3


def test_graphed_steps_keep_a_restricted_head_and_follow_weight_changes(model_dir):
    eager = ModelRunner(model_dir, DEVICE)
    graphed = ModelRunner(model_dir, DEVICE)
    graphed.fast.use_graphs(capture=CUDA)
    ids = torch.arange(0, eager.vocab_size, 3)
    for runner in (eager, graphed):
        runner.fast.restrict_head(ids.to(runner.device))  # replaces the output layer: new graphs
    assert graphed.fast.graphs is not None and not graphed.fast.graphs.passes
    a, b = eager.start_session("a", 0), graphed.start_session("a", 0)
    for token in [5, 9, 2, 7, 7, 1]:
        a.tokens.append(token)
        b.tokens.append(token)
        want, got = eager.forward(a, 1), graphed.forward(b, 1)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert torch.isinf(got[0, 1]) and got[0, 0].isfinite()  # only the head's ids are scored


def test_int4_weights_run_eager(model_dir):
    """int4 products are CPU kernels: quantizing drops the graphs, and none can be asked for."""
    runner = ModelRunner(model_dir, "cpu")
    runner.fast.use_graphs(capture=False)
    int4.quantize(runner.fast, 32, None, "torch")
    assert runner.fast.graphs is None
    with pytest.raises(ValueError, match="float forward"):
        runner.fast.use_graphs(capture=False)


def test_graphed_passes_hand_back_the_layers_a_draft_reads(model_dir):
    """A verify pass of a session whose draft reads the target's features (an EAGLE head) goes
    through the graphs too, and its captured layers' inputs are the eager pass's, in the order asked."""
    eager = ModelRunner(model_dir, DEVICE)
    graphed = ModelRunner(model_dir, DEVICE)
    graphed.fast.use_graphs(capture=CUDA)
    a, b = eager.start_session("a", 0), graphed.start_session("a", 0)
    prompt = list(range(3, 40))
    for session in (a, b):
        session.tokens.extend(prompt)
    for runner, session in ((eager, a), (graphed, b)):
        runner.forward_capturing([(session, 1)], (2, 0, 1))  # the prompt: eager in both
    replays = graphed.fast.graphs.replays
    rng = random.Random(1)
    for _ in range(12):
        fed = [rng.randrange(eager.vocab_size) for _ in range(rng.randint(1, 6))]
        a.tokens.extend(fed)
        b.tokens.extend(fed)
        (want,), want_states = eager.forward_capturing([(a, len(fed))], (2, 0, 1))
        (got,), got_states = graphed.forward_capturing([(b, len(fed))], (2, 0, 1))
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        assert got_states[0][0] == want_states[0][0]  # the position of the first fed token
        torch.testing.assert_close(got_states[0][1], want_states[0][1], atol=1e-4, rtol=1e-4)
        a.truncate(len(a.tokens) - 1)
        b.truncate(len(b.tokens) - 1)
    assert graphed.fast.graphs.replays == replays + 12
    assert all(key[4] == (0, 1, 2) for key in graphed.fast.graphs.passes)
