"""`make bench-gpu`: specdec on one GPU, at the shapes of a real pair, with a draft of set quality.

    python -m bench.gpu                                   # Llama-3.1-8B / Llama-3.2-1B shapes, bf16, cuda
    python -m bench.gpu --shapes small --device cpu --dtype float32   # the same steps, tiny (a dry run)

Weights are random (latency depends on shapes, not values), so no draft model would agree with
the target: the system's draft is the oracle (model_service/oracle.py) replaying the target's own
greedy output with each position corrupted at a set rate (--acceptances: per-token acceptance a),
after running the draft model's own K steps each round (--oracle-cost model), so a round costs
what drafting with that model costs. Both services run as their own processes on the one GPU,
with the coordinator in front, over gRPC on loopback.

It reports, each a median over repeated passes:
  copy bandwidth     a device-to-device copy, bytes read + written per second
  decode step        one token of one session on the target (and the draft), CUDA graphs off and
                     on, beside its roofline: the bytes of weights a step reads / the copy bandwidth
  verify pass        K + 1 tokens of one session, K = 0..8 (eager)
  target alone       greedy decode on specdec's runner, one token a forward (graphs on)
  system             the three services, K = 4 (and adaptive K), at each acceptance: tokens/s,
                     x target alone, and the ceiling E[L] / T_verify(K + 1), E[L] = (1 - a^(K+1)) / (1 - a)
  HF                 transformers generate on the same target, alone and assisted by the same
                     draft model (its acceptance as measured: random weights agree on little)
Greedy output of every system row must equal the target alone's (else the bench fails).
Writes a table to stdout and bench/results/gpu.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.systems import grpc_run, hf_generate  # noqa: E402
from bench.verify_latency import time_passes  # noqa: E402
from coordinator.launch import LocalStack  # noqa: E402
from model_service.fast_forward import DTYPES  # noqa: E402
from model_service.model_runner import ModelRunner  # noqa: E402
from speculative.tiny import make_tokenizer  # noqa: E402
from transformers import AutoConfig, AutoModelForCausalLM  # noqa: E402

RESULTS = Path(__file__).parent / "results"

# (hidden, layers, heads, kv_heads, intermediate, vocab)
SHAPES = {
    "llama": {"target": (4096, 32, 32, 8, 14336, 128256), "draft": (2048, 16, 32, 8, 8192, 128256)},
    "small": {"target": (256, 4, 8, 2, 512, 32000), "draft": (128, 2, 4, 2, 256, 32000)},
}
SHAPE_NAMES = {"llama": ("Llama-3.1-8B", "Llama-3.2-1B"), "small": ("small", "smaller")}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_ms(fn, device: torch.device, reps: int, warmup: int = 3) -> float:
    samples = []
    for rep in range(warmup + reps):
        sync(device)
        start = time.perf_counter()
        fn()
        sync(device)
        if rep >= warmup:
            samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def copy_bandwidth_gbs(device: torch.device, megabytes: int) -> float:
    """Bytes read + written per second by a device-to-device copy of `megabytes`, GB/s."""
    src = torch.ones(megabytes << 18, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, reps=10)
    return 2 * src.numel() * 4 / (ms / 1e3) / 1e9


def build(out: Path, shapes: str, dtype: torch.dtype, device: str, context: int) -> tuple[Path, Path]:
    """The random target and draft, each peaked (see peaked), written to out/target and out/draft."""
    tokenizer = make_tokenizer(out / "tokenizer")
    init = device if device.startswith("cuda") else "cpu"
    dirs = []
    for seed, role in enumerate(("target", "draft")):
        hidden, layers, heads, kv_heads, intermediate, vocab = SHAPES[shapes][role]
        config = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                      max_position_embeddings=context, tie_word_embeddings=False,
                                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.eos_token_id,
                                      pad_token_id=tokenizer.eos_token_id)
        torch.manual_seed(seed)
        with torch.device(init):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        peaked(model, len(tokenizer), tokenizer.eos_token_id)
        model.save_pretrained(out / role)
        tokenizer.save_pretrained(out / role)
        dirs.append(out / role)
        del model
        gc.collect()
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return dirs[0], dirs[1]


@torch.no_grad()
def peaked(model, tokens: int, eos: int, seed: int = 1234) -> None:
    """Make the greedy choice after token t a fixed successor s(t) (one permutation of the tokenizer's
    ids, the same for every model it is applied to), by far: the embeddings are scaled up until they
    dominate the residual stream (the layers' outputs stay as they were), and the output layer's row
    s(t) becomes the direction of t's embedding. Logits of a random model are nearly flat, so bf16's
    rounding along different paths (one row or several, a graph or eager) would flip ties every
    few dozen tokens and greedy outputs could not be compared; here no tie is near. Two models
    peaked this way agree (a draft's natural acceptance ~1). Costs are unchanged: same shapes."""
    generator = torch.Generator().manual_seed(seed)
    successor = torch.randperm(tokens, generator=generator)
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    embed.mul_(1000.0)
    rows = torch.arange(tokens)
    # (no token leads to the end token, so outputs run their full length; the end token's embedding is
    # the padding row, zeros)
    keep = (successor != eos) & (rows != eos)
    directions = embed[rows[keep]].float()
    head[successor[keep].to(head.device)] = (0.5 * directions / directions.norm(dim=-1, keepdim=True).clamp_min(1e-6)
                                             ).to(head.dtype)


def step_times(runner: ModelRunner, context: int, reps: int, ks: list[int]) -> dict:
    """Median ms of one session's one-token pass (graphs off, and on where the runner can) and of
    its K + 1-token passes, on `context` cached tokens (verify_latency.time_passes)."""
    out = {"weight_bytes": runner.fast.weight_bytes()}
    graphs, runner.fast.graphs = runner.fast.graphs, None
    out["step_ms_eager"] = time_passes(runner, 1, 0, context, reps)
    out["verify_ms"] = {k: time_passes(runner, 1, k, context, reps) for k in ks}
    if runner.device.type == "cuda":
        runner.fast.graphs = graphs or runner.fast.use_graphs()
        out["step_ms_graphs"] = time_passes(runner, 1, 0, context, reps)
    return out


def decode_alone(runner: ModelRunner, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy decode of each prompt, one token a forward. -> (outputs, seconds)"""
    eos = set(runner.eos_token_ids)
    outputs = []
    sync(runner.device)
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        session = runner.start_session(f"alone-{i}", i)
        session.tokens.extend(prompt)
        out = []
        for _ in range(new_tokens):
            token = int(runner.forward(session)[-1, : runner.vocab_size].argmax())  # (ids its tokenizer has)
            session.tokens.append(token)
            out.append(token)
            if token in eos:
                break
        runner.sessions.release(session.id)
        outputs.append(out)
    sync(runner.device)
    return outputs, time.perf_counter() - start


def expected_per_round(a: float, k: int) -> float:
    """E[tokens a round commits] at per-token acceptance a: the accepted prefix plus one."""
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def hf_rows(target_dir: Path, draft_dir: Path, prompts, new_tokens: int, k: int, device: str, dtype) -> dict:
    """transformers generate, greedy: the target alone, and assisted by the draft model (K = k)."""
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).to(device).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).to(device).eval()
    rows = {}
    for name, assistant in (("alone", None), ("assisted", draft)):
        hf_generate(target, prompts[:1], 0.0, 8, assistant, k)  # warm-up
        outputs, seconds = hf_generate(target, prompts, 0.0, new_tokens, assistant, k)
        generated = sum(map(len, outputs))
        rows[name] = {"tokens_per_s": generated / seconds, "tokens": generated}
    del target, draft
    gc.collect()
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--acceptances", default="0.8,0.6")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20, help="passes per timed median")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers rows")
    parser.add_argument("--work", default=None,
                        help="where the random models are written (default: a temporary dir, in /dev/shm where it"
                             " has room)")
    parser.add_argument("--out", default=str(RESULTS / "gpu.json"))
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    acceptances = [float(a) for a in args.acceptances.split(",") if a]
    # the models go to memory where there is room (/dev/shm): 16 GB of target written and read twice
    shm = Path("/dev/shm")
    scratch = shm if shm.is_dir() and os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize > 40e9 else None
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-gpu-", dir=scratch))
    context = args.prompt_tokens + args.new_tokens + 2 * args.k + 64
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": args.dtype, "k": args.k,
              "shapes": dict(zip(("target", "draft"), SHAPE_NAMES[args.shapes]))}
    t0 = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {message}", flush=True)

    report["copy_gbs"] = copy_bandwidth_gbs(device, 1024 if device.type == "cuda" else 256)
    say(f"copy bandwidth {report['copy_gbs']:.0f} GB/s (read + written)")
    target_dir, draft_dir = build(work, args.shapes, dtype, args.device, context)
    say(f"models written to {work}")

    runner = ModelRunner(draft_dir, args.device, args.dtype, max_context=context, cuda_graphs=True)
    report["draft"] = step_times(runner, args.prompt_tokens, args.reps, [args.k - 1])
    del runner
    gc.collect()
    say(f"draft: {report['draft']}")

    runner = ModelRunner(target_dir, args.device, args.dtype, max_context=context, cuda_graphs=True)
    report["target"] = step_times(runner, args.prompt_tokens, args.reps, list(range(0, 9)))
    say(f"target: {report['target']}")
    vocab = runner.vocab_size
    prompts = [[(97 * i + 31 * j + 5) % vocab for j in range(args.prompt_tokens)] for i in range(args.prompts)]
    decode_alone(runner, prompts[:1], 8)  # warm-up
    references, seconds = decode_alone(runner, prompts, args.new_tokens)
    generated = sum(map(len, references))
    report["target_alone"] = {"tokens_per_s": generated / seconds, "tokens": generated}
    say(f"target alone: {report['target_alone']['tokens_per_s']:.1f} tok/s")
    del runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    oracle = work / "references.json"
    oracle.write_text(json.dumps([p + r for p, r in zip(prompts, references)]))
    on_device = ["--device", args.device, "--dtype", args.dtype, "--max-context", str(context)]
    report["system"] = []
    drafts = [(f"oracle a={a}", a, ["--oracle", str(oracle), "--oracle-cost", "model", "--oracle-acceptance", str(a)])
              for a in acceptances] + [("model (peaked alike)", None, [])]
    stack = LocalStack(draft_dir, target_dir, threads=None, target_args=on_device, draft_args=on_device + drafts[0][2])
    stack.start(timeout=600)
    try:
        for i, (name, a, flags) in enumerate(drafts):
            if i:
                stack.draft_args = on_device + flags
                stack.restart_replica("draft", timeout=600)
            for k in (args.k, None):
                outputs = []
                stats, seconds = grpc_run(stack, prompts, 0.0, args.new_tokens, k, outputs)
                alpha = stats.alpha if a is None else a
                ceiling = expected_per_round(alpha, args.k) / report["target"]["verify_ms"][args.k] * 1e3
                tps = stats.generated_tokens / seconds
                row = {"draft": name, "acceptance_set": a, "k": k or "adaptive", "tokens_per_s": tps,
                       "greedy_equal": outputs == references,
                       "acceptance_rate": stats.acceptance_rate, "alpha": stats.alpha, "rounds": stats.rounds,
                       "draft_ms_per_round": stats.draft_ms / max(1, stats.rounds),
                       "target_ms_per_round": stats.target_ms / max(1, stats.rounds),
                       "x_target_alone": tps / report["target_alone"]["tokens_per_s"],
                       "ceiling_tokens_per_s": ceiling, "of_ceiling": tps / ceiling}
                report["system"].append(row)
                say(f"system, {name} draft, K={row['k']}: {tps:.1f} tok/s, acceptance {stats.acceptance_rate:.3f}"
                    f" (alpha {stats.alpha:.2f}), {row['x_target_alone']:.2f}x alone, {row['of_ceiling']:.0%} of the"
                    f" ceiling {ceiling:.1f}; greedy output {'equal to' if row['greedy_equal'] else 'DIFFERS from'}"
                    " the target's")
    finally:
        stack.stop()
    if not args.skip_hf:
        report["hf"] = hf_rows(target_dir, draft_dir, prompts, args.new_tokens, args.k, args.device, dtype)
        say(f"HF: {report['hf']}")
        ours = next(r for r in report["system"] if r["acceptance_set"] is None and r["k"] == args.k)
        report["x_hf_assisted"] = ours["tokens_per_s"] / report["hf"]["assisted"]["tokens_per_s"]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(table(report))


def table(report: dict) -> str:
    bw = report["copy_gbs"]
    lines = [f"{report['device']}, torch {report['torch']}, {report['dtype']}; copy {bw:.0f} GB/s (read + written)",
             "| pass | ms | roofline ms | x roofline |", "| --- | --- | --- | --- |"]
    for role in ("target", "draft"):
        r = report[role]
        roof = r["weight_bytes"] / (bw * 1e9) * 1e3
        name = report["shapes"][role]
        for kind in ("eager", "graphs"):
            if f"step_ms_{kind}" in r:
                ms = r[f"step_ms_{kind}"]
                lines.append(f"| {name} decode step, {kind} | {ms:.2f} | {roof:.2f} | {ms / roof:.2f} |")
        for k, ms in r["verify_ms"].items():
            tokens = f"{int(k) + 1} token{'s' if int(k) else ''}"
            lines.append(f"| {name} pass of {tokens}, eager | {ms:.2f} | {roof:.2f} | {ms / roof:.2f} |")
    lines += ["", f"target alone: {report['target_alone']['tokens_per_s']:.1f} tok/s",
              "| draft | K | tok/s | acceptance (alpha) | draft / target ms a round | x target alone | ceiling tok/s"
              " | of ceiling | greedy = target's |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["system"]:
        lines.append(f"| {r['draft']} | {r['k']} | {r['tokens_per_s']:.1f} | {r['acceptance_rate']:.3f}"
                     f" ({r['alpha']:.2f}) | {r['draft_ms_per_round']:.2f} / {r['target_ms_per_round']:.2f} |"
                     f" {r['x_target_alone']:.2f} | {r['ceiling_tokens_per_s']:.1f} | {r['of_ceiling']:.0%} |"
                     f" {'yes' if r['greedy_equal'] else 'NO'} |")
    if "hf" in report:
        hf = report["hf"]
        lines.append(f"HF generate: alone {hf['alone']['tokens_per_s']:.1f} tok/s, assisted by the same draft model"
                     f" (K = {report['k']}) {hf['assisted']['tokens_per_s']:.1f} tok/s; specdec with that draft at"
                     f" K = {report['k']}: {report['x_hf_assisted']:.2f}x HF assisted")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
