"""assets.packed: the committed models at 8 bits a weight, unpacked into an ordinary checkpoint that
transformers loads with the model's outputs kept; and the committed models' budget."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from assets.packed import PACKED, UNPACKED, pack, pack_tensors, unpack, unpack_tensors
from speculative.tiny import make_model, make_tokenizer

ROOT = Path(__file__).resolve().parent.parent
MODELS_BUDGET = 40 * 1000 * 1000  # bytes of committed files under models/


def test_each_row_comes_back_within_half_a_step_of_its_scale():
    g = torch.Generator().manual_seed(0)
    big = torch.randn(300, 256, generator=g) * torch.logspace(-3, 1, 300).unsqueeze(1)  # rows of very different sizes
    big[7] = 0.0  # a row of zeros keeps its zeros
    tensors = {"big": big.to(torch.bfloat16), "kept": torch.randn(512, 256).to(torch.bfloat16),
               "norm": torch.randn(256), "small": torch.randn(16, 16).to(torch.bfloat16)}
    packed, metadata = pack_tensors(tensors, keep=("kept",))
    assert packed["big"].dtype == torch.int8 and packed["big.int8_scale"].shape == (300,)
    assert {"kept", "norm", "small"} <= packed.keys() and "kept.int8_scale" not in packed
    out = unpack_tensors(packed, metadata)
    assert out.keys() == tensors.keys() and out["big"].dtype == torch.bfloat16
    for name in ("kept", "norm", "small"):
        assert torch.equal(out[name], tensors[name])
    row_max = tensors["big"].float().abs().amax(dim=1, keepdim=True)
    err = (out["big"].float() - tensors["big"].float()).abs()
    # half an int8 step of the row's own scale, plus bf16's rounding of the result (2^-8 relative)
    assert (err <= row_max / 254 + tensors["big"].float().abs() / 256 + 1e-30).all()
    assert torch.equal(out["big"][7], torch.zeros(256, dtype=torch.bfloat16))
    assert (err > 0).any()  # it did round: the test can tell a copy from a packing


def test_a_packed_model_unpacks_into_a_checkpoint_transformers_loads(tmp_path):
    model_dir = make_model(tmp_path / "m", make_tokenizer(tmp_path / "tok"), hidden=128, layers=2, heads=4,
                           kv_heads=2, intermediate=512, dtype=torch.bfloat16)
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    size = (model_dir / UNPACKED).stat().st_size
    pack(model_dir)
    assert (model_dir / PACKED).stat().st_size < 0.6 * size
    with safe_open(str(model_dir / PACKED), "pt") as f:
        assert sum(f.get_tensor(k).dtype == torch.int8 for k in f.keys()) >= 2 * 7  # each layer's linears
    assert not unpack(model_dir)  # pack left model.safetensors as the packed file's rounding
    (model_dir / UNPACKED).unlink()
    assert unpack(model_dir) and not unpack(model_dir)  # written once, then up to date
    with safe_open(str(model_dir / UNPACKED), "pt") as f:
        assert f.metadata().get("format") == "pt"  # what transformers asks of a checkpoint
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(0, reference.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        a, b = reference(ids).logits, model(ids).logits
    assert torch.allclose(a, b, atol=0.05 * a.abs().max().item())
    assert not torch.equal(a, b)


def test_an_unpacked_file_not_made_from_the_packed_one_is_made_again(tmp_path):
    """Whatever the files' times say (a copy that kept them, a cache restored): the unpacked file
    records the sha256 of the packed one it came from, and one that does not match is rewritten."""
    model_dir = make_model(tmp_path / "m", make_tokenizer(tmp_path / "tok"), hidden=64, layers=1,
                           dtype=torch.bfloat16)
    pack(model_dir)
    made = load_file(model_dir / UNPACKED)
    other = make_model(tmp_path / "other", make_tokenizer(tmp_path / "tok2"), hidden=64, layers=1, seed=1,
                       dtype=torch.bfloat16)
    os.replace(other / UNPACKED, model_dir / UNPACKED)  # stale weights, and the newer file of the two
    assert (model_dir / UNPACKED).stat().st_mtime >= (model_dir / PACKED).stat().st_mtime
    assert unpack(model_dir)
    again = load_file(model_dir / UNPACKED)
    assert again.keys() == made.keys() and all(torch.equal(again[k], made[k]) for k in made)
    assert not unpack(model_dir)
    assert unpack(model_dir, force=True)


def test_unpack_refuses_what_pack_did_not_write(tmp_path):
    make_model(tmp_path / "m", make_tokenizer(tmp_path / "tok"), hidden=64, layers=1)
    os.replace(tmp_path / "m" / UNPACKED, tmp_path / "m" / PACKED)
    with pytest.raises(ValueError, match="not a packed checkpoint"):
        unpack(tmp_path / "m")
    assert not unpack(tmp_path / "absent")


def test_the_committed_models_keep_to_their_budget():
    """What git holds under models/ (the packed weights, tokenizer, cards), not what make setup unpacks."""
    try:
        files = subprocess.run(["git", "ls-files", "-z", "models"], cwd=ROOT, capture_output=True, check=True,
                               text=True).stdout.split("\0")
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    sizes = {f: (ROOT / f).stat().st_size for f in files if f and (ROOT / f).is_file()}
    assert not [f for f in sizes if f.endswith("/" + UNPACKED)], "commit the packed weights (assets/packed.py)"
    # what make setup unpacks (`python -m training distill|eagle --out` replaces the whole directory:
    # `make draft` / `make eagle` pack it again)
    assert {f"models/{m}/{PACKED}" for m in ("draft", "eagle")} <= sizes.keys()
    assert sum(sizes.values()) <= MODELS_BUDGET, f"{sum(sizes.values()) / 1e6:.1f} MB under models/"
