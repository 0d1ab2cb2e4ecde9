"""A long prompt arriving while other requests stream: what it costs them, fed whole or in parts
(the target's --prefill-chunk, engines.TargetEngine).

    python -m bench.long_prompts [--quantize int4] [--streams 3] [--prompts 3] [--prompt-tokens 2000]
                                 [--chunks 128,256,0] [--draft eagle]

One run, one stack per --chunks value (its target's --prefill-chunk), over the OpenAI-compatible HTTP
API (the official client), greedy. `--streams` requests stream their answers (ignore_eos, up to
`--stream-tokens`, then again) for the whole arm; once each has streamed tokens, `--prompts` long
requests (a document of ~`--prompt-tokens` tokens and a question, a different document each time, so
that prefix reuse takes none of it) come one after another, each for 8 tokens. Per arm: the long
requests' time to the first token (TTFT: their prefill), and what the streams saw from a long
request's start to its end (its prefill, the draft taking in its prompt, its 8 tokens): each
stream's longest wait between two tokens (its stall; the median over streams and long requests, and
the worst), their tokens a second then, and their median time between tokens outside those windows.
Writes bench/results/long_prompts.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import AutoTokenizer  # noqa: E402

from assets.prompts import CHAT, GROUNDED  # noqa: E402
from bench.pair import RESULTS, add_stack_flags, stack_of  # noqa: E402
from bench.systems import machine  # noqa: E402
from coordinator.launch import LocalStack  # noqa: E402

STREAM_PROMPT = "Write a long story about a lighthouse keeper and the ships she guides through a stormy winter."


def document(tokenizer, tokens: int, seed: int) -> str:
    """A long prompt of about `tokens` tokens: the bench prompts' texts shuffled (each seed its own
    order from the first line), and a question about them."""
    rng = random.Random(seed)
    texts, parts, n = CHAT + GROUNDED, [f"Document {seed}."], 0
    while n < tokens:
        text = rng.choice(texts)
        parts.append(text)
        n += len(tokenizer(text)["input_ids"]) + 1
    return "\n".join(parts) + "\n\nWhich of the requests above is the most useful? Answer in one word."


def stream(client, stop: threading.Event, times: list[float], started: threading.Event, tokens: int) -> None:
    """A request streaming until `stop` (another after it, should it end first), appending each chunk's
    arrival time to `times`."""
    while not stop.is_set():
        response = client.chat.completions.create(model="target", stream=True, temperature=0.0, max_tokens=tokens,
                                                  messages=[{"role": "user", "content": STREAM_PROMPT}],
                                                  extra_body={"ignore_eos": True})
        try:
            for event in response:
                if event.choices and event.choices[0].delta.content:
                    times.append(time.perf_counter())
                    started.set()
                if stop.is_set():
                    break
        finally:
            response.close()


def arm(stack: LocalStack, tokenizer, args) -> dict:
    import openai

    client = openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="none", max_retries=0, timeout=600)
    client.chat.completions.create(model="target", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    stop = threading.Event()
    times: list[list[float]] = [[] for _ in range(args.streams)]
    started = [threading.Event() for _ in range(args.streams)]
    threads = [threading.Thread(target=stream, args=(client, stop, times[s], started[s], args.stream_tokens),
                                daemon=True) for s in range(args.streams)]
    for thread in threads:
        thread.start()
    for event in started:
        assert event.wait(600), "a stream never started"
    windows = []
    try:
        for p in range(args.prompts):
            prompt = document(tokenizer, args.prompt_tokens, seed=p)
            n = len(tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                                  tokenize=True, return_dict=True)["input_ids"])
            while min(len(t) for t in times) < 16 * (p + 1):  # the streams at work before each
                time.sleep(0.05)
            start = time.perf_counter()
            first = None
            for event in client.chat.completions.create(model="target", messages=[{"role": "user", "content": prompt}],
                                                        max_tokens=8, temperature=0.0, stream=True):
                if event.choices and event.choices[0].delta.content and first is None:
                    first = time.perf_counter()
            end = time.perf_counter()
            windows.append({"prompt_tokens": n, "start": start, "first": first or end, "end": end})
    finally:
        stop.set()
        for thread in threads:
            thread.join(600)
    for w in windows:
        stalls, tokens = [], 0
        for t in times:
            inside = [x for x in t if w["start"] <= x <= w["end"]]
            before = [x for x in t if x < w["start"]][-1:]
            after = [x for x in t if x > w["end"]][:1]
            span = before + inside + after  # each wait that overlaps the window
            stalls.append(max(b - a for a, b in zip(span, span[1:])) if len(span) > 1 else w["end"] - w["start"])
            tokens += len(inside)
        w.update(ttft_ms=(w["first"] - w["start"]) * 1e3, stall_ms=[s * 1e3 for s in stalls],
                 stream_tokens_per_s=tokens / (w["end"] - w["start"]))
    outside = [(b - a) * 1e3 for t in times for a, b in zip(t, t[1:])
               if not any(a <= w["end"] and b >= w["start"] for w in windows)]  # (waits overlapping none)
    return {"windows": [{k: v for k, v in w.items() if k not in ("start", "first", "end")} for w in windows],
            "itl_ms_outside": statistics.median(outside) if outside else None}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.long_prompts", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_stack_flags(parser)
    parser.add_argument("--streams", type=int, default=3)
    parser.add_argument("--prompts", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=2000)
    parser.add_argument("--stream-tokens", type=int, default=4000, help="the streaming requests' max_tokens")
    parser.add_argument("--chunks", default="128,256,0", help="the target's --prefill-chunk (a number or auto),"
                                                              " an arm each")
    parser.add_argument("--out", type=Path, default=RESULTS / "long_prompts.json")
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.target_model)
    arms = {}
    for chunk in [c if c == "auto" else int(c) for c in args.chunks.split(",")]:
        stack = stack_of(args, target_args=["--prefill-chunk", str(chunk)]).start()
        try:
            arms[chunk] = arm(stack, tokenizer, args)
        finally:
            stack.stop()
    print(f"\n{machine()}; {args.draft} draft, target {args.quantize}; {args.streams} streams, {args.prompts} long"
          f" prompts one after another, greedy\n")
    print("| --prefill-chunk | prompt tokens | long prompt TTFT ms | streams' stall ms (median / worst) |"
          " streams' tok/s meanwhile | streams' ITL ms otherwise |")
    print("| --- | --- | --- | --- | --- | --- |")
    rows = []
    for chunk, result in arms.items():
        windows = result["windows"]
        stalls = [s for w in windows for s in w["stall_ms"]]
        row = {"prefill_chunk": chunk, "prompt_tokens": statistics.median(w["prompt_tokens"] for w in windows),
               "ttft_ms": statistics.median(w["ttft_ms"] for w in windows),
               "stall_ms_median": statistics.median(stalls), "stall_ms_worst": max(stalls),
               "stream_tokens_per_s": statistics.median(w["stream_tokens_per_s"] for w in windows),
               "itl_ms_outside": result["itl_ms_outside"]}
        rows.append(row)
        print(f"| {'off' if chunk == 0 else chunk} | {row['prompt_tokens']:.0f} | {row['ttft_ms']:.0f} | {row['stall_ms_median']:.0f} /"
              f" {row['stall_ms_worst']:.0f} | {row['stream_tokens_per_s']:.1f} | {row['itl_ms_outside'] or 0:.1f} |")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": {"machine": machine(), "args": {k: str(v) for k, v in vars(args).items()}},
                                    "rows": rows, "arms": {str(k): v for k, v in arms.items()}}, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
