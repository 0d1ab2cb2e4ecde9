"""training.eagle end to end at toy scale on a tiny random Llama target (the answer stages skipped by a
hand-written generations dir), and its training-time test checked against the head's serving step."""

from __future__ import annotations

import asyncio
import json
import random
import shutil
import tarfile

import pytest
import torch
from safetensors import safe_open

from transformers import AutoConfig, AutoModelForCausalLM

from model_service.eagle import EagleDraft
from model_service.eagle_head import Eagle3Head
from model_service.engines import TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from speculative.protocol import SamplingParams
from speculative.round import generate
from speculative.tiny import make_model, make_tokenizer
from training import eagle

VOCAB = 3000  # embedding rows; the answers use the first 300 ids, so the draft vocabulary is 1024 of them
TINY = ["--top-k", "4", "--steps", "40", "--train-batch", "4", "--ttt-steps", "3", "--lr", "3e-3", "--warmup", "4",
        "--eval-every", "20", "--heldout-rows", "4", "--heldout-share", "0.1", "--threads", "1",
        "--feature-batch-tokens", "256"]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    out = tmp_path_factory.mktemp("eagle")
    tokenizer = make_tokenizer(out / "tok", "bpe")
    return make_model(out / "target", tokenizer, hidden=32, layers=8, heads=4, kv_heads=2, vocab_size=VOCAB,
                      init_std=0.1)


def write_generations(work, shards=2, rows=24):
    """distill's generation output, as if its stages had run: a periodic answer per prompt, so there is
    something to learn."""
    rng = random.Random(0)
    (work / "generations").mkdir(parents=True)
    (work / "prompts.json").write_text("[]")
    tokens = 0
    for s in range(shards):
        shard = []
        for _ in range(rows):
            cycle = rng.sample(range(300), 5)
            answer = [cycle[i % 5] for i in range(rng.randint(12, 24))]
            shard.append({"prompt": [rng.randrange(300) for _ in range(rng.randint(3, 8))], "answer": answer,
                          "top_ids": None, "top_logp": None, "temperature": 0.0})
            tokens += len(answer)
        torch.save(shard, work / "generations" / f"{s:05d}.pt")
    (work / "generations" / "done.json").write_text(json.dumps(
        {"sequences": shards * rows, "answer_tokens": tokens, "minutes": 0.0}))


