"""Train an EAGLE-3 draft head for any local transformers Llama-family target, on the target's own answers.

    python -m training eagle --target models/target --out models/eagle
    python -m training eagle --target DIR --out DIR --work .cache/eagle-data --feature-minutes 60 --steps 6000

Stages, each resumable from --work (default .cache/eagle/<out's name>); the same command starts and
resumes the run, and a stage already done is skipped:

  answers    distill's prompt and generation stages (training/distill.py), unchanged: prompts.json
             and generations/*.pt with done.json. A --work where they are done is used as it is;
             --answers ARCHIVE unpacks a finished stage into an empty one (made with
             `tar czf ARCHIVE -C WORK prompts.json generations`: token ids, ~2.6 MB for 1.85 M answer
             tokens; training/answers/ holds the default target's, ~3.7 hours of generation saved).
  features   the float32 target teacher-forced over prompt + answer, batched: at every position the
             hidden states at the aux layers (the INPUTS of decoder layers --aux-layers, vLLM's
             convention; default 2, L // 2, L - 3), float16 [T, len(aux) * H]; at every position
             predicting an answer token, the target's --top-k next-token log-probabilities (the soft
             labels, as its forward makes its logits: output_logits; a target that makes them otherwise
             is refused, check_output_logits). One shard per generation shard (features/*.pt,
             index.json); bounded by --feature-minutes and --max-tokens over all runs.
  vocab      the draft vocabulary: the most frequent answer ids covering --vocab-coverage of the
             answer tokens (a multiple of 1024; d2t / t2d), held-out answers excluded; with --init,
             that head's (answers added since, training/more_answers.py, do not change it).
  train      the head (model_service/eagle_head.py) learns the target's distribution with training-time
             test: --ttt-steps steps in which a row is fed the head's own out_hidden, one position
             further, attending as at inference (the target-feature rows up to its position, then its
             own chain), and the answer's next token (--ttt-tokens teacher, as EAGLE-3 trains: step k
             only counts where steps 0..k-1 were accepted, i.e. proposed the tokens the target's labels
             were computed after) or its own proposal (own); step k's loss is weighted --ttt-decay ** k. The soft
             labels are restricted to the draft vocabulary and renormalised. The decoder layer starts as
             the target's last layer (q/k/v's hidden half; the embedding half is random), norm as the
             target's final norm (times the scale its logits take after the output layer: Granite's,
             Cohere's; output_logits), lm_head as the target's output rows of the draft vocabulary; the
             embedding is the target's, frozen; or, with --init HEAD_DIR (a head this module exported
             for the same target and draft vocabulary), that head's weights: a run of one session
             goes on in the next without the checkpoint (fresh optimizer and schedule). A head wider
             than the target's layer (--intermediate-size) starts its MLP's first units as the
             target's (or --init's narrower head's) and the rest with no say (their down_proj columns
             zero), so it begins as the function it starts from. AdamW, warmup
             + cosine (training/loop.py); every
             --eval-every steps the held-out answers (every 50th) give the agreement per step (the
             head's argmax, fed its own states, equals the target's argmax) and the chain (all steps up
             to k agree): train/curve.json.
  export     --out: config.json + model.safetensors in the speculators layout (bf16, no embedding: the
             server reads the target's), eagle.json and a model card with the figures.

--device cuda runs the target's passes (answers, features) and the head's training on a GPU; the data stays
in host memory (features float16, a batch pinned and copied as it is drawn). On one H200 the default
target's features came at ~50 k tokens/s (5.1 M tokens in 1.7 min; ~550 on 2 CPU cores) and a step of
--train-batch 32 took ~40 ms (4,559 steps in 3.2 min), with --feature-batch-tokens 32768 --threads 16.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tarfile
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from model_service.eagle_head import Eagle3Config, Eagle3Head, default_aux_layer_ids, read_target_tensor
from model_service.loading import sections

from . import distill, loop
from .distill import log

REPO = Path(__file__).resolve().parent.parent


@dataclass
class Config:
    target: Path
    out: Path
    work: Path
    # answers (distill's stages)
    answers: str = ""  # a tar.gz of a finished answers stage, unpacked into an empty --work
    stdlib_prompts: int = 2500
    own_questions: int = 4000
    requests: int = 2500
    new_tokens: int = 192
    batch: int = 48
    temperature: float = 0.8
    generate_minutes: float = 30.0
    generate_dtype: str = "bfloat16"
    # features
    aux_layers: str = ""  # comma-separated layer ids; empty: vLLM's default
    top_k: int = 16
    feature_batch_tokens: int = 2048
    feature_minutes: float = 120.0
    max_tokens: int = 0  # 0: no bound
    # vocab
    vocab_coverage: float = 0.99
    # train
    init: str = ""  # an exported head to start from (same target and draft vocabulary)
    intermediate_size: int = 0  # the head's MLP width; 0: --init's, else the target's
    steps: int = 1000
    train_batch: int = 8
    max_length: int = 512
    lr: float = 6e-4
    warmup: int = 50
    ttt_steps: int = 4
    ttt_decay: float = 0.8
    ttt_tokens: str = "teacher"  # what steps >= 1 read: "teacher" (the answer's tokens) or "own" (the head's argmax)
    heldout_share: float = 0.02
    heldout_rows: int = 64
    eval_every: int = 100
    seed: int = 0
    threads: int = 2
    device: str = "cpu"  # where the target's passes and the head's training run ("cuda", "cuda:1"); data stays on the CPU


# ------------------------------------------------------------------ answers


def stage_answers(cfg: Config) -> None:
    """distill's prompts and generations, in --work."""
    if cfg.answers and not (cfg.work / "generations").exists():
        with tarfile.open(cfg.answers) as archive:
            archive.extractall(cfg.work, filter="data")
        if not (cfg.work / "generations" / "done.json").exists():
            raise SystemExit(f"--answers {cfg.answers}: no generations/done.json in the archive")
    if (cfg.work / "generations" / "done.json").exists():
        log(f"answers: done ({json.loads((cfg.work / 'generations' / 'done.json').read_text())})")
        return
    # top_k 1: the generation stage's smallest label set; the features stage takes the target's top-k itself
    gen = distill.Config(target=cfg.target, out=cfg.out, work=cfg.work, top_k=1, **{
        k: getattr(cfg, k) for k in ("stdlib_prompts", "own_questions", "requests", "new_tokens", "batch",
                                     "temperature", "generate_minutes", "generate_dtype", "seed", "threads")})
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    model = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=getattr(torch, cfg.generate_dtype)).eval()
    model = model.to(cfg.device)
    distill.stage_generations(gen, model, tokenizer, distill.stage_prompts(gen, model, tokenizer))


