"""training.more_answers on a tiny chat-templated target: new everyday requests answered by the int4
runner, batched, appended to a finished answers stage as distill's shards; resumable. (That a head
which goes on keeps its draft vocabulary as answers are added: test_eagle_train.py.)"""

from __future__ import annotations

import json

import pytest
import torch

from assets.prompts import HELD_OUT, normalized
from model_service.model_runner import ModelRunner
from speculative.tiny import make_model, make_tokenizer
from training import more_answers


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    out = tmp_path_factory.mktemp("more")
    return make_model(out / "target", make_tokenizer(out / "tok", "bpe"), hidden=64, layers=2, heads=2, kv_heads=1,
                      intermediate=96, vocab_size=None, max_context=512)


def stage(work):
    """A finished answers stage of one shard."""
    (work / "generations").mkdir(parents=True)
    (work / "prompts.json").write_text(json.dumps(["an old prompt"]))
    torch.save([{"prompt": [1, 2, 3], "answer": [4, 5], "top_ids": None, "top_logp": None, "temperature": 0.0}],
               work / "generations" / "00000.pt")
    (work / "generations" / "done.json").write_text(json.dumps(
        {"sequences": 1, "answer_tokens": 2, "minutes": 1.0, "source": "distill"}))


def test_answers_are_appended_as_shards_and_greedy_ones_are_the_runners_own(target, tmp_path):
    work = tmp_path / "work"
    stage(work)
    argv = ["--target", str(target), "--work", str(work), "--requests", "7", "--batch", "4", "--new-tokens", "6",
            "--seed", "3", "--threads", "1"]
    more_answers.main(argv)
    shards = sorted((work / "generations").glob("*.pt"))
    assert [s.name for s in shards] == ["00000.pt", "01000.pt", "01001.pt"]  # a new thousand, as distill's kinds
    new = [torch.load(s, weights_only=False) for s in shards[1:]]
    prompts = json.loads((work / "prompts.json").read_text())
    assert prompts[0] == "an old prompt" and len(prompts) == 8 and not {normalized(p) for p in prompts} & HELD_OUT
    done = json.loads((work / "generations" / "done.json").read_text())
    rows = [r for shard in new for r in shard]
    assert done["sequences"] == 1 + len(rows) and done["answer_tokens"] == 2 + sum(len(r["answer"]) for r in rows)
    assert "more everyday" in done["source"] and done["source"].startswith("distill")
    assert all(1 <= len(r["answer"]) <= 6 for r in rows)
    assert [r["temperature"] for r in new[0]] == [0.0] * len(new[0]) and new[1][0]["temperature"] == 0.7

    # the greedy batch's answers are what the int4 runner gives each prompt alone
    runner = ModelRunner(target, "cpu", quantize="int4")
    for r in new[0]:
        alone = more_answers.answer(runner, [r["prompt"]], 6, 0.0, 0, "alone")[0]
        assert alone == r["answer"]

    # a second run finds the work done: nothing rewritten
    stamps = {p: p.stat().st_mtime_ns for p in (*shards, work / "prompts.json")}
    more_answers.main(argv)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps
