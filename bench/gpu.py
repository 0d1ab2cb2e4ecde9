"""`make bench-gpu`: specdec on one GPU, at the shapes of a real pair, with a draft of set quality.

    python -m bench.gpu                                   # Llama-3.1-8B / Llama-3.2-1B shapes, bf16, cuda
    python -m bench.gpu --shapes small --device cpu --dtype float32   # the same steps, tiny (a dry run)

Weights are random (latency depends on shapes, not values), so no draft model would agree with
the target: the system's draft is the oracle (model_service/oracle.py) replaying the target's own
greedy output with each position corrupted at a set rate (--acceptances: per-token acceptance a),
free (as the issue's synthetic draft: what is left of a round is the machinery's own cost) and,
with --oracle-cost model, after running the draft model's own K steps each round, so a round costs
what drafting with that model costs. Both services run as their own processes on the one GPU,
with the coordinator in front, over gRPC on loopback.

It reports, each a median over repeated passes:
  copy bandwidth     a device-to-device copy, bytes read + written per second
  decode step        one token of one session on the target (and the draft), CUDA graphs off and
                     on, beside its roofline: the bytes of weights a step reads / the copy bandwidth
  verify pass        K + 1 tokens of one session, K = 0..8, eager and through CUDA graphs
  target alone       greedy decode on specdec's runner, one token a forward (graphs on)
  in one process     the speculative round over the engines themselves (no gRPC, no second
                     process), the free oracle at the first acceptance, K = 4
  system             the three services, K = 4 (and adaptive K), each draft: tokens/s, x target
                     alone, the time a round spends inside each service and on its model, and the
                     ceiling E[L] / T_verify(K + 1), E[L] = (1 - a^(K+1)) / (1 - a), T_verify the
                     pass the target runs (graphed where graphs are on)
  eagle              an EAGLE-3 head of the target's shape (random weights: its step time and the
                     features' bytes and cost; acceptance is the oracle rows'), over gRPC
  HF                 transformers generate on the same target, alone and assisted by the same
                     draft model (its acceptance as measured: random weights agree on little)
Greedy output of every system row must equal the target alone's (else the bench fails).
Writes a table to stdout and bench/results/gpu.json (after each part, so a run cut short keeps
what it measured).
"""

from __future__ import annotations

import argparse
import asyncio
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
    """Median ms of one session's one-token pass and of its K + 1-token passes on `context` cached
    tokens (verify_latency.time_passes), eager and, where the runner can, through CUDA graphs."""
    out = {"weight_bytes": runner.fast.weight_bytes()}
    graphs, runner.fast.graphs = runner.fast.graphs, None
    out["step_ms_eager"] = time_passes(runner, 1, 0, context, reps)
    out["verify_ms"] = {k: time_passes(runner, 1, k, context, reps) for k in ks}
    if runner.device.type == "cuda":
        runner.fast.graphs = graphs or runner.fast.use_graphs()
        out["step_ms_graphs"] = time_passes(runner, 1, 0, context, reps)
        out["verify_ms_graphs"] = {k: time_passes(runner, 1, k, context, reps) for k in ks}
    return out


def verify_ms(report: dict, k: int) -> float:
    """The target's pass over k + 1 tokens as the services run it: graphed where graphs ran."""
    target = report["target"]
    return target.get("verify_ms_graphs", target["verify_ms"])[k]


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


def local_rows(target: ModelRunner, draft: ModelRunner, oracle: list[list[int]], prompts, references,
               new_tokens: int, k: int, a: float, context: int) -> dict:
    """The round in one process: the engines behind in-process peers (model_service/local.py), the
    free oracle at acceptance a, K = k, greedy; no gRPC, no second process."""
    from model_service.engines import TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from model_service.oracle import OracleDraftEngine
    from speculative.protocol import SamplingParams
    from speculative.round import Stats, generate

    peers = LocalDraft(OracleDraftEngine(draft, oracle, acceptance=a)), LocalTarget(TargetEngine(target))

    async def run(batch, stats) -> list[list[int]]:
        outputs = []
        for prompt in batch:
            out, own = [], Stats()  # (generate counts a request's tokens in its stats)
            async for new in generate(*peers, prompt, max_new_tokens=new_tokens, k=k, params=SamplingParams(0.0),
                                      max_context=context, stats=own):
                out += new
            stats.merge(own)
            outputs.append(out)
        return outputs

    asyncio.run(run(prompts[:1], Stats()))  # warm-up (graphs captured)
    stats = Stats()
    sync(target.device)
    start = time.perf_counter()
    outputs = asyncio.run(run(prompts, stats))
    sync(target.device)
    return row(f"oracle a={a}, one process", a, k, stats, time.perf_counter() - start, outputs == references)