# ------------------------------------------------------------------ features


def aux_layer_ids(cfg: Config, target_config) -> list[int]:
    layers = target_config.num_hidden_layers
    ids = [int(i) for i in cfg.aux_layers.split(",")] if cfg.aux_layers else default_aux_layer_ids(layers)
    if not all(0 <= i < layers for i in ids):
        raise SystemExit(f"--aux-layers {ids}: a target of {layers} layers has decoder-layer inputs 0..{layers - 1}")
    return ids


def output_logits(model, hidden: torch.Tensor) -> torch.Tensor:
    """The target's logits for final hidden states [.., D], float32, as its forward makes them: the output
    layer, then what some families do to it (Granite's logits_scaling, Cohere's logit_scale, Gemma 2's
    final_logit_softcapping). check_output_logits says whether that is all a target does."""
    config = model.config
    logits = model.lm_head(hidden).float()
    if getattr(config, "logits_scaling", None):
        logits = logits / config.logits_scaling
    if getattr(config, "logit_scale", None):
        logits = logits * config.logit_scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


@torch.inference_mode()
def check_output_logits(model, ids: list[int]) -> None:
    """Refuse a target whose forward makes its logits otherwise than output_logits does (its labels would
    not be its distribution): both ways, on `ids`."""
    input_ids = torch.tensor([ids], device=model.device)
    own = model(input_ids=input_ids).logits[0].float()
    ours = output_logits(model, model.model(input_ids=input_ids).last_hidden_state[0])
    if not torch.allclose(own, ours, atol=1e-3, rtol=1e-3):
        raise SystemExit(f"the target's forward ({type(model).__name__}) makes its logits otherwise than its output"
                         f" layer and the scalings training.eagle knows (max difference"
                         f" {(own - ours).abs().max().item():.3g}): its labels would not be its distribution")


@torch.inference_mode()
def featurize(model, rows: list[dict], aux: list[int], top_k: int, batch_tokens: int) -> list[dict]:
    """Per row: ids [T], prompt (its length), hidden float16 [T, len(aux) * H] (the inputs of the aux
    layers), top_ids int32 / top_logp float16 [A, k] at the A positions p-1 .. T-2 predicting answer tokens."""
    seqs = [r["prompt"] + r["answer"] for r in rows]
    order = sorted(range(len(rows)), key=lambda i: len(seqs[i]))
    out: list[dict | None] = [None] * len(rows)
    start = 0
    while start < len(order):
        width, end = len(seqs[order[start]]), start
        while end < len(order) and (end - start + 1) * len(seqs[order[end]]) <= max(batch_tokens, width):
            width, end = len(seqs[order[end]]), end + 1
        picks = order[start:end]
        ids = torch.zeros(len(picks), width, dtype=torch.long)
        mask = torch.zeros(len(picks), width, dtype=torch.long)
        for b, i in enumerate(picks):  # right-padded: a row's positions never see the padding
            ids[b, : len(seqs[i])], mask[b, : len(seqs[i])] = torch.tensor(seqs[i]), 1
        result = model.model(input_ids=ids.to(model.device), attention_mask=mask.to(model.device),
                             output_hidden_states=True)
        hidden = torch.cat([result.hidden_states[i] for i in aux], dim=-1).half().cpu()  # [B, T, len(aux) * H]
        for b, i in enumerate(picks):
            n, p = len(seqs[i]), len(rows[i]["prompt"])
            logp = output_logits(model, result.last_hidden_state[b, p - 1 : n - 1]).log_softmax(-1)  # [A, V]
            top_logp, top_ids = logp.topk(top_k, dim=-1)
            out[i] = {"ids": torch.tensor(seqs[i]), "prompt": p, "hidden": hidden[b, :n].clone(),
                      "top_ids": top_ids.int().cpu(), "top_logp": top_logp.half().cpu()}
        start = end
    return out