def test_eagle_trains_a_loadable_head_and_resumes(target, tmp_path):
    out, work = tmp_path / "head", tmp_path / "work"
    write_generations(work)
    argv = ["--target", str(target), "--out", str(out), "--work", str(work), *TINY]
    eagle.main(argv)
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 1024
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM's default for 8 layers
    with safe_open(out / "model.safetensors", "pt") as f:
        names = set(f.keys())
        assert f.get_tensor("fc.weight").dtype == torch.bfloat16 and tuple(f.get_tensor("fc.weight").shape) == (32, 96)
    assert "embed_tokens.weight" not in names and {"d2t", "t2d", "lm_head.weight", "norm.weight"} <= names
    head = Eagle3Head.load(out, target_dir=target)
    assert head.draft_to_target(torch.arange(1024)).max() < VOCAB and int(head.t2d.sum()) == 1024
    info = json.loads((out / "eagle.json").read_text())
    served = EagleDraft.load(out, target, "cpu")  # the draft service's method loads it as it is
    assert served.info()["feature_layers"] == [2, 4, 5] and served.acceptance_prior == info["heldout"]["agree_0"]
    assert set(info["heldout"]) >= {"agree_0", "agree_2", "chain_2", "expected_accepted"}
    assert info["training"]["steps"] == 40 and len(info["curve"]) == 2
    assert "held-out agreement per step" in (out / "README.md").read_text()
    curve = json.loads((work / "train" / "curve.json").read_text())
    assert [c["step"] for c in curve] == [20, 40]

    # training lowered the loss on what it saw
    rows = [r for i, r in enumerate(eagle.load_features(eagle.Config(target, out, work))) if not eagle.held_out(i, 0.1)]
    cfg = eagle.Config(target, out, work, aux_layers="2,4,5")
    vocab = json.loads((work / "vocab.json").read_text())
    fresh = eagle.build_head(cfg, vocab["ids"], init=True)
    trained = eagle.loop.load_trained(eagle.build_head(cfg, vocab["ids"], init=False), work / "train")
    batch = eagle.collate(rows[:16], fresh, 512)
    with torch.no_grad():
        before, after = (float(eagle.ttt_loss(h, batch, 3, 0.8)) for h in (fresh, trained))
    assert after < 0.8 * before, (before, after)

    # a second run finds every stage done and only exports again
    stamps = {p: p.stat().st_mtime_ns for p in (work / "train" / "checkpoint.pt", work / "features" / "index.json")}
    eagle.main(argv)
    assert {p: p.stat().st_mtime_ns for p in stamps} == stamps


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_eagle_trains_on_a_gpu_as_on_the_cpu(target, tmp_path):
    """--device cuda: features and training on the GPU give a head that loads and learned, as on the CPU."""
    out, work = tmp_path / "head", tmp_path / "work"
    write_generations(work)
    eagle.main(["--target", str(target), "--out", str(out), "--work", str(work), *TINY, "--device", "cuda"])
    info = json.loads((out / "eagle.json").read_text())
    assert info["training"]["device"] != "cpu" and info["training"]["steps"] == 40
    cfg = eagle.Config(target, out, work, aux_layers="2,4,5")
    rows = [r for i, r in enumerate(eagle.load_features(cfg)) if not eagle.held_out(i, 0.1)]
    ids = json.loads((work / "vocab.json").read_text())["ids"]
    batch = eagle.collate(rows[:16], eagle.build_head(cfg, ids, init=True), 512)
    with torch.no_grad():
        before, after = (float(eagle.ttt_loss(h, batch, 3, 0.8)) for h in (
            eagle.build_head(cfg, ids, init=True), Eagle3Head.load(out, target_dir=target)))
    assert after < 0.8 * before, (before, after)


def test_a_run_goes_on_in_another_session_from_the_answers_archive_and_the_exported_head(target, tmp_path):
    """What survives a session is what is committed: the answers (an archive of token ids) and the
    exported head; a new --work built from them trains on from that head, not from the target's init."""
    first, work = tmp_path / "first", tmp_path / "work"
    write_generations(work)
    eagle.main(["--target", str(target), "--out", str(first), "--work", str(work), *TINY])
    archive = tmp_path / "answers.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for name in ("prompts.json", "generations"):
            tar.add(work / name, arcname=name)

    second, fresh = tmp_path / "second", tmp_path / "fresh"
    argv = ["--target", str(target), "--out", str(second), "--work", str(fresh), "--answers", str(archive),
            *TINY[:TINY.index("--steps")], "--steps", "2", *TINY[TINY.index("--steps") + 2 :]]
    eagle.main([*argv, "--init", str(first)])
    assert json.loads((fresh / "vocab.json").read_text())["ids"] == json.loads((work / "vocab.json").read_text())["ids"]
    cfg = eagle.Config(target, second, fresh, aux_layers="2,4,5")
    ids = json.loads((fresh / "vocab.json").read_text())["ids"]
    rows = [r for i, r in enumerate(eagle.load_features(cfg)) if not eagle.held_out(i, 0.1)]
    batch = eagle.collate(rows[:16], eagle.build_head(cfg, ids, init=True), 512)
    with torch.no_grad():
        exported, went_on, from_scratch = (float(eagle.ttt_loss(h, batch, 3, 0.8)) for h in (
            Eagle3Head.load(first, target_dir=target), Eagle3Head.load(second, target_dir=target),
            eagle.build_head(cfg, ids, init=True)))
    # two more steps from the first head: about where it ended, far below a head at the target's init
    assert went_on < 0.8 * from_scratch and abs(went_on - exported) < 0.2 * exported, (exported, went_on, from_scratch)

    other = tmp_path / "other"  # a head of another shape (its aux layers) is refused
    with pytest.raises(SystemExit, match="another shape"):
        eagle.main(["--target", str(target), "--out", str(other), "--work", str(tmp_path / "w4"), "--answers",
                    str(archive), "--init", str(first), "--aux-layers", "1,4,5", *TINY])


