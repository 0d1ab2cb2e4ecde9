"""Loads a local Hugging Face causal LM and runs it over per-session KV caches.

Shared by the draft and the target services. Any transformers causal LM that
works with `DynamicCache` is accepted; it is loaded from a local directory only
(nothing is downloaded). Llama, Mistral, Qwen2, Qwen3, Phi-3 and Granite models run on the lean
forward of `fast_forward` (same weights, same results, a fraction of the Python overhead);
others, or `forward="transformers"`, run on the model's own forward.
"""

from __future__ import annotations

import gc
import hashlib
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer, DynamicCache

from speculative.protocol import PassCost
from speculative.errors import InvalidRequest
from .fast_forward import DTYPES, FastForward, unsupported
from . import int4, q4_kernel
from .kv_cache import POOL_CAPACITY
from .loading import LoadMeter, describe, import_model_code, load_model, release_checkpoint_maps, return_freed_memory
from .sessions import Session, SessionTable, check_session_id
from .sharding import adopt_shard, check_shardable
from .threads import pass_threads

log = logging.getLogger("specdec")

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

FORWARDS = ("auto", "transformers")
BUSY_WINDOW = 0.5  # seconds: sessions used this recently count as at work (see forward_many)
PREFILL_TOKENS = 32  # a pass feeding this many tokens of one session runs on every thread


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def tokenizer_fingerprint(tokenizer) -> str:
    """sha256 of the id <-> token mapping (added and special tokens included)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    return hashlib.sha256(json.dumps(vocab, ensure_ascii=False).encode()).hexdigest()


def tokenizer_fields(tokenizer, logits_size: int) -> dict:
    """ModelInfo's pairing fields, by which the coordinator pairs a draft with a target: vocab_size
    (the ids the tokenizer can produce and a model `logits_size` wide can score) and
    tokenizer_fingerprint."""
    return {"vocab_size": min(len(tokenizer), logits_size), "tokenizer_fingerprint": tokenizer_fingerprint(tokenizer)}


FREE_ROWS = (0, 1, 2, 4, 8, 16)  # the free_rows fit_pass_cost tries


def fit_pass_cost(shapes: list[tuple[int, int]], times: list[float]) -> PassCost:
    """PassCost from timed passes, (sessions, tokens each) -> ms: least squares for each free_rows
    of FREE_ROWS (per_token counting the tokens past them), the one that fits best."""
    best = None
    y = torch.tensor(times, dtype=torch.float64)
    for free in FREE_ROWS:
        x = torch.tensor([[1.0, max(0.0, s * t - free), float(s), float(s * t > 1)] for s, t in shapes],
                         dtype=torch.float64)
        coef = torch.linalg.lstsq(x, y[:, None]).solution[:, 0].clamp(min=0.0)
        error = float(((x @ coef - y) ** 2).sum())
        if best is None or error < best[0] - 1e-9:
            best = (error, PassCost(*(float(v) for v in coef), free_rows=float(free)))
    return best[1]


def saved_tokenizer_files(tokenizer) -> list[tuple[str, bytes]]:
    """The tokenizer as save_pretrained writes it (GetTokenizer), so a peer can load the same one."""
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp)
        return [(f.name, f.read_bytes()) for f in sorted(Path(tmp).iterdir()) if f.is_file()]


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's; nothing to wait for on a CPU): timings need it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def fastest_ms(shapes: list, prepare: Callable, run: Callable, device: torch.device, reps: int) -> dict:
    """shape -> the fastest of `reps` timings of run(shape) in ms (prepare(shape) before each, untimed).

    Each shape runs once untimed first (a first call compiles: TorchScript, oneDNN's primitive for a
    shape), then every rep times each shape once, the shapes interleaved, and a shape keeps its
    fastest: a spell of contention (a service starting beside this one on the same cores) only adds
    time, and falls on one rep of several shapes rather than on all of one shape's (timed shape by
    shape, the median of 3, SmolLM2 float32 calibrated while another process computed on its 2 cores
    fitted a fixed cost of 563 ms against ~37)."""
    samples: dict = {shape: [] for shape in shapes}
    for rep in range(reps + 1):  # (rep 0: the untimed warm-up)
        for shape in shapes:
            prepare(shape)
            synchronize(device)
            start = time.perf_counter()
            run(shape)
            synchronize(device)
            if rep:
                samples[shape].append((time.perf_counter() - start) * 1e3)
    return {shape: min(times) for shape, times in samples.items()}


def mix_seed(seed: int) -> int:
    """A request's 64-bit seed, mixed (splitmix64's finalizer) so that every bit of it moves the
    generator: torch's CPU generator (mt19937) keeps only the low 32 bits of its seed, so seeds
    s, s + 2**32 and s + 2**63 would draw the same numbers."""
    mask = (1 << 64) - 1
    z = (seed + 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return z ^ (z >> 31)

QUANTIZATIONS = ("none", "int4")  # --quantize
KV_DTYPES = ("auto", "float32", "float16", "bfloat16")  # --kv-dtype


def kv_dtype_for(fast: FastForward, name: str) -> torch.dtype:
    """The KV caches' dtype for --kv-dtype `name`: auto is float16 where int4 weights run through
    specdec's C++ layer loop (their passes at long contexts read about as many bytes of keys and
    values as of weights: float16 halves those, 5-19% off a one-token pass of SmolLM2 at 1-2 k cached
    tokens on a 2-core AMD EPYC, level at 128, and the caches' memory; the int4 model with float16 keys and values
    is another int4 model, no worse: its int8 activations make any last-bit change move its logits
    ~2-7%), else the weights' dtype (float32 weights keep float32 caches: their greedy output is the
    checkpoint's, token for token). FastForward.set_kv_dtype refuses what the forward cannot read."""
    if name != "auto":
        return DTYPES[name]
    if fast.int4_kernel == "specdec" and fast.runs_c_loop():
        return torch.float16
    return fast.embed.dtype