def stage_features(cfg: Config) -> dict:
    root = cfg.work / "features"
    root.mkdir(parents=True, exist_ok=True)
    if (root / "done.json").exists():
        info = json.loads((root / "done.json").read_text())
        log(f"features: done ({info})")
        return info
    index_path = root / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {}
    model = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).eval().to(cfg.device)
    check_output_logits(model, list(range(1, min(33, model.config.vocab_size))))
    aux = aux_layer_ids(cfg, model.config)
    shards = sorted((cfg.work / "generations").glob("*.pt"))
    log(f"features: {len(shards)} generation shards ({len(index)} done), aux layers {aux}, top-{cfg.top_k}")
    bar = tqdm(total=len(shards), initial=len(index), desc="features", mininterval=10)
    for shard in shards:
        if shard.name in index:
            continue
        tokens, seconds = sum(v["tokens"] for v in index.values()), sum(v["seconds"] for v in index.values())
        if seconds / 60 >= cfg.feature_minutes or (cfg.max_tokens and tokens >= cfg.max_tokens):
            log(f"features: bound reached ({tokens:,} tokens, {seconds / 60:.1f} min)")
            break
        tick = time.perf_counter()
        rows = featurize(model, torch.load(shard, weights_only=False), aux, cfg.top_k, cfg.feature_batch_tokens)
        loop.save_atomic(rows, root / shard.name)
        index[shard.name] = {"rows": len(rows), "tokens": sum(len(r["ids"]) for r in rows),
                             "seconds": round(time.perf_counter() - tick, 2)}
        index_path.write_text(json.dumps(index))
        bar.update(1)
        done = index[shard.name]
        bar.set_postfix(tok_s=f"{(tokens + done['tokens']) / (seconds + done['seconds']):.0f}", refresh=False)
    bar.close()
    seconds = sum(v["seconds"] for v in index.values())
    info = {"shards": len(index), "sequences": sum(v["rows"] for v in index.values()),
            "tokens": sum(v["tokens"] for v in index.values()), "minutes": round(seconds / 60, 1),
            "tokens_per_s": round(sum(v["tokens"] for v in index.values()) / max(seconds, 1e-9)),
            "aux_layer_ids": aux, "top_k": cfg.top_k, "hidden_dtype": "float16"}
    (root / "done.json").write_text(json.dumps(info))
    return info


def load_features(cfg: Config) -> list[dict]:
    """All feature rows, in generation order, memory-mapped (pages are read as rows are drawn)."""
    index = json.loads((cfg.work / "features" / "index.json").read_text())
    rows = []
    for name in sorted(index):
        rows.extend(torch.load(cfg.work / "features" / name, weights_only=False, mmap=True))
    return rows


def held_out(i: int, share: float) -> bool:
    """Every round(1 / share)-th answer (by its index over all generation shards, in order) is held out."""
    return i % max(2, round(1 / share)) == 0


# ------------------------------------------------------------------ vocab


def stage_vocab(cfg: Config, vocab_size: int) -> dict:
    path = cfg.work / "vocab.json"
    if path.exists():
        return json.loads(path.read_text())
    if cfg.init:  # a head that goes on keeps its draft vocabulary, however the answers have grown since
        head = Eagle3Head.load(Path(cfg.init), target_dir=cfg.target)
        ids = head.draft_to_target(torch.arange(head.config.draft_vocab_size)).tolist()
        answers = [t for i, r in enumerate(distill.load_generations(cfg)) if not held_out(i, cfg.heldout_share)
                   for t in r["answer"]]
        have = set(ids)
        covered = sum(t in have for t in answers)
        info = {"ids": sorted(ids), "size": len(ids), "recommended": len(ids), "from": str(cfg.init),
                "target_coverage": round(covered / max(1, len(answers)), 5), "answer_tokens": len(answers)}
        path.write_text(json.dumps(info))
        log(f"vocab: {len(ids):,} ids, --init's")
        return info
    rows = [r for i, r in enumerate(distill.load_generations(cfg)) if not held_out(i, cfg.heldout_share)]
    counts = distill.draft_vocab(rows, vocab_size, cfg.vocab_coverage)
    size = counts["recommended"] or vocab_size
    chosen = counts["ids"][:size]
    chosen += [i for i in range(vocab_size) if i not in set(chosen)][: size - len(chosen)]  # ids never seen
    info = {"ids": sorted(chosen), "size": size, **{k: v for k, v in counts.items() if k != "ids"}}
    path.write_text(json.dumps(info))
    log(f"vocab: {size:,} ids cover {cfg.vocab_coverage:.1%}+ of {counts['answer_tokens']:,} answer tokens")
    return info


# ------------------------------------------------------------------ the head and its training-time test


