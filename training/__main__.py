"""python -m training {corpus,tokenizer,target,draft,generations,refine,export,all} [--smoke] [--target-steps N] [--draft-steps N]

The draft is distilled twice: first on corpus windows (`draft`), then on a mix that is
mostly the target's own continuations (`generations` writes them, `refine` trains on
them): the draft is used on text the target writes, not on the corpus, and training on
it (on-policy data, as in DistillSpec) is what raises acceptance.

Each stage skips work already done and the two training stages resume from their last
checkpoint, so the same command both starts and resumes the run:

    cd /work/main && nohup nice -n 10 .venv/bin/python -m training all > .cache/training/train.log 2>&1 &

--smoke runs the whole pipeline at toy scale (a few dozen files, tiny models, a few steps)
in /tmp/specdec-smoke/{cache,models}, never touching models/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from . import data, export, loop, models  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SEQUENCE = loop.Schedule.length + 1  # tokens per generated sequence: one training window plus its label
STAGES = ["corpus", "tokenizer", "target", "draft", "generations", "refine", "export"]


@dataclass(frozen=True)
class Plan:
    cache: Path
    models: Path
    max_files: int | None
    vocab_size: int
    target: models.Shape
    draft: models.Shape
    target_steps: int  # 2100: ~55 min at ~1.6 s/step = 1.3 k tokens/s (fp32, 2 cores, no native bf16)
    draft_steps: int   # 1450: ~25 min at ~1.0 s/step (teacher forward 0.5 s + draft step 0.5 s)
    generations: int = 2048  # target continuations to refine the draft on (half greedy, half sampled)
    generation_batch: int = 32
    generation_temperature: float = 0.8
    refine_steps: int = 1500
    refine_lr: float = 1e-3
    refine_generated_share: float = 0.75  # of each batch; the rest are corpus windows
    target_lr: float = 1e-3
    draft_lr: float = 2e-3
    warmup: int = 100
    draft_ce_weight: float = 0.0  # share of next-token cross-entropy mixed into the KL
    eval_windows: int = 64
    eval_every: int = 250
    checkpoint_minutes: float = 5.0
    prompts: int = 32
    prompt_tokens: int = 128  # + new_tokens stays within the 256-token training windows
    new_tokens: int = 128
    k: int = 4
    seed: int = 0


FULL = Plan(
    cache=REPO / ".cache" / "training",
    models=REPO / "models",
    max_files=None,
    vocab_size=8192,
    target=models.TARGET,
    draft=models.DRAFT,
    target_steps=2100,
    draft_steps=1450,
)
SMOKE = replace(
    FULL,
    cache=Path("/tmp/specdec-smoke/cache"),
    models=Path("/tmp/specdec-smoke/models"),
    max_files=60,
    vocab_size=1024,
    target=models.Shape(hidden=64, layers=2, heads=4, ffn=192),
    draft=models.Shape(hidden=32, layers=1, heads=2, ffn=96),
    target_steps=40,
    draft_steps=40,
    warmup=5,
    eval_windows=8,
    eval_every=15,
    checkpoint_minutes=0.05,
    generations=16,
    generation_batch=8,
    refine_steps=20,
    prompts=6,
    prompt_tokens=32,
    new_tokens=32,
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ------------------------------------------------------------------ stages


def stage_corpus(plan: Plan) -> None:
    out = plan.cache / "corpus"
    if (out / "corpus.json").exists():
        log(f"corpus: done ({out})")
        return
    info = data.build_corpus(out, plan.max_files)
    log(
        f"corpus: Python {info['python_version']} stdlib, {info['files']} files ({info['train_files']} train,"
        f" {info['heldout_files']} held out, {len(info['skipped_files'])} skipped), {info['train_bytes']:,} train bytes"
    )


def stage_tokenizer(plan: Plan) -> None:
    out, counts = plan.cache / "tokenizer", plan.cache / "tokens.json"
    if counts.exists():
        log(f"tokenizer: done ({out})")
        return
    tokenizer = data.train_tokenizer(plan.cache / "corpus", out, plan.vocab_size)
    n = {split: data.tokenize_split(tokenizer, plan.cache / "corpus", split, plan.cache / f"{split}.u16")
         for split in ("train", "heldout")}
    counts.write_text(json.dumps({"vocab_size": len(tokenizer), "eos_id": tokenizer.eos_token_id, **n}))
    log(f"tokenizer: {len(tokenizer)} ids, eos id {tokenizer.eos_token_id}; {n['train']:,} train / {n['heldout']:,} held-out tokens")


def load_tokenizer(plan: Plan):
    return AutoTokenizer.from_pretrained(plan.cache / "tokenizer")


def precision() -> str:
    return "bf16" if loop.bf16_is_fast() else "fp32"


def build(shape: models.Shape, tokenizer, seed: int):
    return models.build(shape, len(tokenizer), tokenizer.eos_token_id, seed)


def finished(ckpt_dir: Path, steps: int) -> dict | None:
    path = ckpt_dir / "result.json"
    if path.exists():
        result = json.loads(path.read_text())
        if result["steps"] >= steps:
            return result
    return None


def stage_target(plan: Plan) -> None:
    ckpt_dir = plan.cache / "target"
    if result := finished(ckpt_dir, plan.target_steps):
        log(f"target: done ({result['steps']} steps, held-out loss {result['final']['heldout_loss']:.3f})")
        return
    tokenizer = load_tokenizer(plan)
    train, heldout = data.load_tokens(plan.cache / "train.u16"), data.load_tokens(plan.cache / "heldout.u16")
    schedule = loop.Schedule(steps=plan.target_steps, peak_lr=plan.target_lr, warmup=plan.warmup)
    eval_windows = data.heldout_windows(heldout, plan.eval_windows, schedule.length)  # [N, T+1]
    model = build(plan.target, tokenizer, plan.seed)
    log(f"target: {models.num_parameters(model):,} parameters, {plan.target_steps} steps, {precision()}")

    def loss_of(model, window):  # window: [B, T+1]
        return models.cross_entropy(models.logits_of(model, window[:, :-1]), window[:, 1:])

    def evaluate(model) -> dict:
        losses = [loss_of(model, w) for w in eval_windows.split(8)]
        return {"heldout_loss": torch.stack(losses).mean().item()}

    result = loop.train(
        "target", model, loss_of, evaluate, train, schedule, ckpt_dir,
        seed=plan.seed, precision=precision(), checkpoint_minutes=plan.checkpoint_minutes, eval_every=plan.eval_every,
    )
    log(f"target: held-out loss {result['final']['heldout_loss']:.3f} after {result['train_wall_s'] / 60:.1f} min")


def trained_target(plan: Plan, tokenizer):
    teacher = loop.load_trained(build(plan.target, tokenizer, plan.seed), plan.cache / "target")
    for p in teacher.parameters():
        p.requires_grad_(False)
    return teacher


def draft_metrics(teacher, student, window: torch.Tensor) -> dict[str, torch.Tensor]:
    """window: [B, T+1] -> KL, agreement, 1 - TV and the student's cross-entropy."""
    p_logits, q_logits = models.logits_of(teacher, window[:, :-1]), models.logits_of(student, window[:, :-1])
    return {
        "heldout_kl": models.forward_kl(p_logits, q_logits),
        "heldout_agreement": models.agreement(p_logits, q_logits),
        "heldout_1_minus_tv": models.one_minus_tv(p_logits, q_logits),
        "heldout_loss": models.cross_entropy(q_logits, window[:, 1:]),
    }


