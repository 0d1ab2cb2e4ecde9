"""model_service.eagle_head: the EAGLE-3 head's serving step, its cache, its vocabulary map and
its checkpoints (speculators layout, vLLM's midlayer naming, embeddings from the target)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from model_service.eagle_head import Eagle3Config, Eagle3Head, default_aux_layer_ids
from speculative.tiny import make_model, make_tokenizer

V, VD, H = 40, 24, 32


def tiny_config(**overrides) -> Eagle3Config:
    return Eagle3Config(**{"hidden_size": H, "intermediate_size": 48, "num_attention_heads": 4,
                           "num_key_value_heads": 2, "head_dim": 8, "vocab_size": V, "draft_vocab_size": VD,
                           "aux_layer_ids": [0, 1, 2], "rope_theta": 10000.0, **overrides})


def random_head(seed: int = 0, **overrides) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(tiny_config(**overrides))
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.3)
        head.embed_tokens.weight.normal_()
    head.set_vocab(torch.randperm(V)[:VD].sort().values)
    return head.eval()


def run(head: Eagle3Head, ids, hidden, positions, cache):
    with torch.no_grad():
        return head.step(ids, hidden, positions, cache)


def test_many_rows_at_once_equal_one_row_at_a_time():
    head = random_head()
    S = 7
    ids, hidden = torch.randint(0, V, (S,)), head.fuse(torch.randn(S, 3 * H))
    together = run(head, ids, hidden, torch.arange(S), head.new_cache())
    cache, rows = head.new_cache(), []
    for i in range(S):
        rows.append(run(head, ids[i : i + 1], hidden[i : i + 1], torch.tensor([i]), cache))
    assert cache.length == S
    for got, want in zip((torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])), together):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a draft step fed its own out_hidden attends to the cache (the earlier rows change its output)
    chained = run(head, ids[:1], together[0][-1:], torch.tensor([S]), cache)
    alone = run(head, ids[:1], together[0][-1:], torch.tensor([S]), head.new_cache())
    assert not torch.allclose(chained[1], alone[1])


@pytest.mark.parametrize("bias", [False, True])
def test_joined_projections_compute_what_the_separate_ones_do(bias, tmp_path):
    """fuse_projections (serving): q/k/v and gate/up as one linear each give the same step."""
    head = random_head(2, attention_bias=bias)
    ids, hidden = torch.randint(0, V, (5,)), torch.randn(5, H)
    want = run(head, ids, hidden, torch.arange(5), head.new_cache())
    head.layer.fuse_projections()
    assert head.layer.qkv_proj.weight.shape[0] == (4 + 2 * 2) * 8
    got = run(head, ids, hidden, torch.arange(5), head.new_cache())
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    with torch.no_grad():  # the joined linear is the one that runs: a changed q/k/v weight changes the step
        head.layer.qkv_proj.weight.mul_(2)
    assert not torch.allclose(run(head, ids, hidden, torch.arange(5), head.new_cache())[1], want[1])
    assert "q_proj" not in head.layer.self_attn and "up_proj" not in head.layer.mlp  # one copy of the weights
    with pytest.raises(ValueError, match="serving"):
        head.save(tmp_path)


def test_crop_then_step_again_gives_the_same_as_before():
    head = random_head(1)
    ids, hidden = torch.randint(0, V, (9,)), torch.randn(9, H)
    cache = head.new_cache()
    run(head, ids[:5], hidden[:5], torch.arange(5), cache)
    first = run(head, ids[5:], hidden[5:], torch.arange(5, 9), cache)
    cache.crop(5)
    assert cache.length == 5
    again = run(head, ids[5:], hidden[5:], torch.arange(5, 9), cache)
    for a, b in zip(first, again):
        torch.testing.assert_close(a, b)
    cache.crop(2)  # rows of a rejected draft; the cache grows past its first allocation
    run(head, torch.randint(0, V, (100,)), torch.randn(100, H), torch.arange(2, 102), cache)
    assert cache.length == 102


def test_draft_ids_map_to_target_ids():
    head = random_head()
    ids = torch.arange(V)[torch.arange(V) % 5 != 1][:VD]  # 0, 2, 3, 4, 5, 7, ...: ascending, VD of them
    head.set_vocab(ids)
    assert head.d2t[:6].tolist() == [0, 1, 1, 1, 1, 2]  # target_id = draft_id + d2t[draft_id]
    assert head.draft_to_target(torch.arange(VD)).tolist() == ids.tolist()
    assert head.draft_to_target(torch.tensor([[5, 0]])).tolist() == [[7, 0]]
    assert head.t2d.nonzero().flatten().tolist() == ids.tolist()


def test_save_and_load_round_trip(tmp_path):
    head = random_head(2, norm_before_residual=True, rope_scaling={"rope_type": "linear", "factor": 2.0})
    head.save(tmp_path, dtype=torch.float32, embeddings=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == VD
    assert config["eagle_aux_hidden_state_layer_ids"] == [0, 1, 2] and config["norm_before_residual"] is True
    assert config["transformer_layer_config"]["num_hidden_layers"] == 1
    loaded = Eagle3Head.load(tmp_path)
    assert loaded.config.rope_scaling == {"rope_type": "linear", "factor": 2.0}
    ids, hidden = torch.randint(0, V, (4,)), torch.randn(4, H)
    for a, b in zip(run(head, ids, hidden, torch.arange(4), head.new_cache()),
                    run(loaded, ids, hidden, torch.arange(4), loaded.new_cache())):
        torch.testing.assert_close(a, b)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)
    # bf16 by default, and no embedding when it came from the target
    loaded.embeddings_from_target = True
    loaded.save(tmp_path / "bf16")
    from safetensors import safe_open
    with safe_open(tmp_path / "bf16" / "model.safetensors", "pt") as f:
        assert "embed_tokens.weight" not in set(f.keys()) and f.get_tensor("fc.weight").dtype == torch.bfloat16
        assert f.get_tensor("d2t").dtype == torch.int64 and f.get_tensor("t2d").dtype == torch.bool


def speculators_checkpoint(directory, head: Eagle3Head, names: str, config: dict) -> None:
    """A checkpoint written as speculators or an older vLLM EAGLE-3 head would write it."""
    state = {k: v.clone().contiguous() for k, v in head.state_dict().items() if k != "embed_tokens.weight"}
    if names == "midlayer":
        state = {k.replace("layers.0.", "midlayer."): v for k, v in state.items()}
    directory.mkdir()
    save_file(state, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps(config))


def target_dir(tmp_path, hidden=H, layers=8):
    tokenizer = make_tokenizer(tmp_path / "tok", "chars")
    return make_model(tmp_path / "target", tokenizer, hidden=hidden, layers=layers, heads=4, kv_heads=2,
                      vocab_size=V)


def test_a_speculators_checkpoint_loads_with_the_targets_embeddings(tmp_path):
    head = random_head(3)
    target = target_dir(tmp_path)
    layer = {"model_type": "llama", "hidden_size": H, "intermediate_size": 48, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "vocab_size": V, "num_hidden_layers": 1, "rms_norm_eps": 1e-5,
             "rope_theta": 10000.0, "max_position_embeddings": 512}
    speculators_checkpoint(tmp_path / "spec", head, "layers", {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3", "draft_vocab_size": VD,
        "norm_before_residual": False, "eagle_aux_hidden_state_layer_ids": [0, 1, 2],
        "transformer_layer_config": layer, "speculators_config": {"verifier": {"name_or_path": str(target)}}})
    loaded = Eagle3Head.load(tmp_path / "spec")  # the verifier's path from the config
    from model_service.eagle_head import read_target_tensor
    assert loaded.embeddings_from_target
    torch.testing.assert_close(loaded.embed_tokens.weight, read_target_tensor(target, "model.embed_tokens.weight"))
    head.embed_tokens.weight.data.copy_(loaded.embed_tokens.weight)
    ids, hidden = torch.randint(0, V, (5,)), torch.randn(5, H)
    for a, b in zip(run(head, ids, hidden, torch.arange(5), head.new_cache()),
                    run(loaded, ids, hidden, torch.arange(5), loaded.new_cache())):
        torch.testing.assert_close(a, b)
    loaded.save(tmp_path / "again")  # embeddings from the target are not written back
    from safetensors import safe_open
    with safe_open(tmp_path / "again" / "model.safetensors", "pt") as f:
        assert "embed_tokens.weight" not in set(f.keys()) and "layers.0.hidden_norm.weight" in set(f.keys())


def test_vllms_older_flat_config_with_midlayer_names(tmp_path):
    head = random_head(4)
    target = target_dir(tmp_path, layers=10)
    speculators_checkpoint(tmp_path / "old", head, "midlayer", {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": H,
        "intermediate_size": 48, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "vocab_size": V,
        "num_hidden_layers": 1, "draft_vocab_size": VD, "rms_norm_eps": 1e-5, "rope_theta": 10000.0})
    loaded = Eagle3Head.load(tmp_path / "old", target_dir=target)
    assert loaded.config.aux_layer_ids == default_aux_layer_ids(10) == [2, 5, 7]
    assert loaded.config.norm_before_residual is False  # as vLLM reads a flat config without the key
    torch.testing.assert_close(loaded.layer.self_attn["q_proj"].weight, head.layer.self_attn["q_proj"].weight)
    with pytest.raises(ValueError, match="target"):  # neither aux ids nor embeddings without it
        Eagle3Head.load(tmp_path / "old")
    # paths that name no directory are named as such (a missing target's read as the head's missing embedding)
    with pytest.raises(FileNotFoundError, match="the target's directory .*nowhere is not a directory"):
        Eagle3Head.load(tmp_path / "old", target_dir=tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="nowhere is not an EAGLE head's directory"):
        Eagle3Head.load(tmp_path / "nowhere", target_dir=target)


def test_heads_this_module_cannot_run_are_refused():
    config = Eagle3Config.to_dict(tiny_config())
    for change in ({"norm_before_fc": True}, {"transformer_layer_config": {**config["transformer_layer_config"],
                                                                         "num_hidden_layers": 2}}):
        with pytest.raises(ValueError, match="not supported"):
            Eagle3Config.from_dict({**config, **change})
    assert Eagle3Config.from_dict(config) == tiny_config()


@pytest.mark.parametrize("scaling", [None, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
                                     {"rope_type": "dynamic", "factor": 2.0}])
def test_rope_rows_are_the_rotary_modules_own(scaling):
    """The head's RoPE (a table of rows it grows as positions pass it) gives what transformers' rotary
    module computes, for any positions, in float32 and bf16, and with scaled variants (a dynamic
    one, whose frequencies depend on the length, calls the module)."""
    head = random_head(rope_scaling=scaling, max_position_embeddings=128)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, 1, 8, dtype=dtype)
        for positions in (torch.tensor([[0, 5, 17]]), torch.arange(300, 700).reshape(2, 200),
                          torch.tensor([[3]])):
            got, want = head.rope(x, positions), head.rotary(x, positions)
            for g, w in zip(got, want):
                assert g.dtype == dtype and g.shape == w.shape
                torch.testing.assert_close(g, w, atol=0, rtol=0)
    assert (head._rope_rows is None) == (scaling is not None and scaling["rope_type"] == "dynamic")


def relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.mark.parametrize("shape", [{"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8},
                                   {"num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64,
                                    "norm_before_residual": True}])
def test_the_fused_int4_step_computes_the_op_by_op_step(shape):
    """An int4 head's step in one call (q4_eagle_step) against the same head op by op (the same
    Q4Linear products between torch's norms, RoPE, attention and MLP): a prompt's rows, then
    several sessions a row each at different lengths; each path keeps its own caches, both are fed
    the op-by-op outputs. Activations go through int8 blocks, so a last-bit difference before a
    product can flip a rounding: the bound is a few percent, far under what a wrong step gives."""
    from model_service import q4_kernel

    if not q4_kernel.available():
        pytest.skip("specdec's int4 kernel is not built here")
    head = random_head(3, intermediate_size=64, **shape)
    head.layer.fuse_projections()
    with torch.no_grad():
        head.quantize_int4()
    assert head._q4_step is not None
    fused = head._q4_step

    def both(call):
        """call(caches) on the fused path and op by op -> (fused, op-by-op) results."""
        head._q4_step = fused
        got = call(fused_caches)
        head._q4_step = None
        want = call(plain_caches)
        head._q4_step = fused
        return got, want

    # a prompt past the cache's first 64 rows (it grows) and 16 keys (the AVX-512 attention's
    # blocks), a short one, one row
    lengths = [70, 5, 1]
    fused_caches = [head.new_cache() for _ in lengths]
    plain_caches = [head.new_cache() for _ in lengths]
    last = []
    with torch.no_grad():
        for s, n in enumerate(lengths):
            ids, hidden = torch.randint(0, V, (n,)), head.fuse(torch.randn(n, 3 * H))
            (out, logits), (want_out, want_logits) = both(lambda caches: head.step(ids, hidden, torch.arange(n), caches[s]))
            assert relative(out, want_out) < 0.03 and relative(logits, want_logits) < 0.03
            assert head.step(ids, hidden, torch.arange(n), head.new_cache(), logits=False)[1] is None
            # the logits of rows taken in without them (EagleDraft's first draft): the step's own, bit for bit
            assert torch.equal(head.logits(out), logits)
            last.append(want_out[-1])
        for k in range(4):
            ids = torch.randint(0, V, (len(lengths),))
            positions = torch.tensor([n + k for n in lengths])
            (out, logits), (want_out, want_logits) = both(
                lambda caches: head.step_many(ids, torch.stack(last), positions, caches, int(positions.max()) + 1))
            assert relative(out, want_out) < 0.03 and relative(logits, want_logits) < 0.03
            assert torch.equal(logits.argmax(-1), want_logits.argmax(-1))
            last = list(want_out)
    with pytest.raises(RuntimeError, match="q4_output: x must be float32 \\[rows, in\\]"):
        torch.ops.specdec.q4_output(torch.zeros(H), *[part[i] for part, i in zip(fused, (3, 4, 4))], 1e-5)
    for got, want in zip(fused_caches, plain_caches):
        assert got.length == want.length
        assert relative(got.k[:, : got.length], want.k[:, : want.length]) < 0.03
        assert relative(got.v[:, : got.length], want.v[:, : want.length]) < 0.03
