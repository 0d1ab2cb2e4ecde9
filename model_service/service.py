"""Main body of a model service (draft_service, target_service): its flags, its engine (over a
model, or a drafting method that needs none) loaded off the event loop, idle sessions swept,
then served."""

from __future__ import annotations

import argparse
import asyncio
import logging
from collections.abc import Callable
from typing import Any

import grpc

from assets.models import MODELS
from runtime.cli import MAX_THREADS, EnvArgumentParser, number, setup_logging
from runtime.metrics import add_metrics_flag, start as start_metrics
from runtime.server import serve
from runtime.transport import server_credentials
from speculative.protocol import PassCost

from .batcher import Batching
from .metrics import ModelMetrics
from .servicer import ModelServicer
from .threads import ModelThread, ModelThreadStopped, resolve_threads, set_threads

log = logging.getLogger("specdec")

# a stopping service waits (through its grace) for the sessions used within this many seconds: a generation
# calls every round, one its coordinator left (gone, or its release lost) waits for the idle timeout instead
QUIET_WINDOW_S = 5.0


def shipped_model(role: str) -> str | None:
    """models/<role> (assets.models) where the checkout has it."""
    shipped = MODELS / role
    return str(shipped) if (shipped / "config.json").is_file() else None


def add_model_flags(parser: EnvArgumentParser, role: str, model_required: bool = True) -> None:
    """Model flags; --model defaults to the shipped models/<role> when the checkout has it (and is
    required otherwise, unless `model_required` is False: the service then checks it)."""
    default = shipped_model(role)
    parser.add_argument("--model", default=default, required=model_required and default is None,
                        help="local Hugging Face model directory (nothing is downloaded); "
                             f"default: the shipped models/{role}")
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:N (default: cuda when present)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="weights and activations dtype")
    parser.add_argument("--quantize", default="none", choices=["none", "int4"],
                        help="int4: weight-only int4 linears and output layer (CPU, lean forward, one rank), through"
                             " --int4-kernel: ~0.6 bytes a weight with its group's scale and zero (float32: 4), faster"
                             " passes where memory-bound (docs/performance.md). The service then serves that model"
                             " (its greedy output is the int4 model's)")
    parser.add_argument("--quant-group", type=int, default=32, choices=[32, 64, 128, 256],
                        help="inputs per int4 group (each has its own scale and zero)")
    parser.add_argument("--int4-kernel", default="auto", choices=["auto", "specdec", "torch"],
                        help="whose products run --quantize int4: specdec's (int8 activation blocks against the 4-bit"
                             " weights, GGUF Q4_1's float16 d and m; groups of 32; built for this CPU by make setup),"
                             " torch's (bf16 activations and scales), auto: specdec's where it is built and the groups"
                             " are 32. Each is its own model: greedy output may differ between them")
    parser.add_argument("--float-kernel", default="auto", choices=["auto", "specdec", "onednn"],
                        help="whose products run float32 weights on CPU: specdec's (the weights in panels streamed"
                             " once for every row of a pass, which then runs its layers in specdec's C++ loop; built"
                             " for this CPU by make setup), oneDNN's packed weights (and MKL's x @ w for one row where"
                             " faster), auto: specdec's where it is built. Elsewhere (a GPU, --dtype bfloat16 or"
                             " float16) torch's own run: auto there, the other two refused")
    parser.add_argument("--kv-dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"],
                        help="the sessions' keys and values: auto keeps them in --dtype, except with --quantize int4"
                             " through specdec's kernel, where they are float16 (half the bytes a pass reads from a long"
                             " context and half the memory; that int4 model's own output). float16 under float32 or"
                             " int4 weights runs where specdec's C++ layer loop does (a CPU, one rank); otherwise only"
                             " --dtype's own is taken")
    parser.add_argument("--cuda-graphs", default="on", choices=["on", "off"],
                        help="on a GPU, one session's passes of up to 17 tokens (a draft's steps, a target's decode"
                             " steps and verify passes) replay a CUDA graph per cache and pass length instead of"
                             " launching each kernel (model_service/cuda_graphs.py); lean float forward, one rank")
    parser.add_argument("--forward", default="auto", choices=["auto", "transformers"],
                        help="auto: the lean forward for Llama/Mistral/Qwen2 models, transformers' own for others;"
                             " transformers: always transformers' own")
    parser.add_argument("--threads", type=number(int, 0, MAX_THREADS), default=0,
                        help="torch intra-op threads for this process (0: by role: " + (
                            "the target takes every CPU this process may use" if role == "target" else
                            "1, the draft's small matrices gain little from more and leave the rest to the target")
                        + "; see default_threads)")
    parser.add_argument("--max-sessions", type=number(int, 1), default=256, help="sessions held at once")
    parser.add_argument("--session-idle-timeout", type=number(float, above=0), default=600.0,
                        help="seconds after which an idle (abandoned) session is evicted")
    parser.add_argument("--max-kv-tokens", type=number(int, 0), default=0,
                        help="cap on tokens held by all sessions together, beyond which calls get RESOURCE_EXHAUSTED"
                             " (0: only --max-sessions x the context)")
    parser.add_argument("--prefix-cache-mb", type=number(float, 0), default=256.0,
                        help="memory for the KV caches of finished requests' sessions, kept so that a later prompt"
                             " beginning with one's tokens (a chat's next turn: the last prompt, its answer and a new"
                             " message) takes that cache and computes only what is new; the least recently finished"
                             " dropped first, and first when --max-kv-tokens needs the room. 0: off. A target or a"
                             " draft model of one rank; the EAGLE head keeps its rows; the n-gram draft nothing")
    parser.add_argument("--max-context", type=number(int, 0), default=0,
                        help="cap on tokens per session (0: the model's max_position_embeddings)")
    parser.add_argument("--max-tokens-per-call", type=number(int, 1), default=16,
                        help="most draft tokens per round (K)")
    parser.add_argument("--kv-pool-capacity", type=number(int, 0), default=None,
                        help="the lean forward keeps sessions' KV caches as slots of one tensor, so a pass over"
                             " several sessions runs attention once per layer; the tensor holds slots x the longest"
                             " pooled session, at most this many positions (default 1024, kv_cache.POOL_CAPACITY);"
                             " a longer session moves to a cache of its own. 0: every session's cache on its own")
    parser.add_argument("--batched-threads", type=number(int, 0, MAX_THREADS), default=0,
                        help="torch threads for passes over several sessions (0: --threads; see"
                             " model_service.threads.default_threads)")
    parser.set_defaults(role=role)
    parser.add_argument("--max-queue", type=int, default=1024,
                        help="calls that may wait for the model; beyond, a call starting a session is refused"
                             " (RESOURCE_EXHAUSTED); a live session's next call is queued all the same")
    parser.add_argument("--max-batch", type=int, default=32,
                        help="most sessions per model pass (continuous batching; 1: one session at a time)")
    parser.add_argument("--batch-wait-ms", type=wait_ms, default="0.5" if role == "draft" else "auto",
                        help="when fewer calls wait than sessions are at work, wait up to this long for the others before a"
                             " pass (never with one session at work): ms, or auto, half the model's one-token pass as"
                             " calibrated at start-up, at most 8 ms (a pass that leaves them out makes them wait for a"
                             " pass of their own). Default: the draft 0.5 (the calls of a group of sessions verified"
                             " together come a moment apart), the target auto")
    parser.add_argument("--turn-wait-ms", type=float, default=3.0,
                        help="the longest a pass waits for the rest of a coordinator's lockstep turn (--lockstep): each of"
                             " its calls says which turn and how many calls it has; a pass serves one turn")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="ranks to shard the model over, placed by Ray (one GPU each on GPU machines, one CPU"
                             " each on CPU); rank 0 runs in this process")
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster for the tensor-parallel ranks (HOST:PORT of its head, or auto on one of its nodes);"
                             " default: a local Ray instance, started and stopped with the service")
    parser.add_argument("--tp-start-timeout", type=float, default=120.0,
                        help="seconds to wait for the ranks' placement, weights and process group")
    add_metrics_flag(parser)