def build_head(cfg: Config, vocab_ids: list[int], init: bool) -> Eagle3Head:
    """A head shaped as the target's layers; with init, started from the target (see the module's docstring)."""
    t = AutoConfig.from_pretrained(cfg.target)
    head_dim = getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads
    rope = distill.llama_rope(t, head_dim)  # (the head, a Llama layer, rotates its whole heads)
    theta = rope.pop("rope_theta")
    config = Eagle3Config(
        hidden_size=t.hidden_size, intermediate_size=cfg.intermediate_size or init_width(cfg) or t.intermediate_size,
        num_attention_heads=t.num_attention_heads,
        num_key_value_heads=t.num_key_value_heads, head_dim=head_dim, vocab_size=t.vocab_size,
        draft_vocab_size=len(vocab_ids),
        aux_layer_ids=aux_layer_ids(cfg, t), target_hidden_size=t.hidden_size, rms_norm_eps=t.rms_norm_eps,
        rope_theta=theta, rope_scaling=rope if rope.get("rope_type", "default") != "default" else None,
        max_position_embeddings=t.max_position_embeddings,
        hidden_act=getattr(t, "hidden_act", None) or getattr(t, "hidden_activation", None) or "silu",  # (Gemma's name)
        attention_bias=getattr(t, "attention_bias", False), verifier=str(cfg.target), speculative_tokens=cfg.ttt_steps,
        extra={k: getattr(t, k) for k in ("bos_token_id", "eos_token_id") if getattr(t, k, None) is not None})
    torch.manual_seed(cfg.seed)
    head = Eagle3Head(config)
    ids = torch.tensor(vocab_ids)
    head.set_vocab(ids)
    head.embed_tokens.weight.data.copy_(read_target_tensor(cfg.target, "model.embed_tokens.weight"))
    head.embeddings_from_target = True
    if init:
        last = f"model.layers.{t.num_hidden_layers - 1}."
        layer = head.layer
        with torch.no_grad():
            for name, linear in layer.self_attn.items():
                w = target_linear(cfg.target, t, f"{last}self_attn.", name)
                linear.weight[:, -w.shape[1] :].copy_(w)  # q/k/v: the hidden half [.., H:2H]
            widen(layer.mlp, {name: target_linear(cfg.target, t, f"{last}mlp.", name) for name in layer.mlp})
            # an RMSNorm's weight as the head's multiplies by it (Gemma's stores it less 1: x * (1 + w))
            offset = 1.0 if t.model_type in OFFSET_NORMS else 0.0
            layer.hidden_norm.weight.copy_(read_target_tensor(cfg.target, f"{last}input_layernorm.weight") + offset)
            # the norm before the MLP (Gemma 2's and 3's post_attention_layernorm norms the attention's output)
            before_mlp = "pre_feedforward_layernorm" if t.model_type in SANDWICH_NORMS else "post_attention_layernorm"
            layer.post_attention_layernorm.weight.copy_(
                read_target_tensor(cfg.target, f"{last}{before_mlp}.weight") + offset)
            # (the logits' scale some families apply after the output layer, output_logits, in the norm)
            scale = getattr(t, "logit_scale", None) or 1.0 / (getattr(t, "logits_scaling", None) or 1.0)
            head.norm.weight.copy_((read_target_tensor(cfg.target, "model.norm.weight") + offset) * scale)
            head.lm_head.weight.copy_(read_target_tensor(cfg.target, "lm_head.weight")[ids])
    return head


OFFSET_NORMS = {"gemma", "gemma2", "gemma3", "gemma3_text"}  # families whose RMSNorm multiplies by 1 + weight
SANDWICH_NORMS = {"gemma2", "gemma3", "gemma3_text"}  # ... whose MLP's input norm is pre_feedforward_layernorm

FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
         "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}  # part: (the fused weight, its section)


def target_linear(target: Path, config, prefix: str, name: str) -> torch.Tensor:
    """The weight of the target's linear prefix + name; where the checkpoint fuses it with others
    (Phi-3's qkv_proj and gate_up_proj) its rows of the fused weight."""
    try:
        return read_target_tensor(target, f"{prefix}{name}.weight")
    except KeyError:
        if name not in FUSED:
            raise
    owner, part = FUSED[name]
    return read_target_tensor(target, f"{prefix}{owner}.weight").split(sections(owner, config))[part]


def init_width(cfg: Config) -> int:
    """--init's MLP width (0 without --init): a head goes on as wide as it was unless told otherwise."""
    if not cfg.init:
        return 0
    return Eagle3Config.from_dict(json.loads((Path(cfg.init) / "config.json").read_text())).intermediate_size


def widen(mlp: torch.nn.ModuleDict, weights: dict[str, torch.Tensor]) -> None:
    """mlp's first units from `weights` (an MLP as wide or narrower); its other units' down_proj
    columns zero, so that mlp computes what `weights` do until training gives them a say. Where mlp
    is the narrower, it keeps `weights`' first units."""
    units = min(weights["down_proj"].shape[1], mlp["down_proj"].weight.shape[1])
    with torch.no_grad():
        for name in ("gate_proj", "up_proj"):
            mlp[name].weight[:units].copy_(weights[name][:units])
        mlp["down_proj"].weight.zero_()
        mlp["down_proj"].weight[:, :units].copy_(weights["down_proj"][:, :units])


