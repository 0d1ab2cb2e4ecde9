"""The lean forward computes what transformers computes, through feeds, rollbacks and cache growth."""

from __future__ import annotations

import json
import random
import threading
from functools import partial
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoModelForCausalLM

from model_service import fast_forward, q4_kernel, scripted
from model_service.fast_forward import FastForward, unsupported
from model_service.kv_cache import KVCache, KVPool
from model_service.model_runner import ModelRunner
from speculative.tiny import make_model, make_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok") / "tok")


def feeds_and_rollbacks(fast, slow, seed: int, until: int, sizes, rollback: int, some_logits: bool = False):
    """Random feeds (`sizes` tokens each) into a session of each runner, each followed by a rollback of
    0..`rollback` tokens, until `fast`'s holds `until`: every pass's logits equal. -> (the sessions, the
    passes checked). some_logits: each pass asks for the last 1..len(feed) logits, else all of the feed's."""
    rng = random.Random(seed)
    sessions = [r.start_session("s", 0) for r in (fast, slow)]
    checked = 0
    while len(sessions[0].tokens) < until:
        new = [rng.randrange(fast.vocab_size) for _ in range(rng.choice(sizes))]
        num_logits = rng.randint(1, len(new)) if some_logits else len(new)
        outs = []
        for runner, session in zip((fast, slow), sessions):
            session.tokens.extend(new)
            outs.append(runner.forward(session, num_logits))
        assert outs[1].abs().max() > 1e-2  # (logits the weights shape, not ~0)
        torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
        checked += 1
        back = rng.randint(0, min(rollback, len(sessions[0].tokens) - 1))
        for session in sessions:
            session.truncate(len(session.tokens) - back)
        assert sessions[0].cache.get_seq_length() == sessions[1].cache.get_seq_length()
    return sessions, checked


