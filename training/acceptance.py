"""The acceptance rate of a draft/target pair, measured the way specdec uses it.

specdec's own in-process speculative round (speculative.round.generate over LocalDraft /
LocalTarget) on the given prompts, greedy, K draft tokens per round; per prompt accepted /
proposed, reported as the mean over prompts and pooled. `python -m training distill
--acceptance` writes it into the draft's card.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from model_service.engines import DraftEngine, TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from speculative.round import Stats, generate
from speculative.protocol import SamplingParams


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