def start_from(head: Eagle3Head, directory: Path, target: Path) -> None:
    """head's weights from an exported head of the same shape and draft vocabulary (--init), or
    one whose MLP is narrower (widened: `widen`)."""
    trained = Eagle3Head.load(directory, target_dir=target)
    mine, theirs = head.config.to_dict(), trained.config.to_dict()
    differ = sorted(k for k in mine.keys() | theirs.keys()
                    if k not in ("speculators_config", "transformer_layer_config") and mine.get(k) != theirs.get(k))
    layer, trained_layer = mine["transformer_layer_config"], theirs["transformer_layer_config"]
    differ += sorted(k for k in layer.keys() | trained_layer.keys()
                     if k != "intermediate_size" and layer.get(k) != trained_layer.get(k))
    if layer["intermediate_size"] < trained_layer["intermediate_size"]:
        differ.append("intermediate_size (narrower than --init's)")
    if differ or not torch.equal(head.d2t, trained.d2t):
        raise SystemExit(f"--init {directory}: another shape or draft vocabulary ({differ or 'd2t'})")
    state = {k: v for k, v in trained.state_dict().items() if ".mlp." not in k}
    head.load_state_dict(state, strict=False)
    widen(head.layer.mlp, {name: linear.weight for name, linear in trained.layer.mlp.items()})
    log(f"train: starting from {directory}" + (f", its MLP widened {trained_layer['intermediate_size']}"
                                               f" -> {layer['intermediate_size']}" if layer != trained_layer else ""))


def collate(rows: list[dict], head: Eagle3Head, max_length: int) -> dict[str, torch.Tensor]:
    """Right-padded rows. Row t: feature t, token t+1 (`inputs`), position t. Labels indexed by the
    position they belong to: at position s the target's top-k for token s+1, as draft columns
    (`columns`, clamped), renormalised over the draft vocabulary (`p`), weight 1 where s predicts an
    answer token and some label mass is in the draft vocabulary; `top1`: the target's argmax id."""
    width = min(max_length, max(len(r["ids"]) for r in rows))
    k = rows[0]["top_ids"].shape[1]
    B = len(rows)
    features = torch.zeros(B, width, rows[0]["hidden"].shape[1], dtype=rows[0]["hidden"].dtype)  # as stored
    inputs = torch.zeros(B, width, dtype=torch.long)
    top_ids = torch.zeros(B, width, k, dtype=torch.long)
    top_logp = torch.full((B, width, k), -1e4)
    weight = torch.zeros(B, width)
    for b, r in enumerate(rows):
        n, p = min(len(r["ids"]), width), r["prompt"]
        features[b, :n] = r["hidden"][:n]
        inputs[b, : n - 1] = r["ids"][1:n]
        a = max(0, n - p)  # labels at p-1 .. n-2
        top_ids[b, p - 1 : p - 1 + a] = r["top_ids"][:a].long()
        top_logp[b, p - 1 : p - 1 + a] = r["top_logp"][:a].float()
        weight[b, p - 1 : p - 1 + a] = 1
    column = torch.full((head.config.vocab_size,), -1, dtype=torch.long)
    draft = torch.arange(head.config.draft_vocab_size)
    column[head.draft_to_target(draft.to(head.d2t.device)).cpu()] = draft  # (on the host, wherever the head is)
    columns = column[top_ids]
    p = top_logp.exp() * (columns >= 0)
    mass = p.sum(-1, keepdim=True)
    weight *= (mass[..., 0] > 0).float()
    return {"features": features, "inputs": inputs, "columns": columns.clamp(min=0), "p": p / mass.clamp(min=1e-9),
            "top1": top_ids[..., 0], "weight": weight}


def on(batch: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """collate's batch on the head's device (pinned first where that is a GPU: the copy does not wait)."""
    if torch.device(device).type == "cpu":
        return batch
    return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}


def chain_attention(q, k0, v0, ks, vs):
    """Training-time test's attention for step >= 1: row t attends causally to the target-feature rows
    (k0, v0: step 0, [B, kv, T, hd]) and to row t of every later step (ks, vs: steps 1..k), as at
    inference. q: [B, heads, T, hd] -> [B, heads, T, hd]."""
    groups, T = q.shape[1] // k0.shape[1], q.shape[2]
    k0, v0 = k0.repeat_interleave(groups, 1), v0.repeat_interleave(groups, 1)
    kd = torch.stack([k.repeat_interleave(groups, 1) for k in ks], dim=3)  # [B, heads, T, steps, hd]
    vd = torch.stack([v.repeat_interleave(groups, 1) for v in vs], dim=3)
    scale = q.shape[-1] ** -0.5
    causal = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    s0 = (q @ k0.transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))  # [B, heads, T, T]
    sd = (q.unsqueeze(3) * kd).sum(-1) * scale  # [B, heads, T, steps]: the row's own chain
    w = torch.cat([s0, sd], dim=-1).float().softmax(-1).to(q.dtype)
    return w[..., :T] @ v0 + (w[..., T:].unsqueeze(-1) * vd).sum(3)


def ttt(head: Eagle3Head, batch: dict, steps: int, teacher: bool = False):
    """Yields each step's logits [B, T, Vd]: step 0 from the target's features, step k from step k-1's
    out_hidden at positions t + k, and its proposed tokens, or with `teacher` the sequence's own tokens
    (step k's row t reads token t + 1 + k: the tokens a chain still alive at step k has proposed,
    whose labels the target computed after exactly those tokens)."""
    hidden = head.fc(batch["features"].to(head.fc.weight.dtype))  # [B, T, H]
    inputs = batch["inputs"]
    positions = torch.arange(inputs.shape[1], device=inputs.device).expand_as(inputs)
    ks, vs = [], []
    for k in range(steps):
        cos, sin = head.rope(hidden, positions + k)
        q, key, value, residual = head.layer.project(head.embed_tokens(inputs).to(hidden.dtype), hidden, cos, sin)
        if k == 0:
            k0, v0 = key, value
            attention = F.scaled_dot_product_attention(q, key, value, is_causal=True, enable_gqa=True)
        else:
            ks.append(key)
            vs.append(value)
            attention = chain_attention(q, k0, v0, ks, vs)
        hidden = head.layer.finish(attention, residual)
        logits = head.lm_head(head.norm(hidden))
        yield logits
        inputs = shifted(batch["inputs"], k + 1) if teacher else head.draft_to_target(logits.detach().argmax(-1))