def hf_forward_unchanged(fast, slow, tokens: list[int], max_context: int) -> None:
    """After the lean forward is built on it, the HF model's own forward computes what a fresh one does,
    and so does a second lean forward built on the same model (nothing reordered or folded twice)."""
    ids = torch.tensor([tokens])
    with torch.inference_mode():
        reference = slow.model(ids).logits[0]
        torch.testing.assert_close(fast.model(ids).logits[0], reference, atol=1e-4, rtol=1e-4)
        again = FastForward.build(fast.model, max_context)
        assert again.folded == fast.fast.folded
        torch.testing.assert_close(again(tokens, again.new_cache(), len(tokens)), reference, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(fast.model(ids).logits[0], reference, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["specdec", "onednn"])
# phi3: qkv_proj, gate_up_proj; smollm3: a layer without RoPE
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral", "phi3", "smollm3"])
def test_matches_transformers_through_feeds_and_rollbacks(tmp_path, tokenizer, arch, kernel):
    """Random feeds of 1..9 tokens, rollbacks of 0..5, past the cache's first capacity (256); the
    float32 products through specdec's panels (and its C++ layer loop) or oneDNN's packed weights
    (and TorchScript's loop)."""
    if kernel == "specdec" and not q4_kernel.available():
        pytest.skip(f"specdec's kernel is not built here: {q4_kernel.path()}")
    model_dir = make_model(tmp_path / arch, tokenizer, arch=arch, hidden=64, layers=2, heads=4, kv_heads=2,
                           max_context=512, init_std=0.1)
    fast, slow = ModelRunner(model_dir, float_kernel=kernel), ModelRunner(model_dir, forward="transformers")
    assert fast.forward_kind.startswith("fast") and slow.forward_kind == "transformers"
    assert fast.fast.float_kernel == kernel and fast.fast._runs_q4_layers() == (kernel == "specdec")
    assert [layer["rope"] for layer in fast.fast.layers] == [True, arch != "smollm3"]
    sessions, checked = feeds_and_rollbacks(fast, slow, 0, 300, range(1, 10), 5, some_logits=True)
    assert isinstance(sessions[0].cache, KVCache)
    assert checked > 40 and sessions[0].cache.data.shape[4] >= 512  # grown once at least


@pytest.mark.parametrize("rope", [{"rope_type": "linear", "factor": 2.0}, {"rope_type": "dynamic", "factor": 2.0}],
                         ids=["linear (table)", "dynamic (module)"])
def test_scaled_rope_matches_transformers(tmp_path, tokenizer, rope):
    """RoPE variants: static ones index the precomputed cos/sin table, dynamic ones call the
    model's rotary module on each pass; both give transformers' logits, multi-row (packed) and
    single-row products alike."""
    model_dir = make_model(tmp_path / "m", tokenizer, init_std=0.1, max_context=256)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"] = {**rope, "rope_theta": 10000.0}
    (model_dir / "config.json").write_text(json.dumps(config))
    fast, slow = ModelRunner(model_dir, float_kernel="onednn"), ModelRunner(model_dir, forward="transformers")
    assert (fast.fast.rope_table is None) == (rope["rope_type"] == "dynamic")
    assert fast.fast.lm_head_packed is None  # a tiny model's weights are under PACK_MIN_ELEMENTS
    fast.fast.pack_min = 0
    fast.fast.pack()  # every wide weight packed, to test that path
    if torch.backends.mkldnn.is_available():
        assert fast.fast.lm_head_packed is not None and fast.fast.layers[0]["qkv_packed"] is not None
    feeds_and_rollbacks(fast, slow, 2, 200, [1, 1, 4, 9, 30], 0)


@pytest.mark.parametrize("rope, kernel", [("default", "specdec"), ("default", "onednn"), ("longrope", "specdec")])
def test_heads_rotated_in_part_match_transformers(tmp_path, tokenizer, rope, kernel):
    """Phi-3's partial_rotary_factor (Phi-4-mini: 96 of 128 dimensions): the lean forward keeps q's
    and k's heads in head_order, its RoPE table 1 and 0 where nothing rotates, and computes
    transformers' logits, the RoPE table indexed (default) or the module called each pass (longrope,
    whose frequencies change past its original context of 64)."""
    if kernel == "specdec" and not q4_kernel.available():
        pytest.skip(f"specdec's kernel is not built here: {q4_kernel.path()}")
    model_dir = make_model(tmp_path / "m", tokenizer, arch="phi3", hidden=64, layers=2, heads=4, kv_heads=2,
                           max_context=256, init_std=0.1)
    config = json.loads((model_dir / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": rope, "rope_theta": 10000.0, "partial_rotary_factor": 0.75}
    if rope == "longrope":  # a factor per rotated pair: 12 of the 16 dimensions rotate
        config["original_max_position_embeddings"] = 64
        config["rope_parameters"].update(short_factor=[1 + 0.2 * i for i in range(6)],
                                         long_factor=[2 + 0.5 * i for i in range(6)])
    (model_dir / "config.json").write_text(json.dumps(config))
    fast, slow = ModelRunner(model_dir, float_kernel=kernel), ModelRunner(model_dir, forward="transformers")
    assert fast.forward_kind.startswith("fast") and fast.fast.head_order.tolist() == [
        0, 1, 2, 3, 4, 5, 12, 13, 6, 7, 8, 9, 10, 11, 14, 15]
    assert (fast.fast.rope_table is None) == (rope == "longrope")
    sessions, _ = feeds_and_rollbacks(fast, slow, 3, 150, [1, 2, 5, 9, 20], 3)
    hf_forward_unchanged(fast, slow, sessions[0].tokens[:80], 256)  # (past longrope's original context)


GRANITE = {"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.2,
           "logits_scaling": 8.0}  # (Granite 3.3's, but attention's: 1/128 is for its head_dim of 128)


@pytest.mark.parametrize("tied, kernel", [(False, "specdec"), (True, "specdec"), (True, "onednn")])
def test_granite_s_multipliers_match_transformers(tmp_path, tokenizer, tied, kernel):
    """Granite: the embedding's, residual's and logits' multipliers taken into the weights
    (fold_multipliers; tied: the output layer is the scaled embedding table), the attention's as its
    scale; transformers' logits through feeds and rollbacks, and the HF model's own forward unchanged."""
    if kernel == "specdec" and not q4_kernel.available():
        pytest.skip(f"specdec's kernel is not built here: {q4_kernel.path()}")
    model_dir = make_model(tmp_path / "m", tokenizer, arch="granite", hidden=64, layers=2, heads=4, kv_heads=2,
                           max_context=256, init_std=0.1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.update({**GRANITE, "tie_word_embeddings": tied})
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.save_pretrained(model_dir)
    fast, slow = ModelRunner(model_dir, float_kernel=kernel), ModelRunner(model_dir, forward="transformers")
    assert fast.forward_kind.startswith("fast") and fast.fast.folded == {"o": 0.22, "down": 0.22}
    assert (fast.model.get_output_embeddings().weight.data_ptr() == fast.fast.embed.data_ptr()) == tied
    sessions, _ = feeds_and_rollbacks(fast, slow, 4, 120, [1, 2, 5, 9, 20], 3)
    hf_forward_unchanged(fast, slow, sessions[0].tokens[:30], 256)


@pytest.mark.parametrize("arch, kernel, kv_dtype", [("mistral", "specdec", "auto"), ("mistral", "onednn", "auto"),
                                                   ("phi3", "specdec", "auto"), ("mistral", "specdec", "float16")])
def test_a_sliding_window_matches_transformers(tmp_path, tokenizer, arch, kernel, kv_dtype):
    """Mistral's and Phi-3's sliding window (a query sees the last `sliding_window` keys up to its own)
    in every loop (the C++ loop's float32 and float16 attention, TorchScript's with its mask, the KV
    pool's slots): two sessions fed together and apart, 1..20 tokens a feed, rollbacks, far past the
    window, against transformers' forward over each whole sequence."""
    if kernel == "specdec" and not q4_kernel.available():
        pytest.skip(f"specdec's kernel is not built here: {q4_kernel.path()}")
    model_dir = make_model(tmp_path / arch, tokenizer, arch=arch, hidden=64, layers=2, heads=4, kv_heads=2,
                           max_context=256, init_std=0.1)
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "sliding_window": 24, "use_sliding_window": True}))
    fast = ModelRunner(model_dir, float_kernel=kernel, kv_dtype=kv_dtype)
    assert fast.forward_kind.startswith("fast") and fast.fast.window == 24
    reference = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    atol = 5e-3 if kv_dtype == "float16" else 1e-4  # (keys and values rounded to float16)
    rng = random.Random(5)
    sessions = [fast.start_session(f"s{i}", 0) for i in range(2)]
    checked = 0
    while len(sessions[0].tokens) < 160:
        feeds = []
        for session in sessions[: rng.choice([1, 2])]:
            new = [rng.randrange(fast.vocab_size) for _ in range(rng.choice([1, 1, 2, 5, 9, 20]))]
            session.tokens.extend(new)
            feeds.append((session, len(new)))
        outs = fast.forward_many(feeds)
        for (session, n), out in zip(feeds, outs):
            with torch.inference_mode():
                want = reference(torch.tensor([session.tokens])).logits[0, -n:]
            torch.testing.assert_close(out, want, atol=atol, rtol=atol)
            checked += 1
            back = rng.randint(0, min(3, len(session.tokens) - 1))
            session.truncate(len(session.tokens) - back)
    assert checked > 20
    with torch.inference_mode():  # (the window matters here: transformers without it differs)
        ids = torch.tensor([sessions[0].tokens])
        windowed = reference(ids).logits[0, -1]
        reference.config.sliding_window = None
        assert (reference(ids).logits[0, -1] - windowed).abs().max() > 1e-2


def test_refits_rows_already_cached(tmp_path, tokenizer):
    """Scoring more rows than were fed steps the cache back and re-feeds them, as the target does."""
    model_dir = make_model(tmp_path / "m", tokenizer, init_std=0.1)
    fast, slow = ModelRunner(model_dir), ModelRunner(model_dir, forward="transformers")
    prompt = list(range(5, 40))
    outs = []
    for runner in (fast, slow):
        session = runner.start_session("s", 0)
        session.tokens.extend(prompt)
        runner.forward(session, 1)
        outs.append(runner.forward(session, 3))  # nothing new: the last 3 positions again
    torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)


