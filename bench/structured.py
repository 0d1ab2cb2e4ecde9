"""`make bench-structured`: structured output on the real pair, beside the same requests unconstrained.

    python -m bench.structured [--prompts 8] [--new-tokens 192] [--quantize int4] [--temperature 0]

The requests (assets/prompts.py RECORDS) ask for a small record about a subject as JSON; the
constrained rows give them RECORD_SCHEMA (name, category from a list, year, one-sentence summary).
One run, one stack (coordinator + the shipped draft + the default target over gRPC, both services
--quantize as given), same prompts:

  u  unconstrained, the coordinator's adaptive K and K = 4
  c  constrained by the JSON schema, the same two K; `valid`: outputs that parse and validate
     (jsonschema) and ended at the end of sequence; `mask ms/rnd`: the time both services spent
     computing token masks per round (their specdec_grammar_mask_seconds_total, scraped)
  m / x  (in one process, greedy, K = 4, the same constrained requests) the draft masking its q
     with the constraint (m) and not (x): the acceptance a masked draft buys
  t / t0 (over HTTP, the coordinator's adaptive K) the requests of TOOL_REQUESTS with TOOLS,
     tool_choice required, one call each: with the target taking the tokens the constraint forces in
     the passes that decode (t), and a stack whose coordinator asks for no copies (t0:
     --target-lookup 0); `valid`: calls whose arguments validate against their tool's schema

Bars (issue 43): 100% valid; c tok/s >= 0.9x u tok/s at the same K; m's acceptance >= x's; t's calls
the same as t0's (greedy), t tok/s over t0's reported.
Writes a table to stdout and bench/results/structured.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import time
import urllib.request
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import grpc  # noqa: E402
import jsonschema  # noqa: E402
from transformers import AutoTokenizer  # noqa: E402

from assets.prompts import RECORD_SCHEMA, RECORDS, TOOL_REQUESTS, TOOLS  # noqa: E402
from bench.pair import chat_prompts  # noqa: E402
from bench.systems import machine  # noqa: E402
from coordinator.launch import LocalStack  # noqa: E402
from runtime.ports import free_port  # noqa: E402
from specdec.v1 import specdec_pb2 as pb  # noqa: E402
from specdec.v1 import specdec_pb2_grpc as pb_grpc  # noqa: E402
from speculative.protocol import Constraint, SamplingParams  # noqa: E402
from speculative.round import Stats, generate  # noqa: E402

RESULTS = Path(__file__).parent / "results"


def mask_seconds(port: int) -> float:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    found = re.search(r"^specdec_grammar_mask_seconds_total ([0-9.e+-]+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def grpc_rows(stack, ports, prompts, new_tokens, temperature) -> list[dict]:
    rows = []
    schema = json.dumps(RECORD_SCHEMA)
    with grpc.insecure_channel(stack.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        stub.Generate(pb.GenerateRequest(prompt_token_ids=prompts[0], max_new_tokens=8,
                                         constraint=pb.Constraint(json_schema=schema)))  # warm: compile, caches
        for k in (None, 4):
            for name in ("u", "c"):
                stats, valid, ended = Stats(), 0, 0
                masks = sum(mask_seconds(p) for p in ports)
                start = time.perf_counter()
                for i, prompt in enumerate(prompts):
                    request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=new_tokens,
                                                 temperature=temperature)
                    if k is not None:
                        request.num_speculative_tokens = k
                        request.seed = i
                    if name == "c":
                        request.constraint.json_schema = schema
                    reply = stub.Generate(request)
                    stats.merge(reply.stats)
                    ended += reply.finish_reason == pb.FINISH_REASON_EOS
                    if name == "c":
                        try:
                            jsonschema.validate(json.loads(reply.text), RECORD_SCHEMA)
                            valid += reply.finish_reason == pb.FINISH_REASON_EOS
                        except (ValueError, jsonschema.ValidationError):
                            pass
                seconds = time.perf_counter() - start
                mask_ms = (sum(mask_seconds(p) for p in ports) - masks) * 1e3
                rows.append({
                    "row": name, "k": "adaptive" if k is None else k, "requests": len(prompts),
                    "tokens": stats.generated_tokens, "tokens_per_s": stats.generated_tokens / seconds,
                    "acceptance_rate": stats.acceptance_rate, "alpha": stats.alpha, "rounds": stats.rounds,
                    "mean_k": stats.draft_tokens / max(stats.rounds, 1), "ended_with_eos": ended,
                    "valid": valid if name == "c" else None,
                    "mask_ms_per_round": mask_ms / max(stats.rounds, 1) if name == "c" else None,
                    "round_ms": seconds * 1e3 / max(stats.rounds, 1),
                })
    return rows


def tool_rows(name: str, stack, new_tokens: int, temperature: float) -> tuple[dict, list]:
    """One t row: the tool requests over HTTP through the official client. -> (row, each reply's calls)"""
    import openai

    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    calls, tokens, copied, valid = [], 0, 0, 0
    with openai.OpenAI(base_url=f"{stack.http_url}/v1", api_key="none", max_retries=0, timeout=300) as client:
        ask = dict(model="target", tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   max_tokens=new_tokens, temperature=temperature)
        client.chat.completions.create(messages=[{"role": "user", "content": TOOL_REQUESTS[0]}], **ask)  # warm
        start = time.perf_counter()
        for question in TOOL_REQUESTS:
            reply = client.chat.completions.create(messages=[{"role": "user", "content": question}], **ask)
            made = [(c.function.name, c.function.arguments) for c in reply.choices[0].message.tool_calls or []]
            calls.append(made)
            tokens, copied = tokens + reply.usage.completion_tokens, copied + reply.specdec["copied_tokens"]
            for function, arguments in made:
                try:
                    jsonschema.validate(json.loads(arguments), schemas[function])
                    valid += 1
                except (ValueError, jsonschema.ValidationError):
                    pass
        seconds = time.perf_counter() - start
    return {"row": name, "k": "adaptive", "requests": len(TOOL_REQUESTS), "tokens": tokens,
            "tokens_per_s": tokens / seconds, "ms_per_request": seconds * 1e3 / len(TOOL_REQUESTS),
            "copied_tokens": copied, "valid": valid}, calls


def in_process_rows(draft_dir, target_dir, quantize, prompts, new_tokens) -> list[dict]:
    """m and x: the same constrained greedy requests, K = 4, the draft masking its q or not."""
    from model_service.engines import DraftEngine, TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from model_service.model_runner import ModelRunner

    target_runner = ModelRunner(target_dir, device="cpu", quantize=quantize)
    target = LocalTarget(TargetEngine(target_runner))
    engine = DraftEngine(ModelRunner(draft_dir, device="cpu", quantize=quantize))
    rule = Constraint("json_schema", json.dumps(RECORD_SCHEMA))
    rows, outputs = [], {}
    for name, grammars in (("m", engine.grammars), ("x", None)):
        engine.grammars = grammars
        stats, outs = Stats(), []

        async def go(prompt):
            out = []
            async for new in generate(LocalDraft(engine), target, prompt, max_new_tokens=new_tokens, k=4,
                                      params=SamplingParams(0.0), eos_token_ids=set(target_runner.eos_token_ids),
                                      max_context=target_runner.max_context, stats=stats, constraint=rule):
                out += new
            return out

        start = time.perf_counter()
        for prompt in prompts:
            outs.append(asyncio.run(go(prompt)))
        seconds = time.perf_counter() - start
        outputs[name] = outs
        rows.append({"row": name, "k": 4, "requests": len(prompts), "tokens": stats.generated_tokens,
                     "tokens_per_s": stats.generated_tokens / seconds, "acceptance_rate": stats.acceptance_rate,
                     "alpha": stats.alpha, "rounds": stats.rounds, "mean_k": stats.draft_tokens / max(stats.rounds, 1)})
    rows[-1]["same_output_as_m"] = outputs["m"] == outputs["x"]
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.structured", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", default="models/draft")
    parser.add_argument("--target", default="models/target")
    parser.add_argument("--prompts", type=int, default=len(RECORDS))
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--quantize", default="none", choices=["none", "int4"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tool-tokens", type=int, default=100, help="the t rows' max_tokens")
    parser.add_argument("--out", default=str(RESULTS / "structured.json"))
    args = parser.parse_args(argv)
    tokenizer = AutoTokenizer.from_pretrained(args.target)
    prompts = chat_prompts(tokenizer, RECORDS[: args.prompts])
    quantize = ["--quantize", args.quantize] if args.quantize != "none" else []
    ports = [free_port(), free_port()]
    stack = LocalStack(args.draft, args.target, threads=args.threads, draft_threads=1, http_port=0,
                       draft_args=[*quantize, "--metrics-port", str(ports[0])],
                       target_args=[*quantize, "--metrics-port", str(ports[1])]).start()
    try:
        rows = grpc_rows(stack, ports, prompts, args.new_tokens, args.temperature)
        tools, calls = tool_rows("t", stack, args.tool_tokens, args.temperature)
    finally:
        stack.stop()
    stack = LocalStack(args.draft, args.target, threads=args.threads, draft_threads=1, http_port=0,
                       draft_args=quantize, target_args=quantize, coordinator_args=["--target-lookup", "0"]).start()
    try:
        alone, calls_alone = tool_rows("t0", stack, args.tool_tokens, args.temperature)
    finally:
        stack.stop()
    tools["same_calls_as_t0"] = calls == calls_alone
    rows += [tools, alone]
    import torch

    torch.set_num_threads(args.threads)
    rows += in_process_rows(args.draft, args.target, args.quantize, prompts, args.new_tokens)
    by = {(r["row"], r["k"]): r for r in rows}
    bars = {
        "all_valid": all(r["valid"] == r["requests"] for r in rows if r["row"] == "c"),
        **{f"c_vs_u_tokens_per_s_k_{k}": by[("c", k)]["tokens_per_s"] / by[("u", k)]["tokens_per_s"]
           for k in ("adaptive", 4)},
        "masked_vs_unmasked_acceptance": (by[("m", 4)]["acceptance_rate"], by[("x", 4)]["acceptance_rate"]),
        "t_vs_t0_tokens_per_s": by[("t", "adaptive")]["tokens_per_s"] / by[("t0", "adaptive")]["tokens_per_s"],
        "t_same_calls_as_t0": by[("t", "adaptive")]["same_calls_as_t0"],
    }
    print(f"machine: {machine()}; target {args.target} ({args.quantize}), draft {args.draft}, "
          f"temperature {args.temperature}, {len(prompts)} requests of up to {args.new_tokens} tokens")
    print(f"{'row':<5}{'K':>9}{'tok/s':>8}{'accept':>8}{'alpha':>7}{'mean K':>8}{'rnd ms':>8}{'valid':>7}"
          f"{'mask ms/rnd':>12}")
    for r in rows:
        if r["row"] in ("t", "t0"):
            print(f"{r['row']:<5}{r['k']:>9}{r['tokens_per_s']:>8.1f}  {r['ms_per_request']:.0f} ms a request, "
                  f"{r['tokens']} tokens, {r['copied_tokens']} copied, {r['valid']}/{r['requests']} calls valid")
            continue
        valid = f"{r['valid']}/{r['requests']}" if r.get("valid") is not None else "-"
        mask = f"{r['mask_ms_per_round']:.3f}" if r.get("mask_ms_per_round") is not None else "-"
        print(f"{r['row']:<5}{str(r['k']):>9}{r['tokens_per_s']:>8.1f}{r['acceptance_rate']:>8.3f}{r['alpha']:>7.3f}"
              f"{r['mean_k']:>8.2f}{r.get('round_ms', 0):>8.1f}{valid:>7}{mask:>12}")
    print("bars:", json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in bars.items()}))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"machine": machine(), "config": vars(args), "rows": rows, "bars": bars}, indent=1)
                   + "\n")


if __name__ == "__main__":
    main()