def shifted(x: torch.Tensor, by: int) -> torch.Tensor:
    """x[:, by:] padded with zeros to x's width: row t gets what belongs to position t + by."""
    return torch.cat([x[:, by:], x.new_zeros(x.shape[0], min(by, x.shape[1]), *x.shape[2:])], dim=1)


def ttt_loss(head: Eagle3Head, batch: dict, steps: int, decay: float, teacher: bool = False) -> torch.Tensor:
    """sum_k decay^k * mean over rows of -sum_v p(v) log q_k(v), step k's row t scored against position t+1+k."""
    total = 0.0
    for k, logits in enumerate(ttt(head, batch, steps, teacher)):
        w = shifted(batch["weight"], 1 + k) > 0
        if not w.any():
            break
        logq = logits[w].float().log_softmax(-1)  # [N, Vd]
        total = total + decay**k * -(shifted(batch["p"], 1 + k)[w] * logq.gather(-1, shifted(
            batch["columns"], 1 + k)[w])).sum(-1).mean()
    return total


def walk_rounds(runs: list[int], k: int) -> tuple[int, int]:
    """Greedy rounds at K = k walked over one answer, as specdec's round takes them: `runs[i]`, the
    steps the head's chain from the i-th answer position agrees for (at most k). A round drafts from
    where the last one committed, accepts its chain's run and commits one token more (the target's
    correction or bonus), so the next round starts right after a token the head got wrong (or a
    bonus): the positions the rounds start from are not all positions, and the mean over rounds is
    below the mean over positions wherever the head's errors come in runs. Only rounds whose k
    positions all lie in the answer count. -> (accepted tokens, rounds)"""
    accepted = rounds = i = 0
    while i + k <= len(runs):
        run = min(runs[i], k)
        accepted, rounds, i = accepted + run, rounds + 1, i + run + 1
    return accepted, rounds


@torch.no_grad()
def evaluate(head: Eagle3Head, rows: list[dict], cfg: Config) -> dict:
    """Per step k: agreement (the head's argmax, mapped to target ids, equals the target's argmax at the
    position it predicts) and chain (steps 0..k all agree, over chains starting in the answer);
    expected_accepted, the chain's sum (a round's accepted tokens averaged over every start), and
    round_accepted / round_acceptance, what greedy rounds at K = ttt_steps accept walked over each
    answer (walk_rounds: the figure specdec's round measures)."""
    agree, chain, counted, started = ([0.0] * cfg.ttt_steps for _ in range(4))
    walked, rounds = 0, 0
    for i in range(0, len(rows), 8):
        batch = on(collate(rows[i : i + 8], head, cfg.max_length), head.norm.weight.device)
        alive = shifted(batch["weight"], 1) > 0
        runs = torch.zeros(alive.shape, dtype=torch.long, device=alive.device)
        for k, logits in enumerate(ttt(head, batch, cfg.ttt_steps)):
            w = shifted(batch["weight"], 1 + k) > 0
            right = head.draft_to_target(logits.argmax(-1)) == shifted(batch["top1"], 1 + k)
            agree[k] += (right & w).sum().item()
            counted[k] += w.sum().item()
            alive &= right & w
            runs += alive
            chain[k] += alive.sum().item()
            started[k] += (shifted(batch["weight"], 1).bool() & w).sum().item()
        # row t drafts answer position t + 2 on; a row's answer starts at row prompt - 1 (the first
        # round: the prompt and the target's first token committed)
        width = batch["weight"].shape[1]
        for b, r in enumerate(rows[i : i + 8]):
            first, last = r["prompt"] - 1, min(len(r["ids"]), width) - 2  # rows whose first label is in the answer
            accepted, n = walk_rounds(runs[b, first:last].tolist(), cfg.ttt_steps)
            walked, rounds = walked + accepted, rounds + n
    metrics = {f"agree_{k}": agree[k] / max(counted[k], 1) for k in range(cfg.ttt_steps)}
    metrics.update({f"chain_{k}": chain[k] / max(started[k], 1) for k in range(cfg.ttt_steps)})
    metrics["expected_accepted"] = sum(metrics[f"chain_{k}"] for k in range(cfg.ttt_steps))
    metrics["round_accepted"] = walked / max(rounds, 1)
    metrics["round_acceptance"] = metrics["round_accepted"] / cfg.ttt_steps
    return metrics