def random_head(target, tmp_path, seed: int) -> eagle.Eagle3Head:
    """A head as the trainer builds it (draft vocabulary: the even ids below 2048), its fc random
    enough that the target-feature rows matter."""
    torch.manual_seed(seed)
    head = eagle.build_head(eagle.Config(target, tmp_path, tmp_path), list(range(0, 2048, 2)), init=True).eval()
    with torch.no_grad():
        for p in head.fc.parameters():
            p.normal_(0, 0.2)
    return head


def test_training_time_test_is_the_serving_step(target, tmp_path):
    """Step k of the training-time test at row t equals drafting at inference: the target-feature rows
    0..t in the cache, then the head's own rows one position further each step."""
    head = random_head(target, tmp_path, seed=0)
    T, steps = 9, 4
    ids = torch.randint(0, 2048, (1, T))
    batch = {"features": torch.randn(1, T, 96), "inputs": ids}
    with torch.no_grad():
        trained = list(eagle.ttt(head, batch, steps))  # [1, T, Vd] per step
        hidden = head.fuse(batch["features"][0])
        for t in (0, 4, T - 1):
            cache = head.new_cache()
            out, logits = head.step(ids[0, : t + 1], hidden[: t + 1], torch.arange(t + 1), cache)
            out, logits = out[-1:], logits[-1:]
            for k in range(steps):
                torch.testing.assert_close(logits[0], trained[k][0, t], atol=2e-4, rtol=2e-4)
                token = head.draft_to_target(logits.argmax(-1))
                out, logits = head.step(token, out, torch.tensor([t + 1 + k]), cache)


def test_teacher_tokens_are_the_serving_step_fed_the_answer(target, tmp_path):
    """--ttt-tokens teacher: step k at row t equals drafting at inference where every earlier proposal
    was the sequence's own next token (a chain still alive), and differs from feeding the head's own
    argmax where that is another token."""
    head = random_head(target, tmp_path, seed=1)
    T, steps = 9, 3
    ids = torch.randint(0, 1024, (1, T + 1)) * 2  # in the draft vocabulary
    batch = {"features": torch.randn(1, T, 96), "inputs": ids[:, 1:]}  # row t: token t + 1
    with torch.no_grad():
        taught = list(eagle.ttt(head, batch, steps, teacher=True))
        own = list(eagle.ttt(head, batch, steps))
        hidden = head.fuse(batch["features"][0])
        differs = 0
        for t in (0, 3, 5):
            cache = head.new_cache()
            out, logits = head.step(ids[0, 1 : t + 2], hidden[: t + 1], torch.arange(t + 1), cache)
            out, logits = out[-1:], logits[-1:]
            for k in range(steps):
                torch.testing.assert_close(logits[0], taught[k][0, t], atol=2e-4, rtol=2e-4)
                differs += k > 0 and not torch.allclose(taught[k][0, t], own[k][0, t], atol=1e-3)
                out, logits = head.step(ids[0, t + 2 + k : t + 3 + k], out, torch.tensor([t + 1 + k]), cache)
    assert differs  # the random head's argmax is not the sequence: the two modes are different trainings


