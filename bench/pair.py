"""What every bench shares: which pair it runs (its flags, else the default pair), the held-out
prompts it sends (assets/prompts.py, through the target's chat template), and where it writes.

    add_pair_flags(parser)                      # --draft-model / --target-model
    draft_dir, target_dir = pair_of(args)
    prompts = heldout_prompts(tokenizer, 16)    # token ids, one user message each
"""

from __future__ import annotations

import argparse
from pathlib import Path

from assets.prompts import CHAT
from coordinator.launch import model_pair

RESULTS = Path(__file__).resolve().parent / "results"


def add_pair_flags(parser: argparse.ArgumentParser) -> None:
    """--draft-model / --target-model, shared by the benches."""
    parser.add_argument("--draft-model", help="draft model directory (default: the default pair)")
    parser.add_argument("--target-model", help="target model directory (default: the default pair)")


def pair_of(args: argparse.Namespace):
    """(draft dir, target dir): the flags, else the default pair's."""
    return model_pair(args.draft_model, args.target_model)


def heldout_prompts(tokenizer, n: int) -> list[list[int]]:
    """The first n held-out chat prompts as token ids: one user message through the tokenizer's
    chat template (its assistant turn opened), or the bare text where it has none."""
    if n > len(CHAT):
        raise SystemExit(f"at most {len(CHAT)} prompts (assets/prompts.py), not {n}")
    return chat_prompts(tokenizer, CHAT[:n])


def chat_prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    """Each text as one user message through the tokenizer's chat template (its assistant turn
    opened), or the bare text where it has none."""
    if not tokenizer.chat_template:
        return [tokenizer(text)["input_ids"] for text in texts]
    return [list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                               tokenize=True, return_dict=True)["input_ids"]) for text in texts]