def distil(plan: Plan, name: str, steps: int, peak_lr: float, warmup: int, seed: int,
           student_of: Callable, sample_of: Callable | None = None) -> None:
    """Train a draft on the target's soft labels (forward KL), resumable in plan.cache/<name>.

    student_of(tokenizer) -> the model to start from; sample_of(train tokens, schedule) -> the
    batch sampler for loop.train (default: random corpus windows)."""
    ckpt_dir = plan.cache / name
    if result := finished(ckpt_dir, steps):
        log(f"{name}: done ({result['steps']} steps, greedy agreement {result['final']['heldout_agreement']:.3f})")
        return
    tokenizer = load_tokenizer(plan)
    train, heldout = data.load_tokens(plan.cache / "train.u16"), data.load_tokens(plan.cache / "heldout.u16")
    schedule = loop.Schedule(steps=steps, peak_lr=peak_lr, warmup=warmup)
    eval_windows = data.heldout_windows(heldout, plan.eval_windows, schedule.length)
    teacher = trained_target(plan, tokenizer)
    student = student_of(tokenizer)
    log(f"{name}: {models.num_parameters(student):,} parameters, {steps} steps, {precision()}")
    sample = sample_of(train, schedule) if sample_of else None

    def loss_of(student, window):  # window: [B, T+1]
        with torch.no_grad():
            p_logits = models.logits_of(teacher, window[:, :-1])  # [B, T, V]
        q_logits = models.logits_of(student, window[:, :-1])
        loss = models.forward_kl(p_logits, q_logits)
        if plan.draft_ce_weight:
            loss = loss + plan.draft_ce_weight * models.cross_entropy(q_logits, window[:, 1:])
        return loss

    def evaluate(student) -> dict:
        chunks = [draft_metrics(teacher, student, w) for w in eval_windows.split(8)]
        return {k: torch.stack([c[k] for c in chunks]).mean().item() for k in chunks[0]}

    result = loop.train(
        name, student, loss_of, evaluate, train, schedule, ckpt_dir,
        seed=seed, precision=precision(), checkpoint_minutes=plan.checkpoint_minutes,
        eval_every=plan.eval_every, sample=sample,
    )
    log(f"{name}: greedy agreement {result['final']['heldout_agreement']:.3f} after {result['train_wall_s'] / 60:.1f} min")


