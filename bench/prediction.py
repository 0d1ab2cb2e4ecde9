"""Predicted outputs (OpenAI's `prediction`, speculative/prediction.py): what sending the expected
answer buys on the real target, beside the same stack without it.

    python -m bench.prediction [--quantize int4] [--prompts 8] [--new-tokens 128] [--drafts eagle,ngram]

One run, greedy, the input-grounded requests (assets/prompts.py GROUNDED: rewrite, sort, fix, rename
what the prompt holds) through the target's chat template. Each request's prediction is what its prompt
holds after the first colon (the code to rename in, the list to sort, the email to edit): what a client
editing a text would send. Rows:
  a'        the target alone on specdec's runner (measured before and after the stacks: their mean)
  s         specdec over gRPC with each --drafts draft (the EAGLE-3 head, models/eagle; the n-gram
            draft), adaptive K, no prediction
  s + pred  the same stack, each request with its prediction
  s + own   the same stack, each request predicted with a''s own answer (prediction_token_ids): the
            ceiling, where the prediction is the answer
tok/s, x a', the prediction's tokens kept / verified, and how many greedy outputs are a''s own (the
prediction must not change a token). Writes bench/results/prediction.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer  # noqa: E402

from assets.models import EAGLE, TARGET  # noqa: E402
from assets.prompts import GROUNDED  # noqa: E402
from bench.pair import RESULTS, chat_prompts  # noqa: E402
from bench.systems import machine, runner_alone  # noqa: E402
from coordinator.launch import LocalStack  # noqa: E402
from speculative.round import Stats  # noqa: E402


def material(prompt: str) -> str:
    """What a grounded request holds for its answer to copy: its text after the first colon."""
    return prompt.split(":", 1)[1].strip()


def served(stack: LocalStack, prompts: list[list[int]], new_tokens: int, predictions: list | None,
           outputs: list) -> tuple[Stats, float]:
    """Each prompt once over gRPC, greedy, adaptive K; predictions: per prompt a text or token ids (None: none)."""
    import grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    stats = Stats()
    with grpc.insecure_channel(stack.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        stub.Generate(pb.GenerateRequest(prompt_token_ids=prompts[0], max_new_tokens=4))  # warm up
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=new_tokens, temperature=0.0)
            predicted = predictions[i] if predictions is not None else None
            if isinstance(predicted, str):
                request.prediction = predicted
            elif predicted is not None:
                request.prediction_token_ids.extend(predicted)
            reply = stub.Generate(request)
            stats.merge(reply.stats)
            outputs.append(list(reply.token_ids))
        seconds = time.perf_counter() - start
    return stats, seconds


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.prediction", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target-model", default=str(TARGET))
    parser.add_argument("--eagle", default=str(EAGLE))
    parser.add_argument("--quantize", default="int4", help="the target's --quantize (none: float32)")
    parser.add_argument("--drafts", default="eagle,ngram")
    parser.add_argument("--prompts", type=int, default=len(GROUNDED))
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=RESULTS / "prediction.json")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.target_model)
    texts = GROUNDED[: args.prompts]
    prompts = chat_prompts(tokenizer, texts)
    predictions = [material(text) for text in texts]
    eos = {tokenizer.eos_token_id}
    target_flags = [] if args.quantize == "none" else ["--quantize", args.quantize]
    own: list[list[int]] = []
    alone = []
    tokens, seconds, _ = runner_alone(args.target_model, prompts, 0.0, args.new_tokens, eos, args.quantize, own)
    alone.append(tokens / seconds)
    print(f"a' {args.quantize}: {alone[0]:.1f} tok/s", flush=True)
    rows = []
    for draft in args.drafts.split(","):
        stack = LocalStack(args.eagle if draft == "eagle" else None, args.target_model, threads=args.threads,
                           draft_threads=1, draft_method=draft, target_args=target_flags).start()
        try:
            for label, given in (("", None), (" + pred", predictions), (" + own", own)):
                outputs: list[list[int]] = []
                stats, seconds = served(stack, prompts, args.new_tokens, given, outputs)
                made = sum(map(len, outputs))
                row = {"name": f"s {draft}{label}", "tokens": made, "tokens_per_s": made / seconds,
                       "rounds": stats.rounds, "draft_tokens": stats.draft_tokens,
                       "accepted_tokens": stats.accepted_tokens, "prediction_tokens": stats.prediction_tokens,
                       "accepted_prediction_tokens": stats.accepted_prediction_tokens,
                       "copied_tokens": stats.copied_tokens,
                       "identical": sum(a == b for a, b in zip(outputs, own))}
                rows.append(row)
                print(f"{row['name']:<18} {row['tokens_per_s']:7.1f} tok/s, {stats.rounds} rounds, prediction"
                      f" {stats.accepted_prediction_tokens}/{stats.prediction_tokens} kept, draft"
                      f" {stats.accepted_tokens}/{stats.draft_tokens}, identical {row['identical']}/{len(prompts)}",
                      flush=True)
        finally:
            stack.stop()
    tokens, seconds, _ = runner_alone(args.target_model, prompts, 0.0, args.new_tokens, eos, args.quantize)
    alone.append(tokens / seconds)
    base = statistics.mean(alone)
    print(f"a' {args.quantize} again: {alone[1]:.1f} tok/s (mean {base:.1f})")
    print(f"\n| row | tok/s | x a' | prediction kept / verified | draft kept / proposed | greedy = a' |")
    print("|---|---|---|---|---|---|")
    print(f"| a' {args.quantize} (runner alone) | {base:.1f} | 1.00x | | | |")
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / base
        print(f"| {row['name']} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
              f"{row['accepted_prediction_tokens']} / {row['prediction_tokens']} | "
              f"{row['accepted_tokens']} / {row['draft_tokens']} | {row['identical']}/{len(prompts)} |")
    args.out.write_text(json.dumps({
        "meta": {"machine": machine(), "threads": args.threads, "quantize": args.quantize, "prompts": len(prompts),
                 "new_tokens": args.new_tokens, "date": time.strftime("%Y-%m-%d %H:%M")},
        "alone_tokens_per_s_runs": alone, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