def test_labels_are_the_targets_top_k_in_the_draft_vocabulary(target, tmp_path):
    head = eagle.build_head(eagle.Config(target, tmp_path, tmp_path), [5, 7, 9, 11], init=False)
    row = {"ids": torch.tensor([1, 2, 3, 7, 9]), "prompt": 3, "hidden": torch.zeros(5, 96).half(),
           "top_ids": torch.tensor([[7, 5, 100], [9, 200, 300]], dtype=torch.int32),
           "top_logp": torch.tensor([[-0.1, -3.0, -2.5], [-1.0, -0.9, -3.0]]).half()}
    batch = eagle.collate([row], head, 512)
    assert batch["inputs"].tolist() == [[2, 3, 7, 9, 0]]  # row t: token t + 1
    assert batch["weight"].tolist() == [[0, 0, 1, 1, 0]]  # positions 2, 3 predict the answer tokens 3, 4
    assert batch["columns"][0, 2, :2].tolist() == [1, 0] and batch["columns"][0, 3, 0].tolist() == 2
    p = batch["p"][0, 2]
    torch.testing.assert_close(p.sum(), torch.tensor(1.0))  # 100 is outside the draft vocabulary: renormalised
    assert p[2] == 0 and p[0] > p[1] > 0
    assert batch["top1"][0, 3].item() == 9