def stage_draft(plan: Plan) -> None:
    """Distil a fresh draft on random corpus windows."""
    distil(plan, "draft", plan.draft_steps, plan.draft_lr, plan.warmup, plan.seed + 1,
           lambda tokenizer: build(plan.draft, tokenizer, plan.seed + 1))


@torch.no_grad()
def continue_batch(teacher, prompts: torch.Tensor, new_tokens: int, temperature: float,
                   generator: torch.Generator) -> torch.Tensor:
    """prompts [B, P] -> [B, P + new_tokens]: the target's own continuations (greedy at temperature 0)."""
    out = teacher(prompts, use_cache=True)
    past, logits, pieces = out.past_key_values, out.logits[:, -1].float(), [prompts]
    for i in range(new_tokens):
        if temperature > 0:
            probs = torch.softmax(logits / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator)
        else:
            nxt = logits.argmax(-1, keepdim=True)
        pieces.append(nxt)
        if i + 1 < new_tokens:
            out = teacher(nxt, past_key_values=past, use_cache=True)
            past, logits = out.past_key_values, out.logits[:, -1].float()
    return torch.cat(pieces, dim=1)


def stage_generations(plan: Plan) -> None:
    """Continuations by the target of random training windows, 256 + 1 tokens each (the last
    `new_tokens` generated), alternating greedy and sampled batches; resumable batch by batch."""
    out, partial = plan.cache / "generations.u16", plan.cache / "generations.partial.u16"
    length = SEQUENCE
    if out.exists():
        log(f"generations: done ({out.stat().st_size // (2 * length)} sequences)")
        return
    tokenizer = load_tokenizer(plan)
    train = data.load_tokens(plan.cache / "train.u16")
    teacher = trained_target(plan, tokenizer)
    g = torch.Generator().manual_seed(plan.seed + 2)
    batches = plan.generations // plan.generation_batch
    prompts = data.random_windows(train, batches * plan.generation_batch, length - plan.new_tokens - 1, g)
    done = partial.stat().st_size // (2 * length * plan.generation_batch) if partial.exists() else 0
    if partial.exists():
        with open(partial, "r+b") as f:  # drop a batch half-written when the run stopped
            f.truncate(done * 2 * length * plan.generation_batch)
    log(f"generations: {batches} batches of {plan.generation_batch} x {plan.new_tokens} tokens, from batch {done}")
    for b in tqdm(range(done, batches), desc="generations", initial=done, total=batches, mininterval=10):
        temperature = plan.generation_temperature if b % 2 else 0.0
        rows = prompts[b * plan.generation_batch : (b + 1) * plan.generation_batch]
        seqs = continue_batch(teacher, rows, plan.new_tokens, temperature, torch.Generator().manual_seed(plan.seed + b))
        with open(partial, "ab") as f:
            f.write(seqs.to(torch.int32).numpy().astype(np.uint16).tobytes())
    os.replace(partial, out)
    log(f"generations: {batches * plan.generation_batch} sequences in {out}")


