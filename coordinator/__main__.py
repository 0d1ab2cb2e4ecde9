"""Run the coordinator: the public Generation API in front of a draft and a target service.

    python -m coordinator --draft 127.0.0.1:50052 --target 127.0.0.1:50051 --port 50050   # or: specdec coordinator ...

At start-up it waits for the target to be SERVING (--peer-timeout) and for a draft
replica up to --draft-wait s more (past them it serves without drafting until one is
ready), refuses a pair whose tokenizers or vocabularies differ, and loads the target's
tokenizer from the target service itself. Every flag can also be set from the environment
(SPECDEC_COORDINATOR_<FLAG>); see --help.

TLS, two sides (runtime/transport.py): --tls-cert / --tls-key / --tls-ca for the clients of
its public API, as on the model services; --peer-tls-ca / --peer-tls-cert / --peer-tls-key for its
own channels to the model services (the CA that signed their certificates, and the certificate
it presents where they require mutual TLS).

--http-port P serves the OpenAI-compatible HTTP API beside gRPC (coordinator/http.py), in the same
event loop, over the same pools, limits and metrics; TLS flags apply to it too. --api-key (or
SPECDEC_COORDINATOR_API_KEY, or --api-key-file) makes both front doors ask for
`Authorization: Bearer KEY` (runtime/auth.py); health checks stay open.

Health (grpc.health.v1): "" is SERVING from start-up until SIGTERM (liveness); specdec.v1.Generation only
while a request would be served, a target replica healthy (readiness; HTTP GET /health the same, 200 or 503).
"""

from __future__ import annotations

import asyncio
import logging
import signal

from specdec.v1 import specdec_pb2_grpc as pb_grpc
from runtime.auth import RequireApiKey, add_api_key_flags, api_key
from runtime.metrics import add_metrics_flag, start as start_metrics
from runtime.cli import PORT, EnvArgumentParser, add_common_flags, exit_process, number, setup_logging
from runtime.server import serve
from runtime.transport import MAX_REQUEST_BYTES, add_dial_flags, channel_credentials, server_credentials

from .metrics import CoordinatorMetrics
from .peers import GrpcDraft, GrpcTarget
from .pool import CLOSE_WAIT, DRAFT_WAIT, Pool, RecentLatency

log = logging.getLogger("specdec.coordinator")
DEFAULT_PORT = 50050