def row(name: str, a: float | None, k: int | None, stats, seconds: float, greedy_equal: bool) -> dict:
    rounds = max(1, stats.rounds)
    return {"draft": name, "acceptance_set": a, "k": k or "adaptive", "tokens_per_s": stats.generated_tokens / seconds,
            "greedy_equal": greedy_equal, "acceptance_rate": stats.acceptance_rate, "alpha": stats.alpha,
            "rounds": stats.rounds, "tokens_per_round": stats.generated_tokens / rounds,
            "draft_ms_per_round": stats.draft_ms / rounds, "target_ms_per_round": stats.target_ms / rounds,
            "draft_pass_ms_per_round": stats.draft_pass_ms / rounds,
            "target_pass_ms_per_round": stats.target_pass_ms / rounds,
            "round_ms": seconds * 1e3 / rounds, "feature_bytes_per_round": stats.feature_bytes / rounds,
            "draft_tokens": stats.draft_tokens, "draft_calls": stats.draft_calls, "predrafts": stats.predrafts,
            "predraft_hits": stats.predraft_hits, "lost_draft_rounds": stats.lost_draft_rounds}


def random_head(target_dir: Path, out: Path, shapes: str, device: str, dtype: torch.dtype) -> Path:
    """An EAGLE-3 head of the target's shape (random weights; a draft vocabulary of 32,000 ids, or the
    target's if smaller), in the speculators layout, its embeddings read from the target's directory."""
    from model_service.eagle_head import Eagle3Config, Eagle3Head, default_aux_layer_ids

    hidden, layers, heads, kv_heads, intermediate, vocab = SHAPES[shapes]["target"]
    config = Eagle3Config(hidden_size=hidden, intermediate_size=intermediate, num_attention_heads=heads,
                          num_key_value_heads=kv_heads, head_dim=hidden // heads, vocab_size=vocab,
                          draft_vocab_size=min(32000, vocab), aux_layer_ids=default_aux_layer_ids(layers),
                          verifier=str(target_dir))
    torch.manual_seed(7)
    head = Eagle3Head(config).to(device=device, dtype=dtype)
    with torch.no_grad():
        for parameter in head.parameters():
            parameter.normal_(0, 0.02)
    head.set_vocab(torch.randperm(vocab)[: config.draft_vocab_size].sort().values.to(device))
    head.embeddings_from_target = True
    head.save(out)
    del head
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama", choices=sorted(SHAPES))
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--acceptances", default="0.8,0.6", help="the oracle's, each a row (free)")
    parser.add_argument("--model-cost", default="0.8", help="acceptances of oracle rows at the draft model's cost")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--reps", type=int, default=20, help="passes per timed median")
    parser.add_argument("--skip-hf", action="store_true", help="no transformers rows")
    parser.add_argument("--skip-eagle", action="store_true", help="no EAGLE-3 head row")
    parser.add_argument("--work", default=None,
                        help="where the random models are written (default: a temporary dir, in /dev/shm where it"
                             " has room)")
    parser.add_argument("--out", default=str(RESULTS / "gpu.json"))
    args = parser.parse_args(argv)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    acceptances = [float(a) for a in args.acceptances.split(",") if a]
    costly = [float(a) for a in args.model_cost.split(",") if a]
    # the models go to memory where there is room (/dev/shm): 16 GB of target written and read twice
    shm = Path("/dev/shm")
    scratch = shm if shm.is_dir() and os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize > 40e9 else None
    work = Path(args.work or tempfile.mkdtemp(prefix="bench-gpu-", dir=scratch))
    context = args.prompt_tokens + args.new_tokens + 2 * args.k + 64
    report = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
              "torch": torch.__version__, "dtype": args.dtype, "k": args.k,
              "shapes": dict(zip(("target", "draft"), SHAPE_NAMES[args.shapes])), "system": []}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()

    def say(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.1f} s] {message}", flush=True)
        out.write_text(json.dumps(report, indent=1) + "\n")  # what is measured so far

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
    sequences = [p + r for p, r in zip(prompts, references)]
    if acceptances:
        drafter = ModelRunner(draft_dir, args.device, args.dtype, max_context=context, cuda_graphs=True)
        local = local_rows(runner, drafter, sequences, prompts, references, args.new_tokens, args.k, acceptances[0],
                           context)
        report["system"].append(with_ceiling(local, report, args.k))
        say(describe(local))
        del drafter
    del runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()

    oracle = work / "references.json"
    oracle.write_text(json.dumps(sequences))
    on_device = ["--device", args.device, "--dtype", args.dtype, "--max-context", str(context)]
    replay = ["--oracle", str(oracle), "--oracle-acceptance"]
    drafts = ([(f"oracle a={a}", a, [*replay, str(a)], (args.k, None)) for a in acceptances]
              + [(f"oracle a={a}, at the draft model's cost", a, [*replay, str(a), "--oracle-cost", "model"], (args.k,))
                 for a in costly]
              + [("model (peaked alike)", None, [], (args.k, None))])
    stack = LocalStack(draft_dir, target_dir, threads=None, target_args=on_device, draft_args=on_device + drafts[0][2])
    stack.start(timeout=600)
    try:
        for i, (name, a, flags, ks) in enumerate(drafts):
            if i:
                stack.draft_args = on_device + flags
                stack.restart_replica("draft", timeout=600)
            for k in ks:
                report["system"].append(system_row(stack, name, a, k, prompts, references, args, report))
                report["system"][-1]["pass_costs"] = logged_pass_costs(stack)
                say(describe(report["system"][-1]))
    finally:
        stack.stop()
    if not args.skip_eagle:
        try:
            head = random_head(target_dir, work / "eagle", args.shapes, args.device, dtype)
            stack = LocalStack(head, target_dir, threads=None, target_args=on_device, draft_args=on_device,
                               draft_method="eagle")
            stack.start(timeout=600)
            try:
                report["eagle"] = system_row(stack, "EAGLE-3 head (random weights)", None, args.k, prompts,
                                             references, args, report)
                report["eagle"]["pass_costs"] = logged_pass_costs(stack)
            finally:
                stack.stop()
            say(describe(report["eagle"]))
        except Exception as exc:  # (the rows above are kept)
            report["eagle"] = {"error": repr(exc)}
            say(f"eagle row failed: {exc!r}")
    if not args.skip_hf:
        report["hf"] = hf_rows(target_dir, draft_dir, prompts, args.new_tokens, args.k, args.device, dtype)
        ours = next(r for r in report["system"] if r["draft"].startswith("model") and r["k"] == args.k)
        report["x_hf_assisted"] = ours["tokens_per_s"] / report["hf"]["assisted"]["tokens_per_s"]
        say(f"HF: {report['hf']}")
    print(table(report))
    if not all(r["greedy_equal"] for r in report["system"] + ([report["eagle"]] if "greedy_equal" in
                                                                report.get("eagle", {}) else [])):
        raise SystemExit("a system row's greedy output differs from the target alone's")