async def sweep_idle_sessions(engine, thread: ModelThread, every: float = 30.0) -> None:
    """Evict abandoned sessions in the background (on the model thread, which owns them); a sweep that
    fails is logged, and the next one comes all the same (until the model thread has stopped)."""
    while True:
        await asyncio.sleep(every)
        try:
            evicted = await thread.run(engine.evict_idle)
        except ModelThreadStopped:
            return
        except Exception:  # noqa: BLE001 - a bug of the engine's: sessions would never be evicted again
            log.exception("evicting idle sessions failed")
            continue
        if evicted:
            log.info("evicted %d idle sessions", evicted)


AUTO_WAIT_SHARE = 0.5  # --batch-wait-ms auto: this share of the calibrated one-token pass...
AUTO_WAIT_MAX_MS = 8.0  # ...and at most this long


def wait_ms(text: str) -> float | str:
    """--batch-wait-ms: a number of ms, or auto."""
    if text == "auto":
        return text
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"a number of ms or auto, not {text!r}") from None


def auto_wait_ms(pass_cost: PassCost) -> float:
    """--batch-wait-ms auto's wait for a model whose passes cost `pass_cost` (ms): half its
    one-token pass, at most AUTO_WAIT_MAX_MS.

    The calls of the sessions a pass served come back a few ms apart (each through the
    coordinator, one after another). A pass that starts with the first of them leaves the rest
    to a pass of their own, and on a model whose extra rows cost little beside its weights' reads
    that pass costs nearly what the batch's would have: waiting part of a pass for them pays,
    waiting past the few ms they take does not. SmolLM2 on 2 cores, 8 streams, without drafting
    (16 requests of 64 tokens; with drafting in brackets): float32 (a pass ~40 ms) 82.8 (87.9)
    tokens/s without a wait, 144.1 (91.7) with 3 ms, 164.5 / 151.6 (129.1 / 145.9) with 8, 138.2
    (123.5) with 16; int4 (~4 ms) 250.5 (198.3) without, 340.7 (388.5) with 1 ms, 528.2 (327.3)
    with 2."""
    return min(AUTO_WAIT_MAX_MS, AUTO_WAIT_SHARE * pass_cost(1, 1))