def test_falls_back_where_it_would_differ(tmp_path, tokenizer):
    """A sliding window shorter than the context, where transformers' forward keeps it to some layers (Qwen2's
    max_window_layers), keeps the transformers forward."""
    model_dir = make_model(tmp_path / "m", tokenizer, arch="qwen2", max_context=512)
    model = ModelRunner(model_dir).model
    model.config.sliding_window, model.config.use_sliding_window = 64, True
    assert FastForward.build(model, max_context=512) is None
    assert FastForward.build(model, max_context=64) is not None
    # what it does not run is named (ModelRunner's refusals of --quantize int4 and tensor parallelism say it)
    assert unsupported(model.config, 512) == ("it attends over a sliding window of 64 tokens, less than its context"
                                              " of 512 (the lean forward's sliding windows: mistral, phi3's)")
    assert unsupported(model.config, 64) is None
    for change, said in (({"model_type": "gemma"}, "its architecture is gemma (the lean forward's: granite, llama,"
                                                   " mistral, phi3, qwen2, qwen3, smollm3)"),
                         ({"hidden_act": "gelu"}, "its activation is gelu"), ({"mlp_bias": True}, "MLP projections"),
                         ({"attention_bias": True, "model_type": "llama"}, "attention projections have biases"),
                         ({"rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}},
                          "it rotates 12 of each head's 16 dimensions, which transformers' qwen2 does not"),
                         ({"model_type": "phi3", "partial_rotary_factor": 0.3125},
                          "it rotates 5 of each head's 16 dimensions (the lean forward's RoPE: an even split)")):
        config = SimpleNamespace(**{**model.config.to_dict(), "sliding_window": None, **change})
        assert said in unsupported(config, 512)
    # transformers' Qwen2, Qwen3 and SmolLM3 slide the layers their layer_types say, whatever use_sliding_window says
    for arch in ("qwen2", "smollm3"):
        config = SimpleNamespace(**{**model.config.to_dict(), "model_type": arch, "sliding_window": 64,
                                    "use_sliding_window": False, "layer_types": ["full_attention", "sliding_attention"]})
        assert "it attends over a sliding window of 64 tokens" in unsupported(config, 512)
        assert unsupported(SimpleNamespace(**{**vars(config), "layer_types": ["full_attention"] * 2}), 512) is None
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, "sliding_window": 64, "use_sliding_window": True}))
    with pytest.raises(ValueError, match="int4 needs the lean forward, which m has not: it attends over a sliding"):
        ModelRunner(model_dir, quantize="int4")