class ModelRunner:
    """One model, its tokenizer and the sessions it serves."""

    def __init__(
        self,
        model_dir: str | Path,
        device: str | None = None,
        dtype: str = "float32",
        max_sessions: int = 256,
        idle_timeout: float = 600.0,
        max_context: int | None = None,
        forward: str = "auto",
        tensor_parallel: int = 1,
        ray_address: str | None = None,
        tp_timeout: float = 120.0,
        kv_pool_capacity: int | None = None,
        vocab_subset: int = 0,
        *,
        max_kv_tokens: int = 0,
        batched_threads: int = 0,
        on_forward: Callable[[], None] | None = None,
        quantize: str = "none",
        quant_group: int = 32,
        int4_kernel: str = "auto",
        float_kernel: str = "auto",
        cuda_graphs: bool = False,
        kv_dtype: str = "auto",
        prefix_cache_mb: float = 0.0,
    ):
        """vocab_subset N > 0 (a draft's only): score only the N most frequent ids of the model
        directory's draft_vocab.json (FastForward.restrict_head); every other id gets probability 0.
        max_kv_tokens: cap on tokens held by all sessions together (0: none but max_sessions);
        batched_threads: torch threads for passes over several sessions (0: the same as for one);
        on_forward: called as each forward starts (ModelThread.flush).
        quantize "int4": weight-only int4 in groups of quant_group inputs on the lean forward, CPU
        (int4.quantize), through int4_kernel's products (auto, specdec or torch); the
        service then runs that model.
        float_kernel: float32 on CPU through specdec's panels or oneDNN's packed weights (auto, specdec
        or onednn; FastForward.pack); on a GPU or in half precision torch's own (only auto is taken).
        cuda_graphs: on a GPU, one session's passes of up to 17 tokens replay CUDA graphs (cuda_graphs.py),
        where the forward is the lean float one of one rank.
        kv_dtype: the KV caches' dtype (KV_DTYPES): auto keeps them in the weights' dtype, except
        int4 weights through specdec's kernel, whose keys and values are float16 (kv_dtype_for).
        prefix_cache_mb: memory the caches of released sessions may keep for a later prompt that begins
        with their tokens (sessions.py's prefix reuse; 0: none; one rank only)."""
        if quantize not in QUANTIZATIONS:
            raise ValueError(f"--quantize must be one of {QUANTIZATIONS}, not {quantize!r}")
        if quantize != "none" and (forward != "auto" or tensor_parallel > 1):
            raise ValueError("--quantize int4 runs on the lean forward of one rank: --forward auto, no tensor parallelism")
        path = Path(model_dir)
        if not (path / "config.json").is_file():
            raise FileNotFoundError(f"{path} is not a model directory (no config.json)")
        if dtype not in DTYPES:
            raise ValueError(f"--dtype must be one of {sorted(DTYPES)}, not {dtype!r}")
        if float_kernel not in ("auto", "specdec", "onednn"):
            raise ValueError(f"--float-kernel must be auto, specdec or onednn, not {float_kernel!r}")
        if kv_dtype not in KV_DTYPES:
            raise ValueError(f"--kv-dtype must be one of {KV_DTYPES}, not {kv_dtype!r}")
        if forward not in FORWARDS:
            raise ValueError(f"--forward must be one of {FORWARDS}, not {forward!r}")
        if tensor_parallel < 1:
            raise ValueError(f"--tensor-parallel-size must be >= 1, not {tensor_parallel}")
        if tensor_parallel > 1 and forward != "auto":
            raise ValueError("tensor parallelism runs on the lean forward: --forward must be auto")
        self.name = path.resolve().name
        self.device = torch.device(device or default_device())
        self.dtype = DTYPES[dtype]
        self.tensor_parallel = tensor_parallel
        self.tp = None  # tensor_parallel.ShardedForward where tensor_parallel > 1
        placement = None
        if tensor_parallel > 1:
            from transformers import AutoConfig

            from .tensor_parallel import Placement

            # before Ray starts: a size that does not divide the model fails fast
            check_shardable(AutoConfig.from_pretrained(path, local_files_only=True), tensor_parallel)

            placement = Placement(tensor_parallel, self.device, ray_address, tp_timeout)
            self.device = placement.device
        try:
            self._load(path, max_context, forward, placement, dtype, kv_pool_capacity, float_kernel)
        except BaseException:
            if placement is not None and self.tp is None:
                placement.give_up("the model failed to load")
            raise
        self.head_ids = self._restrict_head(path, vocab_subset) if vocab_subset else None
        self.quantization = "none"
        if quantize == "int4":
            if self.fast is None:
                raise ValueError(f"--quantize int4 needs the lean forward, which {self.name} has not:"
                                 f" {unsupported(self.model.config, self.max_context)}")
            linears = 4 * len(self.fast.layers)
            from_blocks = int4.quantize(self.fast, quant_group, int4.read_q4_1_blocks(path), int4_kernel)
            kernel = (f"specdec's kernel ({q4_kernel.path()}), float16 d and m, int8 activation blocks"
                      if self.fast.int4_kernel == "specdec" else "torch's kernel, bf16 scales")
            self.quantization = f"int4 (weights in groups of {quant_group}, {kernel}" + (
                f"; {from_blocks} of {linears} layer linears from the GGUF's Q4_1 blocks as shipped)"
                if from_blocks else ")")
        self.kv_dtype = self.dtype
        if self.fast is not None and self.tp is None:
            self.kv_dtype = kv_dtype_for(self.fast, kv_dtype)
            self.fast.set_kv_dtype(self.kv_dtype)
        elif kv_dtype not in ("auto", dtype):
            raise ValueError(f"--kv-dtype {kv_dtype} needs the lean forward of one rank; this model keeps {dtype} keys"
                             " and values")
        if cuda_graphs and self.device.type == "cuda" and self.fast is not None and self.tp is None \
                and self.quantization == "none" and self.fast.rope_table is not None:
            self.fast.use_graphs()
            self.forward_kind += ", CUDA graphs for passes of up to 17 tokens"
        if self.tp is None and self.fast is not None and self.quantization == "none" \
                and self.fast.float_kernel in ("specdec", "onednn"):
            self.forward_kind += (", specdec's float32 panels" if self.fast.float_kernel == "specdec"
                                  else ", oneDNN's packed float32")
        if self.kv_dtype != self.dtype:
            self.forward_kind += f", {str(self.kv_dtype).removeprefix('torch.')} keys and values"
        release_checkpoint_maps(self.model)
        gc.collect()
        return_freed_memory()
        keep = 0
        if prefix_cache_mb > 0 and self.tp is None:
            try:
                keep = int(prefix_cache_mb * 2**20 // self.kv_position_bytes())
            except (AttributeError, TypeError, ZeroDivisionError) as e:  # (a config without attention's sizes)
                log.warning("--prefix-cache-mb: %s keeps no finished sessions' caches (%s)", self.name, e)
        self.sessions = SessionTable(max_sessions, idle_timeout, self.fast.new_cache if self.fast else DynamicCache,
                                     keep_positions=keep)
        self._tokenizer_files: list[tuple[str, bytes]] | None = None
        self.lock = threading.Lock()  # one forward at a time; sessions are touched under it
        self.max_kv_tokens = max_kv_tokens
        self.threads = torch.get_num_threads()
        self.batched_threads = batched_threads
        self.at_work = 0  # sessions used within BUSY_WINDOW, as of the last pass (read by other threads)
        self.pass_cost = PassCost()  # measured by calibrate() where a service wants it (adaptive K reads it)
        self.on_forward = on_forward

    def _load(self, path: Path, max_context: int | None, forward: str, placement, dtype: str,
              kv_pool_capacity: int | None, float_kernel: str = "auto") -> None:
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
        import_model_code(path)
        with LoadMeter() as meter:  # this rank's load (rank 0's where tensor-parallel)
            # tensor-parallel: rank 0's slices, on its device (or, from a checkpoint that is not
            # safetensors, the whole model, sharded in host memory before its shard goes to the device)
            loaded = load_model(path, self.dtype, self.device, 0, self.tensor_parallel)
            self.model = loaded.model
            if placement is None:
                self.model.to(self.device)
            config = self.model.config
            model_context = getattr(config, "max_position_embeddings", None) or 2048
            self.max_context = min(max_context or model_context, model_context)
            pool_capacity = POOL_CAPACITY if kv_pool_capacity is None else kv_pool_capacity
            # (tensor-parallel ranks pick their own float kernel: auto)
            kernel = float_kernel if loaded.world == 1 else "auto"
            self.fast = FastForward.build(self.model, self.max_context, pool_capacity, kernel) \
                if forward == "auto" else None
            if self.fast is not None and loaded.world > 1:
                adopt_shard(self.fast, loaded.world, loaded.logits_size)
        self.logits_size = loaded.logits_size
        pairing = tokenizer_fields(self.tokenizer, self.logits_size)
        self.vocab_size = pairing["vocab_size"]  # ids a tokenizer can produce and the model can score
        self.fingerprint = pairing["tokenizer_fingerprint"]
        self.eos_token_ids = self._eos_ids()
        self.num_parameters = loaded.num_parameters  # the whole model's, where this rank holds a shard
        self.forward_kind = "fast" if self.fast else "transformers"
        self.loads = [meter.record()]  # each rank's load: time and peak resident memory
        if placement is not None:
            if self.fast is None:
                raise placement.give_up(f"tensor parallelism needs the lean forward, which {config.model_type} lacks:"
                                        f" {unsupported(config, self.max_context)}")
            self.tp = placement.start(self.fast, path, dtype, self.max_context, torch.get_num_threads())
            self.fast = self.tp
            self.forward_kind = f"fast, tensor-parallel x{self.tensor_parallel}"
            self.loads += self.tp.loads
        log.info("%s: weights loaded: %s", self.name, describe(self.loads))

    def _restrict_head(self, path: Path, size: int) -> torch.Tensor:
        """The first `size` ids of path/draft_vocab.json (most frequent first), applied to the forward."""
        import json

        listing = path / "draft_vocab.json"
        if not listing.is_file():
            raise FileNotFoundError(f"--draft-vocab {size} needs {listing} (python -m training distill writes it)")
        ids = json.loads(listing.read_text())["ids"][:size]
        if not ids or max(ids) >= self.logits_size or min(ids) < 0:
            raise ValueError(f"{listing} lists ids outside the model's {self.logits_size} logits")
        head = torch.tensor(sorted(set(ids)), dtype=torch.long, device=self.device)
        if self.tp is not None:
            raise ValueError("--draft-vocab is not supported with tensor parallelism")
        if self.fast is not None:
            self.fast.restrict_head(head)
        return head

    def kv_position_bytes(self) -> int:
        """The bytes of keys and values one cached position holds (all layers)."""
        config = self.model.config
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        return config.num_hidden_layers * 2 * kv_heads * head_dim * torch.empty((), dtype=self.kv_dtype).element_size()

    def kv_pool_positions(self) -> int:
        """Positions this rank's KV pool has room for (slots x capacity), 0 without one."""
        fast = self.tp.fast if self.tp is not None else self.fast
        pool = getattr(fast, "pool", None)
        return pool.slots * pool.capacity if pool is not None else 0

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any."""
        if self.tp is not None:
            with self.lock:
                self.tp.close()

    @torch.inference_mode()
    def calibrate(self, context: int = 64, reps: int = 3) -> PassCost:
        """Time forward passes over scratch sessions (not in the table) and fit PassCost by least squares.

        Shapes: 1..16 sessions of 1..8 new tokens each, on `context` cached tokens, each run once
        untimed first: a first call compiles (TorchScript optimises the layer loop on its second
        run; oneDNN makes a primitive per shape), and on SmolLM2 timing it cold fitted a fixed cost
        of 35 ms and no jump past one row, against 23 and 7.6 warm, which made adaptive K draft
        where it did not pay. It takes a second or two on CPU; the coordinator's adaptive K reads
        the result. A context too short for `context` cached tokens and a shape's new ones after them
        (--max-context) calibrates on as many as fit; none fit: nothing is timed.
        """
        vocab = max(2, self.vocab_size)
        shapes = [(1, 1), (1, 2), (1, 4), (1, 8), (4, 1), (4, 5), (8, 1), (8, 5), (16, 1), (16, 3), (16, 8)]
        context = min(context, self.max_context - max(tokens for _, tokens in shapes))
        if context < 1:
            return self.pass_cost
        scratch = [Session(f"calibrate-{i}", self.sessions.new_cache(), torch.Generator()) for i in range(16)]
        for i, session in enumerate(scratch):
            session.tokens = [(7 * i + j) % vocab for j in range(context)]
        self.forward_many([(session, 1) for session in scratch])

        def prepare(shape: tuple[int, int]) -> None:  # the shape's sessions at `context`, then its new tokens
            for session in scratch[: shape[0]]:
                session.truncate(context)
                session.tokens.extend([1] * shape[1])

        times = fastest_ms(shapes, prepare, lambda shape: self.forward_many(
            [(session, shape[1]) for session in scratch[: shape[0]]]), self.device, reps)
        self.pass_cost = fit_pass_cost(shapes, [times[shape] for shape in shapes])
        return self.pass_cost

    def _eos_ids(self) -> list[int]:
        ids: set[int] = set()
        for source in (self.model.generation_config, self.model.config):
            eos = getattr(source, "eos_token_id", None)
            if eos is not None:
                ids.update([eos] if isinstance(eos, int) else eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(self.tokenizer.eos_token_id)
        return sorted(ids)

    def info(self) -> dict:
        return {
            "model_name": self.name,
            "vocab_size": self.vocab_size,
            "tokenizer_fingerprint": self.fingerprint,
            "max_context": self.max_context,
            "max_kv_tokens": self.max_kv_tokens,
            "eos_token_ids": self.eos_token_ids,
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "kv_dtype": str(self.kv_dtype).removeprefix("torch."),
            "quantization": self.quantization,
            "num_parameters": self.num_parameters,
            "logits_size": self.logits_size,
            "active_sessions": len(self.sessions),
            "max_sessions": self.sessions.max_sessions,
            **self.pass_cost.info(),
            "tensor_parallel_size": self.tensor_parallel,
            "rank_loads": self.loads,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
        }

    @property
    def hidden_size(self) -> int:
        return int(getattr(self.model.config.get_text_config(), "hidden_size", 0) or 0)

    @property
    def num_hidden_layers(self) -> int:
        """Decoder layers: the feature layers a session may ask for are 0 .. this - 1."""
        return int(getattr(self.model.config.get_text_config(), "num_hidden_layers", 0) or 0)

    def tokenizer_files(self) -> list[tuple[str, bytes]]:
        """saved_tokenizer_files, once."""
        if self._tokenizer_files is None:
            self._tokenizer_files = saved_tokenizer_files(self.tokenizer)
        return self._tokenizer_files

    # ------------------------------------------------------------ sessions

    check_session_id = staticmethod(check_session_id)

    def start_session(self, session_id: str, seed: int, prompt: list[int] | None = None,
                      feature_layers: tuple[int, ...] = ()) -> Session:
        """A new session; given its `prompt`, with a kept cache of a session whose tokens began as it does
        (sessions.py's prefix reuse: the prompt's first positions come cached; `feature_layers`: those its
        answers carry, SessionTable.reuse)."""
        if not session_id:
            raise InvalidRequest("session_id is empty")
        generator = torch.Generator(device=self.device)
        generator.manual_seed(mix_seed(seed))
        session = self.sessions.create(session_id, generator)
        if prompt:
            self.sessions.reuse(session, prompt, feature_layers)
        return session

    def check_tokens(self, tokens: list[int], what: str) -> None:
        bad = [t for t in tokens if not 0 <= t < self.logits_size]
        if bad:
            raise InvalidRequest(f"{what} token id {bad[0]} is outside the vocabulary [0, {self.logits_size})")

    def check_context(self, session_id: str, length: int, held: int = 0, pending: int = 0, sampled: int = 0) -> None:
        """Refuse a call that would grow a session (holding `held` tokens now) to `length` tokens
        past the context, or all sessions past max_kv_tokens; `pending`: tokens the calls already
        admitted to the same pass will add beyond what their sessions hold now (SessionTable.check_room)."""
        self.sessions.check_room(session_id, length, self.max_context, self.max_kv_tokens, held, pending, sampled)

    def forward(self, session: Session, num_logits: int = 1) -> torch.Tensor:
        """Feed the session's uncached tokens; return the last `num_logits` rows of logits.

        -> [num_logits, logits_size] float32. The session's tokens are all cached after.
        """
        return self.forward_many([(session, num_logits)])[0]

    @torch.inference_mode()
    def forward_many(self, feeds: list[tuple[Session, int]]) -> list[torch.Tensor]:
        """`forward` for several sessions (distinct ones) in one pass where the forward allows it.

        The lean forward batches them (one matrix multiply per weight for all their tokens);
        transformers' forward runs them one after another.
        """
        return self.forward_capturing(feeds, ())[0]

    @torch.inference_mode()
    def forward_capturing(self, feeds: list[tuple[Session, int]], capture: tuple[int, ...]
                          ) -> tuple[list[torch.Tensor], list[tuple[int, torch.Tensor]]]:
        """`forward_many`, and each session's hidden states at the `capture` layers (the input of
        decoder layer i, FastForward.many_capturing) for the tokens the pass fed it. -> (logits,
        per feed (the position of its first fed token, states [fed, len(capture), D]); none
        where capture is empty)."""
        news = []
        for session, num_logits in feeds:
            short = num_logits - (len(session.tokens) - session.cached)
            if short > 0:  # rows to score are already cached: step the cache back and re-feed them
                if short > session.cached:
                    raise InvalidRequest(f"cannot score {num_logits} positions of a {len(session.tokens)}-token session")
                session.cache.crop(-short)
                session.cached -= short
            news.append(session.tokens[session.cached :])
        self.at_work = self.sessions.recently_used(BUSY_WINDOW)
        if self.batched_threads:
            # a lone session's pass may use every thread only while it is the one session at work:
            # under load the other cores are busy (other sessions' drafts), and a pass whose
            # threads wait for a descheduled sibling at every op costs ~3x its time
            alone = len(feeds) == 1 and self.at_work <= 1
            # a prompt's products are big enough to share among threads even on busy cores (100
            # tokens: 36 ms on 1 thread, 22 on 2); a few rows per session are not
            prefill = max(map(len, news)) >= PREFILL_TOKENS
            pass_threads(self.threads if alone or prefill else self.batched_threads)
        if self.on_forward is not None:
            self.on_forward()
        starts = [session.cached for session, _ in feeds]
        states: list[tuple[int, torch.Tensor]] = []
        if self.fast is not None:
            passes = [(new, s.cache, n) for new, (s, n) in zip(news, feeds)]
            # (FastForward's, or a tensor-parallel target's rank 0: ShardedForward.many_capturing)
            logits, captured = self.fast.many_capturing(passes, capture)
            if capture:
                states = list(zip(starts, captured.split([len(new) for new in news])))
        else:
            logits = []
            for new, start, (session, num_logits) in zip(news, starts, feeds):
                input_ids = torch.tensor([new], dtype=torch.long, device=self.device)  # [1, S]
                out = self.model(input_ids=input_ids, past_key_values=session.cache, use_cache=True,
                                 logits_to_keep=num_logits, output_hidden_states=bool(capture))
                row = out.logits[0]
                if self.head_ids is not None:  # as the lean forward's restricted head: -inf elsewhere
                    row = torch.full_like(row, float("-inf")).index_copy_(1, self.head_ids, row[:, self.head_ids])
                logits.append(row)
                if capture:  # hidden_states[i]: the input of layer i, as the lean forward counts
                    states.append((start, torch.stack([out.hidden_states[i][0] for i in capture], dim=1)))
        for session, _ in feeds:
            session.cached = len(session.tokens)
        return [row.float() for row in logits], states


class Timer:
    """Milliseconds since construction: the `service_ms` a service reports."""

    def __init__(self) -> None:
        self.start = time.perf_counter()

    @property
    def ms(self) -> float:
        return (time.perf_counter() - self.start) * 1e3
