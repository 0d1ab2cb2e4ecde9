"""Tensor-parallel ranks load only their own shard (model_service/loading.py): a rank's slices are
exactly the shard the whole model gives (`sharding.shard`), tensor for tensor; a rank's peak
resident memory while loading is a fraction of a whole load's; the sharded model's logits are
TP = 1's."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from model_service.fast_forward import FastForward
from model_service.loading import load_model
from model_service.sharding import adopt_shard, shard
from speculative.tiny import make_tokenizer

ROOT = Path(__file__).resolve().parents[2]
CPU = torch.device("cpu")
LAYER_KEYS = ("in_norm", "post_norm", "qkv", "qkv_bias", "qk_norm", "sizes", "o", "gate_up", "half", "down",
              "scaling", "rope")


def save_model(out: Path, arch: str = "llama", *, tied: bool = False, hidden: int = 64, heads: int = 4,
               kv_heads: int = 2, intermediate: int = 96, layers: int = 2, vocab: int = 101, seed: int = 0,
               bin: bool = False, **save) -> Path:
    """A random-weight model saved with save_pretrained (bin: as a pytorch_model.bin instead); arch
    "phi3+partial": RoPE over 3/4 of each head's dimensions."""
    arch, _, partial = arch.partition("+")
    config = AutoConfig.for_model(arch, vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                  num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                  max_position_embeddings=256, tie_word_embeddings=tied, pad_token_id=0,
                                  bos_token_id=0, eos_token_id=0,  # (Phi-3's defaults lie past a small vocabulary)
                                  **({"no_rope_layer_interval": 2} if arch == "smollm3" else {}))
    if partial:
        config.rope_parameters["partial_rotary_factor"] = 0.75
    if arch == "granite":
        config.update({"embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.2,
                       "logits_scaling": 8.0})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # norms of ones would not tell a norm from another
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
    model.save_pretrained(out, **save)
    if bin:  # save_pretrained writes safetensors only
        (out / "model.safetensors").unlink()
        torch.save(model.state_dict(), out / "pytorch_model.bin")
    return out


def forward(path: Path, rank: int, world: int, sliced: bool) -> FastForward:
    """Rank `rank` of `world`'s forward: from its slices (sliced) or from the whole model, sharded."""
    if sliced:
        loaded = load_model(path, torch.float32, CPU, rank, world)
        assert loaded.world == world
        fast = FastForward.build(loaded.model, 128)
        adopt_shard(fast, loaded.world, loaded.logits_size)
    else:
        fast = FastForward.build(AutoModelForCausalLM.from_pretrained(path).eval(), 128)
        shard(fast, rank, world)
    return fast


def assert_same_shard(a: FastForward, b: FastForward) -> None:
    def same(x, y, what):
        if isinstance(x, torch.Tensor):
            assert x.shape == y.shape and x.dtype == y.dtype and torch.equal(x, y), what
        else:
            assert x == y, what

    for i, (x, y) in enumerate(zip(a.layers, b.layers, strict=True)):
        for key in LAYER_KEYS:
            same(x[key], y[key], f"layer {i} {key}")
    for key in ("lm_head", "embed", "heads", "kv_heads", "head_dim", "vocab_size", "world", "eps"):
        same(getattr(a, key), getattr(b, key), key)
    same(a.final_norm.weight, b.final_norm.weight, "final norm")
    for x, y, what in zip(a.rope_table, b.rope_table, ("cos", "sin")):
        same(x, y, what)


