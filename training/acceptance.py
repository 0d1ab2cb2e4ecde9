"""The acceptance rate of a draft/target pair, measured the way specdec uses it.

specdec's own in-process speculative round (speculative.round.generate over LocalDraft /
LocalTarget) on the given prompts, greedy, K draft tokens per round; per prompt accepted /
proposed, reported as the mean over prompts and pooled. `python -m training distill
--acceptance` writes it into the draft's card, and `--draft DIR --write` again (`make draft`, once
the weights are packed as they are committed); for an EAGLE-3 head (the target's features handed
to it each round, as over gRPC) `--eagle DIR`:

    python -m training.acceptance --eagle models/eagle --target models/target [--write]
    python -m training.acceptance --eagle models/eagle --target models/target --lookup-min 3 --grounded
    python -m training.acceptance --draft models/draft --target models/target [--write]
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


async def _acceptance(draft_dir: Path, target_dir: Path, prompts, k: int, new_tokens: int, vocab_subset: int,
                      eagle: bool = False, quantize: str = "none", head_quantize: str = "none",
                      lookup_min: int = 0) -> dict:
    if eagle:
        from model_service.eagle import EagleDraft

        method = EagleDraft.load(draft_dir, target_dir, "cpu", quantize=head_quantize,
                                 lookup=range(lookup_min, 5) if lookup_min else range(0))
        layers = method.layers
    else:
        method, layers = DraftEngine(ModelRunner(draft_dir, device="cpu", vocab_subset=vocab_subset)), ()
    draft = LocalDraft(method)
    target_runner = ModelRunner(target_dir, device="cpu", quantize=quantize)
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
            draft_context=method.info()["max_context"],
            stats=stats,
            session_id=f"prompt-{i}",
            feature_layers=layers,
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
        "target_quantize": quantize,
        "sampling": "greedy (temperature 0)",
        "per_prompt": [round(r, 4) for r in rates],
    }


def acceptance(draft_dir: Path, target_dir: Path, prompts, k: int, new_tokens: int, vocab_subset: int = 0,
               eagle: bool = False, quantize: str = "none", head_quantize: str = "none", lookup_min: int = 0) -> dict:
    """vocab_subset: the draft's output layer over its draft_vocab.json's first N ids (0: all);
    eagle: draft_dir is an EAGLE-3 head (fed the target's features); quantize: the target's;
    lookup_min: the head's prompt lookup as the draft service's --lookup-min (0: the head alone)."""
    return asyncio.run(_acceptance(draft_dir, target_dir, prompts, k, new_tokens, vocab_subset, eagle, quantize,
                                   head_quantize, lookup_min))


def main(argv=None) -> None:
    import argparse
    import json

    from transformers import AutoTokenizer

    from assets.prompts import CHAT, GROUNDED

    parser = argparse.ArgumentParser(prog="python -m training.acceptance", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    model = parser.add_mutually_exclusive_group(required=True)
    model.add_argument("--eagle", type=Path, help="an EAGLE-3 head's directory")
    model.add_argument("--draft", type=Path, help="a draft model's directory (one `training distill` wrote:"
                                                  " its output layer over the card's recommended draft vocabulary)")
    parser.add_argument("--target", type=Path, required=True)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quantize", default="none", choices=["none", "int4"], help="the target's")
    parser.add_argument("--head-quantize", default="none", choices=["none", "int8", "int4"],
                        help="the head's, as the draft service's --head-quantize (the card records the float head)")
    parser.add_argument("--lookup-min", type=int, default=0,
                        help="eagle: the prompt lookup beside the head, as the draft service's --lookup-min (its"
                             " default 3); 0: the head alone (what the card records)")
    parser.add_argument("--grounded", action="store_true",
                        help="the bench's input-grounded prompts (assets/prompts.py GROUNDED) instead of the chat ones")
    parser.add_argument("--write", action="store_true",
                        help="write it into the model's card (eagle.json, or distill.json for --draft) and README")
    args = parser.parse_args(argv)
    if args.lookup_min and (not args.eagle or not 1 <= args.lookup_min <= 4):
        parser.error("--lookup-min N: an --eagle head's lookup of the last N..4 tokens (1 <= N <= 4), or 0")
    if args.write and (args.lookup_min or args.grounded):
        parser.error("--write records the head alone on the chat prompts: leave --lookup-min 0, no --grounded")
    if args.write and args.head_quantize != "none":
        parser.error("--write records the float head's acceptance: leave --head-quantize none")
    if args.write and args.draft and args.quantize != "none":
        parser.error("--write records a draft's acceptance against the float target: leave --quantize none")
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
               for p in (GROUNDED if args.grounded else CHAT)]
    directory = args.eagle or args.draft
    card = directory / ("eagle.json" if args.eagle else "distill.json")
    info = json.loads(card.read_text()) if card.is_file() else {}
    subset = 0 if args.eagle else info.get("draft_vocab", {}).get("recommended", 0)
    result = acceptance(directory, args.target, prompts, args.k, args.new_tokens, vocab_subset=subset,
                        eagle=bool(args.eagle), quantize=args.quantize, head_quantize=args.head_quantize,
                        lookup_min=args.lookup_min)
    print(json.dumps({k: v for k, v in result.items() if k != "per_prompt"}, indent=1))
    if not args.write:
        return
    if args.draft:  # (as `training distill --acceptance` writes it)
        from training.distill import save_card

        info["acceptance"] = result
        save_card(directory, info)
        return
    info.setdefault("acceptance", {})[args.quantize] = result
    if args.quantize == "none":
        info["acceptance"].update(result)
    card.write_text(json.dumps(info, indent=1) + "\n")
    if {"generations", "features", "training", "heldout", "draft_vocab"} <= info.keys():  # the trainer's card
        from training.eagle import model_card

        (directory / "README.md").write_text(model_card(info))

if __name__ == "__main__":
    main()
