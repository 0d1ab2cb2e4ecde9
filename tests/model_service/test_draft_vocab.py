"""A draft whose output layer scores only some ids (FR-Spec, --draft-vocab): those logits are the
full model's, every other id has probability 0, and speculative decoding stays exact with it
(greedy output is the target's; sampled tokens follow the target's distribution)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from draft_service.__main__ import parse_args, vocab_subset
from model_service.engines import DraftEngine, TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from speculative.protocol import SamplingParams
from tests import rounds
from tests.stats import chi2_stat, fits

PROMPT = [3, 5, 4, 7]


def restricted_copy(model_dir, out, ids, recommended=0):
    shutil.copytree(model_dir, out)
    (out / "draft_vocab.json").write_text(json.dumps({"ids": ids, "recommended": recommended}))
    return out


@pytest.mark.parametrize("forward", ["auto", "transformers"])
def test_restricted_head_scores_only_its_ids(pair, tmp_path, forward):
    draft_dir, _ = pair
    vocab = AutoModelForCausalLM.from_pretrained(draft_dir).config.vocab_size
    ids = list(range(vocab - 1, 0, -3))  # most frequent first: any order
    restricted = restricted_copy(draft_dir, tmp_path / "d", ids)
    full, part = ModelRunner(draft_dir, "cpu", forward=forward), ModelRunner(restricted, "cpu", forward=forward,
                                                                            vocab_subset=40)
    kept = torch.tensor(sorted(ids[:40]))
    for runner in (full, part):
        session = runner.start_session("s", 0)
        session.tokens.extend([1, 2, 3, 4, 5])
        runner.logits = runner.forward(session, 3)  # [3, V]
    assert part.logits.shape == full.logits.shape
    torch.testing.assert_close(part.logits[:, kept], full.logits[:, kept], rtol=1e-5, atol=1e-5)
    others = torch.ones(vocab, dtype=torch.bool)
    others[kept] = False
    assert torch.isneginf(part.logits[:, others]).all()


def test_draft_vocab_flag(tmp_path):
    (tmp_path / "draft_vocab.json").write_text(json.dumps({"ids": [1, 2, 3], "recommended": 2}))
    assert vocab_subset("auto", str(tmp_path)) == 2
    assert vocab_subset("auto", str(tmp_path / "none")) == 0
    assert vocab_subset("full", str(tmp_path)) == 0 and vocab_subset("7", None) == 7
    with pytest.raises(SystemExit, match="auto, full or a number"):
        vocab_subset("many", None)


def test_max_support_flag_is_checked(capsys):
    """q holds at least one token: --max-support 0 is refused at start, not at the first sampled draft."""
    ngram = ["--method", "ngram", "--tokenizer", "tok"]
    assert parse_args([*ngram, "--max-support", "1"]).max_support == 1
    for bad in ("0", "-3"):
        with pytest.raises(SystemExit):
            parse_args([*ngram, "--max-support", bad])
        assert f"--max-support must be at least 1, not {bad}" in capsys.readouterr().err


def run(draft, target, params, k, seed, n, prompt=PROMPT):
    return rounds.run(draft, target, params, k, seed, n, prompt)


def test_greedy_with_a_restricted_draft_is_the_targets(pair, tmp_path, reference):
    draft_dir, target_dir = pair
    vocab = AutoModelForCausalLM.from_pretrained(draft_dir).config.vocab_size
    restricted = restricted_copy(draft_dir, tmp_path / "d", list(range(0, vocab, 2)))
    draft = LocalDraft(DraftEngine(ModelRunner(restricted, "cpu", vocab_subset=vocab // 2)))
    target = LocalTarget(TargetEngine(ModelRunner(target_dir, "cpu")))
    from transformers import AutoTokenizer

    prompt_text = "def speculative_round(draft, target):"
    prompt = AutoTokenizer.from_pretrained(target_dir)(prompt_text).input_ids
    out, stats = run(draft, target, SamplingParams(0.0), 4, 0, 40, prompt)
    assert out == reference(prompt_text, 40)[: len(out)] and len(out) == 40
    assert stats.draft_tokens > 0


def test_sampling_with_a_restricted_draft_follows_the_target(small_vocab_pair, tmp_path):
    """The draft may only propose 4 of the 12 ids; the first token still follows the target's p."""
    draft_dir, target_dir = small_vocab_pair
    restricted = restricted_copy(draft_dir, tmp_path / "d", [2, 5, 7, 9])
    draft = LocalDraft(DraftEngine(ModelRunner(restricted, "cpu", vocab_subset=4)))
    target = LocalTarget(TargetEngine(ModelRunner(target_dir, "cpu")))
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    with torch.inference_mode():
        p = model(input_ids=torch.tensor([PROMPT])).logits[0, -1].softmax(-1).double()
    firsts, proposed = [], 0
    for seed in range(1200):
        out, stats = run(draft, target, SamplingParams(1.0), 2, seed, 3)
        firsts.append(out[0])
        proposed += stats.draft_tokens
    counts = torch.bincount(torch.tensor(firsts), minlength=p.shape[0]).double()
    assert proposed > 0
    assert fits(counts, p), chi2_stat(counts, p)
    assert counts[[i for i in range(p.shape[0]) if i not in (2, 5, 7, 9)]].sum() > 0  # recovered tokens outside