def test_a_wider_head_starts_as_the_narrower_one_it_grows_from(target, tmp_path):
    """--intermediate-size with --init: the MLP's first units are the narrower head's, the others have
    no say at first (zero down_proj columns), so the wider head computes what it started from; it
    exports and loads (the speculators layout carries the width); a narrower one is refused."""
    first, work = tmp_path / "first", tmp_path / "work"
    write_generations(work)
    eagle.main(["--target", str(target), "--out", str(first), "--work", str(work), *TINY])
    narrow = Eagle3Head.load(first, target_dir=target)
    units = narrow.config.intermediate_size
    cfg = eagle.Config(target, tmp_path / "wide", work, aux_layers="2,4,5", intermediate_size=3 * units)
    ids = json.loads((work / "vocab.json").read_text())["ids"]
    wide = eagle.build_head(cfg, ids, init=True)
    wide.float()
    eagle.start_from(wide, first, target)
    assert wide.layer.mlp["up_proj"].weight.shape[0] == 3 * units
    rows = eagle.load_features(cfg)
    batch = eagle.collate(rows[:8], wide, 512)
    with torch.no_grad():
        before, grown = (float(eagle.ttt_loss(h, batch, 3, 0.8)) for h in (narrow, wide))
    assert abs(grown - before) < 1e-4 * abs(before), (before, grown)
    assert float(wide.layer.mlp["up_proj"].weight[units:].detach().abs().sum()) > 0  # the new units are live, not dead

    wide.save(tmp_path / "wide")
    assert Eagle3Head.load(tmp_path / "wide", target_dir=target).config.intermediate_size == 3 * units
    assert EagleDraft.load(tmp_path / "wide", target, "cpu").info()["feature_layers"] == [2, 4, 5]
    with pytest.raises(SystemExit, match="narrower"):
        eagle.start_from(eagle.build_head(eagle.Config(target, tmp_path / "n", work, aux_layers="2,4,5",
                                                       intermediate_size=units // 2), ids, init=True), first, target)
    # --init the wide head, no width given: it goes on as wide (not refused as narrower than --init's)
    again = eagle.build_head(eagle.Config(target, tmp_path / "again", work, aux_layers="2,4,5",
                                          init=str(tmp_path / "wide")), ids, init=True)
    eagle.start_from(again, tmp_path / "wide", target)
    assert again.config.intermediate_size == 3 * units


def test_a_head_that_goes_on_keeps_its_draft_vocabulary_when_answers_are_added(target, tmp_path):
    """Answers added to a stage (training/more_answers.py) would choose another draft vocabulary; a run
    from an exported head (--init) keeps the head's, so it can go on from it."""
    first, work = tmp_path / "first", tmp_path / "work"
    write_generations(work)
    eagle.main(["--target", str(target), "--out", str(first), "--work", str(work), *TINY])
    rng = random.Random(1)
    torch.save([{"prompt": [rng.randrange(300)], "answer": [rng.randrange(1200, 2400) for _ in range(20)],
                 "top_ids": None, "top_logp": None, "temperature": 0.0} for _ in range(40)],
               work / "generations" / "00002.pt")
    for stale in ("features", "train", "vocab.json"):
        path = work / stale
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    grown = eagle.stage_vocab(eagle.Config(target, tmp_path / "x", work), VOCAB)
    kept = Eagle3Head.load(first, target_dir=target).draft_to_target(torch.arange(1024)).tolist()
    assert set(grown["ids"]) != set(kept)  # the added answers would move it
    (work / "vocab.json").unlink()
    second = tmp_path / "second"
    eagle.main(["--target", str(target), "--out", str(second), "--work", str(work), "--init", str(first),
                *TINY[:TINY.index("--steps")], "--steps", "2", *TINY[TINY.index("--steps") + 2 :]])
    assert sorted(Eagle3Head.load(second, target_dir=target).draft_to_target(torch.arange(1024)).tolist()) \
        == sorted(kept)
    card = (second / "README.md").read_text()
    assert "draft vocabulary" in card
    assert f"| started from | the head in {first} (`--init`) |" in card  # as wide: nothing widened
    assert "started from" not in (first / "README.md").read_text()


def test_a_walk_of_rounds_starts_each_round_after_the_last_ones_correction():
    # runs: the steps the chain from each answer position agrees for; k = 4
    assert eagle.walk_rounds([2, 0, 3, 1, 0, 0, 4, 4], 4) == (3, 2)  # from 0 (2 + 1 on), from 3; 5 + 4 > 8
    assert eagle.walk_rounds([4] * 10, 4) == (8, 2)  # from 0, from 5 (a whole window: 5 + 4 <= 10)
    assert eagle.walk_rounds([9, 0, 0], 2) == (2, 1)  # a run counts at most k
    assert eagle.walk_rounds([1, 1, 1], 4) == (0, 0)
    # a round lands where the last one's chain broke off: here on every 0, where the mean over all
    # starts (2.4) says a round accepts more
    assert eagle.walk_rounds([3, 3, 3, 3, 0] * 5, 3) == (15, 9)  # 3 from 0, 5, ..., 20; 0 from 4, 9, ..., 19


def test_the_held_out_round_walk_is_what_specdec_s_rounds_accept(tmp_path):
    """evaluate()'s round_accepted, greedy rounds walked over an answer from the features the trainer
    records, is what specdec's own round accepts with the head drafting (the target's features handed
    over each round), round for round, over the rounds whose whole window lies in the answer."""
    tokenizer = make_tokenizer(tmp_path / "tok", "bpe")  # the output layer as wide as the tokenizer: one argmax
    target = make_model(tmp_path / "target", tokenizer, hidden=32, layers=8, heads=4, kv_heads=2, init_std=0.1)
    out, work, k = tmp_path / "head", tmp_path / "work", 3
    write_generations(work)
    eagle.main(["--target", str(target), "--out", str(out), "--work", str(work), *TINY, "--steps", "80"])
    prompts = [r["prompt"] + r["answer"][:6] for r in torch.load(work / "generations" / "00000.pt")[:6]]

    async def rounds():
        method = EagleDraft.load(out, target, "cpu", lookup=range(0))  # the head alone, as the walk
        runner = ModelRunner(target, device="cpu")
        draft, peer = LocalDraft(method), LocalTarget(TargetEngine(runner))
        answers = []
        for i, prompt in enumerate(prompts):
            answers.append([chunk async for chunk in generate(
                draft, peer, prompt, max_new_tokens=40, k=k, params=SamplingParams(0.0),
                eos_token_ids=set(runner.eos_token_ids), max_context=runner.max_context, session_id=f"p{i}",
                feature_layers=method.layers)])
        return answers

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    head = Eagle3Head.load(out, target_dir=target)
    cfg = eagle.Config(target, out, work, ttt_steps=k)
    compared = []
    for prompt, chunks in zip(prompts, asyncio.run(rounds())):
        answer = [token for chunk in chunks for token in chunk]
        # the drafting rounds (after the prompt's pass) whose k tokens and the one after lie in the answer
        # (the last token's round asks fewer: max_new_tokens), against the walk over the answer less that
        # token, whose whole windows are those rounds'
        served, before = [], 0
        for chunk in chunks:
            if before and before + k + 1 <= len(answer):
                served.append(len(chunk) - 1)
            before += len(chunk)
        row = eagle.featurize(model, [{"prompt": prompt, "answer": answer[:-1]}], [2, 4, 5], 4, 4096)
        walked = eagle.evaluate(head, row, cfg)
        if served:
            compared.append((walked["round_accepted"], sum(served) / len(served)))
    assert len(compared) >= 4 and any(s > 0 for _, s in compared)  # the head drafts something right
    for walked, served in compared:
        assert walked == pytest.approx(served, abs=1e-9)


def test_a_head_starts_from_a_fused_checkpoint_s_parts(target, tmp_path):
    """A Phi-3 target keeps q, k, v in one qkv_proj and gate, up in one gate_up_proj: the head's
    init takes each part's rows, so it starts as it would from the same layer stored unfused."""
    llama = AutoModelForCausalLM.from_pretrained(target)
    config = llama.config.to_dict()
    config.update(model_type="phi3", architectures=["Phi3ForCausalLM"])
    config.pop("head_dim", None)
    fused = AutoModelForCausalLM.from_config(type(AutoConfig.for_model("phi3")).from_dict(config))
    state = llama.state_dict()
    for i in range(llama.config.num_hidden_layers):
        at = f"model.layers.{i}."
        state[f"{at}self_attn.qkv_proj.weight"] = torch.cat(
            [state.pop(f"{at}self_attn.{n}_proj.weight") for n in "qkv"])
        state[f"{at}mlp.gate_up_proj.weight"] = torch.cat(
            [state.pop(f"{at}mlp.{n}_proj.weight") for n in ("gate", "up")])
    fused.load_state_dict(state, strict=True)
    fused.save_pretrained(tmp_path / "phi3")
    ids = list(range(0, 2048, 2))
    heads = [eagle.build_head(eagle.Config(t, tmp_path, tmp_path), ids, init=True).state_dict()
             for t in (target, tmp_path / "phi3")]
    assert heads[0].keys() == heads[1].keys()
    for name, weight in heads[0].items():
        assert torch.equal(weight, heads[1][name]), name
    assert all(heads[1][f"layers.0.self_attn.{n}_proj.weight"].abs().sum() > 0 for n in "qkv")


SMALL = {"vocab_size": 512, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "pad_token_id": 0}
SCALED = {"granite": {"logits_scaling": 8.0, "embedding_multiplier": 12.0, "residual_multiplier": 0.22},
          "cohere": {"logit_scale": 0.0625}, "gemma2": {"final_logit_softcapping": 2.0}}


@pytest.mark.parametrize("arch", sorted(SCALED))
def test_labels_are_the_targets_own_probabilities_whatever_it_does_to_its_logits(arch):
    """Granite divides its logits, Cohere scales them, Gemma 2 soft-caps them: the labels are the
    probabilities its own forward gives, and a target doing something else is refused by name."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **SMALL, **SCALED[arch])).eval()
    for p in model.parameters():  # (logits far enough from uniform that the scaling shows)
        p.data.normal_(0, 0.3) if p.dim() > 1 else None
    ids = list(range(3, 20))
    eagle.check_output_logits(model, ids)
    (row,) = eagle.featurize(model, [{"prompt": ids[:5], "answer": ids[5:]}], [1], 4, 4096)
    with torch.inference_mode():
        logp = model(torch.tensor([ids])).logits[0, 4:-1].float().log_softmax(-1)  # positions 4.. predict 5..
        plain = model.lm_head(model.model(torch.tensor([ids])).last_hidden_state[0, 4:-1]).float().log_softmax(-1)
    top_logp, top_ids = logp.topk(4, dim=-1)
    assert torch.equal(row["top_ids"], top_ids.int())
    torch.testing.assert_close(row["top_logp"].float(), top_logp, atol=2e-3, rtol=2e-3)
    assert (top_logp[:, 0] - plain.max(-1).values).abs().max() > 1e-2  # (what it does to them matters)
    model.config.update({"logit_scale": 3.0} if arch != "cohere" else {"final_logit_softcapping": 0.5})
    with pytest.raises(SystemExit, match="makes its logits otherwise"):
        eagle.check_output_logits(model, ids)


def test_a_head_for_a_target_rotating_part_of_each_head_rotates_its_whole_heads(tmp_path):
    """Phi-4-mini rotates 96 of each head's 128 dimensions under longrope: the head (a Llama layer)
    rotates its whole heads, so it takes the target's theta but not its factors, made for the part;
    it drafts, and goes through its export and load."""
    tokenizer = make_tokenizer(tmp_path / "tok", "bpe")
    model_dir = make_model(tmp_path / "phi3", tokenizer, arch="phi3", hidden=64, layers=4, heads=4, kv_heads=2,
                           vocab_size=VOCAB, init_std=0.1)
    config = json.loads((model_dir / "config.json").read_text())
    config["original_max_position_embeddings"] = 64
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 5000.0, "partial_rotary_factor": 0.75,
                                 "short_factor": [1.0] * 6, "long_factor": [2.0] * 6}
    (model_dir / "config.json").write_text(json.dumps(config))
    head = eagle.build_head(eagle.Config(model_dir, tmp_path, tmp_path), list(range(0, 1024)), init=True)
    assert head.config.rope_theta == 5000.0 and head.config.rope_scaling is None
    head.save(tmp_path / "head")
    loaded = Eagle3Head.load(tmp_path / "head", target_dir=model_dir)
    hidden = loaded.fc(torch.randn(6, loaded.config.fused_size))
    cache = loaded.new_cache()
    out, logits = loaded.step(torch.tensor(list(range(10, 16))), hidden, torch.arange(60, 66), cache)
    assert logits.shape == (6, 1024) and torch.isfinite(logits).all()


def test_a_head_started_from_granite_scales_its_logits_as_the_target(tmp_path):
    """Granite divides its logits by logits_scaling after the output layer: a head started from it
    (--init) takes that into its final norm, so that it starts as sharp as the target, not 8x sharper."""
    tokenizer = make_tokenizer(tmp_path / "tok", "bpe")
    model_dir = make_model(tmp_path / "granite", tokenizer, arch="granite", hidden=32, layers=4, heads=4, kv_heads=2,
                           vocab_size=VOCAB, init_std=0.1)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.config.logits_scaling = 8.0
    model.save_pretrained(model_dir)
    head = eagle.build_head(eagle.Config(model_dir, tmp_path, tmp_path), list(range(1024)), init=True)
    torch.testing.assert_close(head.norm.weight.detach(), model.model.norm.weight.detach() / 8.0)


def test_a_head_started_from_gemma_takes_its_norms_as_they_multiply(tmp_path):
    """Gemma's RMSNorm multiplies by 1 + weight, and Gemma 2's MLP input norm is pre_feedforward_layernorm
    (its post_attention_layernorm norms the attention's output): a head started from it (--init) takes
    each norm as the factor it is."""
    config = AutoConfig.for_model("gemma2", **{**SMALL, "vocab_size": 1200, "num_hidden_layers": 6})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.uniform_(-0.5, 0.5)
    model.save_pretrained(tmp_path / "gemma2")
    head = eagle.build_head(eagle.Config(tmp_path / "gemma2", tmp_path, tmp_path), list(range(1024)), init=True)
    last = model.model.layers[-1]
    torch.testing.assert_close(head.layer.hidden_norm.weight.detach(), last.input_layernorm.weight.detach() + 1)
    torch.testing.assert_close(head.layer.post_attention_layernorm.weight.detach(),
                               last.pre_feedforward_layernorm.weight.detach() + 1)
    torch.testing.assert_close(head.norm.weight.detach(), model.model.norm.weight.detach() + 1)