def test_kv_cache_crop():
    cache = KVCache(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"), capacity=4)
    cache.reserve(9)
    assert cache.data.shape[4] == 16
    cache.length = 9
    cache.crop(-4)
    assert cache.get_seq_length() == 5
    cache.crop(7)  # keeps at most 7: nothing to drop
    assert cache.get_seq_length() == 5
    cache.crop(2)
    assert cache.get_seq_length() == 2
    cache.crop(-10)
    assert cache.get_seq_length() == 0


def test_a_cache_of_its_own_holds_zeros_past_what_it_was_given_even_in_recycled_memory():
    """A graphed pass reads every position of its storage, masked (cuda_graphs.py): garbage there must
    not be NaN, or 0 x NaN poisons the pass (a recycled address looks like a storage already cleaned).
    Memory that held NaNs is freed just before each allocation, so that the allocator hands it out again."""
    cpu = torch.device("cpu")
    for _ in range(20):
        torch.full((1, 2, 1, 1, 4, 2), float("nan"))  # (a NaN-filled block of the size the cache takes, freed)
        cache = KVCache(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=cpu, capacity=4)
        assert not cache.data.isnan().any() and (cache.data == 0).all()
        cache.data[..., :3, :] = 1.0
        cache.length = 3
        torch.full((1, 2, 1, 1, 8, 2), float("nan"))
        cache.reserve(6)  # grown: what it held, then zeros
        assert (cache.data[..., :3, :] == 1).all() and (cache.data[..., 3:, :] == 0).all()


def test_rejects_unknown_forward(tmp_path, tokenizer):
    model_dir = make_model(tmp_path / "m", tokenizer)
    with pytest.raises(ValueError, match="--forward"):
        ModelRunner(model_dir, forward="fastest")


def test_a_float_kernel_names_only_what_runs(tmp_path, tokenizer):
    """The float32 kernels are CPU float32 products: a half-precision model runs torch's own and its
    forward_kind names none; asking for one there by name is refused, not ignored."""
    model_dir = make_model(tmp_path / "m", tokenizer)
    runner = ModelRunner(model_dir, "cpu", dtype="bfloat16")
    assert runner.fast.float_kernel == "none" and runner.fast.lm_head_packed is None
    assert "panels" not in runner.forward_kind and "oneDNN" not in runner.forward_kind
    session = runner.start_session("s", 0)
    session.tokens.extend([1, 2, 3])
    assert runner.fast.embed.dtype == torch.bfloat16 and torch.isfinite(runner.forward(session)).all()
    for kernel in ("specdec", "onednn"):
        with pytest.raises(ValueError, match=f"float_kernel {kernel} runs float32 weights on CPU; these are bfloat16"):
            ModelRunner(model_dir, "cpu", dtype="bfloat16", float_kernel=kernel)
    # built on CPU in float32 (auto picks a kernel there), its weights then no longer CPU float32 (a
    # tensor-parallel rank's shard moves to its GPU so, FastForward.to): packed again, the kernel auto
    # picked is not taken for one asked for
    fast = ModelRunner(model_dir, "cpu").fast
    assert fast.float_kernel in ("specdec", "onednn")
    fast.model.to(torch.bfloat16)  # (in place: fast.embed follows, as it follows a move to a GPU)
    fast.pack()
    assert fast.embed.dtype == torch.bfloat16 and fast.float_kernel == "none"


# longrope picks its frequencies from the longest position of the rotary module's call: a short
# session batched with one past original_max_position_embeddings must still get its own
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 32,
            "short_factor": [1.0] * 8, "long_factor": [4.0 + i for i in range(8)]}


@pytest.mark.parametrize("forward,rope,script", [("auto", None, True), ("auto", None, False), ("transformers", None, False),
                                                 ("auto", LONGROPE, True)],
                         ids=["fast", "fast eager loop", "transformers", "fast longrope"])
