"""Export the trained pair and measure it the way specdec uses it.

    python -m training export   # -> models/{target,draft}/ (bf16 safetensors, tokenizer, card) + models/metrics.json

Acceptance rate: specdec's own in-process speculative round (speculative.round.generate
over LocalDraft / LocalTarget) on held-out prompts, greedy, K draft tokens per round;
per prompt accepted / proposed, reported as the mean over prompts. Each prompt is a
window of the held-out token stream at an evenly spaced offset, moved to just after
the last file boundary (EOS) inside it so that it never straddles two files.
The model cards are generated from metrics.json alone.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import torch
from transformers import GenerationConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from speculative.engines import DraftEngine, TargetEngine
from speculative.local import LocalDraft, LocalTarget
from speculative.model_runner import ModelRunner
from speculative.round import Stats, generate
from speculative.sampling import SamplingParams

from .models import cross_entropy, logits_of


def save_model(model: LlamaForCausalLM, tokenizer: PreTrainedTokenizerFast, out: Path) -> None:
    """bf16 safetensors + generation_config (eos) + tokenizer files, in a fresh folder."""
    if out.exists():
        shutil.rmtree(out)
    eos = tokenizer.eos_token_id
    model.generation_config = GenerationConfig(bos_token_id=eos, eos_token_id=eos, pad_token_id=eos)
    model.to(torch.bfloat16).save_pretrained(out)
    model.float()
    tokenizer.save_pretrained(out)


def heldout_prompts(heldout: torch.Tensor, eos_id: int, count: int, length: int) -> list[list[int]]:
    """count prompts of `length` held-out tokens, none containing a file boundary."""
    prompts = []
    for start in torch.linspace(0, heldout.numel() - 2 * length - 1, count).long().tolist():
        window = heldout[start : start + 2 * length]
        bounds = (window[:length] == eos_id).nonzero()
        shift = int(bounds[-1]) + 1 if bounds.numel() else 0  # start after the last EOS in the first half
        prompt = window[shift : shift + length]
        if (prompt == eos_id).any():  # a file shorter than the prompt: skip it
            continue
        prompts.append(prompt.tolist())
    return prompts


async def _acceptance(draft_dir: Path, target_dir: Path, prompts, k: int, new_tokens: int, vocab_subset: int) -> dict:
    draft = LocalDraft(DraftEngine(ModelRunner(draft_dir, device="cpu", vocab_subset=vocab_subset)))
    target_runner = ModelRunner(target_dir, device="cpu")
    target = LocalTarget(TargetEngine(target_runner))
    rates, total, start = [], Stats(), time.perf_counter()
    for i, prompt in enumerate(prompts):
        stats = Stats()
        async for _ in generate(
            draft,
            target,
            prompt,
            max_new_tokens=new_tokens,
            k=k,
            params=SamplingParams(0.0),
            eos_token_ids=set(target_runner.eos_token_ids),
            max_context=target_runner.max_context,
            stats=stats,
            session_id=f"prompt-{i}",
        ):
            pass
        rates.append(stats.acceptance_rate)
        total.merge(stats)
    seconds = time.perf_counter() - start
    return {
        "acceptance_rate_mean": sum(rates) / len(rates),
        "acceptance_rate_pooled": total.acceptance_rate,
        "acceptance_rate_min": min(rates),
        "acceptance_rate_max": max(rates),
        "alpha_pooled": total.alpha,
        "mean_accepted_per_round": total.accepted_tokens / total.rounds,
        "tokens_per_round": total.generated_tokens / total.rounds,
        "generated_tokens": total.generated_tokens,
        "tokens_per_s_in_process": total.generated_tokens / seconds,
        "prompts": len(prompts),
        "prompt_tokens": len(prompts[0]),
        "new_tokens": new_tokens,
        "k": k,
        "sampling": "greedy (temperature 0)",
        "per_prompt": [round(r, 4) for r in rates],
    }


def acceptance(draft_dir: Path, target_dir: Path, prompts, k: int, new_tokens: int, vocab_subset: int = 0) -> dict:
    """vocab_subset: the draft's output layer over its draft_vocab.json's first N ids (0: all)."""
    return asyncio.run(_acceptance(draft_dir, target_dir, prompts, k, new_tokens, vocab_subset))


@torch.no_grad()
def late_position_loss(model: LlamaForCausalLM, heldout: torch.Tensor, length: int, count: int = 16) -> float:
    """held-out cross-entropy of positions [length/2, length) of `length`-token windows: how the model fares
    at context lengths it may not have been trained on."""
    starts = torch.linspace(0, heldout.numel() - length - 1, count).long().tolist()
    losses = []
    for s in starts:
        w = heldout[s : s + length + 1][None]  # [1, T+1]
        logits = logits_of(model, w[:, :-1])
        losses.append(cross_entropy(logits[:, length // 2 :], w[:, 1 + length // 2 :]).item())
    return sum(losses) / len(losses)


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def model_card(role: str, m: dict) -> str:
    """README.md for models/<role>, from metrics.json's fields."""
    c, r, a = m["corpus"], m[role], m["acceptance"]
    other = "draft" if role == "target" else "target"
    shape = r["shape"]
    lines = [
        f"# specdec default {role}",
        "",
        f"A {r['parameters'] / 1e6:.2f} M-parameter Llama (transformers `LlamaForCausalLM`) for Python source code,"
        f" the {role} of specdec's default speculative-decoding pair (its {other} is `../{other}`)."
        " Trained from scratch on CPU by `python -m training all`; every number below is in `../metrics.json`.",
        "",
        "## Data",
        f"- The `.py` files of the standard library of Python {c['python']} ({c['python_version']}),"
        " site-packages excluded, sorted; files joined with `<|endoftext|>`.",
        f"- {c['files']} files: {c['train_files']} for training ({c['train_tokens']:,} tokens),"
        f" {c['heldout_files']} held out ({c['heldout_tokens']:,} tokens), chosen by a seeded shuffle (seed {c['seed']})"
        f" of whole files; {len(c['skipped_files'])} non-UTF-8 files skipped.",
        f"- Tokenizer: byte-level BPE, {m['vocab_size']} ids, `<|endoftext|>` (id {m['eos_id']}) is eos, bos and pad.",
        "",
        "## Model",
        f"- {r['parameters']:,} parameters (tied input/output embeddings counted once): hidden {shape['hidden']},"
        f" {shape['layers']} layers, {shape['heads']} heads, SwiGLU width {shape['ffn']}, RoPE,"
        " max_position_embeddings 1024. Weights stored in bfloat16.",
        f"- Trained on {r['schedule']['length']}-token windows: context beyond that is untrained"
        + (
            f" (held-out loss of positions 256-511 in 512-token windows: {m['target']['late_position_loss_512']:.3f}"
            f" vs {m['target']['heldout_loss']:.3f} within 256)."
            if role == "target"
            else "."
        ),
        "",
        "## Training",
    ]
    if role == "target":
        lines.append("- Objective: next-token cross-entropy.")
    else:
        lines.append(
            "- Objective: distillation from the target, forward KL(p_target || q_draft) at temperature 1 over the"
            f" full vocabulary at every position (teacher under no_grad), plus {r['ce_weight']} x next-token"
            " cross-entropy."
        )
        first, gen = r["corpus_phase"], r["generations"]
        lines.append(
            f"- Two phases. (1) {first['steps']:,} steps on random corpus windows ({first['tokens_seen']:,} tokens,"
            f" {first['train_wall_s'] / 60:.1f} min; greedy agreement {first['final']['heldout_agreement']:.3f})."
            f" (2) The steps below, continuing from (1), on batches that are {gen['generated_share']:.0%} the"
            f" target's own continuations: {gen['sequences']:,} random training windows continued by the target"
            f" for {gen['new_tokens']} tokens, half greedily and half sampled at temperature {gen['temperatures'][1]}"
            " (on-policy data, as in DistillSpec), and the rest corpus windows."
        )
    s = r["schedule"]
    lines += [
        f"- {r['steps']:,} steps of {s['batch']} x {s['length']} tokens (random windows, seed {r['seed']}):"
        f" {r['tokens_seen']:,} tokens seen; AdamW (betas 0.9/0.95, weight decay {s['weight_decay']}),"
        f" peak LR {s['peak_lr']}, {s['warmup']} warmup steps then cosine to {s['min_lr_ratio']} x peak,"
        f" gradient clip {s['grad_clip']}; {r['precision']} on {m['machine']}.",
        f"- Wall time: {r['train_wall_s'] / 60:.1f} min.",
        "",
        "## Results (held-out files)",
        f"- Held-out loss (cross-entropy, nats/token): {r['heldout_loss']:.3f}.",
    ]
    if role == "draft":
        lines += [
            f"- KL(p_target || q_draft): {r['heldout_kl']:.3f} nats/token; mean 1 - TV(p, q): {r['heldout_1_minus_tv']:.3f}.",
        ]
    lines += [
        f"- Greedy agreement with the {other} (teacher-forced, argmax equality per position):"
        f" {m['draft']['heldout_agreement']:.3f}.",
        f"- Acceptance rate of the pair in specdec's speculative round: {a['acceptance_rate_mean']:.3f}"
        f" (mean over {a['prompts']} held-out prompts of accepted / proposed; pooled {a['acceptance_rate_pooled']:.3f},"
        f" range {a['acceptance_rate_min']:.2f}-{a['acceptance_rate_max']:.2f})"
        + (f"; per-token alpha {a['alpha_pooled']:.3f}" if "alpha_pooled" in a else "")
        + f"; greedy, K = {a['k']},"
        f" {a['prompt_tokens']}-token prompts, {a['new_tokens']} new tokens;"
        f" {a['tokens_per_round']:.2f} tokens committed per round.",
        "",
        "## Use",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        f'tokenizer = AutoTokenizer.from_pretrained("models/{role}")',
        f'model = AutoModelForCausalLM.from_pretrained("models/{role}")',
        "```",
        "",
    ]
    return "\n".join(lines)