@pytest.mark.parametrize("arch, tied, world, kv_heads, vocab, save", [
    ("llama", False, 2, 2, 101, {}),  # GQA; a vocabulary the ranks split unevenly (the last block padded)
    ("qwen2", True, 2, 2, 100, {}),  # q/k/v biases; lm_head tied to the embedding
    ("mistral", False, 4, 4, 103, {"max_shard_size": "40KB"}),  # a checkpoint in several files (an index)
    ("qwen3", False, 2, 2, 100, {}),  # each q and k head's norm (whole on every rank)
    ("phi3", False, 2, 2, 100, {}),  # one qkv_proj and one gate_up_proj: each section's rows split
    ("phi3+partial", False, 2, 2, 100, {}),  # RoPE over part of each head: q's and k's heads in head_order
    ("granite", False, 2, 2, 100, {}),  # its multipliers in the weights, as the whole model's
    ("smollm3", True, 2, 2, 100, {}),  # a layer without RoPE (the second, here)
])
def test_a_rank_loads_exactly_the_shard_of_the_whole_model(tmp_path, arch, tied, world, kv_heads, vocab, save):
    path = save_model(tmp_path / arch, arch, tied=tied, kv_heads=kv_heads, vocab=vocab, **save)
    assert (path / "model.safetensors.index.json").is_file() == bool(save)
    for rank in range(world):
        assert_same_shard(forward(path, rank, world, sliced=True), forward(path, rank, world, sliced=False))


def test_the_sliced_model_reports_the_whole_models_size(tmp_path):
    path = save_model(tmp_path / "m", vocab=101)
    whole = load_model(path, torch.float32, CPU)
    rank = load_model(path, torch.float32, CPU, 1, 2)
    assert (rank.num_parameters, rank.logits_size) == (whole.num_parameters, whole.logits_size) == (
        sum(p.numel() for p in whole.model.parameters()), 101)
    assert whole.world == 1 and rank.world == 2
    assert rank.model.lm_head.weight.shape == (51, 64)  # ceil(101 / 2) rows, the last one zeros
    assert not rank.model.lm_head.weight[50].any()
    assert not any(t.is_meta for t in (*rank.model.parameters(), *rank.model.buffers()))


def test_a_half_precision_rank_matches_the_whole_model_in_that_dtype(tmp_path):
    path = save_model(tmp_path / "m")
    loaded = load_model(path, torch.bfloat16, CPU, 0, 2)
    whole = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    # the rotary frequencies are computed as from_pretrained computes them (float32), not cast
    for name, buffer in whole.named_buffers():
        assert torch.equal(buffer, dict(loaded.model.named_buffers())[name]), name


def test_a_checkpoint_that_is_not_safetensors_loads_whole(tmp_path, caplog):
    path = save_model(tmp_path / "bin", bin=True)
    with caplog.at_level(logging.WARNING, logger="specdec.load"):
        loaded = load_model(path, torch.float32, CPU, 1, 2)
    assert loaded.world == 1  # the caller shards it (sharding.shard)
    assert "has no safetensors checkpoint: rank 1 loads the whole model" in caplog.text
    fast = FastForward.build(loaded.model, 128)
    shard(fast, 1, 2)
    assert_same_shard(fast, forward(save_model(tmp_path / "st"), 1, 2, sliced=True))  # the same weights


# ----------------------------------------------------------------- peak memory

# a rank's load in a fresh process, as a service or a Ray worker does it: the model, then its forward
MEASURE = """
import json, sys
from pathlib import Path
import torch
from model_service.fast_forward import FastForward
from model_service.loading import LoadMeter, import_model_code, load_model
from model_service.sharding import adopt_shard
path, rank, world = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
import_model_code(path)  # as a service does: the meter measures the weights
Path("/proc/self/clear_refs").write_text("5")  # the high-water mark from here (LoadMeter is then exact)
with LoadMeter() as meter:
    loaded = load_model(path, torch.float32, torch.device("cpu"), rank, world)
    fast = FastForward.build(loaded.model, 512)
    if loaded.world > 1:
        adopt_shard(fast, loaded.world, loaded.logits_size)
print(json.dumps(meter.record()))
"""


@pytest.fixture(scope="module")
def big_model(tmp_path_factory) -> Path:
    """~220 MB of float32 weights: 4 layers of 1024 x 2816, a 4096-token vocabulary; a tokenizer."""
    path = save_model(tmp_path_factory.mktemp("big") / "model", hidden=1024, heads=16, kv_heads=8,
                      intermediate=2816, layers=4, vocab=4096)
    make_tokenizer(path, "chars")
    return path