def test_batched_forward_matches_one_at_a_time(tmp_path, tokenizer, forward, rope, script):
    """Sessions of different lengths fed different numbers of tokens in one pass, with rollbacks
    between passes, get the logits each gets alone (the lean forward's layer loop in TorchScript,
    or eager)."""
    model_dir = make_model(tmp_path / "m", tokenizer, hidden=64, layers=2, heads=4, kv_heads=2, init_std=0.1)
    if rope is not None:
        config = json.loads((model_dir / "config.json").read_text())
        config["rope_parameters"] = rope
        (model_dir / "config.json").write_text(json.dumps(config))
    batched, alone = ModelRunner(model_dir, forward=forward), ModelRunner(model_dir, forward=forward)
    if rope is not None:
        assert batched.fast.rope_table is None  # the module's own call, per session
    if batched.fast is not None:
        assert batched.fast.scripted == (scripted.LAYERS is not None)  # on by default
        batched.fast.scripted = alone.fast.scripted = script and scripted.LAYERS is not None
    rng = random.Random(1)
    ids = [f"s{i}" for i in range(5)]
    pairs = [(batched.start_session(i, 0), alone.start_session(i, 0)) for i in ids]
    for step in range(12):
        feeds, expected = [], []
        for b, a in rng.sample(pairs, len(pairs) if step == 0 else rng.randint(1, len(pairs))):  # a varying subset
            new = [rng.randrange(batched.vocab_size) for _ in range(rng.randint(1, 30 if step == 0 else 6))]
            num_logits = rng.randint(1, len(new))
            b.tokens.extend(new)
            a.tokens.extend(new)
            feeds.append((b, num_logits))
            expected.append(alone.forward(a, num_logits))
        got = batched.forward_many(feeds)
        assert [g.shape for g in got] == [e.shape for e in expected]
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e, atol=1e-4, rtol=1e-4)
        for b, a in pairs:
            back = rng.randint(0, min(3, len(b.tokens) - 1))
            b.truncate(len(b.tokens) - back)
            a.truncate(len(a.tokens) - back)


@pytest.mark.parametrize("script", [True, False], ids=["TorchScript loop", "eager loop"])
def test_slot_attention_matches_transformers(tmp_path, tokenizer, monkeypatch, script):
    """Passes over pooled sessions run attention as one call over their slots: with sessions of
    different lengths fed different numbers of tokens, slots left free between them, sessions
    ended and new ones taking their slots, and sessions that outgrow the pool moving to caches of
    their own, every session gets transformers' logits, and the one-call path does run."""
    if script and scripted.LAYERS is None:
        pytest.skip("this torch has no TorchScript")
    model_dir = make_model(tmp_path / "m", tokenizer, hidden=64, layers=2, heads=4, kv_heads=2, init_std=0.1)
    fast, slow = ModelRunner(model_dir), ModelRunner(model_dir, forward="transformers")
    fast.fast.pool_capacity = 40  # sessions past 40 positions move out of the pool
    fast.fast.scripted = script
    fast.fast.fused_layers = False  # TorchScript's loop, not specdec's C++ one (which has no slot batches)
    calls = []  # passes that took the one-call path
    slot_batch = fast_forward.slot_batch

    def counted(*args):
        batch = slot_batch(*args)
        if batch is not None:
            calls.append(1)
        return batch

    monkeypatch.setattr(fast_forward, "slot_batch", counted)
    rng = random.Random(3)
    live: dict[str, tuple] = {}
    moved = started = 0
    for step in range(60):
        while len(live) < 6:  # new sessions take the slots ended ones gave back
            sid = f"s{started}"
            started += 1
            live[sid] = (fast.start_session(sid, 0), slow.start_session(sid, 0))
        chosen = rng.sample(sorted(live), rng.randint(2, len(live)))
        feeds, expected = [], []
        width = rng.randint(1, 6)  # a pass's feeds are mostly alike (draft steps, verifies of one K)
        for sid in chosen:
            f, s = live[sid]
            n = rng.randint(1, 20) if not f.tokens else width if rng.random() < 0.8 else rng.randint(1, 6)
            new = [rng.randrange(fast.vocab_size) for _ in range(n)]
            num_logits = rng.randint(1, len(new))
            f.tokens.extend(new)
            s.tokens.extend(new)
            feeds.append((f, num_logits))
            expected.append(slow.forward(s, num_logits))
        for got, want in zip(fast.forward_many(feeds), expected):
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
        for sid in list(live):
            f, s = live[sid]
            back = rng.randint(0, max(0, min(2, len(f.tokens) - 1)))
            f.truncate(len(f.tokens) - back)
            s.truncate(len(s.tokens) - back)
            moved += not f.cache.pooled
            if step % 20 == 19 or rng.random() < 0.05 or len(f.tokens) > 80:  # mostly in cohorts
                del live[sid]
                fast.sessions.release(sid)
                slow.sessions.release(sid)
    assert len(calls) >= 8 and moved > 0 and started > 8, (len(calls), moved, started)
    del feeds, f, s  # the last step's sessions, released or not
    pool = fast.fast.pool
    held = [f.cache.slot for f, _ in live.values() if f.cache.pooled]
    assert sorted(pool.free + pool.returned + held) == list(range(pool.slots))
    unpooled = ModelRunner(model_dir, kv_pool_capacity=0)  # --kv-pool-capacity 0: caches of their own
    assert not unpooled.start_session("s", 0).cache.pooled and unpooled.fast.pool is None


