"""Distil a small draft for any local transformers causal LM, on the target's own answers.

    python -m training distill --target models/target --out models/draft
    python -m training distill --target DIR --out DIR --hidden 256 --layers 4 --generate-minutes 30 --steps 3000

Stages, each resumable from --work (default .cache/distill/<out's name>); the same command
starts and resumes the run, and a stage already done is skipped:

  prompts      instructions built from what is on the machine: the standard library's
               modules, functions and classes (their names and docstrings, read with `ast`,
               never imported), questions the target itself writes when asked for one about
               a subject (sampled, temperature 1), and everyday requests composed from
               templates (everyday.py: recipes, explanations, emails, code, advice). The benches'
               held-out chat prompts (assets/prompts.py) are dropped, compared case- and
               punctuation-blind (everyday.py leaves their topics out as well).
  generations  the target answers them through its chat template (on-policy data, as in
               DistillSpec): batches alternate greedy and temperature --temperature; at every
               answer position the target's --top-k most likely next tokens and their
               log-probabilities are kept (the soft labels), so training needs no target pass.
               Each batch is one shard file; --generate-minutes bounds the stage.
  train        the draft learns the target's next-token distribution on the answer positions:
               loss = -sum_v p(v) log q(v) over the target's top-k v (forward KL up to the
               target's entropy and the mass outside its top-k), with q over the ids the draft
               service will score (draft_vocab's recommended size: the training pass is as cheap
               as the served one, and q is trained as it is served). Its embedding (tied with the
               output layer) starts as the target's, projected on its first --hidden principal
               directions, so the draft starts in the target's output space. 2% of the answers
               are held out for the evaluations (greedy agreement: argmax q == argmax p).
  export       bf16 safetensors, the target's tokenizer and chat template, a model card with
               the figures, distill.json, and draft_vocab.json: the ids of the target's answers,
               most frequent first, with the smallest size that covers --vocab-coverage of them
               (the draft service's --draft-vocab auto scores only those: FR-Spec); with
               --acceptance, the acceptance rate of the pair in specdec's own round on the
               held-out bench prompts.
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import os
import random
import shutil
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tqdm import tqdm  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM  # noqa: E402

from assets.prompts import CHAT, HELD_OUT, normalized  # noqa: E402

from . import everyday, loop  # noqa: E402

REPO = Path(__file__).resolve().parent.parent

# Subjects the target is asked to write questions about (its own questions are the bulk of the prompts).
SUBJECTS = """
astronomy, planets, the moon, weather, climate, oceans, volcanoes, earthquakes, rivers, mountains, deserts, forests,
animals, dogs, cats, birds, insects, fish, dinosaurs, plants, gardening, trees, flowers, the human body, the heart,
the brain, sleep, nutrition, exercise, running, yoga, mental health, medicine, vaccines, first aid, cooking, baking,
bread, coffee, tea, vegetables, fruit, chocolate, restaurants, travel, Japan, Italy, Brazil, Egypt, Canada, India,
Paris, London, New York, airplanes, trains, cars, bicycles, electricity, magnets, light, sound, energy, batteries,
solar power, nuclear power, chemistry, atoms, water, air, fire, mathematics, algebra, geometry, statistics,
probability, prime numbers, fractions, history, ancient Rome, ancient Greece, the Middle Ages, the Renaissance,
the industrial revolution, world war two, the moon landing, inventions, famous scientists, philosophy, ethics,
psychology, economics, money, saving, budgeting, investing, taxes, business, marketing, job interviews, resumes,
careers, teamwork, leadership, public speaking, writing essays, poetry, novels, Shakespeare, grammar, vocabulary,
learning languages, Spanish, French, music, the piano, the guitar, painting, photography, movies, video games,
board games, chess, football, basketball, tennis, swimming, the Olympics, computers, the internet, smartphones,
programming, Python, JavaScript, databases, algorithms, sorting, recursion, data structures, machine learning,
artificial intelligence, cybersecurity, passwords, Linux, git, web development, HTML, CSS, spreadsheets, email,
time management, productivity, habits, friendship, parenting, pets, holidays, birthdays, weddings, gifts,
home repair, cleaning, recycling, the environment, pollution, architecture, bridges, space travel, robots
"""
QUESTION_STYLES = [
    "Write one question that someone might ask an AI assistant about {s}. Reply with the question only.",
    "Write one short request a user could give a helpful assistant, related to {s}. Reply with the request only.",
    "Ask a beginner's question about {s}. Reply with the question only.",
    "Write a question about {s} that needs a detailed answer. Reply with the question only.",
]
STDLIB_STYLES = [
    "What does the Python function `{name}` do?",
    "Show me a short example of how to use `{name}` in Python.",
    "Explain in plain words: \"{doc}\"",
    "When would I use `{name}` in a Python program?",
]
MODULE_STYLES = ["What is the Python `{module}` module used for?", "Give an overview of Python's `{module}` module."]


@dataclass(frozen=True)
class Config:
    target: Path
    out: Path
    work: Path
    hidden: int = 256
    layers: int = 4
    heads: int = 4
    kv_heads: int = 4
    ffn: int = 768
    stdlib_prompts: int = 2500
    own_questions: int = 4000
    requests: int = 2500  # everyday.py's
    question_tokens: int = 48
    new_tokens: int = 192
    batch: int = 48
    temperature: float = 0.8
    top_k: int = 16
    generate_minutes: float = 30.0
    generate_dtype: str = "bfloat16"  # the target's data pass: bf16 doubles its batch throughput where bf16 is native
    steps: int = 3000
    train_batch: int = 16
    lr: float = 2e-3
    warmup: int = 100
    heldout_share: float = 0.02
    vocab_coverage: float = 0.995
    seed: int = 0
    threads: int = 2


def log(msg: str) -> None:
    tqdm.write(f"[{time.strftime('%H:%M:%S')}] {msg}")


# ------------------------------------------------------------------ prompts


def first_line(doc: str | None) -> str:
    line = (doc or "").strip().split("\n\n")[0].replace("\n", " ")
    return " ".join(line.split())


def stdlib_items(enough: int, rng: random.Random) -> list[tuple[str, str, str]]:
    """(module, qualified name, docstring's first paragraph) for public functions and classes of
    the standard library, read from the source with `ast` (nothing is imported): files in a
    random order until `enough` items."""
    root = Path(sysconfig.get_paths()["stdlib"])
    items = []
    paths = sorted(root.rglob("*.py"))
    rng.shuffle(paths)
    for path in paths:
        if len(items) >= enough:
            break
        rel = path.relative_to(root)
        if any(p in ("site-packages", "test", "tests", "idle_test", "lib2to3", "__pycache__") or p.startswith("_")
               for p in rel.parts[:-1]) or rel.name.startswith("_") and rel.name != "__init__.py":
            continue
        module = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        items.append((module, "", first_line(ast.get_docstring(tree))))
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and not node.name.startswith("_"):
                items.append((module, f"{module}.{node.name}", first_line(ast.get_docstring(node))))
    return items


def stdlib_prompts(count: int, rng: random.Random) -> list[str]:
    items = stdlib_items(3 * count, rng)
    rng.shuffle(items)
    prompts = []
    for module, name, doc in items:
        if not name:
            prompts.append(rng.choice(MODULE_STYLES).format(module=module))
        else:
            style = rng.choice(STDLIB_STYLES if 20 <= len(doc) <= 200 else STDLIB_STYLES[:2] + STDLIB_STYLES[3:])
            prompts.append(style.format(name=name, doc=doc))
        if len(prompts) >= count:
            break
    return prompts


def subjects() -> list[str]:
    return [s.strip() for s in SUBJECTS.replace("\n", " ").split(",") if s.strip()]


def chat_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                              tokenize=True, return_dict=True)["input_ids"])


def clean_question(text: str) -> str | None:
    text = text.strip().strip('"').strip()
    line = text.split("\n")[0].strip().strip('"').strip()
    if not 12 <= len(line) <= 300 or line.lower().startswith(("sure", "here", "certainly")):
        return None
    return line


@torch.no_grad()
def own_questions(model, tokenizer, cfg: Config, rng: random.Random) -> list[str]:
    """Questions the target writes itself when asked for one about a subject (temperature 1)."""
    asks = [rng.choice(QUESTION_STYLES).format(s=s) for s in subjects()
            for _ in range(math.ceil(cfg.own_questions / len(subjects())))]
    rng.shuffle(asks)
    asks = asks[: cfg.own_questions]
    questions = []
    for i in tqdm(range(0, len(asks), cfg.batch), desc="questions", mininterval=10):
        rows = [chat_ids(tokenizer, a) for a in asks[i : i + cfg.batch]]
        for seq, _ in generate_batch(model, tokenizer, rows, cfg.question_tokens, 1.0, cfg.seed + i, top_k=0):
            q = clean_question(tokenizer.decode(seq, skip_special_tokens=True))
            if q:
                questions.append(q)
    return questions


def stage_prompts(cfg: Config, model, tokenizer) -> list[str]:
    path = cfg.work / "prompts.json"
    if path.exists():
        prompts = json.loads(path.read_text())
        log(f"prompts: done ({len(prompts)})")
        return prompts
    rng = random.Random(cfg.seed)
    from_stdlib = stdlib_prompts(cfg.stdlib_prompts, rng)
    log(f"prompts: {len(from_stdlib)} from the standard library; asking the target for {cfg.own_questions} questions")
    from_target = own_questions(model, tokenizer, cfg, rng)
    from_requests = everyday.requests(cfg.requests, cfg.seed)
    seen, prompts = set(HELD_OUT), []
    for p in from_stdlib + from_target + from_requests:
        key = normalized(p)
        if key not in seen:
            seen.add(key)
            prompts.append(p)
    rng.shuffle(prompts)
    path.write_text(json.dumps(prompts, indent=0))
    log(f"prompts: {len(prompts)} distinct ({len(from_target)} written by the target, {len(from_requests)} everyday"
        " requests), held-out bench prompts excluded")
    return prompts


# ------------------------------------------------------------------ generations


@torch.no_grad()
def generate_batch(model, tokenizer, rows: list[list[int]], new_tokens: int, temperature: float, seed: int,
                   top_k: int):
    """Left-padded batch through HF generate -> per row (answer ids up to and including EOS,
    (top ids [R, k], top log-probs [R, k]) of the target at each answer position, or None)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    width = max(len(r) for r in rows)
    input_ids = torch.tensor([[pad] * (width - len(r)) + r for r in rows])
    attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows])
    torch.manual_seed(seed)
    out = model.generate(
        input_ids=input_ids.to(model.device), attention_mask=attention.to(model.device), max_new_tokens=new_tokens,
        do_sample=temperature > 0, temperature=temperature if temperature > 0 else None, top_p=None, top_k=None,
        output_logits=top_k > 0, return_dict_in_generate=True, pad_token_id=pad,
    )
    answers = out.sequences[:, width:].cpu()  # [B, N]
    eos = set(model.generation_config.eos_token_id if isinstance(model.generation_config.eos_token_id, list)
              else [model.generation_config.eos_token_id])
    if top_k > 0:
        logits = torch.stack(out.logits, dim=1).float()  # [B, N, V]
        top_logp, top_ids = (t.cpu() for t in logits.log_softmax(-1).topk(top_k, dim=-1))
    results = []
    for b in range(len(rows)):
        ids = answers[b].tolist()
        end = next((i + 1 for i, t in enumerate(ids) if t in eos), len(ids))
        labels = (top_ids[b, :end].to(torch.int32), top_logp[b, :end].to(torch.float16)) if top_k > 0 else None
        results.append((ids[:end], labels))
    return results


