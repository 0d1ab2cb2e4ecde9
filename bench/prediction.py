"""Predicted outputs (OpenAI's `prediction`, speculative/prediction.py): what sending the expected
answer buys on the real target, beside the same stack without it.

    python -m bench.prediction [--quantize int4] [--sets g,e] [--new-tokens 256] [--drafts eagle,ngram]

One run, greedy, the input-grounded requests (assets/prompts.py GROUNDED: rewrite, sort, fix, rename
what the prompt holds) and this file's EDITS (a module, a page, a configuration, a note to change a
line of and repeat) through the target's chat template. Each request's prediction is what its prompt
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


# longer edits (written for this bench, never trained on): a file to change a few lines of, as predicted
# outputs are meant for; the prediction is the file as it stands
EDITS = [
    "Rename the function load_rows to read_rows everywhere in this module and change nothing else:\n\n"
    "import csv\n\n\ndef load_rows(path):\n    with open(path, newline='') as handle:\n"
    "        return list(csv.DictReader(handle))\n\n\ndef totals(rows, column):\n    result = {}\n"
    "    for row in rows:\n        key = row['region']\n        result[key] = result.get(key, 0) + float(row[column])\n"
    "    return result\n\n\ndef report(path, column):\n    rows = load_rows(path)\n"
    "    for region, total in sorted(totals(rows, column).items()):\n        print(f'{region}: {total:.2f}')\n",
    "Change the greeting from Hello to Welcome in this page and keep everything else as it is:\n\n"
    "<html>\n  <head>\n    <title>Club news</title>\n  </head>\n  <body>\n    <h1>Hello, members!</h1>\n"
    "    <p>The next meeting is on Thursday at seven in the library.</p>\n    <ul>\n"
    "      <li>Bring your membership card.</li>\n      <li>Coffee and tea will be served.</li>\n"
    "      <li>New members are always welcome to join.</li>\n    </ul>\n  </body>\n</html>\n",
    "Set the timeout to 30 in this configuration and return the whole file:\n\n"
    "server:\n  host: 0.0.0.0\n  port: 8080\n  timeout: 10\n  workers: 4\ndatabase:\n  name: orders\n"
    "  user: app\n  pool_size: 8\nlogging:\n  level: info\n  file: /var/log/orders.log\n",
    "Fix the spelling mistakes in this note and repeat it otherwise unchanged:\n\n"
    "Dear team, the quartely report is due next Friday. Please send your numbers to Maria before Wendesday so "
    "that she can check them. If you have questions about the new template, ask Paul, who prepared it. "
    "Thank you all for your hard work this quarter.\n",
]


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
    parser.add_argument("--sets", default="g,e", help="g: GROUNDED, e: EDITS (this file's)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--out", type=Path, default=RESULTS / "prediction.json")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.target_model)
    sets = {name: texts for name, texts in (("g", GROUNDED), ("e", EDITS)) if name in args.sets.split(",")}
    prompts = {name: chat_prompts(tokenizer, texts) for name, texts in sets.items()}
    predictions = {name: [material(text) for text in texts] for name, texts in sets.items()}
    eos = {tokenizer.eos_token_id}
    target_flags = [] if args.quantize == "none" else ["--quantize", args.quantize]
    own: dict[str, list[list[int]]] = {name: [] for name in sets}
    alone: dict[str, list[float]] = {name: [] for name in sets}

    def runner_row(name: str, outputs=None) -> None:
        tokens, seconds, _ = runner_alone(args.target_model, prompts[name], 0.0, args.new_tokens, eos,
                                          args.quantize, outputs)
        alone[name].append(tokens / seconds)
        print(f"{name}: a' {args.quantize} {alone[name][-1]:.1f} tok/s", flush=True)

    for name in sets:
        runner_row(name, own[name])
    rows = []
    for draft in args.drafts.split(","):
        stack = LocalStack(args.eagle if draft == "eagle" else None, args.target_model, threads=args.threads,
                           draft_threads=1, draft_method=draft, target_args=target_flags).start()
        try:
            for name in sets:
                for label, given in (("", None), (" + pred", predictions[name]), (" + own", own[name])):
                    outputs: list[list[int]] = []
                    stats, seconds = served(stack, prompts[name], args.new_tokens, given, outputs)
                    made = sum(map(len, outputs))
                    row = {"set": name, "name": f"s {draft}{label}", "tokens": made, "tokens_per_s": made / seconds,
                           "rounds": stats.rounds, "draft_tokens": stats.draft_tokens,
                           "accepted_tokens": stats.accepted_tokens, "prediction_tokens": stats.prediction_tokens,
                           "accepted_prediction_tokens": stats.accepted_prediction_tokens,
                           "copied_tokens": stats.copied_tokens,
                           "identical": sum(a == b for a, b in zip(outputs, own[name]))}
                    rows.append(row)
                    print(f"{name}: {row['name']:<18} {row['tokens_per_s']:7.1f} tok/s, {made} tokens in {stats.rounds}"
                          f" rounds, prediction {stats.accepted_prediction_tokens}/{stats.prediction_tokens} kept,"
                          f" draft {stats.accepted_tokens}/{stats.draft_tokens}, copied {stats.copied_tokens},"
                          f" identical {row['identical']}/{len(outputs)}", flush=True)
        finally:
            stack.stop()
    for name in sets:
        runner_row(name)
    print("\n| set | row | tok/s | x a' | tokens / rounds | prediction kept / verified | draft kept / proposed"
          " | greedy = a' |")
    print("|---|---|---|---|---|---|---|---|")
    for name in sets:
        base = statistics.mean(alone[name])
        print(f"| {name} | a' {args.quantize} (runner alone, mean of {len(alone[name])}) | {base:.1f} | 1.00x"
              " | | | | |")
        for row in rows:
            if row["set"] == name:
                row["speedup"] = row["tokens_per_s"] / base
                print(f"| {name} | {row['name']} | {row['tokens_per_s']:.1f} | {row['speedup']:.2f}x | "
                      f"{row['tokens']} / {row['rounds']} | "
                      f"{row['accepted_prediction_tokens']} / {row['prediction_tokens']} | "
                      f"{row['accepted_tokens']} / {row['draft_tokens']} | {row['identical']}/{len(prompts[name])} |")
    args.out.write_text(json.dumps({
        "meta": {"machine": machine(), "threads": args.threads, "quantize": args.quantize, "sets": args.sets,
                 "new_tokens": args.new_tokens, "date": time.strftime("%Y-%m-%d %H:%M")},
        "alone_tokens_per_s_runs": alone, "rows": rows}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