def parse_args(argv=None, prog: str = "python -m coordinator"):
    parser = EnvArgumentParser("SPECDEC_COORDINATOR", prog=prog, description=__doc__)
    add_common_flags(parser, DEFAULT_PORT)
    parser.add_argument("--draft", default="127.0.0.1:50052",
                        help="draft replicas: HOST:PORT entries, comma-separated; a name resolving to several"
                             " addresses (a headless Service) gives one replica each; file:PATH lists HOST:PORT lines")
    parser.add_argument("--target", default="127.0.0.1:50051", help="target replicas, as --draft")
    parser.add_argument("--resolve-every", type=float, default=10.0,
                        help="seconds between re-resolving --draft / --target (replicas come and go)")
    parser.add_argument("--num-speculative-tokens", default="auto",
                        help="K, draft tokens per round, when a request does not say: a number, or auto (chosen"
                             " per round from acceptance and measured costs, at most --adaptive-max-k)")
    parser.add_argument("--adaptive-max-k", type=int,
                        help="the most draft tokens adaptive K uses (default: 8 for a draft model; for a draft"
                             " that costs nothing per token, as the n-gram method, --max-speculative-tokens)")
    parser.add_argument("--draft-late-floor", type=number(float, above=0), default=RecentLatency.FLOOR,
                        help="seconds: the least a draft call is given before its round goes on without it (a"
                             " replica's bound is 4x its recent calls' 99th percentile, at least this): raise it"
                             " where a network's or a machine's stalls would make on-time calls late")
    parser.add_argument("--predraft", action="store_true",
                        help="while the target verifies a round, let the draft draft the next as if all were"
                             " accepted (PEARL's post-verify); kept when its guess holds, else rolled back")
    parser.add_argument("--lockstep", action="store_true",
                        help="let the generations' calls reach the models in turns (all drafts, then all"
                             " verifications) instead of pipelining them: for a draft and a target that share cores;"
                             " needs a fixed --num-speculative-tokens (the services serve each turn in one pass:"
                             " their --turn-wait-ms)")
    parser.add_argument("--lockstep-calls", choices=["batch", "each"], default="batch",
                        help="with --lockstep, a turn's calls to a service go as one batch RPC, or each as its own"
                             " call (as --peer-calls says)")
    parser.add_argument("--lockstep-hold-ms", type=number(float, most=1000, above=0), default=5.0,
                        help="with --lockstep, the longest a call waits for the generations not yet waiting")
    parser.add_argument("--decode-steps", type=number(int, 1), default=8,
                        help="a round that drafts nothing (K = 0) asks the target for up to this many tokens in one"
                             " call, a pass each, as many as ~100 ms of passes hold under adaptive K: the round trip is"
                             " paid once per call (1: a token per call; at most the target's tokens per call)")
    parser.add_argument("--target-lookup", type=number(int, 0), default=4,
                        help="each pass of such a call also verifies up to this many tokens the target copies from the"
                             " context, where its last 2-4 tokens occurred before (prompt lookup in the target; exact:"
                             " the tokens are still drawn from the target's p), so that a pass may commit several"
                             " (0: off)")
    parser.add_argument("--draft-p-min", type=float, default=0.0,
                        help="stop drafting at a token the draft gives less probability than this (0: off)")
    parser.add_argument("--max-speculative-tokens", type=int, default=16, help="largest K a request may ask for, and the most tokens one call asks the draft for (a --predraft call asks K + 1, cut to this)")
    parser.add_argument("--max-new-tokens", type=int, default=256,
                        help="new tokens per request when a request does not say")
    parser.add_argument("--peer-timeout", type=float, default=300.0,
                        help="seconds to wait at start-up for the target service to be SERVING")
    parser.add_argument("--draft-wait", type=number(float, 0, infinite=True), default=DRAFT_WAIT,
                        help="seconds to wait at start-up for a draft replica once the target is SERVING; past"
                             " them the coordinator serves without drafting, and drafts once one is ready (inf:"
                             " it serves only once one is)")
    parser.add_argument("--call-timeout", type=float, default=60.0,
                        help="deadline of each call to a model service, and 0.02 s more for each token a call feeds"
                             " (a long prompt's prefill)")
    parser.add_argument("--peer-calls", choices=["stream", "unary"], default="stream",
                        help="per-round calls to the model services: one stream per generation, or unary calls")
    add_dial_flags(parser, "peer-tls", "the draft and target services")
    parser.add_argument("--max-request-bytes", type=number(int, 1), default=MAX_REQUEST_BYTES,
                        help="largest request a client may send; gRPC refuses a larger one with RESOURCE_EXHAUSTED,"
                             " HTTP with 413")
    add_metrics_flag(parser)
    parser.add_argument("--http-port", type=PORT, default=0,
                        help="serve the OpenAI-compatible HTTP API (/v1/chat/completions, /v1/completions, /v1/models;"
                             " /health, /metrics) on this port, beside gRPC (0: off)")
    parser.add_argument("--store-responses", type=number(int, 0), default=None,
                        help="the most /v1/responses answers kept in this process's memory (`store`), for GET"
                             " /v1/responses/{id} and previous_response_id; the oldest are dropped first (0: none;"
                             " default 1000)")
    parser.add_argument("--store-responses-mb", type=number(float, above=0), default=None,
                        help="about the most MB of /v1/responses answers kept (their JSON: input items, output); the"
                             " oldest are dropped first (default 256)")
    add_api_key_flags(parser)
    args = parser.parse_args(argv)
    if args.num_speculative_tokens != "auto" and not args.num_speculative_tokens.isdigit():
        parser.error(f"--num-speculative-tokens must be a number >= 0 or auto, not {args.num_speculative_tokens!r}")
    if args.adaptive_max_k is not None and not 0 <= args.adaptive_max_k <= args.max_speculative_tokens:
        parser.error(f"--adaptive-max-k must lie in [0, --max-speculative-tokens={args.max_speculative_tokens}]")
    if not 0.0 <= args.draft_p_min <= 1.0:
        parser.error(f"--draft-p-min must lie in [0, 1], not {args.draft_p_min}")
    if args.lockstep and args.num_speculative_tokens == "auto":
        parser.error("--lockstep needs a fixed --num-speculative-tokens (4 suits the default pair): adaptive K's"
                     " cost model assumes pipelined services and picks K ~0.4-2.4 in lockstep, 0.65-0.75x of K = 4")
    if args.lockstep and args.predraft:
        parser.error("--lockstep and --predraft exclude each other: pre-drafting overlaps the two models")
    return args


