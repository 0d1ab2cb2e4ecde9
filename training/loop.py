"""The training loop: AdamW, warmup + cosine LR, seeded batches, resumable checkpoints.

Used by `python -m training distill`. The loop owns the schedule, the checkpoints and the
progress bar; what is learnt is the `loss_of` callable on what `sample` draws:
  loss_of(model, sample(generator)) -> scalar loss to minimise.

Checkpoint (CKPT_DIR/checkpoint.pt, written atomically every few minutes and at the end):
model and optimizer state, the step, tokens seen, training wall time, the global and the
window-sampling RNG states, and the evaluations so far. Re-running the stage loads it and
continues from that step with the same schedule. When every step is done the stage's
result (CKPT_DIR/result.json) is written and later runs skip the stage.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm



@dataclass
class Schedule:
    steps: int
    peak_lr: float
    warmup: int
    min_lr_ratio: float = 0.1
    batch: int = 8
    length: int = 256
    weight_decay: float = 0.1
    grad_clip: float = 1.0

    def lr(self, step: int) -> float:
        """linear warmup to peak_lr, then cosine decay to min_lr_ratio * peak_lr at the last step."""
        if step < self.warmup:
            return self.peak_lr * (step + 1) / self.warmup
        progress = (step - self.warmup) / max(1, self.steps - self.warmup)
        cosine = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
        return self.peak_lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * cosine)


def bf16_is_fast(device: str | torch.device = "cpu") -> bool:
    """bf16 autocast pays on GPUs that have it and on CPUs with native bf16 (AVX-512 BF16 / AMX); on a CPU
    without, it is ~30x SLOWER than fp32."""
    if torch.device(device).type == "cuda":
        return torch.cuda.is_bf16_supported()
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def autocast(precision: str, device_type: str = "cpu"):
    """'bf16' -> bf16 autocast on device_type ("cpu", "cuda"); 'fp32' -> nothing."""
    if precision == "bf16":
        return torch.autocast(device_type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def adamw(model: torch.nn.Module, schedule: Schedule) -> torch.optim.AdamW:
    """decay matrices only; norms (vectors) are not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": schedule.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=schedule.peak_lr, betas=(0.9, 0.95), eps=1e-8)


def save_atomic(obj, path: Path) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def train(
    name: str,
    model: torch.nn.Module,
    loss_of: Callable[[torch.nn.Module, torch.Tensor], torch.Tensor],
    evaluate: Callable[[torch.nn.Module], dict],
    schedule: Schedule,
    ckpt_dir: Path,
    *,
    seed: int,
    precision: str,
    checkpoint_minutes: float = 5.0,
    eval_every: int = 250,
    sample: Callable[[torch.Generator], object],
) -> dict:
    """Train `model` for schedule.steps steps (resuming from ckpt_dir), evaluate, return the result dict.

    Each step's batch is `sample(generator)`, drawn from a generator seeded by `seed` and checkpointed.
    """
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    ckpt_path, result_path = ckpt_dir / "checkpoint.pt", ckpt_dir / "result.json"
    optimizer = adamw(model, schedule)
    device_type = next(model.parameters()).device.type  # autocast where the model is
    windows = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    step, tokens_seen, wall_s, evals = 0, 0, 0.0, []
    if ckpt_path.exists():
        state = torch.load(ckpt_path, map_location="cpu", weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        windows.set_state(state["windows_rng"])
        step, tokens_seen, wall_s, evals = state["step"], state["tokens_seen"], state["wall_s"], state["evals"]
        tqdm.write(f"[{name}] resuming from step {step} ({tokens_seen:,} tokens, {wall_s / 60:.1f} min)")

    def checkpoint() -> None:
        save_atomic(
            {
                "model": model.state_dict(),
                "optimizer": optimizer.state_dict(),
                "rng": torch.get_rng_state(),
                "windows_rng": windows.get_state(),
                "step": step,
                "tokens_seen": tokens_seen,
                "wall_s": wall_s,
                "evals": evals,
                "schedule": vars(schedule),
                "precision": precision,
            },
            ckpt_path,
        )

    def record_eval() -> None:
        model.eval()
        with torch.no_grad(), autocast(precision, device_type):
            metrics = evaluate(model)
        model.train()
        evals.append({"step": step, "tokens_seen": tokens_seen, **metrics})
        tqdm.write(f"[{name}] step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))

    model.train()
    bar = tqdm(total=schedule.steps, initial=step, desc=name, mininterval=10, dynamic_ncols=True, smoothing=0.05)
    session_start = tick = last_ckpt = time.perf_counter()
    session_tokens, smooth_loss = 0, None
    while step < schedule.steps:
        lr = schedule.lr(step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        window = sample(windows)
        with autocast(precision, device_type):
            loss = loss_of(model, window)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), schedule.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step += 1
        tokens_seen += schedule.batch * schedule.length
        session_tokens += schedule.batch * schedule.length
        smooth_loss = loss.item() if smooth_loss is None else 0.95 * smooth_loss + 0.05 * loss.item()
        tok_s = session_tokens / (time.perf_counter() - session_start)
        bar.set_postfix(loss=f"{smooth_loss:.3f}", lr=f"{lr:.2e}", tok_s=f"{tok_s:,.0f}", refresh=False)
        bar.update(1)
        if step % eval_every == 0 and step < schedule.steps:
            record_eval()
        if time.perf_counter() - last_ckpt > checkpoint_minutes * 60:
            wall_s += time.perf_counter() - tick
            tick = time.perf_counter()
            checkpoint()
            last_ckpt = time.perf_counter()
        wall_s += time.perf_counter() - tick  # training wall time, evaluations and checkpoints included
        tick = time.perf_counter()
    bar.close()
    if not evals or evals[-1]["step"] != step:
        record_eval()
        wall_s += time.perf_counter() - tick
    checkpoint()
    result = {
        "steps": step,
        "tokens_seen": tokens_seen,
        "train_wall_s": round(wall_s, 1),
        "final": evals[-1],
        "evals": evals,
        "schedule": vars(schedule),
        "precision": precision,
        "seed": seed,
    }
    result_path.write_text(json.dumps(result, indent=1))
    return result


def load_trained(model: torch.nn.Module, ckpt_dir: Path) -> torch.nn.Module:
    """The weights of a finished (or interrupted) run."""
    state = torch.load(ckpt_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    model.load_state_dict(state["model"])
    return model.eval()
