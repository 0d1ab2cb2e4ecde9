"""The fault matrix's tools: stacks whose coordinator tells a hook every moment of every per-round
call (coordinator/peers.py, SPECDEC_FAULT_HOOK), the hook that strikes a service at the moment
armed (hook.py), and requests run side by side while it does.

A strike is one of
  kill     SIGKILL; healed by starting the service again at its address
  stop     SIGSTOP (the service hangs); healed by SIGCONT
  restart  SIGKILL, then a new service at the same address, SERVING before the call goes on
"""

from __future__ import annotations

import signal
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from coordinator.launch import LocalStack
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc

from .hook import FaultHook, freezer, wait_until

PROMPT = [5, 17, 42, 9, 100, 3]
NEW_TOKENS = 40
CALL_TIMEOUT = 3.0  # the coordinator's per-call deadline in these stacks: what catches a hung target


@dataclass
class Outcome:
    """One request's stream: its tokens, its last chunk (None if it failed) or its error."""

    greedy: bool
    tokens: list[int] = field(default_factory=list)
    last: pb.GenerateChunk | None = None
    error: grpc.RpcError | None = None
    seconds: float = 0.0


class FaultStack:
    """A LocalStack (`replicas` drafts and as many targets) whose coordinator calls its models by
    `path` (stream, unary or lockstep batches) and tells `hook` every moment of every call."""

    def __init__(self, pair, replicas: int, path: str, call_timeout: float = CALL_TIMEOUT):
        self.replicas, self.path = replicas, path
        self.dir = Path(tempfile.mkdtemp(prefix="specdec-faults-"))
        self.hook = FaultHook(self.dir / "hook.sock")
        args = ["--num-speculative-tokens", "2", "--call-timeout", str(call_timeout),
                "--peer-calls", "unary" if path == "unary" else "stream", *(["--lockstep"] if path == "lockstep" else [])]
        draft, target = pair
        self.stack = LocalStack(draft, target, draft_replicas=replicas, target_replicas=replicas, log_dir=self.dir,
                                coordinator_args=args, coordinator_env={"SPECDEC_FAULT_HOOK": self.hook.path})
        self.stack.start()
        self.channel = grpc.insecure_channel(self.stack.addr)
        self.stub = pb_grpc.GenerationStub(self.channel)
        # lockstep batches need several generations in a turn: two per replica
        self.concurrency = 2 * replicas if path == "lockstep" else 2
        self.reference = self.faultless()

    # ------------------------------------------------------------ requests

    def requests(self) -> list[pb.GenerateRequest]:
        """Half greedy, half sampled (seeded), side by side."""
        out = []
        for i in range(self.concurrency):
            sampling = dict(temperature=0.0) if i % 2 == 0 else dict(temperature=1.0, top_p=0.95, seed=7 + i)
            out.append(pb.GenerateRequest(prompt_token_ids=PROMPT, max_new_tokens=NEW_TOKENS, **sampling))
        return out

    def stream(self, request: pb.GenerateRequest) -> Outcome:
        outcome, start = Outcome(request.temperature == 0.0), time.monotonic()
        try:
            for chunk in self.stub.GenerateStream(request, timeout=120):
                outcome.tokens += chunk.token_ids
                if chunk.HasField("stats"):
                    outcome.last = chunk
        except grpc.RpcError as e:
            outcome.error = e
        outcome.seconds = time.monotonic() - start
        return outcome

    def run(self) -> list[Outcome]:
        requests = self.requests()
        with ThreadPoolExecutor(len(requests)) as pool:
            return list(pool.map(self.stream, requests))

    def faultless(self) -> list[int]:
        outcomes = self.run()
        greedy = [o.tokens for o in outcomes if o.greedy and o.error is None]
        assert len(greedy) == len([o for o in outcomes if o.greedy]), [o.error for o in outcomes]
        assert all(tokens == greedy[0] for tokens in greedy) and len(greedy[0]) == NEW_TOKENS
        return greedy[0]

    # ------------------------------------------------------------ strikes and healing

    def name_of(self, address: str) -> str:
        return next(name for name, a in self.stack.addresses.items() if a == address)

    def strike(self, fault: str, address: str) -> None:
        proc = self.stack.procs[self.name_of(address)]
        if fault == "kill":
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        elif fault == "stop":
            freezer(proc)(address)
        else:  # restart: the call goes on against a new process at the old address
            self.stack.restart_replica(self.name_of(address), sig=signal.SIGKILL)

    def heal(self, fault: str, address: str) -> None:
        """Bring the struck service back (the coordinator is not touched)."""
        name = self.name_of(address)
        if fault == "kill":
            self.stack.restart_replica(name)
        elif fault == "stop":
            self.stack.procs[name].send_signal(signal.SIGCONT)

    def settle(self) -> None:
        """Wait until the coordinator serves on every replica again and no service holds a session."""
        def serving() -> bool:
            replicas = self.stub.GetInfo(pb.GetInfoRequest(), timeout=5).replicas
            return all(r.state == "serving" for r in replicas) and len(replicas) == 2 * self.replicas

        wait_until("every replica serving", serving)
        wait_until("every session released", lambda: not any(self.sessions().values()), timeout=20)

    def sessions(self) -> dict[str, int]:
        held = {}
        for name, address in self.stack.addresses.items():
            stub_class = pb_grpc.DraftStub if name.startswith("draft") else pb_grpc.TargetStub
            with grpc.insecure_channel(address) as channel:
                held[name] = stub_class(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=5).active_sessions
        return held

    def close(self) -> None:
        self.channel.close()
        self.stack.stop()
        self.hook.close()


class Stacks:
    """One FaultStack at a time, kept while consecutive tests ask for the same kind."""

    def __init__(self, pair):
        self.pair = pair
        self.current: FaultStack | None = None

    def get(self, replicas: int, path: str) -> FaultStack:
        if self.current is not None and (self.current.replicas, self.current.path) != (replicas, path):
            self.close()
        if self.current is None:
            self.current = FaultStack(self.pair, replicas, path)
        return self.current

    def close(self) -> None:
        if self.current is not None:
            self.current.close()
            self.current = None


@pytest.fixture(scope="package")
def stacks(pair):
    made = Stacks(pair)
    yield made
    made.close()