def measured(path: Path, rank: int, world: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", MEASURE, str(path), str(rank), str(world)], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow  # ~16 s: loads a larger model whole and on two ranks
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures Linux's VmHWM")
def test_each_rank_peaks_at_a_fraction_of_a_whole_load(big_model):
    runs = {"whole": measured(big_model, 0, 1), "rank 0 of 2": measured(big_model, 0, 2),
            "rank 1 of 2": measured(big_model, 1, 2)}
    loads = {}
    for what, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, err[-2000:]
        loads[what] = json.loads(out.strip().splitlines()[-1])
    print(json.dumps(loads))
    whole = loads.pop("whole")["peak_rss_mb"]
    assert whole > 400  # the weights' 220 MB are seen (fused and packed copies included)
    for what, load in loads.items():
        assert load["peak_rss_mb"] < 0.6 * whole, (what, load, whole)


# a model service's load, TP = 1 or 2 (rank 1 a Ray actor): each rank's record, and logits to compare
SERVE = """
import json, sys
from pathlib import Path
import torch
from model_service.model_runner import ModelRunner
path, world, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
Path("/proc/self/clear_refs").write_text("5")
runner = ModelRunner(path, "cpu", tensor_parallel=world, tp_timeout=120)
session = runner.start_session("s", 0)
session.tokens = [(7 * i) % 4096 for i in range(40)]
torch.save(runner.forward(session, 5), out)
print(json.dumps(runner.info()["rank_loads"]))
runner.close()
"""


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/clear_refs").exists(), reason="measures Linux's VmHWM")
def test_a_tensor_parallel_service_loads_shards_and_computes_tp1s_logits(big_model, tmp_path):
    loads, logits = {}, {}
    for world in (1, 2):
        out = tmp_path / f"logits-{world}.pt"
        done = subprocess.run([sys.executable, "-c", SERVE, str(big_model), str(world), str(out)], cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-3000:]
        loads[world], logits[world] = json.loads(done.stdout.strip().splitlines()[-1]), torch.load(out)
    print(json.dumps({f"TP = {world}": records for world, records in loads.items()}))
    (whole,), ranks = loads[1], loads[2]
    assert len(ranks) == 2
    for rank, load in enumerate(ranks):
        assert load["peak_rss_mb"] < 0.6 * whole["peak_rss_mb"], (rank, load, whole)
    assert logits[1].shape == logits[2].shape == (5, 4096)
    assert (logits[1] - logits[2]).abs().max().item() < 1e-4


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
@pytest.mark.parametrize("forward", ["auto", "transformers"])
def test_a_loaded_runner_keeps_no_checkpoint_mapped(tmp_path, forward):
    """from_pretrained's tensors are views of the mapped safetensors file; a few left there (the
    norms, after the lean forward copied the rest) would keep the whole file mapped and resident.
    After ModelRunner's load no parameter or buffer lies in a mapped checkpoint, and the logits
    are those of the model as loaded."""
    import gc

    from model_service.loading import mapped_checkpoints, release_checkpoint_maps
    from model_service.model_runner import ModelRunner

    path = save_model(tmp_path / "m")
    make_tokenizer(path)
    reference = AutoModelForCausalLM.from_pretrained(path).eval()
    assert mapped_checkpoints(tmp_path)  # from_pretrained maps it (else this test tests nothing)
    ids = list(range(3, 19))
    with torch.inference_mode():
        expected = reference(torch.tensor([ids])).logits[0, -1]
    assert release_checkpoint_maps(reference) > 0
    del reference
    gc.collect()
    runner = ModelRunner(path, "cpu", forward=forward)
    gc.collect()
    spans = mapped_checkpoints(tmp_path)
    for name, tensor in [*runner.model.named_parameters(), *runner.model.named_buffers()]:
        start = tensor.untyped_storage().data_ptr()
        assert not any(lo <= start < hi for lo, hi in spans), name
    assert not spans  # nothing else held the file either
    session = runner.start_session("s", 0)
    session.tokens.extend(ids)
    torch.testing.assert_close(runner.forward(session)[-1], expected, rtol=1e-4, atol=1e-4)
