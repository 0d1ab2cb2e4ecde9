"""`make soak`: a bounded loopback load test. Many clients for a fixed time, mixed requests.

    python -m bench.soak [--clients 32] [--seconds 60] [--draft-model D --target-model T] [--chaos]
                         [--quantize int4] [--draft-method eagle --draft-model models/eagle]

Each client loops until the time is up, picking at random: a greedy request (its output must
equal the reference computed before the load), a greedy request with a long prompt (~--long-chars
characters of code, which the target feeds in parts beside the others' passes: --prefill-chunk;
checked against its reference too), a seeded sampled request, a stream it cancels after the first
chunk, or a request with a deadline too short to finish (DEADLINE_EXCEEDED or, if it did finish,
OK); a cancelled or deadline-bound request's prompt is a long one one time in three. Anything
else is an unexpected error. It reports requests by outcome, outputs checked, the resident memory
of every process at start and end, and the sessions the model services still hold afterwards, and
exits 1 on an unexpected error, a wrong output, a dead process or a leaked session.

--chaos: two draft and two target replicas, and while the load runs, every 0.5-3 s (seeded by
--seed) one replica of each kind is killed (SIGKILL, then started again at its address), hung
(SIGSTOP for 0.5-8 s, then SIGCONT; the coordinator's per-call deadline is 5 s) or restarted
(SIGTERM, then started again): one replica of a kind at a time, the next only once the
coordinator serves on it again, so the other always serves. No request may fail for it, and
every greedy output must still be the reference.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import threading
import time
from collections import Counter
from collections.abc import Callable

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.pair import add_pair_flags, pair_of  # noqa: E402
from coordinator.launch import LocalStack  # noqa: E402

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\n\nfor name in",
           "    return sorted(", "try:\n    value = int(text)\nexcept", "# parse the arguments\nparser ="]


def long_prompts(chars: int) -> list[str]:
    """Two long prompts of about `chars` characters each: PROMPTS' code again and again, in two orders."""
    out = []
    for order in (PROMPTS, PROMPTS[::-1]):
        text = ""
        for n in range(chars):
            if len(text) >= chars:
                break
            text += f"# part {n}\n{order[n % len(order)]}\n"
        out.append(text)
    return out


def rss_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def soak(addr: str, clients: int, seconds: float, new_tokens: int, seed: int,
               on_load: Callable[[], None] | None = None, long_chars: int = 1500) -> tuple[Counter, int, list[str]]:
    """The load; `on_load()` is called once the references are made, as the clients start."""
    import grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    outcomes: Counter = Counter()
    problems: list[str] = []
    checked = 0
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        reference = {}
        long = long_prompts(long_chars) if long_chars else []
        for p in PROMPTS + long:  # before the load, one at a time
            reply = await stub.Generate(pb.GenerateRequest(prompt=p, max_new_tokens=new_tokens, temperature=0.0))
            reference[p] = list(reply.token_ids)
        kinds = ["greedy", *(["long"] if long else []), "sampled", "cancel", "deadline"]
        end = time.monotonic() + seconds
        if on_load is not None:
            on_load()

        async def client(i: int) -> None:
            nonlocal checked
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < end:
                prompt, kind = rng.choice(PROMPTS), rng.choice(kinds)
                if kind == "long" or (kind in ("cancel", "deadline") and long and rng.random() < 1 / 3):
                    prompt = rng.choice(long)
                request = pb.GenerateRequest(prompt=prompt, max_new_tokens=new_tokens)
                if kind in ("greedy", "long"):
                    request.temperature = 0.0
                    if rng.random() < 0.5:
                        request.num_speculative_tokens = rng.randint(0, 8)
                else:
                    request.temperature, request.seed = 0.8, rng.getrandbits(32)
                try:
                    if kind == "cancel":
                        call = stub.GenerateStream(request, timeout=120)
                        async for _ in call:
                            break
                        call.cancel()
                        outcomes["cancelled by the client"] += 1
                        continue
                    timeout = 0.05 if kind == "deadline" else 120
                    reply = await stub.Generate(request, timeout=timeout)
                    outcomes[f"{kind}: OK"] += 1
                    if kind in ("greedy", "long"):
                        checked += 1
                        if list(reply.token_ids) != reference[prompt]:
                            problems.append(f"greedy output differs for {prompt!r} (K {request.num_speculative_tokens})")
                except grpc.aio.AioRpcError as e:
                    if kind == "deadline" and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                        outcomes["deadline: DEADLINE_EXCEEDED"] += 1
                    else:
                        outcomes[f"{kind}: {e.code().name}"] += 1
                        problems.append(f"{kind} request got {e.code().name}: {e.details()}")

        await asyncio.gather(*(client(i) for i in range(clients)))
    return outcomes, checked, problems