def test_kv_pool_grows_shrinks_and_keeps_what_it_holds():
    pool = KVPool(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
                  max_capacity=64, slots=2, capacity=4)
    caches = [KVCache(1, 1, 2, torch.float32, torch.device("cpu"), pool=pool) for _ in range(5)]
    assert [c.slot for c in caches] == [0, 1, 2, 3, 4] and pool.slots == 8  # doubled twice
    for n, c in enumerate(caches):
        with torch.inference_mode():  # as the passes write
            c.data[0, 0, 0, 0, :3] = n
        c.length = 3
    caches[1].reserve(9)  # every slot grows
    assert pool.capacity == 16
    assert [c.data[0, 0, 0, 0, :3, 0].tolist() for c in caches] == [[n] * 3 for n in range(5)]
    del caches[1]  # its slot is free again: the next cache takes it
    assert KVCache(1, 1, 2, torch.float32, torch.device("cpu"), pool=pool).slot == 1  # (and frees it once made)
    caches[3].reserve(65)  # past max_capacity: out of the pool, what it held kept
    assert not caches[3].pooled and caches[3].data.shape[4] >= 65 and caches[3].data[0, 0, 0, 0, :3, 0].tolist() == [4] * 3
    del caches[2:]
    again = KVCache(1, 1, 2, torch.float32, torch.device("cpu"), pool=pool)  # upper half free: the pool halves
    assert pool.slots == 4 and again.slot == 1 and caches[0].data[0, 0, 0, 0, :3, 0].tolist() == [0] * 3
    del caches, again
    KVCache(1, 1, 2, torch.float32, torch.device("cpu"), pool=pool)
    assert (pool.slots, pool.capacity) == (2, 4)  # nothing held: back to the first size


def test_kv_pool_stays_within_its_waste_bound(monkeypatch):
    """Past its floor the pool grows only while it holds at most POOL_WASTE x the positions its
    sessions use; a session it will not grow for keeps a cache of its own, and a pool its long
    session left shrinks its capacity at the next take."""
    import model_service.kv_cache as ff

    monkeypatch.setattr(ff, "POOL_FLOOR_BYTES", 0)
    pool = KVPool(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
                  max_capacity=1024, slots=4, capacity=4)
    new = partial(KVCache, 1, 1, 2, torch.float32, torch.device("cpu"), pool=pool)
    caches = [new() for _ in range(4)]
    for c in caches:
        c.length = 3
    caches[0].reserve(8)  # 4 slots x 8 = 32 positions <= 2 x (12 held + 8): grows
    assert caches[0].pooled and pool.capacity == 8
    caches[0].length = 8
    caches[0].reserve(40)  # 4 x 64 = 256 > 2 x (17 + 40): moves out, what it held kept
    assert not caches[0].pooled and caches[0].data.shape[4] >= 40 and pool.capacity == 8
    back = new()
    assert back.slot == 0  # its slot is free again
    spare = [new() for _ in range(2)]  # a fifth and sixth session: 8 slots x 8 = 64 > 2 x 9 held
    assert [c.pooled for c in spare] == [False, False] and pool.slots == 4
    monkeypatch.setattr(ff, "POOL_FLOOR_BYTES", 1 << 20)  # under the floor the pool grows freely
    assert new().pooled and pool.slots == 8
    for c in caches[1:]:
        c.length = 1
    new()  # every session fits a quarter of 8 positions: the capacity halves
    assert pool.capacity == 4


def test_kv_pool_give_from_a_finalizer_inside_take_does_not_block():
    """The garbage collector may run a cache's finalizer (give) at any allocation, even inside
    take, which holds the pool's lock, in the same thread: give must not wait for that lock."""
    pool = KVPool(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
                  max_capacity=64, slots=2, capacity=4)
    new = partial(KVCache, 1, 1, 2, torch.float32, torch.device("cpu"), pool=pool)
    kept, gone = new(), new()
    gone._give_back.detach()  # given back below instead, as its finalizer would
    lengths = pool._lengths

    def collected_meanwhile():
        pool.give(gone.slot)
        return lengths()

    pool._lengths = collected_meanwhile
    made = []
    worker = threading.Thread(target=lambda: made.append(new()), daemon=True)
    worker.start()
    worker.join(5)
    stuck = worker.is_alive()
    if stuck:  # let it go on, so that this fails rather than hangs the run
        pool.lock.release()
        worker.join(5)
    assert not stuck and made[0].pooled and kept.pooled
    assert sorted(pool.free + pool.returned + [kept.slot, made[0].slot]) == list(range(pool.slots))


