"""The systems the bench's rows measure, each over a list of prompts (token ids), and what it
records about the machine they ran on.

  hf_generate     transformers `generate`: the target alone (a), assisted by the draft (b), or by
                  prompt lookup (p)
  runner_alone    the target alone on specdec's ModelRunner, one token per forward (a')
  engine_run      specdec's round in one process (c)
  grpc_run        specdec over gRPC, through a running LocalStack (d, e, f, n)
  interleaved     two rows' systems run again, turn about, each row's tok/s their median
Also: the GGUF a target was converted from (row l's), a process's resident memory, this
process's memory bandwidth, and the machine's description.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import torch

from assets.models import GGUF_FILE, packaged_gguf
from coordinator.launch import LocalStack
from model_service.engines import DraftEngine, TargetEngine
from model_service.local import LocalDraft, LocalTarget
from model_service.model_runner import ModelRunner
from speculative.protocol import SamplingParams
from speculative.round import Stats, generate


def hf_generate(target, prompts, temperature: float, new_tokens: int, assistant=None, k: int = 0,
                prompt_lookup: int = 0):
    """(generated token lists, seconds) for transformers generate, optionally assisted by a draft
    model (K = k) or by prompt lookup (prompt_lookup_num_tokens = prompt_lookup)."""
    outputs, start = [], time.perf_counter()
    for i, prompt in enumerate(prompts):
        torch.manual_seed(i)
        kwargs = dict(max_new_tokens=new_tokens, do_sample=temperature > 0, pad_token_id=target.config.eos_token_id)
        if temperature > 0:
            kwargs.update(temperature=temperature, top_k=0, top_p=1.0)
        if assistant is not None:
            assistant.generation_config.num_assistant_tokens = k
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = 0.0
            kwargs["assistant_model"] = assistant
        if prompt_lookup:
            kwargs["prompt_lookup_num_tokens"] = prompt_lookup
        with torch.inference_mode():
            out = target.generate(torch.tensor([prompt], device=target.device), **kwargs)
        outputs.append(out[0, len(prompt):].tolist())
    return outputs, time.perf_counter() - start


def runner_alone(target_dir, prompts, temperature: float, new_tokens: int, eos: set[int], quantize: str = "none",
                 outputs: list | None = None):
    """The target decoding alone on specdec's ModelRunner, one token per forward (`quantize`: its
    --quantize); each prompt's generated ids appended to `outputs` when given.
    -> (tokens, seconds, bytes of weights one pass reads)"""
    from model_service import q4_kernel
    from speculative.sampling import logits_to_probs, sample

    runner = ModelRunner(target_dir, quantize=quantize)
    to_probs, draw = q4_kernel.sampling_on(runner.device)  # (the target service's sampling)
    to_probs = to_probs or logits_to_probs
    weight_bytes = runner.fast.weight_bytes() if runner.fast is not None else 0
    generated, start = 0, time.perf_counter()
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature, 0, 1.0, seed=i)
        session = runner.start_session(f"alone-{i}", i)
        session.tokens.extend(prompt)
        for _ in range(new_tokens):
            logits = runner.forward(session)[-1]
            # greedy: the argmax, as the target service takes it (no one-hot distribution to sample)
            token = int(logits.argmax()) if params.greedy else sample(to_probs(logits, params), session.generator, draw)
            session.tokens.append(token)
            generated += 1
            if token in eos:
                break
        if outputs is not None:
            outputs.append(session.tokens[len(prompt):])
        runner.sessions.release(session.id)
    return generated, time.perf_counter() - start, weight_bytes


def memory_bandwidth_gbs(threads: int) -> float:
    """What this process reads from memory per second (GB/s): the median of 5 sums over a 256 MB
    float32 tensor (far larger than any cache), with `threads` torch threads."""
    x = torch.ones(64 << 20)
    runs = []
    for _ in range(6):
        start = time.perf_counter()
        x.sum()
        runs.append(x.numel() * 4 / (time.perf_counter() - start) / 1e9)
    return statistics.median(runs[1:])


def engine_run(draft_dir, target_dir, prompts, temperature: float, new_tokens: int, k: int, eos: set[int]):
    """specdec's round in one process. -> (Stats, seconds)"""
    draft_runner, target_runner = ModelRunner(draft_dir), ModelRunner(target_dir)
    draft, target = LocalDraft(DraftEngine(draft_runner)), LocalTarget(TargetEngine(target_runner))
    stats = Stats()

    async def run() -> float:
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature, 0, 1.0, seed=i)
            one = Stats()  # generate() counts toward max_new_tokens in the Stats it is given
            async for _ in generate(draft, target, prompt, max_new_tokens=new_tokens, k=k, params=params,
                                    eos_token_ids=eos, max_context=target_runner.max_context,
                                    draft_context=draft_runner.max_context, stats=one):
                pass
            stats.merge(one)
        return time.perf_counter() - start

    return stats, asyncio.run(run())