def stage_generations(cfg: Config, model, tokenizer, prompts: list[str]) -> None:
    shards = cfg.work / "generations"
    shards.mkdir(parents=True, exist_ok=True)
    if (shards / "done.json").exists():
        log(f"generations: done ({json.loads((shards / 'done.json').read_text())})")
        return
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))  # similar lengths batch with less padding
    batches = [order[i : i + cfg.batch] for i in range(0, len(order), cfg.batch)]
    random.Random(cfg.seed + 1).shuffle(batches)
    model = model.to(getattr(torch, cfg.generate_dtype))
    start, tokens = time.monotonic(), 0
    bar = tqdm(total=len(batches), desc="generations", mininterval=10)
    for b, batch in enumerate(batches):
        path = shards / f"{b:05d}.pt"
        if path.exists():
            bar.update(1)
            continue
        if (time.monotonic() - start) / 60 > cfg.generate_minutes:
            log(f"generations: --generate-minutes {cfg.generate_minutes} reached at batch {b} of {len(batches)}")
            break
        temperature = cfg.temperature if b % 2 else 0.0
        rows = [chat_ids(tokenizer, prompts[i]) for i in batch]
        results = generate_batch(model, tokenizer, rows, cfg.new_tokens, temperature, cfg.seed + b, cfg.top_k)
        shard = [{"prompt": row, "answer": ans, "top_ids": lab[0] if lab else None,
                  "top_logp": lab[1] if lab else None, "temperature": temperature}
                 for row, (ans, lab) in zip(rows, results) if ans]  # (top_k 0: answers alone, no soft labels)
        tokens += sum(len(s["answer"]) for s in shard)
        torch.save(shard, path.with_suffix(".tmp"))
        os.replace(path.with_suffix(".tmp"), path)
        bar.update(1)
        bar.set_postfix(tok_s=f"{tokens / (time.monotonic() - start):.0f}", refresh=False)
    bar.close()
    summary = load_generations(cfg)
    info = {"sequences": len(summary), "answer_tokens": sum(len(s["answer"]) for s in summary),
            "minutes": round((time.monotonic() - start) / 60, 1)}
    (shards / "done.json").write_text(json.dumps(info))
    log(f"generations: {info}")