def main(argv=None, prog: str = "python -m coordinator") -> None:
    args = parse_args(argv, prog)
    # imported once the flags have parsed: --help and a bad flag answer without loading the tokenizer's
    # libraries (transformers, and through it torch: ~4 s)
    from .generation import Coordinator, Limits
    from .http import STORE_BYTES, STORE_RESPONSES, HttpServer, app as http_app
    from .server import SERVICE_NAME, GenerationServicer

    setup_logging(args.log_level)
    credentials = server_credentials(args)
    peer_credentials = channel_credentials(args.peer_tls_ca, args.peer_tls_cert, args.peer_tls_key, "--peer-tls")
    key = api_key(args)

    def pool(name: str, spec: str, kind: type[GrpcDraft | GrpcTarget]) -> Pool:
        streaming = args.peer_calls == "stream"
        def peer(address: str, server_name: str | None) -> GrpcDraft | GrpcTarget:
            made = kind(address, args.call_timeout, streaming, peer_credentials, server_name)
            made.batch_turns = args.lockstep_calls == "batch"
            return made

        return Pool(name, spec, peer, args.resolve_every, late_floor=args.draft_late_floor if name == "draft" else None)

    async def run() -> None:
        draft, target = pool("draft", args.draft, GrpcDraft), pool("target", args.target, GrpcTarget)
        adaptive = args.num_speculative_tokens == "auto"
        k = args.adaptive_max_k if adaptive else int(args.num_speculative_tokens)
        limits = Limits(args.max_new_tokens, k, args.max_speculative_tokens, adaptive, args.draft_p_min, args.predraft,
                        args.lockstep_hold_ms if args.lockstep else 0.0, args.decode_steps, args.target_lookup)
        metrics = CoordinatorMetrics()
        coordinator = Coordinator(draft, target, limits, metrics)
        servicer = GenerationServicer(coordinator)
        start_metrics(metrics.registry, args.host, args.metrics_port)
        # SIGTERM / SIGINT stop both front doors at once; each gives its open calls --shutdown-grace
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            asyncio.get_running_loop().add_signal_handler(sig, stop.set)
        http = None
        if args.http_port:
            tls = (args.tls_cert, args.tls_key, args.tls_ca) if credentials is not None else None
            try:
                kept = STORE_RESPONSES if args.store_responses is None else args.store_responses
                kept_bytes = STORE_BYTES if args.store_responses_mb is None else int(args.store_responses_mb * 2**20)
                application = http_app(coordinator, key, args.max_request_bytes, kept, kept_bytes)
                http = HttpServer(application, args.host, args.http_port, args.shutdown_grace, tls)
            except OSError as e:
                raise SystemExit(f"coordinator: cannot serve HTTP on {args.host}:{args.http_port}: {e}") from e
            serving_http = asyncio.ensure_future(http.run(stop))
            log.info("OpenAI-compatible HTTP API on %s/v1", http.url)
            print(f"coordinator HTTP listening on {http.url} (OpenAI API: {http.url}/v1)", flush=True)

        async def load() -> None:
            await coordinator.connect(args.peer_timeout, args.draft_wait)
            drafting = f"draft {draft.reference.model_name} at {', '.join(draft.replicas)}" \
                if coordinator.ready().drafts else "no draft yet"
            log.info("%s, target %s at %s", drafting, target.reference.model_name, ", ".join(target.replicas))

        def add(server) -> list[str]:
            pb_grpc.add_GenerationServicer_to_server(servicer, server)
            return [SERVICE_NAME]

        async def on_stop() -> None:
            if http is not None:
                await serving_http
            await coordinator.close(CLOSE_WAIT)

        await serve("coordinator", args.host, args.port, add, load, on_stop, grace=args.shutdown_grace,
                    stop=stop, credentials=credentials, max_request_bytes=args.max_request_bytes,
                    interceptors=[RequireApiKey(key)] if key else [], readiness=coordinator.readiness)

    asyncio.run(run())


if __name__ == "__main__":
    exit_process(main())