def test_slot_attention_is_not_poisoned_by_what_a_slot_held_before(tmp_path, tokenizer):
    """One-call attention reads past each slot's length (masked, but 0 x NaN is NaN): a NaN left
    by a released session in its slot, or at tokens a session rolled back, must not reach the
    logits of the session using that slot next."""
    model_dir = make_model(tmp_path / "m", tokenizer, hidden=64, layers=2, heads=4, kv_heads=2, init_std=0.1)
    fast, alone = ModelRunner(model_dir), ModelRunner(model_dir, kv_pool_capacity=0)
    a, b = fast.start_session("a", 0), fast.start_session("b", 0)
    a.tokens.extend(range(5, 45))
    b.tokens.extend(range(5, 15))
    fast.forward_many([(a, 1), (b, 1)])
    with torch.inference_mode():  # as a NaN from an fp16 overflow would be
        fast.fast.pool.data[:, :, a.cache.slot] = float("nan")
    slot = a.cache.slot
    fast.sessions.release("a")
    del a
    c = fast.start_session("c", 0)  # takes the slot "a" held
    assert c.cache.slot == slot
    c.tokens.extend(range(7, 23))
    b.tokens.extend([3, 4, 5, 6])
    with torch.inference_mode():  # and NaN at tokens b is about to roll back
        fast.fast.pool.data[:, :, b.cache.slot, :, 10:14] = float("nan")
    b.cache.length = b.cached = 14
    b.truncate(10)
    b.tokens.extend([3, 4])  # it ends at 12, c at 16: the call reads b's positions 12..15 too
    got = fast.forward_many([(c, 16), (b, 2)])
    ref_c, ref_b = alone.start_session("c", 0), alone.start_session("b", 0)
    ref_c.tokens.extend(range(7, 23))
    ref_b.tokens.extend([*range(5, 15), 3, 4])
    torch.testing.assert_close(got[0], alone.forward(ref_c, 16), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got[1], alone.forward(ref_b, 2), atol=1e-4, rtol=1e-4)


def test_kv_pool_does_not_halve_and_double_back_at_each_take(monkeypatch):
    pool = KVPool(layers=1, kv_heads=1, head_dim=2, dtype=torch.float32, device=torch.device("cpu"),
                  max_capacity=64, slots=2, capacity=4)
    new = partial(KVCache, 1, 1, 2, torch.float32, torch.device("cpu"), pool=pool)
    held = [new(), new(), new()]  # 4 slots
    held.pop()  # the upper half free, the lower one held
    resizes = []
    resize = pool._resize
    monkeypatch.setattr(pool, "_resize", lambda *args: resizes.append(args) or resize(*args))
    more = new()
    assert more.slot == 2 and pool.slots == 4 and resizes == []


@pytest.mark.skipif(scripted.LAYERS is None, reason="this torch has no TorchScript")
@pytest.mark.parametrize("arch,weights", [("llama", "float"), ("llama", "packed"), ("llama", "panels"),
                                          ("llama", "int4"), ("qwen2", "packed"), ("qwen2", "panels"),
                                          ("qwen2", "int4"), ("qwen3", "float"), ("qwen3", "int4"),
                                          ("smollm3", "int4")])
def test_scripted_layers_compute_the_eager_loop(tmp_path, tokenizer, monkeypatch, arch, weights):
    """One sequence's layers run by TorchScript (scripted.LAYERS) give the eager loop's logits, through
    random feeds of 1..9 tokens, partial logits and rollbacks: float weights as x @ w, oneDNN-packed
    (every weight packed: pack_min 0), in specdec's panels, int4; with q/k/v biases (qwen2), with each q and k
    head's norm (qwen3), with a layer without RoPE (smollm3)."""
    model_dir = make_model(tmp_path / arch, tokenizer, arch=arch, hidden=64, layers=2, heads=4, kv_heads=2,
                           max_context=512, init_std=0.1)
    runner = ModelRunner(model_dir, "cpu", quantize="int4" if weights == "int4" else "none",
                         float_kernel="specdec" if weights == "panels" else "onednn", kv_dtype="float32")
    fast = runner.fast
    fast.fused_layers = False  # TorchScript's loop, not specdec's C++ one (tests/model_service/test_q4_kernel.py)
    if weights == "packed":
        fast.pack_min = 0
        fast.pack()
        assert fast.layers[0]["qkv_packed"] is not None
    calls = []
    layers = scripted.LAYERS
    monkeypatch.setattr(scripted, "LAYERS", lambda *args: calls.append(1) or layers(*args))
    caches = {flag: fast.new_cache() for flag in (True, False)}
    rng = random.Random(1)
    for _ in range(40):
        new = [rng.randrange(runner.vocab_size) for _ in range(rng.randint(1, 9))]
        num_logits = rng.randint(1, len(new))
        outs = {}
        for flag, cache in caches.items():
            fast.scripted = flag
            outs[flag] = fast(new, cache, num_logits)
        torch.testing.assert_close(outs[True], outs[False], atol=1e-5, rtol=1e-5)
        assert outs[True].shape == (num_logits, runner.vocab_size)
        back = rng.randint(0, 5)
        for cache in caches.values():
            cache.crop(cache.length - back)
    assert len(calls) == 40  # every scripted pass ran through LAYERS
    length = caches[True].length
    assert length == caches[False].length > 50
    torch.testing.assert_close(caches[True].data[..., :length, :], caches[False].data[..., :length, :])