def load_generations(cfg: Config) -> list[dict]:
    rows = []
    for path in sorted((cfg.work / "generations").glob("*.pt")):
        rows.extend(torch.load(path, weights_only=False))
    return rows


# ------------------------------------------------------------------ the draft


def llama_rope(target_config, head_dim: int) -> dict:
    """The target's RoPE for a Llama layer of `head_dim` that rotates its whole heads (a draft, an EAGLE
    head): its rope_parameters, theta and scaling, less the part of each head it rotates (Phi-4-mini's
    partial_rotary_factor); only the theta (default RoPE) where its per-pair factors (longrope's) are for
    another number of pairs, or its RoPE is per layer type (Gemma 3's: the full-attention layers')."""
    rope = dict(getattr(target_config, "rope_parameters", None) or {})
    if rope and all(isinstance(v, dict) for v in rope.values()):
        rope = dict(rope.get("full_attention") or next(iter(rope.values())))
        log(f"the target's RoPE is per layer type: a layer of head_dim {head_dim} takes its full-attention"
            f" layers' theta {rope.get('rope_theta')}, no scaling")
        return {"rope_type": "default", "rope_theta": rope.get("rope_theta", 10000.0)}
    rope.setdefault("rope_theta", getattr(target_config, "rope_theta", None) or 10000.0)
    rope.pop("partial_rotary_factor", None)
    pairs = {len(rope[k]) for k in ("short_factor", "long_factor") if rope.get(k) is not None}
    if pairs - {head_dim // 2}:
        log(f"the target's {rope.get('rope_type')} factors are for {sorted(pairs)} pairs a head: a layer of head_dim"
            f" {head_dim} rotates with its theta {rope['rope_theta']} alone")
        return {"rope_type": "default", "rope_theta": rope["rope_theta"]}
    return rope


def draft_config(cfg: Config, target_config) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=target_config.vocab_size,
        hidden_size=cfg.hidden,
        intermediate_size=cfg.ffn,
        num_hidden_layers=cfg.layers,
        num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads,
        head_dim=cfg.hidden // cfg.heads,
        max_position_embeddings=target_config.max_position_embeddings,
        rope_parameters=llama_rope(target_config, cfg.hidden // cfg.heads),
        rms_norm_eps=getattr(target_config, "rms_norm_eps", 1e-5),
        tie_word_embeddings=True,
        bos_token_id=target_config.bos_token_id,
        eos_token_id=target_config.eos_token_id,
        pad_token_id=target_config.pad_token_id,
    )


def build_draft(cfg: Config, target) -> LlamaForCausalLM:
    """A fresh draft whose tied embedding is the target's projected on its first `hidden`
    principal directions (rescaled to the draft's initial norm)."""
    torch.manual_seed(cfg.seed)
    draft = LlamaForCausalLM(draft_config(cfg, target.config))
    embedding = target.get_input_embeddings().weight.detach().float()  # [V, D]
    centred = embedding - embedding.mean(0)
    _, _, v = torch.linalg.svd(centred[torch.randperm(len(centred))[:16384]], full_matrices=False)  # v: [D, D]
    projected = embedding @ v[: cfg.hidden].T  # [V, hidden]
    projected *= draft.get_input_embeddings().weight.std() / projected.std()
    draft.get_input_embeddings().weight.data.copy_(projected)
    return draft


def split(rows: list[dict], share: float) -> tuple[list[dict], list[dict]]:
    """(train, held out): every round(1/share)-th answer is held out."""
    every = max(2, round(1 / share))
    return [r for i, r in enumerate(rows) if i % every], [r for i, r in enumerate(rows) if not i % every]


def collate(rows: list[dict]) -> dict[str, torch.Tensor]:
    """Right-padded inputs and the soft labels at each answer position.

    ids [B, T]; labels at input position t predict token t+1: top_ids / top_logp [B, T, k],
    weight [B, T] (1 on the positions predicting an answer token)."""
    seqs = [r["prompt"] + r["answer"] for r in rows]
    width, k = max(len(s) for s in seqs) - 1, rows[0]["top_ids"].shape[1]
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    top_ids = torch.zeros(len(rows), width, k, dtype=torch.long)
    top_logp = torch.full((len(rows), width, k), -1e4)
    weight = torch.zeros(len(rows), width)
    for b, (r, s) in enumerate(zip(rows, seqs)):
        n, p = len(s) - 1, len(r["prompt"])
        ids[b, :n] = torch.tensor(s[:-1])
        a = len(r["answer"])
        top_ids[b, p - 1 : p - 1 + a] = r["top_ids"].long()
        top_logp[b, p - 1 : p - 1 + a] = r["top_logp"].float()
        weight[b, p - 1 : p - 1 + a] = 1
    return {"ids": ids, "top_ids": top_ids, "top_logp": top_logp, "weight": weight}


class Head:
    """The output layer as served: the draft's tied embedding rows of `ids` only (FR-Spec, see
    draft_vocab; all ids when None). Logits over them, and the target's top-k ids mapped to
    columns (-1 where the head does not score an id: that label's mass is dropped, as the
    draft can never propose it)."""

    def __init__(self, ids: torch.Tensor | None, vocab_size: int):
        self.ids = ids
        self.column = torch.full((vocab_size,), -1, dtype=torch.long)
        self.column[ids if ids is not None else torch.arange(vocab_size)] = torch.arange(
            len(ids) if ids is not None else vocab_size)

    def logits(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        """[B, T] -> [B, T, N] float32."""
        hidden = model.model(input_ids=input_ids).last_hidden_state  # [B, T, D]
        weight = model.lm_head.weight if self.ids is None else model.lm_head.weight[self.ids]  # [N, D]
        return (hidden @ weight.T).float()

    def labels(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """(columns [B, T, k] clamped to >= 0, target probabilities [B, T, k], 0 where not scored)."""
        columns = self.column[batch["top_ids"]]
        p = batch["top_logp"].exp() * (columns >= 0)
        return columns.clamp(min=0), p


def soft_loss(model, batch, head: Head | None = None) -> torch.Tensor:
    """-sum_v p(v) log q(v) over the target's top-k v the head scores, averaged over answer positions."""
    head = head or Head(None, model.config.vocab_size)
    logq = head.logits(model, batch["ids"]).log_softmax(-1)  # [B, T, N]
    columns, p = head.labels(batch)
    per_position = -(p * logq.gather(-1, columns)).sum(-1)  # [B, T]
    return (per_position * batch["weight"]).sum() / batch["weight"].sum()


@torch.no_grad()
def evaluate(model, heldout: list[dict], head: Head | None = None) -> dict:
    """greedy agreement (argmax q == the target's argmax) and sum_v min(p, q) over the target's
    top-k (a lower bound on 1 - TV, the acceptance of one sampled token) on held-out answers,
    with the output layer as served."""
    head = head or Head(None, model.config.vocab_size)
    agree = overlap = positions = 0.0
    for i in range(0, len(heldout), 8):
        batch = collate(heldout[i : i + 8])
        q = head.logits(model, batch["ids"]).softmax(-1)  # [B, T, N]
        columns, p = head.labels(batch)
        w = batch["weight"]
        top = columns[..., 0].masked_fill(p[..., 0] == 0, -1)  # the target's argmax, as a column (-1: not scored)
        agree += ((q.argmax(-1) == top).float() * w).sum().item()
        overlap += (torch.minimum(q.gather(-1, columns), p).sum(-1) * w).sum().item()
        positions += w.sum().item()
    return {"heldout_agreement": agree / positions, "heldout_overlap": overlap / positions}


def stage_train(cfg: Config, target) -> dict:
    ckpt = cfg.work / "train"
    if (ckpt / "result.json").exists() and json.loads((ckpt / "result.json").read_text())["steps"] >= cfg.steps:
        return json.loads((ckpt / "result.json").read_text())
    rows = load_generations(cfg)
    train_rows, heldout = split(rows, cfg.heldout_share)
    heldout = heldout[:96]
    draft = build_draft(cfg, target)
    vocab = draft_vocab(train_rows, target.config.vocab_size, cfg.vocab_coverage)
    size = vocab["recommended"]
    head = Head(torch.tensor(sorted(vocab["ids"][:size])) if size else None, target.config.vocab_size)
    log(f"train: {sum(p.numel() for p in draft.parameters()):,} parameters, {len(train_rows)} answers"
        f" ({sum(len(r['answer']) for r in train_rows):,} tokens), {len(heldout)} held out, {cfg.steps} steps;"
        f" output layer over {size or target.config.vocab_size:,} ids, as served")
    schedule = loop.Schedule(steps=cfg.steps, peak_lr=cfg.lr, warmup=cfg.warmup, batch=cfg.train_batch,
                             length=cfg.new_tokens)

    def sample(g: torch.Generator):
        picks = torch.randint(0, len(train_rows), (cfg.train_batch,), generator=g).tolist()
        return collate([train_rows[i] for i in picks])

    return loop.train("distill", draft, lambda m, batch: soft_loss(m, batch, head), lambda m: evaluate(m, heldout, head),
                      schedule, ckpt,
                      seed=cfg.seed, precision="bf16" if loop.bf16_is_fast() else "fp32",
                      checkpoint_minutes=3.0, eval_every=250, sample=sample)


# ------------------------------------------------------------------ export


def draft_vocab(rows: list[dict], vocab_size: int, coverage: float) -> dict:
    """The answers' token ids, most frequent first, and the smallest multiple of 1024 of them
    covering `coverage` of the answer tokens (`recommended`; 0 where that is the whole vocabulary)."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for r in rows:
        counts += torch.bincount(torch.tensor(r["answer"]), minlength=vocab_size)[:vocab_size]
    order = torch.argsort(counts, descending=True, stable=True)
    seen = int((counts > 0).sum())
    cumulative = counts[order].cumsum(0).double() / counts.sum()
    sizes = {n: round(float(cumulative[min(n, vocab_size) - 1]), 5) for n in (1024, 2048, 4096, 8192, 16384, 32768)
             if n < vocab_size}
    needed = int((cumulative < coverage).sum()) + 1
    recommended = min(vocab_size, -(-needed // 1024) * 1024)
    return {"ids": order[:seen].tolist(), "recommended": 0 if recommended >= vocab_size else recommended,
            "coverage_of_answer_tokens": sizes, "target_coverage": coverage, "answer_tokens": int(counts.sum())}



def stage_export(cfg: Config, target, tokenizer, result: dict, acceptance: bool) -> dict:
    draft = loop.load_trained(LlamaForCausalLM(draft_config(cfg, target.config)), cfg.work / "train")
    tmp = cfg.out.with_name(cfg.out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    draft.generation_config = target.generation_config
    draft.to(torch.bfloat16).save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    generations = json.loads((cfg.work / "generations" / "done.json").read_text())
    vocab = draft_vocab(split(load_generations(cfg), cfg.heldout_share)[0], target.config.vocab_size,
                        cfg.vocab_coverage)
    (tmp / "draft_vocab.json").write_text(json.dumps(vocab))
    info = {
        "target": str(cfg.target.name),
        "shape": {k: getattr(cfg, k) for k in ("hidden", "layers", "heads", "kv_heads", "ffn")},
        "parameters": sum(p.numel() for p in draft.parameters()),
        "generations": generations,
        "training": {k: result[k] for k in ("steps", "tokens_seen", "train_wall_s", "precision", "seed")},
        "final": {k: v for k, v in result["final"].items() if k.startswith("heldout")},
        "evals": result["evals"],
        "draft_vocab": {k: v for k, v in vocab.items() if k != "ids"},
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items() if k not in ("out", "work")},
    }
    (tmp / "distill.json").write_text(json.dumps(info, indent=1) + "\n")
    shutil.rmtree(cfg.out, ignore_errors=True)
    os.replace(tmp, cfg.out)
    if acceptance:
        from .acceptance import acceptance as measure

        prompts = [chat_ids(tokenizer, p) for p in CHAT]
        info["acceptance"] = measure(cfg.out, cfg.target, prompts, k=4, new_tokens=128,
                                     vocab_subset=vocab["recommended"])
    save_card(cfg.out, info)
    return info


def save_card(directory: Path, info: dict) -> None:
    """The draft's card: distill.json (its acceptance as measured, less the prompts' length) and, where
    it is the distiller's whole card, the README made from it."""
    if "acceptance" in info:
        info["acceptance"] = {k: v for k, v in info["acceptance"].items() if k != "prompt_tokens"}
    (directory / "distill.json").write_text(json.dumps(info, indent=1) + "\n")
    if {"shape", "generations", "training", "final"} <= info.keys():
        (directory / "README.md").write_text(model_card(info))


def model_card(info: dict) -> str:
    s, g, t, f = info["shape"], info["generations"], info["training"], info["final"]
    lines = [
        f"# Draft for {info['target']} (distilled by specdec)\n",
        f"Llama, {s['layers']} layers, hidden {s['hidden']}, {s['heads']} heads ({s['kv_heads']} KV), SwiGLU {s['ffn']},"
        f" the target's tokenizer and vocabulary, tied embeddings: {info['parameters']:,} parameters, bf16 in"
        " `model.safetensors`; where it is committed, as `model.safetensors.int8` (its matrices as int8 rows:"
        " `python -m assets.packed`), from which `make setup` writes `model.safetensors`.\n",
        "Made by `python -m training distill`: the target answered prompts built from the Python standard library"
        " and from questions it wrote itself (held-out bench prompts excluded), half greedy, half sampled;"
        " the draft learnt its top-k next-token distributions on those answers.\n",
        "| figure | value |\n|---|---|",
        f"| target answers | {g['sequences']:,} ({g['answer_tokens']:,} tokens, {g['minutes']} min) |",
        f"| training | {t['steps']} steps of {info['config']['train_batch']} answers, {t['train_wall_s'] / 60:.1f} min,"
        f" {t['precision']} autocast |",
        f"| held-out greedy agreement (argmax q = argmax p) | {f['heldout_agreement']:.3f} |",
        f"| held-out sum min(p, q) over the target's top-k | {f['heldout_overlap']:.3f} |",
    ]
    v = info.get("draft_vocab")
    if v and v["recommended"]:
        lines.append(f"| output layer served (`--draft-vocab auto`) | the {v['recommended']:,} most frequent answer ids"
                     f" ({100 * v['target_coverage']:.1f}% of answer tokens; q = 0 elsewhere, still exact) |")
    if "acceptance" in info:
        a = info["acceptance"]
        lines.append(f"| acceptance, K = {a['k']}, greedy, {a['prompts']} bench chat prompts x {a['new_tokens']} tokens"
                     f" | {a['acceptance_rate_pooled']:.3f} ({a['tokens_per_round']:.2f} tokens per round) |")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------ main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m training distill", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--target", type=Path, required=True, help="a local transformers causal LM directory")
    parser.add_argument("--out", type=Path, required=True, help="where the draft's directory is written")
    parser.add_argument("--work", type=Path, help="scratch and checkpoints (default .cache/distill/<out's name>)")
    for field in ("hidden", "layers", "heads", "kv_heads", "ffn", "stdlib_prompts", "own_questions", "requests",
                  "new_tokens", "batch", "top_k", "steps", "train_batch", "seed", "threads"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=int, default=Config.__dataclass_fields__[field].default)
    for field in ("temperature", "generate_minutes", "lr", "vocab_coverage"):
        parser.add_argument(f"--{field.replace('_', '-')}", type=float, default=Config.__dataclass_fields__[field].default)
    parser.add_argument("--generate-dtype", default=Config.generate_dtype, choices=["float32", "bfloat16"])
    parser.add_argument("--acceptance", action="store_true", help="measure the pair's acceptance at export")
    args = vars(parser.parse_args(argv))
    acceptance = args.pop("acceptance")
    args["work"] = args["work"] or REPO / ".cache" / "distill" / args["out"].name
    cfg = Config(**args)
    torch.set_num_threads(cfg.threads)
    cfg.work.mkdir(parents=True, exist_ok=True)
    log(f"distill: target {cfg.target}, out {cfg.out}, work {cfg.work}")
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    target = AutoModelForCausalLM.from_pretrained(cfg.target, dtype=torch.float32).eval()
    prompts = stage_prompts(cfg, target.to(getattr(torch, cfg.generate_dtype)), tokenizer)
    stage_generations(cfg, target, tokenizer, prompts)
    target = target.float()
    result = stage_train(cfg, target)
    info = stage_export(cfg, target, tokenizer, result, acceptance)
    log(f"export: {cfg.out}: greedy agreement {info['final']['heldout_agreement']:.3f}"
        + (f", acceptance K=4 {info['acceptance']['acceptance_rate_pooled']:.3f}" if "acceptance" in info else ""))


if __name__ == "__main__":
    main()