def batching_from_args(args: argparse.Namespace) -> Batching:
    """--max-batch, --batch-wait-ms, --turn-wait-ms, --max-queue, checked with the flags' names
    (--batch-wait-ms auto: no wait until run_model_service has calibrated the model's passes)."""
    if args.max_batch < 1:
        raise SystemExit(f"--max-batch must be >= 1, not {args.max_batch}")
    batch_wait = 0.0 if args.batch_wait_ms == "auto" else args.batch_wait_ms
    for flag, value in (("--batch-wait-ms", batch_wait), ("--turn-wait-ms", args.turn_wait_ms)):
        if not 0 <= value <= 1000:  # also NaN
            raise SystemExit(f"{flag} must lie in [0, 1000], not {value}")
    if args.max_queue < 1:
        raise SystemExit(f"--max-queue must be >= 1, not {args.max_queue}")
    return Batching(args.max_batch, batch_wait / 1e3, args.turn_wait_ms / 1e3, args.max_queue)


def run_model_service(name: str, args: argparse.Namespace, make_servicer: Callable[..., ModelServicer],
                      add_to_server, service_name: str,
                      make_engine: Callable[[Callable[[], Any]], Any]) -> None:
    """Main body of a model service: load its engine off the event loop, then serve.

    make_servicer(thread, batching, metrics) -> the service's servicer; make_engine(load_model) ->
    its engine (drafting.py's "Serving"), on the model thread, where load_model() -> the
    ModelRunner of --model and the model flags, loaded and calibrated (a method that needs no
    model never calls it)."""
    setup_logging(args.log_level)
    # the flags first: a bad one fails before torch loads (~3 s)
    credentials = server_credentials(args)  # before the weights: a bad certificate path fails at once
    batching = batching_from_args(args)
    from .model_runner import ModelRunner

    resolve_threads(args)
    set_threads(args.threads)
    servicer = make_servicer(ModelThread(), batching, ModelMetrics())

    async def main() -> None:
        sweeper: asyncio.Task | None = None
        runner = None

        def load_model() -> ModelRunner:
            nonlocal runner
            runner = ModelRunner(args.model, args.device, args.dtype, args.max_sessions,
                                 args.session_idle_timeout, args.max_context or None, args.forward,
                                 args.tensor_parallel_size, args.ray_address, args.tp_start_timeout,
                                 args.kv_pool_capacity, getattr(args, "vocab_subset", 0),
                                 max_kv_tokens=args.max_kv_tokens, batched_threads=args.batched_threads,
                                 on_forward=servicer.thread.flush, quantize=args.quantize,
                                 quant_group=args.quant_group, int4_kernel=args.int4_kernel,
                                 float_kernel=args.float_kernel, cuda_graphs=args.cuda_graphs == "on",
                                 kv_dtype=args.kv_dtype, prefix_cache_mb=args.prefix_cache_mb)
            runner.calibrate()
            if args.batch_wait_ms == "auto":
                servicer.batcher.wait = auto_wait_ms(runner.pass_cost) / 1e3
            log.info("%s loaded %s (%d parameters) on %s, %s forward, quantization %s, %d threads (%d for batched"
                     " passes); pass %s; a pass waits up to %.2f ms for sessions at work", name, runner.name,
                     runner.num_parameters, runner.device, runner.forward_kind, runner.quantization, args.threads,
                     args.batched_threads, runner.pass_cost, servicer.batcher.wait * 1e3)
            return runner

        async def load() -> asyncio.Future:
            nonlocal sweeper
            engine = await servicer.thread.run(lambda: make_engine(load_model))
            servicer.engine = engine
            servicer.metrics.watch(engine.sessions, runner.kv_pool_positions if runner is not None else None,
                                   getattr(engine, "grammars", None),
                                   engine if hasattr(engine, "kept_positions") else None)  # (the EAGLE draft's rows)
            if runner is None:  # (a method that loads its own model, if any: an EAGLE head)
                info = engine.info()
                what = "no model"
                if info.get("num_parameters"):
                    what = (f"{info['model_name']} ({info['num_parameters']:,} parameters) on {info['device']},"
                            f" quantization {info.get('quantization') or 'none'}")
                log.info("%s serves %s: %s", name, info.get("draft_method") or "its engine", what)
            sweeper = asyncio.ensure_future(sweep_idle_sessions(engine, servicer.thread,
                                                                min(30.0, args.session_idle_timeout)))
            loop = asyncio.get_running_loop()
            broken = loop.create_future()  # NOT_SERVING for good: a tensor-parallel rank died, the model thread stopped

            def breaks(message: str) -> None:  # (from another thread)
                loop.call_soon_threadsafe(lambda: broken.done() or broken.set_result(message))

            servicer.thread.on_failure = breaks
            failed = servicer.thread.failed
            if failed is not None:  # (before it was told)
                breaks(f"its model thread stopped ({type(failed).__name__}: {failed})")
            if runner is not None and runner.tp is not None:
                from .tensor_parallel import watch

                watch(runner.tp, breaks)
            return broken

        def add(server: grpc.aio.Server) -> list[str]:
            add_to_server(servicer, server)
            return [service_name]

        start_metrics(servicer.metrics.registry, args.host, args.metrics_port)

        async def on_stop() -> None:
            if sweeper is not None:
                sweeper.cancel()
            if runner is not None:
                await servicer.thread.run(runner.close)

        def quiet() -> bool:  # no generation holds a session here (kept caches are no one's)
            return servicer.held_lately(QUIET_WINDOW_S) == 0

        await serve(name, args.host, args.port, add, load, on_stop, grace=args.shutdown_grace,
                    credentials=credentials, admits=servicer.admits, quiet=quiet)

    asyncio.run(main())
