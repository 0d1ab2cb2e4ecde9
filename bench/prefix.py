"""Prefix reuse (model_service/sessions.py): what keeping finished requests' KV caches buys a chat,
whose every turn sends the whole conversation again, beside the same stack without it.

    python -m bench.prefix [--quantize int4] [--chats 4] [--turns 4] [--max-tokens 96] [--draft eagle]

One run, greedy, streamed over the OpenAI-compatible HTTP API (the official client), the same stack
twice: the services' --prefix-cache-mb at its default, then 0. Each chat opens with one of the
held-out prompts (assets/prompts.py CHAT) and goes on with FOLLOW_UPS, each turn's prompt the whole
conversation through the target's chat template, the answers as the client got them. Per turn: the
median time to the first token (TTFT: the prompt's pass, and the draft's) and to the whole answer,
the prompt's length, and the share of prompt tokens the target took cached
(its specdec_prefix_cache_hit_tokens_total); and whether both stacks gave every answer alike (they must:
a cached prefix is the prefix computed). Writes bench/results/prefix.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer  # noqa: E402

from assets.prompts import CHAT  # noqa: E402
from bench.pair import RESULTS, add_stack_flags, stack_of  # noqa: E402
from bench.systems import machine  # noqa: E402
from coordinator.launch import LocalStack  # noqa: E402
from runtime.ports import free_port  # noqa: E402

FOLLOW_UPS = ["Tell me more about that.", "Can you give me an example?", "Now say it all again in two sentences.",
              "Thank you. What else should I know?", "Summarize our conversation in one line."]


def hit_tokens(urls: list[str]) -> float:
    """specdec_prefix_cache_hit_tokens_total, summed over these metrics pages (0 where none reports it)."""
    total = 0.0
    for url in urls:
        with urllib.request.urlopen(url, timeout=10) as reply:
            for line in reply.read().decode().splitlines():
                if line.startswith("specdec_prefix_cache_hit_tokens_total "):
                    total += float(line.split()[1])
    return total


def chats(stack: LocalStack, urls: list[str], tokenizer, args) -> list[dict]:
    """Every chat's turns in order (chats one after another, as one user's). -> per turn its figures and answer"""
    import openai

    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="none", max_retries=0, timeout=300)
    turns = []
    client.chat.completions.create(model="target", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    for c in range(args.chats):
        messages = [{"role": "user", "content": CHAT[c % len(CHAT)]}]
        for t in range(args.turns):
            prompt = len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                       return_dict=True)["input_ids"])
            before = hit_tokens(urls)
            start = time.perf_counter()
            first, pieces = None, []
            for event in client.chat.completions.create(model="target", messages=messages, max_tokens=args.max_tokens,
                                                        temperature=0.0, stream=True):
                text = event.choices[0].delta.content if event.choices else None
                if text:
                    first = first or time.perf_counter()
                    pieces.append(text)
            end = time.perf_counter()
            answer = "".join(pieces)
            turns.append({"chat": c, "turn": t, "prompt_tokens": prompt, "ttft_ms": ((first or end) - start) * 1e3,
                          "total_ms": (end - start) * 1e3, "hit_tokens": hit_tokens(urls) - before, "answer": answer})
            messages += [{"role": "assistant", "content": answer},
                         {"role": "user", "content": FOLLOW_UPS[t % len(FOLLOW_UPS)]}]
    return turns


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.prefix", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_flags(parser)
    parser.add_argument("--chats", type=int, default=4)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--out", type=Path, default=RESULTS / "prefix.json")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.target_model)
    arms = {}
    for arm, flags in (("kept", []), ("off", ["--prefix-cache-mb", "0"])):
        ports = {role: free_port() for role in ("draft", "target")}
        stack = stack_of(args, target_args=[*flags, "--metrics-port", str(ports["target"])],
                         draft_args=[*flags, "--metrics-port", str(ports["draft"])]).start()
        try:
            arms[arm] = chats(stack, [f"http://127.0.0.1:{ports['target']}/metrics"], tokenizer, args)
        finally:
            stack.stop()
    same = sum(a["answer"] == b["answer"] for a, b in zip(arms["kept"], arms["off"]))
    rows = []
    print(f"\n{machine()}; {args.draft} draft, target {args.quantize}; {args.chats} chats x {args.turns} turns,"
          f" greedy, up to {args.max_tokens} tokens an answer\n")
    print("| turn | prompt tokens | cached | TTFT ms kept | TTFT ms off | x | answer ms kept | answer ms off |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for t in range(args.turns):
        kept = [r for r in arms["kept"] if r["turn"] == t]
        off = [r for r in arms["off"] if r["turn"] == t]
        row = {"turn": t + 1, "prompt_tokens": statistics.median(r["prompt_tokens"] for r in kept),
               "cached_share": sum(r["hit_tokens"] for r in kept) / sum(r["prompt_tokens"] for r in kept),
               "ttft_ms_kept": statistics.median(r["ttft_ms"] for r in kept),
               "ttft_ms_off": statistics.median(r["ttft_ms"] for r in off),
               "total_ms_kept": statistics.median(r["total_ms"] for r in kept),
               "total_ms_off": statistics.median(r["total_ms"] for r in off)}
        rows.append(row)
        print(f"| {row['turn']} | {row['prompt_tokens']:.0f} | {row['cached_share']:.0%} | {row['ttft_ms_kept']:.0f} |"
              f" {row['ttft_ms_off']:.0f} | {row['ttft_ms_off'] / row['ttft_ms_kept']:.2f}x |"
              f" {row['total_ms_kept']:.0f} | {row['total_ms_off']:.0f} |")
    print(f"\nanswers alike in both stacks: {same} of {len(arms['kept'])}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()},
                                             "identical": same, "answers": len(arms["kept"])},
                                    "rows": rows, "turns": arms}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
