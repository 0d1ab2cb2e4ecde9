"""What every bench shares: which pair it runs (its flags, else the default pair), the held-out
prompts it sends (assets/prompts.py, through the target's chat template), and where it writes.

    add_pair_flags(parser)                      # --draft-model / --target-model
    draft_dir, target_dir = pair_of(args)
    prompts = heldout_prompts(tokenizer, 16)    # token ids, one user message each
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from assets.prompts import CHAT
from assets.models import DRAFT, EAGLE, TARGET
from coordinator.launch import LocalStack, model_pair

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


def add_stack_flags(parser: argparse.ArgumentParser) -> None:
    """The flags of a bench that serves the default pair's target over a local stack (stack_of)."""
    parser.add_argument("--target-model", default=str(TARGET))
    parser.add_argument("--draft", default="eagle", help="the draft method: eagle (models/eagle), ngram or model")
    parser.add_argument("--draft-model", default=None, help="the draft model (--draft model; default models/draft)")
    parser.add_argument("--quantize", default="int4", help="the target's --quantize (none: float32)")
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))


def stack_of(args: argparse.Namespace, target_args: list[str] = (), draft_args: list[str] = ()) -> LocalStack:
    """A local stack (not started) as add_stack_flags' flags say, HTTP on, the draft on one thread."""
    draft = EAGLE if args.draft == "eagle" else args.draft_model or DRAFT if args.draft == "model" else None
    quantize = [] if args.quantize == "none" else ["--quantize", args.quantize]
    return LocalStack(draft, args.target_model, threads=args.threads, draft_threads=1, draft_method=args.draft,
                      http_port=0, target_args=[*quantize, *target_args], draft_args=list(draft_args))
