"""`make soak`: a bounded loopback load test. Many clients for a fixed time, mixed requests.

    python -m bench.soak [--clients 32] [--seconds 60] [--draft-model D --target-model T]

Each client loops until the time is up, picking at random: a greedy request (its output must
equal the reference computed before the load), a seeded sampled request, a stream it cancels
after the first chunk, or a request with a deadline too short to finish (DEADLINE_EXCEEDED or,
if it did finish, OK). Anything else is an unexpected error. It reports requests by outcome,
outputs checked, the resident memory of every process at start and end, and the sessions the
model services still hold afterwards, and exits 1 on an unexpected error, a wrong output, a
dead process or a leaked session.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import time
from collections import Counter

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from bench.__main__ import add_pair_flags, pair_of  # noqa: E402
from coordinator.launch import LocalStack  # noqa: E402

PROMPTS = ["def fibonacci(n):", "class Stack:\n    def push(self, item):", "import os\n\nfor name in",
           "    return sorted(", "try:\n    value = int(text)\nexcept", "# parse the arguments\nparser ="]


def rss_mb(pid: int) -> float:
    try:
        for line in open(f"/proc/{pid}/status"):
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


async def soak(addr: str, clients: int, seconds: float, new_tokens: int, seed: int) -> tuple[Counter, int, list[str]]:
    import grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    outcomes: Counter = Counter()
    problems: list[str] = []
    checked = 0
    async with grpc.aio.insecure_channel(addr) as channel:
        stub = pb_grpc.GenerationStub(channel)
        reference = {}
        for p in PROMPTS:  # before the load, one at a time
            reply = await stub.Generate(pb.GenerateRequest(prompt=p, max_new_tokens=new_tokens, temperature=0.0))
            reference[p] = list(reply.token_ids)
        end = time.monotonic() + seconds

        async def client(i: int) -> None:
            nonlocal checked
            rng = random.Random(seed * 1000 + i)
            while time.monotonic() < end:
                prompt, kind = rng.choice(PROMPTS), rng.choice(["greedy", "sampled", "cancel", "deadline"])
                request = pb.GenerateRequest(prompt=prompt, max_new_tokens=new_tokens)
                if kind == "greedy":
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
                    if kind == "greedy":
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.soak", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_pair_flags(parser)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    stack = LocalStack(*pair_of(args), threads=args.threads)
    with stack:
        pids = {name: proc.pid for name, proc in stack.procs.items()}
        before = {name: rss_mb(pid) for name, pid in pids.items()}
        start = time.monotonic()
        outcomes, checked, problems = asyncio.run(
            soak(stack.addr, args.clients, args.seconds, args.new_tokens, args.seed))
        took = time.monotonic() - start
        after = {name: rss_mb(pid) for name, pid in pids.items()}
        alive = {name: stack.procs[name].poll() is None for name in pids}
        left = sessions_left(stack)
    total = sum(outcomes.values())
    print(f"{args.clients} clients for {args.seconds:.0f} s ({took:.0f} s with the reference): {total} requests")
    for outcome, n in sorted(outcomes.items()):
        print(f"  {outcome:<32}{n:>6}")
    print(f"greedy outputs checked against the reference: {checked}, wrong: "
          f"{sum('differs' in p for p in problems)}")
    print(f"unexpected errors: {sum('differs' not in p for p in problems)}")
    for name in pids:
        print(f"  {name:<12} RSS {before[name]:7.1f} MB -> {after[name]:7.1f} MB   alive {alive[name]}")
    print(f"sessions still held after the load: draft {left['draft']}, target {left['target']}")
    for p in problems[:10]:
        print("  problem:", p)
    return 1 if problems or not all(alive.values()) or any(left.values()) else 0


def sessions_left(stack: LocalStack, wait: float = 10.0) -> dict[str, int]:
    """Sessions the model services still hold once every request has ended (a leak if not 0)."""
    import grpc

    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    deadline = time.monotonic() + wait
    while True:
        left = {}
        for role, addr, stub_class in (("draft", stack.draft_addr, pb_grpc.DraftStub),
                                       ("target", stack.target_addr, pb_grpc.TargetStub)):
            with grpc.insecure_channel(addr) as channel:
                left[role] = stub_class(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=5).active_sessions
        if not any(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.2)


if __name__ == "__main__":
    raise SystemExit(main())