def load_generations(plan: Plan) -> torch.Tensor:
    """[N, SEQUENCE] int64: what stage_generations wrote."""
    tokens = np.fromfile(plan.cache / "generations.u16", dtype=np.uint16).astype(np.int64)
    return torch.from_numpy(tokens).view(-1, SEQUENCE)


def stage_refine(plan: Plan) -> None:
    """Continue distilling the draft on batches that are mostly the target's own continuations."""

    def sample_of(train: torch.Tensor, schedule: loop.Schedule):
        generations = load_generations(plan)
        n_generated = round(schedule.batch * plan.refine_generated_share)
        log(f"refine: from the distilled draft, {n_generated}/{schedule.batch} of each batch"
            f" from {len(generations)} target continuations")

        def sample(g: torch.Generator) -> torch.Tensor:
            picked = generations[torch.randint(0, len(generations), (n_generated,), generator=g)]
            corpus = data.random_windows(train, schedule.batch - n_generated, schedule.length, g)
            return torch.cat([picked, corpus])

        return sample

    distil(plan, "refine", plan.refine_steps, plan.refine_lr, plan.warmup // 2, plan.seed + 3,
           lambda tokenizer: loop.load_trained(build(plan.draft, tokenizer, plan.seed + 1), plan.cache / "draft"),
           sample_of)