def grpc_run(stack: LocalStack, prompts, temperature: float, new_tokens: int, k: int | None, outputs=None):
    """The full system over gRPC (k None: the coordinator's adaptive K). -> (Stats summed over requests, seconds);
    each request's token ids appended to `outputs` when given"""
    import grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    stats = Stats()
    with grpc.insecure_channel(stack.addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        stub.Generate(pb.GenerateRequest(prompt_token_ids=prompts[0], max_new_tokens=4))  # warm up
        start = time.perf_counter()
        for i, prompt in enumerate(prompts):
            request = pb.GenerateRequest(prompt_token_ids=prompt, max_new_tokens=new_tokens, temperature=temperature)
            if k is not None:
                request.num_speculative_tokens = k
                request.seed = i
            # else unseeded: a sampled request naming its seed would get the acceptance-only K
            # (coordinator.adaptive.AcceptanceK), not the cost-driven one this row measures
            reply = stub.Generate(request)
            stats.merge(reply.stats)
            if outputs is not None:
                outputs.append(list(reply.token_ids))
        seconds = time.perf_counter() - start
    return stats, seconds


def interleaved(first: dict, second: dict, again_first, again_second, runs: int) -> None:
    """Run two rows' systems runs - 1 more times each, turn about (first, second, first, ...); each
    row's tokens_per_s becomes the median of its runs (its first tokens/s and what again_* return),
    all of them kept in tokens_per_s_runs."""
    for row in (first, second):
        row.setdefault("tokens_per_s_runs", [row["tokens_per_s"]])
    for _ in range(runs - 1):
        first["tokens_per_s_runs"].append(again_first())
        second["tokens_per_s_runs"].append(again_second())
    for row in (first, second):
        row["tokens_per_s"] = statistics.median(row["tokens_per_s_runs"])


def source_gguf(target_dir) -> Path | None:
    """The GGUF file `target_dir` was converted from (training.convert), where it is installed."""
    record = Path(target_dir) / "conversion.json"
    if not record.is_file():
        return None
    name = json.loads(record.read_text())["source"]
    try:
        return packaged_gguf(name=name) if name == GGUF_FILE else None
    except FileNotFoundError:
        return None


def rss_mb(pid: int) -> tuple[float, float]:
    """A process's (peak, current) resident memory (VmHWM, VmRSS), MB: a service's peak is its load,
    which holds the float weights a quantizing one drops; its current RSS is what it serves with."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line)
    return tuple(int(fields.get(key, "0 kB").split()[0]) / 1024 for key in ("VmHWM", "VmRSS"))


def machine() -> str:
    """Cores, CPU model and its vector extensions, torch: figures compare only within one machine."""
    model, flags = "", set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and not model:
                model = line.split(":", 1)[1].strip()
            elif line.startswith("flags") and not flags:
                flags = set(line.split(":", 1)[1].split())
    except OSError:
        pass
    simd = "AMX" if "amx_bf16" in flags else "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "?"
    return f"{os.cpu_count()} cores, {model or 'unknown CPU'} ({simd}), torch {torch.__version__}"