class Chaos:
    """Faults on `stack`'s replicas at random while the load runs (see the module's docstring):
    for draft and target each, a thread striking one replica at a time."""

    HANG_S = (0.5, 8.0)
    PAUSE_S = (0.5, 3.0)

    def __init__(self, stack: LocalStack, seed: int):
        self.stack, self.seed = stack, seed
        self.faults: Counter = Counter()
        self.restarts: Counter = Counter()  # name -> processes started in its place
        self.problems: list[str] = []
        self.done = threading.Event()
        self.threads = [threading.Thread(target=self._strike, args=(role,), daemon=True) for role in ("draft", "target")]

    def start(self) -> None:
        for thread in self.threads:
            thread.start()

    def stop(self) -> None:
        """End the faults: what is hung goes on, what is down is back, before this returns."""
        self.done.set()
        for thread in self.threads:
            if thread.ident is not None:
                thread.join()

    def _strike(self, role: str) -> None:
        rng = random.Random(f"{self.seed}-{role}")
        names = sorted(name for name in self.stack.addresses if name.split("-")[0] == role)
        while not self.done.wait(rng.uniform(*self.PAUSE_S)):
            name, fault = rng.choice(names), rng.choice(["kill", "hang", "restart"])
            proc = self.stack.procs[name]
            try:
                if fault == "kill":
                    proc.send_signal(signal.SIGKILL)
                    proc.wait(30)
                    self.stack.restart_replica(name)
                    self.restarts[name] += 1
                elif fault == "hang":
                    proc.send_signal(signal.SIGSTOP)
                    self.done.wait(rng.uniform(*self.HANG_S))
                    proc.send_signal(signal.SIGCONT)
                else:
                    self.stack.restart_replica(name)
                    self.restarts[name] += 1
                self.faults[f"{role} {fault}"] += 1
                self._wait_serving(self.stack.addresses[name])
            except Exception as e:  # reported: the soak fails
                self.problems.append(f"chaos: {fault} of {name} failed: {type(e).__name__}: {e}")
                return

    def _wait_serving(self, address: str, timeout: float = 60.0) -> None:
        """Until the coordinator serves on the replica at `address` again."""
        import grpc

        from specdec.v1 import specdec_pb2 as pb
        from specdec.v1 import specdec_pb2_grpc as pb_grpc

        deadline = time.monotonic() + timeout
        with grpc.insecure_channel(self.stack.addr) as channel:
            stub = pb_grpc.GenerationStub(channel)
            while time.monotonic() < deadline:
                replicas = stub.GetInfo(pb.GetInfoRequest(), timeout=10).replicas
                if any(r.address == address and r.state == "serving" for r in replicas):
                    return
                time.sleep(0.1)
        raise TimeoutError(f"the coordinator does not serve on {address} {timeout:.0f} s after the fault")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_flags(parser)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--long-chars", type=int, default=1500,
                        help="the long prompts' length in characters (0: no long prompts)")
    parser.add_argument("--quantize", default="", help="the target's --quantize (e.g. int4)")
    parser.add_argument("--draft-method", default="model", help="the draft service's method (eagle: --draft-model"
                                                                 " is the head's directory)")
    parser.add_argument("--chaos", action="store_true",
                        help="2 draft and 2 target replicas, killed, hung and restarted at random during the load")
    args = parser.parse_args(argv)

    replicas = 2 if args.chaos else 1
    stack = LocalStack(*pair_of(args), threads=args.threads, draft_replicas=replicas, target_replicas=replicas,
                       coordinator_args=["--call-timeout", "5"] if args.chaos else [], draft_method=args.draft_method,
                       target_args=["--quantize", args.quantize] if args.quantize else [])
    chaos = Chaos(stack, args.seed) if args.chaos else None
    with stack:
        before = {name: rss_mb(proc.pid) for name, proc in stack.procs.items()}
        start = time.monotonic()
        try:
            outcomes, checked, problems = asyncio.run(
                soak(stack.addr, args.clients, args.seconds, args.new_tokens, args.seed,
                     chaos.start if chaos is not None else None, args.long_chars))
        finally:
            if chaos is not None:
                chaos.stop()
        took = time.monotonic() - start
        after = {name: rss_mb(proc.pid) for name, proc in stack.procs.items()}
        alive = {name: proc.poll() is None for name, proc in stack.procs.items()}
        left = sessions_left(stack)
        said = service_log_lines(stack) if any(left.values()) else []
    if chaos is not None:
        problems += chaos.problems
    total = sum(outcomes.values())
    print(f"{args.clients} clients for {args.seconds:.0f} s ({took:.0f} s with the reference): {total} requests")
    for outcome, n in sorted(outcomes.items()):
        print(f"  {outcome:<32}{n:>6}")
    if chaos is not None:
        print(f"faults: {sum(chaos.faults.values())} ("
              + ", ".join(f"{kind} {n}" for kind, n in sorted(chaos.faults.items())) + ")")
    errors = Counter(outcome.split(": ")[1] for outcome in outcomes if ": " in outcome
                     and not outcome.endswith(": OK") and outcome != "deadline: DEADLINE_EXCEEDED")
    print("errors by status: " + (", ".join(f"{code} {n}" for code, n in sorted(errors.items())) or "none")
          + f" (and {outcomes['deadline: DEADLINE_EXCEEDED']} DEADLINE_EXCEEDED the deadline requests expect)")
    print(f"greedy outputs checked against the reference: {checked}, wrong: "
          f"{sum('differs' in p for p in problems)}")
    print(f"unexpected errors: {sum('differs' not in p for p in problems)}")
    for name in stack.procs:
        restarted = f"   (restarted {chaos.restarts[name]}x)" if chaos is not None and chaos.restarts[name] else ""
        print(f"  {name:<12} RSS {before[name]:7.1f} MB -> {after[name]:7.1f} MB   alive {alive[name]}{restarted}")
    print(f"sessions still held after the load: draft {left['draft']}, target {left['target']}")
    for p in problems[:10]:
        print("  problem:", p)
    for line in said:
        print("  log:", line)
    return 1 if problems or not all(alive.values()) or any(left.values()) else 0


