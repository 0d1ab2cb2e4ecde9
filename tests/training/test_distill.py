"""training.distill end to end at toy scale on a tiny chat-templated target, and its pieces:
the soft labels line up with the positions that predict them, held-out prompts stay out."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from assets.prompts import CHAT
from training import distill

TINY = ["--stdlib-prompts", "12", "--own-questions", "8", "--requests", "4", "--batch", "8", "--new-tokens", "12", "--steps", "6",
        "--train-batch", "4", "--hidden", "32", "--layers", "1", "--heads", "2", "--kv-heads", "1", "--ffn", "64",
        "--top-k", "4", "--generate-dtype", "float32", "--threads", "1"]


def test_distill_makes_a_servable_draft_and_resumes(pair, tmp_path):
    _, target_dir = pair
    out, work = tmp_path / "draft", tmp_path / "work"
    distill.main(["--target", str(target_dir), "--out", str(out), "--work", str(work), *TINY])
    for name in ("config.json", "model.safetensors", "tokenizer.json", "README.md", "distill.json", "draft_vocab.json"):
        assert (out / name).is_file(), name
    draft = AutoModelForCausalLM.from_pretrained(out)
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    assert draft.config.vocab_size == target.config.vocab_size and draft.config.num_hidden_layers == 1
    assert draft.dtype == torch.bfloat16
    text = "def f(x): return x"
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == AutoTokenizer.from_pretrained(target_dir)(text).input_ids
    info = json.loads((out / "distill.json").read_text())
    assert info["training"]["steps"] == 6 and 0 <= info["final"]["heldout_agreement"] <= 1
    assert info["generations"]["sequences"] > 0
    vocab = json.loads((out / "draft_vocab.json").read_text())
    assert len(set(vocab["ids"])) == len(vocab["ids"]) > 0
    assert "held-out greedy agreement" in (out / "README.md").read_text()
    prompts = json.loads((work / "prompts.json").read_text())
    assert not {distill.normalized(p) for p in prompts} & {distill.normalized(p) for p in CHAT}
    # a second run finds every stage done and only exports again
    stamp = (work / "train" / "checkpoint.pt").stat().st_mtime_ns
    distill.main(["--target", str(target_dir), "--out", str(out), "--work", str(work), *TINY])
    assert (work / "train" / "checkpoint.pt").stat().st_mtime_ns == stamp


def test_held_out_prompts_are_dropped_however_written(pair, tmp_path, monkeypatch):
    _, target_dir = pair
    monkeypatch.setattr(distill, "stdlib_prompts", lambda count, rng: ["WHAT is the capital of France -- answer in one"
                                                                         " sentence", "Keep me."])
    monkeypatch.setattr(distill, "own_questions", lambda model, tokenizer, cfg, rng: ["why is the SKY blue"])
    monkeypatch.setattr(distill.everyday, "requests", lambda count, seed: ["Explain how photosynthesis works to a"
                                                                           " ten-year-old!"])
    cfg = distill.Config(target=target_dir, out=tmp_path / "o", work=tmp_path)
    assert distill.stage_prompts(cfg, None, None) == ["Keep me."]


def test_collate_puts_each_label_where_its_token_is_predicted():
    k = 2
    row = {"prompt": [10, 11, 12], "answer": [13, 14],
           "top_ids": torch.tensor([[13, 3], [14, 4]], dtype=torch.int32),
           "top_logp": torch.tensor([[-0.1, -2.0], [-0.2, -3.0]], dtype=torch.float16)}
    short = {"prompt": [20], "answer": [21], "top_ids": torch.tensor([[21, 5]], dtype=torch.int32),
             "top_logp": torch.tensor([[-0.5, -1.0]], dtype=torch.float16)}
    batch = distill.collate([row, short])
    assert batch["ids"].tolist() == [[10, 11, 12, 13], [20, 0, 0, 0]]
    assert batch["weight"].tolist() == [[0, 0, 1, 1], [1, 0, 0, 0]]
    # position t predicts token t + 1: the prompt's last position predicts the first answer token
    assert batch["top_ids"][0, 2].tolist() == [13, 3] and batch["top_ids"][0, 3].tolist() == [14, 4]
    assert batch["top_ids"][1, 0].tolist() == [21, 5] and batch["top_ids"].shape == (2, 4, k)


def test_soft_loss_is_cross_entropy_to_the_targets_top_k():
    torch.manual_seed(0)
    model = distill.LlamaForCausalLM(distill.LlamaConfig(vocab_size=30, hidden_size=16, intermediate_size=32,
                                                         num_hidden_layers=1, num_attention_heads=2))
    row = {"prompt": [1, 2], "answer": [3, 4, 5], "top_ids": torch.randint(0, 30, (3, 4), dtype=torch.int32),
           "top_logp": torch.log_softmax(torch.randn(3, 4), -1).half()}
    batch = distill.collate([row])
    logq = model(input_ids=batch["ids"]).logits.float().log_softmax(-1)[0]  # [T, V]
    logq = logq.detach()
    expected = -sum(float(row["top_logp"][j].float().exp() @ logq[1 + j, row["top_ids"][j].long()]) for j in range(3)) / 3
    assert abs(float(distill.soft_loss(model, batch).detach()) - expected) < 1e-5


def test_build_draft_starts_in_the_targets_embedding_space(pair):
    _, target_dir = pair
    target = AutoModelForCausalLM.from_pretrained(target_dir)
    cfg = distill.Config(target=target_dir, out=None, work=None, hidden=16, layers=1, heads=2, kv_heads=1, ffn=32)
    draft = distill.build_draft(cfg, target)
    t = target.get_input_embeddings().weight.detach()
    d = draft.get_input_embeddings().weight.detach()
    # d = t W for a D x hidden W (t's leading principal directions): in the span of t's columns, with
    # most of t's variance kept (a fresh random embedding is neither)
    w = torch.linalg.lstsq(t, d).solution
    assert (t @ w - d).norm() < 1e-3 * d.norm()
    fresh = distill.LlamaForCausalLM(distill.draft_config(cfg, target.config)).get_input_embeddings().weight.detach()
    assert (t @ torch.linalg.lstsq(t, fresh).solution - fresh).norm() > 0.3 * fresh.norm()
    assert torch.allclose(draft.lm_head.weight, draft.get_input_embeddings().weight)  # tied


@pytest.mark.parametrize("rope, kept", [
    ({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 64}, True),  # (made per frequency: any head size)
    ({"rope_type": "longrope", "short_factor": [1.0] * 8, "long_factor": [2.0] * 8,
      "original_max_position_embeddings": 64}, False),  # 8 pairs: the target's head of 16, not the draft's 8
    ({"rope_type": "linear", "factor": 2.0, "partial_rotary_factor": 0.75}, True)])  # part of each head: the
    # draft rotates all of its own, scaled as the target
def test_a_draft_takes_the_targets_rope_where_it_fits_its_heads(rope, kept):
    """The draft (head_dim 8 here) rotates its whole heads: the target's theta always, its scaling only
    where that does not depend on the target's head (longrope's factors per pair, partial rotation); it
    runs either way (before, a shape error)."""
    family = "phi3" if rope["rope_type"] == "longrope" else "llama"
    config = AutoConfig.for_model(family, vocab_size=256, hidden_size=64, intermediate_size=64, num_hidden_layers=1,
                                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                                  pad_token_id=0, rope_parameters={**rope, "rope_theta": 5000.0})
    cfg = distill.Config(target=None, out=None, work=None, hidden=16, layers=1, heads=2, kv_heads=1, ffn=32)
    draft = distill.LlamaForCausalLM(distill.draft_config(cfg, config))
    got = draft.config.rope_parameters
    assert got["rope_theta"] == 5000.0 and "partial_rotary_factor" not in got
    assert got["rope_type"] == (rope["rope_type"] if kept else "default")
    with torch.inference_mode():
        assert draft(torch.arange(1, 100)[None]).logits.shape == (1, 99, 256)  # past 64 positions: scaled