def system_row(stack: LocalStack, name: str, a: float | None, k: int | None, prompts, references, args,
               report: dict) -> dict:
    """One row of the three services: a warm-up request, then the prompts."""
    grpc_run(stack, prompts[:1], 0.0, 32, k)  # warm-up: the passes' graphs are captured
    outputs = []
    stats, seconds = grpc_run(stack, prompts, 0.0, args.new_tokens, k, outputs)
    return with_ceiling(row(name, a, k, stats, seconds, outputs == references), report, args.k)


def logged_pass_costs(stack: LocalStack) -> dict:
    """The pass costs each model service calibrated at load (its log's "pass PassCost(...)"), which
    the coordinator's adaptive K prices rounds with."""
    out = {}
    for name in ("target", "draft"):
        lines = [line for line in stack.logs[name].read_text().splitlines() if " pass PassCost(" in line]
        if lines:
            out[name] = lines[-1].split(" pass ", 1)[1]
    return out


def with_ceiling(r: dict, report: dict, k: int) -> dict:
    """The row beside the target alone and its ceiling E[L] / T_verify(k + 1) at its acceptance."""
    alpha = r["alpha"] if r["acceptance_set"] is None else r["acceptance_set"]
    r["ceiling_tokens_per_s"] = expected_per_round(alpha, k) / verify_ms(report, k) * 1e3
    r["of_ceiling"] = r["tokens_per_s"] / r["ceiling_tokens_per_s"]
    r["x_target_alone"] = r["tokens_per_s"] / report["target_alone"]["tokens_per_s"]
    return r