def sessions_left(stack: LocalStack, settle: float = 15.0, most: float = 90.0) -> dict[str, int]:
    """Sessions the model services (every replica) still hold once every request has ended (a leak if
    not 0). Releases may still be on their way on a loaded machine (a late draft call's answer is
    awaited, then its session released: coordinator/failover.py): it waits while the count falls,
    and gives up once it has not fallen for `settle` s (or after `most` s in all)."""
    import grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    start = time.monotonic()
    fell_at, least = start, None
    while True:
        left = {"draft": 0, "target": 0}
        for name, addr in stack.addresses.items():
            role = name.split("-")[0]
            stub_class = pb_grpc.DraftStub if role == "draft" else pb_grpc.TargetStub
            with grpc.insecure_channel(addr) as channel:
                left[role] += stub_class(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=5).active_sessions
        now, total = time.monotonic(), sum(left.values())
        if least is None or total < least:
            fell_at, least = now, total
        if not total or now - fell_at > settle or now - start > most:
            return left
        time.sleep(0.2)


def service_log_lines(stack: LocalStack, most: int = 12) -> list[str]:
    """What the services logged at WARNING and above, and the coordinator's late drafts (the last
    `most` lines of each): a leaked session's failure report says what went on in the load."""
    lines = []
    for name, path in stack.logs.items():
        try:
            text = path.read_text(errors="replace").splitlines()
        except OSError:
            continue
        said = [line for line in text if " WARNING " in line or " ERROR " in line or " is late " in line]
        lines += [f"{name}: {line[:300]}" for line in said[-most:]]
    return lines


if __name__ == "__main__":
    raise SystemExit(main())