def stage_train(cfg: Config, vocab: dict) -> dict:
    ckpt = cfg.work / "train"
    if (ckpt / "result.json").exists() and json.loads((ckpt / "result.json").read_text())["steps"] >= cfg.steps:
        return json.loads((ckpt / "result.json").read_text())
    rows = load_features(cfg)
    train_rows = [r for i, r in enumerate(rows) if not held_out(i, cfg.heldout_share)]
    heldout = [r for i, r in enumerate(rows) if held_out(i, cfg.heldout_share)][: cfg.heldout_rows]
    head = build_head(cfg, vocab["ids"], init=True)
    if cfg.init and not (ckpt / "checkpoint.pt").exists():
        start_from(head, Path(cfg.init), cfg.target)
    head = head.to(cfg.device)
    answer_tokens = sum(len(r["top_ids"]) for r in train_rows)
    log(f"train: {sum(p.numel() for p in head.parameters() if p.requires_grad):,} trainable parameters,"
        f" {len(train_rows)} answers ({answer_tokens:,} answer tokens), {len(heldout)} held out, {cfg.steps} steps"
        f" of {cfg.train_batch}, {cfg.ttt_steps} TTT steps; draft vocabulary {vocab['size']:,}")
    # loop counts steps x batch x length tokens: length is the mean answer, so tokens_seen estimates answer tokens
    schedule = loop.Schedule(steps=cfg.steps, peak_lr=cfg.lr, warmup=cfg.warmup, batch=cfg.train_batch,
                             length=round(answer_tokens / max(1, len(train_rows))))
    step = [torch.load(ckpt / "checkpoint.pt", weights_only=False)["step"] if (ckpt / "checkpoint.pt").exists() else 0]
    curve_path = ckpt / "curve.json"

    def sample(g: torch.Generator):
        step[0] += 1
        picks = torch.randint(0, len(train_rows), (cfg.train_batch,), generator=g).tolist()
        return on(collate([train_rows[i] for i in picks], head, cfg.max_length), cfg.device)

    def held_out_metrics(model) -> dict:
        metrics = evaluate(model, heldout, cfg)
        curve = json.loads(curve_path.read_text()) if curve_path.exists() else []
        curve = [c for c in curve if c["step"] < step[0]] + [
            {"step": step[0], "answer_tokens": step[0] * schedule.batch * schedule.length, **metrics}]
        curve_path.write_text(json.dumps(curve, indent=1))
        return metrics

    if cfg.ttt_tokens not in ("teacher", "own"):
        raise SystemExit(f"--ttt-tokens {cfg.ttt_tokens!r}: expected teacher or own")
    teacher = cfg.ttt_tokens == "teacher"
    return loop.train("eagle", head, lambda m, batch: ttt_loss(m, batch, cfg.ttt_steps, cfg.ttt_decay, teacher),
                      held_out_metrics, schedule, ckpt, seed=cfg.seed,
                      precision="bf16" if loop.bf16_is_fast(cfg.device) else "fp32", checkpoint_minutes=3.0,
                      eval_every=cfg.eval_every, sample=sample)


# ------------------------------------------------------------------ export


def stage_export(cfg: Config, vocab: dict, features: dict, result: dict) -> dict:
    head = loop.load_trained(build_head(cfg, vocab["ids"], init=False), cfg.work / "train")
    head.embeddings_from_target = True
    tmp = cfg.out.with_name(cfg.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    head.save(tmp)
    final = {k: round(v, 4) for k, v in result["final"].items() if k not in ("step", "tokens_seen")}
    info = {
        "target": str(cfg.target),
        "aux_layer_ids": head.config.aux_layer_ids,
        "trainable_parameters": sum(p.numel() for n, p in head.named_parameters() if n != "embed_tokens.weight"),
        "generations": json.loads((cfg.work / "generations" / "done.json").read_text()),
        "features": features,
        "draft_vocab": {k: v for k, v in vocab.items() if k != "ids"},
        "training": {"steps": result["steps"], "answer_tokens_seen": result["tokens_seen"],
                     "minutes": round(result["train_wall_s"] / 60, 1), "precision": result["precision"],
                     "ttt_steps": cfg.ttt_steps, "ttt_decay": cfg.ttt_decay, "ttt_tokens": cfg.ttt_tokens,
                     "device": device_name(cfg.device)},
        "heldout": final,
        "init": {"head": cfg.init, "its_intermediate_size": init_width(cfg),
                 "intermediate_size": head.config.intermediate_size} if cfg.init else None,
        "curve": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in e.items()} for e in result["evals"]],
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items() if k not in ("out", "work")},
    }
    (tmp / "eagle.json").write_text(json.dumps(info, indent=1) + "\n")
    (tmp / "README.md").write_text(model_card(info))
    shutil.rmtree(cfg.out, ignore_errors=True)
    os.replace(tmp, cfg.out)
    return info


def device_name(device: str) -> str:
    """"cpu", or the GPU's name ("NVIDIA H200")."""
    return torch.cuda.get_device_name(torch.device(device)) if torch.device(device).type == "cuda" else "cpu"