def describe(r: dict) -> str:
    return (f"{r['draft']}, K={r['k']}: {r['tokens_per_s']:.1f} tok/s, acceptance {r['acceptance_rate']:.3f} (alpha"
            f" {r['alpha']:.2f}), {r['x_target_alone']:.2f}x alone, {r['of_ceiling']:.0%} of the ceiling"
            f" {r['ceiling_tokens_per_s']:.1f}; a round {r['round_ms']:.2f} ms: draft {r['draft_ms_per_round']:.2f}"
            f" (model {r['draft_pass_ms_per_round']:.2f}), target {r['target_ms_per_round']:.2f} (model"
            f" {r['target_pass_ms_per_round']:.2f}); {r['draft_tokens']} draft tokens in {r['rounds']} rounds,"
            f" {r['predraft_hits']} of {r['predrafts']} pre-drafts hit, {r['lost_draft_rounds']} rounds without their"
            f" draft; greedy output {'equal to' if r['greedy_equal'] else 'DIFFERS from'}"
            " the target's")


def table(report: dict) -> str:
    bw = report["copy_gbs"]
    lines = [f"{report['device']}, torch {report['torch']}, {report['dtype']}; copy {bw:.0f} GB/s (read + written)",
             "| pass | eager ms | graphed ms | roofline ms | x roofline (graphed) |", "| --- | --- | --- | --- | --- |"]
    for role in ("target", "draft"):
        r = report[role]
        roof = r["weight_bytes"] / (bw * 1e9) * 1e3
        name = report["shapes"][role]
        graphed = r.get("step_ms_graphs")
        lines.append(f"| {name} decode step | {r['step_ms_eager']:.2f} | {fmt(graphed)} | {roof:.2f} |"
                     f" {fmt(graphed and graphed / roof)} |")
        for k, ms in r["verify_ms"].items():
            tokens = f"{int(k) + 1} token{'s' if int(k) else ''}"
            graphed = r.get("verify_ms_graphs", {}).get(k)
            lines.append(f"| {name} pass of {tokens} | {ms:.2f} | {fmt(graphed)} | {roof:.2f} |"
                         f" {fmt(graphed and graphed / roof)} |")
    lines += ["", f"target alone: {report['target_alone']['tokens_per_s']:.1f} tok/s",
              "| draft | K | tok/s | acceptance (alpha) | tokens a round | round ms | draft ms (on model) | target ms"
              " (on model) | x target alone | ceiling tok/s | of ceiling | greedy = target's |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in report["system"] + ([report["eagle"]] if "tokens_per_s" in report.get("eagle", {}) else []):
        lines.append(f"| {r['draft']} | {r['k']} | {r['tokens_per_s']:.1f} | {r['acceptance_rate']:.3f}"
                     f" ({r['alpha']:.2f}) | {r['tokens_per_round']:.2f} | {r['round_ms']:.2f} |"
                     f" {r['draft_ms_per_round']:.2f} ({r['draft_pass_ms_per_round']:.2f}) |"
                     f" {r['target_ms_per_round']:.2f} ({r['target_pass_ms_per_round']:.2f}) |"
                     f" {r['x_target_alone']:.2f} | {r['ceiling_tokens_per_s']:.1f} | {r['of_ceiling']:.0%} |"
                     f" {'yes' if r['greedy_equal'] else 'NO'} |")
    if "tokens_per_s" in report.get("eagle", {}):
        lines.append(f"EAGLE-3 head: feature bytes a round {report['eagle']['feature_bytes_per_round']:,.0f}")
    if "hf" in report:
        hf = report["hf"]
        lines.append(f"HF generate: alone {hf['alone']['tokens_per_s']:.1f} tok/s, assisted by the same draft model"
                     f" (K = {report['k']}) {hf['assisted']['tokens_per_s']:.1f} tok/s; specdec with that draft at"
                     f" K = {report['k']}: {report['x_hf_assisted']:.2f}x HF assisted")
    return "\n".join(lines)


def fmt(ms: float | None) -> str:
    return "-" if ms is None else f"{ms:.2f}"


if __name__ == "__main__":
    main()