@pytest.mark.skipif(scripted.LAYERS is None, reason="this torch has no TorchScript")
@pytest.mark.parametrize("weights", ["float", "packed", "panels", "int4"])
@pytest.mark.parametrize("pooled", [True, False], ids=["pool slots", "caches of their own"])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_scripted_batched_layers_compute_the_eager_loop(tmp_path, tokenizer, monkeypatch, weights, pooled, arch):
    """Passes over several sequences (ragged, partial logits, rollbacks) through TorchScript
    (scripted.LAYERS_BATCHED) give the eager loop's logits: attention as one call over pool slots,
    or per sequence over caches of their own."""
    model_dir = make_model(tmp_path / "m", tokenizer, arch=arch, hidden=64, layers=2, heads=4, kv_heads=2,
                           init_std=0.1)
    runner = ModelRunner(model_dir, "cpu", quantize="int4" if weights == "int4" else "none",
                         float_kernel="specdec" if weights == "panels" else "onednn", kv_dtype="float32")
    fast = runner.fast
    fast.fused_layers = False  # TorchScript's loop, not specdec's C++ one (tests/model_service/test_q4_kernel.py)
    if weights == "packed":
        fast.pack_min = 0
        fast.pack()
    fast.pool_capacity = 256 if pooled else 0
    sessions = {flag: [fast.new_cache() for _ in range(3)] for flag in (True, False)}
    assert all(c.pooled == pooled for c in sessions[True])
    slotted = []  # scripted passes that took the one-call path
    slot_batch = fast_forward.slot_batch

    def counted(*args):
        batch = slot_batch(*args)
        if batch is not None and fast.scripted:
            slotted.append(1)
        return batch

    monkeypatch.setattr(fast_forward, "slot_batch", counted)
    rng = random.Random(2)
    for _ in range(20):
        width = rng.randint(1, 5)  # mostly alike, as draft steps and verifies of one K are
        feeds = []
        for i in rng.sample(range(3), rng.randint(2, 3)):
            ids = [rng.randrange(runner.vocab_size) for _ in range(width if rng.random() < 0.7 else rng.randint(1, 9))]
            feeds.append((ids, i, rng.randint(1, len(ids))))
        logits = {}
        for flag, caches in sessions.items():
            fast.scripted = flag
            logits[flag] = fast.many([(ids, caches[i], n) for ids, i, n in feeds])
        for got, want, (_, _, n) in zip(logits[True], logits[False], feeds):
            assert got.shape == (n, runner.vocab_size)
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        back = rng.randint(0, 3)
        for caches in sessions.values():
            for c in caches:
                c.crop(c.length - back)
    assert (len(slotted) > 5) == pooled, len(slotted)


@pytest.mark.parametrize("script", [True, False], ids=["scripted", "eager"])
def test_one_row_through_either_product_computes_transformers_logits(tmp_path, tokenizer, monkeypatch, script):
    """pack() measures whether one row runs faster through the packed weights or `x @ w` and sets
    packed_rows; whichever it picks on the machine at hand, both give transformers' logits."""
    if not script:
        monkeypatch.setattr(scripted, "LAYERS", None)
    monkeypatch.setattr(fast_forward, "PACK_MIN_ELEMENTS", 0)  # (a toy model's weights are packed too)
    model_dir = make_model(tmp_path / "m", tokenizer, hidden=64, layers=2, heads=4, kv_heads=2, init_std=0.1)
    fast = ModelRunner(model_dir, "cpu", float_kernel="onednn")
    slow = ModelRunner(model_dir, "cpu", forward="transformers")
    assert fast.fast.packed_rows in (1, 2) and fast.fast.lm_head_packed is not None
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    for rows in (1, 2):
        fast.fast.packed_rows, fast.fast._script_args = rows, None
        sessions = [r.start_session(f"one-row-{rows}", 0) for r in (fast, slow)]
        for token in prompt:
            outs = []
            for runner, session in zip((fast, slow), sessions):
                session.tokens.append(token)
                outs.append(runner.forward(session))
            torch.testing.assert_close(outs[0], outs[1], atol=1e-4, rtol=1e-4)