def model_card(info: dict) -> str:
    g, f, t, h, v = info["generations"], info["features"], info["training"], info["heldout"], info["draft_vocab"]
    steps = range(t["ttt_steps"])
    lines = [
        f"# EAGLE-3 head for {info['target']} (trained by specdec)\n",
        ("One Llama decoder layer fed the target's hidden states at the inputs of its layers"
         f" {info['aux_layer_ids']} (fused by `fc`) and the next token's embedding (the target's, not stored here:"
         f" pass the target's directory). {info['trainable_parameters']:,} trainable parameters, bf16, in the"
         " `speculators` layout that vLLM loads (`config.json`, `model.safetensors`: fc, layers.0.*, norm, lm_head,"
         " d2t, t2d); where it is committed, as `model.safetensors.int8` (its matrices as int8 rows, fc bf16:"
         " `python -m assets.packed`), from which `make setup` writes `model.safetensors`.\n"),
        ("Made by `python -m training eagle`: the target answered prompts ("
         + g.get("prompts", "built from the Python standard library, questions it wrote itself and everyday requests"
                                 " (training/everyday.py)")
         + "; held-out bench prompts excluded); its float32 hidden states and top-k next-token"
         " distributions on those answers, teacher-forced, were the training data; training-time test over"
         f" {t['ttt_steps']} steps"
         + (", each step after the first reading the answer's own next token" if t.get("ttt_tokens") == "teacher"
            else ", each step after the first reading the head's own proposal" if t.get("ttt_tokens") else "")
         + (f"; {t['schedule']}" if t.get("schedule") else "") + ".\n"),
        "| figure | value |\n|---|---|",
        f"| target answers | {g['sequences']:,} ({g['answer_tokens']:,} tokens, {g['minutes']} min) |",
        (f"| features | {f['sequences']:,} sequences, {f['tokens']:,} tokens, {f['minutes']} min"
         f" ({f['tokens_per_s']:,} tokens/s) |"),
        f"| draft vocabulary | {v['size']:,} ids ({100 * v['target_coverage']:.1f}% of answer tokens) |",
        *([f"| started from | the head in {i['head']} (`--init`)"
           + (f", its MLP widened {i['its_intermediate_size']:,} → {i['intermediate_size']:,} units"
              if i["intermediate_size"] != i["its_intermediate_size"] else "") + " |"]
          if (i := info.get("init")) else []),
        (f"| training | {t['steps']:,} steps, ~{t['answer_tokens_seen']:,} answer tokens, {t['minutes']} min,"
         f" {t['precision']}" + (f", on {t['device']}" if t.get("device", "cpu") != "cpu" else "") + " |"),
        "| held-out agreement per step (argmax = the target's argmax, fed its own states) | "
        + " / ".join(f"{h[f'agree_{k}']:.3f}" for k in steps) + " |",
        "| held-out chain (steps 0..k all agree) | " + " / ".join(f"{h[f'chain_{k}']:.3f}" for k in steps) + " |",
        (f"| accepted tokens a round could expect at K = {t['ttt_steps']} from any answer position (sum of the"
         f" chain) | {h['expected_accepted']:.2f} |"),
        *([f"| accepted tokens per round at K = {t['ttt_steps']}, greedy rounds walked over the held-out answers as"
           " specdec takes them (each round starts after the target's correction: where the head has just erred)"
           f" | {h['round_accepted']:.2f} (acceptance {h['round_acceptance']:.3f}) |"] if "round_accepted" in h else []),
        *(f"| acceptance at K = {a['k']} in specdec's round, greedy, the bench's {a['prompts']} chat prompts, target"
          f" {'float32' if q == 'none' else q} (`training.acceptance`) | {a['acceptance_rate_pooled']:.3f} pooled"
          f" ({a['tokens_per_round']:.2f} tokens per round, α {a['alpha_pooled']:.3f}) |"
          for q, a in info.get("acceptance", {}).items() if isinstance(a, dict)),
        "\nHeld-out agreement per step against answer tokens seen:\n",
        "| answer tokens | " + " | ".join(f"step {k}" for k in steps) + " |",
        "|---|" + "---|" * len(steps),
    ]
    lines += [f"| {e['tokens_seen']:,} | " + " | ".join(f"{e[f'agree_{k}']:.3f}" for k in steps) + " |"
              for e in info["curve"]]
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training eagle", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="a local transformers Llama-family model directory")
    parser.add_argument("--out", type=Path, required=True, help="where the head's directory is written")
    parser.add_argument("--work", type=Path, help="scratch and checkpoints (default .cache/eagle/<out's name>)")
    for f in fields(Config):
        if f.name not in ("target", "out", "work"):
            parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(f.default), default=f.default)
    args = vars(parser.parse_args(argv))
    args["work"] = args["work"] or REPO / ".cache" / "eagle" / args["out"].name
    cfg = Config(**args)
    torch.set_num_threads(cfg.threads)
    cfg.work.mkdir(parents=True, exist_ok=True)
    log(f"eagle: target {cfg.target}, out {cfg.out}, work {cfg.work}")
    stage_answers(cfg)
    features = stage_features(cfg)
    vocab = stage_vocab(cfg, AutoConfig.from_pretrained(cfg.target).vocab_size)
    result = stage_train(cfg, vocab)
    info = stage_export(cfg, vocab, features, result)
    log(f"export: {cfg.out}: held-out agreement per step "
        + " / ".join(f"{info['heldout'][f'agree_{k}']:.3f}" for k in range(cfg.ttt_steps))
        + f", accepted per round {info['heldout']['round_accepted']:.2f} (any start {info['heldout']['expected_accepted']:.2f})")


if __name__ == "__main__":
    main()