def stage_export(plan: Plan) -> None:
    metrics_path = plan.models / "metrics.json"
    results = [plan.cache / role / "result.json" for role in ("target", "draft", "refine")]
    if metrics_path.exists() and all(metrics_path.stat().st_mtime > r.stat().st_mtime for r in results):
        log(f"export: done ({metrics_path})")
        return
    tokenizer = load_tokenizer(plan)
    heldout = data.load_tokens(plan.cache / "heldout.u16")
    corpus = json.loads((plan.cache / "corpus" / "corpus.json").read_text())
    counts = json.loads((plan.cache / "tokens.json").read_text())
    corpus = {k: v for k, v in corpus.items() if k != "heldout"} | {
        "heldout_file_names": corpus["heldout"], "train_tokens": counts["train"], "heldout_tokens": counts["heldout"]
    }
    target = trained_target(plan, tokenizer)
    draft = loop.load_trained(build(plan.draft, tokenizer, plan.seed + 1), plan.cache / "refine")
    roles = {}
    for role, model, shape in (("target", target, plan.target), ("draft", draft, plan.draft)):
        result = json.loads((plan.cache / ("refine" if role == "draft" else role) / "result.json").read_text())
        roles[role] = {
            "parameters": models.num_parameters(model),
            "shape": models.shape_dict(shape),
            **{k: result[k] for k in ("steps", "tokens_seen", "train_wall_s", "schedule", "precision", "seed")},
            **result["final"],
            "evals": result["evals"],
        }
    roles["draft"]["ce_weight"] = plan.draft_ce_weight
    first = json.loads((plan.cache / "draft" / "result.json").read_text())
    roles["draft"]["corpus_phase"] = {k: first[k] for k in ("steps", "tokens_seen", "train_wall_s", "schedule")} | {
        "final": first["final"]}
    roles["draft"]["generations"] = {
        "sequences": len(load_generations(plan)), "new_tokens": plan.new_tokens,
        "temperatures": [0.0, plan.generation_temperature], "generated_share": plan.refine_generated_share}
    with torch.no_grad():
        roles["target"]["late_position_loss_512"] = export.late_position_loss(target, heldout, 512)
    for role, model in (("target", target), ("draft", draft)):
        export.save_model(model, tokenizer, plan.models / role)
    prompts = export.heldout_prompts(heldout, tokenizer.eos_token_id, plan.prompts, plan.prompt_tokens)
    log(f"export: acceptance on {len(prompts)} held-out prompts, K={plan.k}, greedy, {plan.new_tokens} new tokens")
    accept = export.acceptance(plan.models / "draft", plan.models / "target", prompts, plan.k, plan.new_tokens)
    metrics = {
        "corpus": corpus,
        "vocab_size": len(tokenizer),
        "eos_id": tokenizer.eos_token_id,
        "machine": f"{os.cpu_count()} CPU cores ({platform.processor() or platform.machine()}), torch {torch.__version__}",
        "target": roles["target"],
        "draft": roles["draft"],
        "acceptance": accept,
    }
    plan.models.mkdir(parents=True, exist_ok=True)
    metrics_path.write_text(json.dumps(metrics, indent=1))
    for role in ("target", "draft"):
        (plan.models / role / "README.md").write_text(export.model_card(role, metrics))
    size = export.folder_bytes(plan.models)
    log(
        f"export: acceptance rate {accept['acceptance_rate_mean']:.3f} (K={plan.k}, greedy), greedy agreement"
        f" {roles['draft']['heldout_agreement']:.3f}; {plan.models} holds {size / 1e6:.1f} MB"
    )
    if size > 40e6:
        log(f"export: WARNING {plan.models} exceeds 40 MB")


def _distill(argv: list[str]) -> None:
    from .distill import main as distill_main

    distill_main(argv)


def _convert(argv: list[str]) -> None:
    from .convert import main as convert_main

    convert_main(argv)


TOOLS = {"distill": _distill, "convert": _convert}
RUN = {"corpus": stage_corpus, "tokenizer": stage_tokenizer, "target": stage_target, "draft": stage_draft,
       "generations": stage_generations, "refine": stage_refine, "export": stage_export}


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:  # the general tools: `distill` (any target) and `convert` (GGUF)
        return TOOLS[argv[0]](argv[1:])
    parser = argparse.ArgumentParser(prog="python -m training", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=STAGES + ["all"])
    parser.add_argument("--smoke", action="store_true", help="toy scale in /tmp/specdec-smoke")
    parser.add_argument("--target-steps", type=int)
    parser.add_argument("--draft-steps", type=int)
    parser.add_argument("--refine-steps", type=int)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    if args.target_steps:
        plan = replace(plan, target_steps=args.target_steps)
    if args.draft_steps:
        plan = replace(plan, draft_steps=args.draft_steps)
    if args.refine_steps:
        plan = replace(plan, refine_steps=args.refine_steps)
    torch.set_num_threads(args.threads)
    plan.cache.mkdir(parents=True, exist_ok=True)
    log(f"training {args.stage}: cache {plan.cache}, models {plan.models}, python {sys.version.split()[0]}")
    for stage in STAGES if args.stage == "all" else [args.stage]:
        RUN[stage](plan)


if __name__ == "__main__":
    main()
