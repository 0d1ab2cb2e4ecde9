"""Pools of draft and target replicas: discovery, health, and pinning by least outstanding work.

A pool is given as `--draft` / `--target`: comma-separated HOST:PORT entries. Each entry is
resolved (a Kubernetes headless Service name resolves to one address per ready pod), or
`file:PATH` names a file listing HOST:PORT lines; both are re-read every `resolve_every`
seconds, so replicas added or removed are picked up without a restart. Every replica is
health-checked (grpc.health.v1) every `check_every` seconds; one that fails gets no new
requests. A replica joining must serve the same model as the pool's first one (name,
parameters, tokenizer fingerprint) within the limits the coordinator read from it (`unlike`);
one that does not is refused and logged. Over TLS, a replica
found by resolving a name must present a certificate for that name (not for its IP).

Each request leases one draft and one target replica for its whole life (their KV caches
hold its state): the healthy replica with the fewest requests in flight, unless one held most of
its prompt. Each finished request's tokens are noted (`PrefixAffinity`); a request whose prompt's
first half or more began a noted sequence goes to that sequence's replica, where its cache is kept
(model_service/sessions.py's prefix reuse: a chat's next turn), while that replica has at most
AFFINITY_SLACK more requests in flight than the least busy one.

Each replica also keeps its recent per-round call times (`RecentLatency`): a draft call that
takes much longer than they say is late, and the round goes on without it (coordinator/failover.py).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import socket
from collections import OrderedDict, deque
from collections.abc import Callable, Collection
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specdec.v1 import specdec_pb2 as pb

from .peers import Peer, PeerError

log = logging.getLogger("specdec.pool")


class RecentLatency:
    """A replica's recent per-round call times, and how long a call may take before it is late:
    TIMES x their 99th percentile, at least `floor` s (FLOOR: the coordinator's --draft-late-floor). A call
    that starts a session carries the whole prefix, and its prefill grows with it: starts are timed per
    prefix token, and their bound is for the prefix at hand. Until a kind has MIN_CALLS calls, its bound
    is FIRST s (or the floor, where that is longer)."""

    WINDOW = 100
    MIN_CALLS = 8
    TIMES = 4.0
    FLOOR = 0.05
    FIRST = 1.0

    def __init__(self, floor: float | None = None):
        self.floor = self.FLOOR if floor is None else floor
        self.starts: deque[float] = deque(maxlen=self.WINDOW)  # seconds per prefix token
        self.steps: deque[float] = deque(maxlen=self.WINDOW)   # seconds

    def add(self, seconds: float, start: bool, prefix: int) -> None:
        if start:
            self.starts.append(seconds / max(prefix, 1))
        else:
            self.steps.append(seconds)

    def bound(self, start: bool, prefix: int) -> float:
        """Seconds past which a call (of a session start with `prefix` tokens) is late."""
        times = self.starts if start else self.steps
        if len(times) < self.MIN_CALLS:
            return max(self.FIRST, self.floor)
        p99 = sorted(times)[int(0.99 * (len(times) - 1))]
        return max(self.floor, self.TIMES * p99 * (max(prefix, 1) if start else 1))


DRAFT_WAIT = 30.0  # s: how long a starting coordinator waits for a draft replica once the target is ready
CLOSE_WAIT = 5.0  # s: how long a stopping coordinator waits for its generations' session releases
CHECK_TIMEOUT = 2.0  # s: a health check's deadline (the channel's (re)connection included)
AFFINITY_BLOCK = 32  # tokens a prompt is hashed in (each block's hash covers the blocks before it too)
AFFINITY_ENTRIES = 1 << 16  # block hashes noted at most, the least recently noted dropped first
AFFINITY_SLACK = 2  # requests in flight a replica holding a prompt's prefix may have beyond the least busy one's


class PrefixAffinity:
    """Which replica last held a sequence that began with these tokens: each finished request's
    sequence noted as the hashes of its first 32, 64, ... tokens, so that a request whose prompt
    continues one (a chat's next turn) can go where that sequence's cache is kept."""

    def __init__(self, entries: int = AFFINITY_ENTRIES):
        self.entries = entries
        self.where: OrderedDict[int, str] = OrderedDict()  # block hash -> replica address

    @staticmethod
    def hashes(tokens: list[int]) -> list[int]:
        out, running = [], 0
        for end in range(AFFINITY_BLOCK, len(tokens) + 1, AFFINITY_BLOCK):
            running = hash((running, tuple(tokens[end - AFFINITY_BLOCK : end])))
            out.append(running)
        return out

    def note(self, tokens: list[int], address: str) -> None:
        for key in self.hashes(tokens):
            self.where[key] = address
            self.where.move_to_end(key)
        while len(self.where) > self.entries:
            self.where.popitem(last=False)

    def find(self, tokens: list[int]) -> tuple[str, int] | None:
        """(the replica, how many first tokens of `tokens` it held) for the longest noted prefix, or None."""
        for blocks, key in reversed(list(enumerate(self.hashes(tokens), 1))):
            if key in self.where:
                return self.where[key], blocks * AFFINITY_BLOCK
        return None


class Replica:
    def __init__(self, peer: Peer, late_floor: float | None = None):
        self.peer = peer
        self.healthy = False
        self.outstanding = 0  # requests leased now
        self.served = 0       # requests leased ever
        self.refused = ""     # why it may not serve (another model), if so
        self.why = ""         # why its last health check failed (a refused connection, a TLS handshake), if it did
        self.removed = False  # no longer discovered: drains, then closes
        self.recent = RecentLatency(late_floor)
        self.missed = 0       # late calls in a row (see failover.FailoverDraft)

    @property
    def address(self) -> str:
        return self.peer.address

    @property
    def state(self) -> str:
        if self.refused:
            return "refused"
        if self.removed:
            return "draining"
        return "serving" if self.healthy else "unhealthy"


def same_model(a: pb.ModelInfo, b: pb.ModelInfo) -> bool:
    return (a.model_name, a.num_parameters, a.tokenizer_fingerprint, a.vocab_size) == (
        b.model_name, b.num_parameters, b.tokenizer_fingerprint, b.vocab_size)


def _under(limit: int, pools: int) -> bool:
    """Whether a replica's limit is under the pool's, 0 meaning none (no limit)."""
    return limit != 0 and (pools == 0 or limit < pools)


def _weights(info: pb.ModelInfo) -> str:
    """What a target computes with (--quantize, --dtype, --kv-dtype), less the instruction set its int4
    kernel was compiled for (AVX-512 and AVX2 builds compute the same products)."""
    kind = re.sub(r"kernel [(][^()]*[)]", "kernel", info.quantization or "none")
    kv = info.kv_dtype or info.dtype  # (a service that does not say: as its weights)
    return f"{kind}, {info.dtype}" + (f", {kv} keys and values" if kv != info.dtype else "")


def unlike(info: pb.ModelInfo, pool: pb.ModelInfo) -> str:
    """Why a replica answering `info` may not serve in a pool whose first replica answered `pool`
    ("" if it may). The coordinator reads its limits once, from that first replica, and admits
    requests and sizes rounds by them; a request leased to a replica that takes less would fail
    there (a target) or lose its draft (a draft). So a replica must serve the pool's model, with a
    context, a KV-token cap and a call at least as long, and (a draft) read the target layers the pool's draft
    reads. A target's weights must be quantized as the pool's are, in the same dtype, over caches
    of the same dtype: an int4 replica's greedy output is not the float one's, nor on float32
    caches what it is on float16 ones."""
    if not same_model(info, pool):
        return (f"serves {info.model_name!r} ({info.num_parameters} parameters, tokenizer "
                f"{info.tokenizer_fingerprint[:12]}), not the pool's {pool.model_name!r} ({pool.num_parameters}, "
                f"{pool.tokenizer_fingerprint[:12]})")
    problems = []
    if _under(info.max_context, pool.max_context):
        problems.append(f"its context is {info.max_context} tokens, the pool's {pool.max_context} (--max-context)")
    if _under(info.max_kv_tokens, pool.max_kv_tokens):
        problems.append(f"it holds at most {info.max_kv_tokens} tokens, the pool's "
                        + (f"{pool.max_kv_tokens}" if pool.max_kv_tokens else "any number") + " (--max-kv-tokens)")
    if _under(info.max_tokens_per_call, pool.max_tokens_per_call):
        problems.append(f"it takes at most {info.max_tokens_per_call} tokens a call, the pool's "
                        + (f"{pool.max_tokens_per_call}" if pool.max_tokens_per_call else "any number")
                        + " (--max-tokens-per-call)")
    if (list(info.feature_layers), info.feature_width) != (list(pool.feature_layers), pool.feature_width):
        problems.append(f"it reads target layers {list(info.feature_layers)} ({info.feature_width} values a "
                        f"position), the pool's draft {list(pool.feature_layers)} ({pool.feature_width})")
    mine, pools = _weights(info), _weights(pool)
    if not pool.draft_method and mine != pools:
        problems.append(f"it computes with {mine}, the pool's with {pools} (--quantize, --dtype, --kv-dtype)")
    if not problems:
        return ""
    return f"serves the pool's model, but {'; '.join(problems)}: start a pool's replicas with the same flags"


class Pool:
    def __init__(self, name: str, spec: str, make_peer: Callable[[str, str | None], Peer], resolve_every: float = 10.0,
                 check_every: float = 2.0, late_floor: float | None = None):
        self.name = name
        self.late_floor = late_floor  # the least a replica's late bound is (RecentLatency; None: its FLOOR)
        self.entries = [e.strip() for e in spec.split(",") if e.strip()]
        if not self.entries:
            raise ValueError(f"no {name} address given")
        self.make_peer = make_peer
        self.resolve_every = resolve_every
        self.check_every = check_every
        self.replicas: dict[str, Replica] = {}
        self.reference: pb.ModelInfo | None = None  # the model every replica must serve
        # why a replica's model may not become the pool's ("": it may), until one has (the draft pool: it
        # must pair with the target)
        self.accept: Callable[[pb.ModelInfo], str] = lambda info: ""
        self.backoff = False  # start looks less often (see start)
        self.latency = None  # a prometheus Histogram handed to every replica's peer
        self.late = None  # a prometheus Counter of calls the round stopped waiting for (draft pool: failover.py)
        self.room_waiters = 0  # requests waiting for a target replica's room to go on (failover.py)
        self.releasing: set[asyncio.Task] = set()  # requests' releases under way (failover.py): close waits for them
        self._turn = itertools.count()
        self.affinity = PrefixAffinity()  # finished requests' sequences -> their replicas
        self._task: asyncio.Task | None = None
        self._rechecked = float("-inf")
        self._rechecking: asyncio.Task | None = None
        # set whenever a replica's state may have turned (a health check, a failed call, discovery): `serving` may
        # have changed (the coordinator's readiness follows it)
        self.changed = asyncio.Event()

    # ------------------------------------------------------------ discovery

    async def resolve(self) -> dict[str, str | None]:
        """The addresses the entries name now -> the host name each was resolved from (None: dialled as given)."""
        loop = asyncio.get_running_loop()
        out: dict[str, str | None] = {}
        for entry in self.entries:
            if entry.startswith("file:"):
                try:
                    lines = Path(entry[5:]).read_text().split()
                except OSError as e:
                    log.warning("%s pool: cannot read %s: %s", self.name, entry, e)
                    continue
                out.update((line, None) for line in lines if not line.startswith("#"))
                continue
            host, _, port = entry.rpartition(":")
            host = host.strip("[]")
            try:
                infos = await loop.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
            except (OSError, ValueError) as e:
                log.warning("%s pool: cannot resolve %s: %s", self.name, entry, e)
                continue
            v4 = [i[4][0] for i in infos if i[0] == socket.AF_INET]
            v6 = [i[4][0] for i in infos if i[0] == socket.AF_INET6]
            for ip in v4 or v6:
                out[f"{ip}:{port}" if ip in v4 else f"[{ip}]:{port}"] = None if ip == host else host
        return out

    async def refresh(self, resolve: bool = True) -> None:
        """Re-resolve (if asked), then health-check every replica."""
        if resolve:
            found = await self.resolve()
            for address, replica in list(self.replicas.items()):
                if address not in found and not replica.removed:
                    log.info("%s replica %s is gone: draining", self.name, address)
                    replica.removed = True
            for address, server_name in found.items():
                replica = self.replicas.get(address)
                if replica is None:
                    peer = self.make_peer(address, server_name)
                    peer.latency = self.latency
                    self.replicas[address] = Replica(peer, self.late_floor)
                    log.info("%s replica %s found", self.name, address)
                elif replica.removed:
                    replica.removed = False
        await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())))
        for address, replica in list(self.replicas.items()):
            # (pop: a failover's recheck may refresh beside the watch)
            if replica.removed and replica.outstanding == 0 and self.replicas.pop(address, None) is replica:
                await replica.peer.close()
        self.changed.set()

    async def _check(self, replica: Replica) -> None:
        was, error = replica.healthy, ""
        try:
            # wait_for_ready: a replica just back is dialled within the check (not failed for the backoff left)
            reply = await health_pb2_grpc.HealthStub(replica.peer.channel).Check(
                health_pb2.HealthCheckRequest(service=""), timeout=CHECK_TIMEOUT, wait_for_ready=True)
            healthy = reply.status == health_pb2.HealthCheckResponse.SERVING
            if healthy:
                # at every check, not once: what answers at an address may have been restarted with
                # another model (and a refused one with the pool's)
                info = await replica.peer.call(replica.peer.stub.GetModelInfo, pb.ModelInfoRequest(), timeout=5.0)
                # (before the pool has a model: `accept`'s reason, else how it differs from the pool's)
                refused, said = (self.accept(info), "") if self.reference is None else \
                    (unlike(info, self.reference), "it ")
                if refused:
                    if replica.refused != refused:
                        log.error("%s replica %s refused: %s%s", self.name, replica.address, said, refused)
                    replica.refused = refused
                    replica.healthy = False
                    self.changed.set()
                    return
                if self.reference is None:
                    self.reference = info
                if replica.refused:
                    log.info("%s replica %s serves the pool's model again", self.name, replica.address)
                    replica.refused = ""
                replica.peer.info = info
            else:
                error = f"{health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)} (starting or stopping)"
        except Exception as e:  # noqa: BLE001 - no answer, however it failed
            healthy, error = False, await self._why(replica, e)
        replica.healthy = healthy
        if healthy != was:
            self.changed.set()
        why, replica.why = replica.why, error
        if healthy != was or error != why:  # (a replica that never answered: why it does not, once a reason)
            log.info("%s replica %s is %s", self.name, replica.address, f"unhealthy: {error}" if error else "healthy")

    @staticmethod
    async def _why(replica: Replica, error: Exception) -> str:
        """A failed health check's reason. One that waited for the channel (wait_for_ready) and ran out of
        time says nothing of the connection: a call that does not wait says the channel's last error (a
        connection refused, a TLS handshake that failed: the peer TLS flags), or answers, late."""
        if isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
            try:
                await health_pb2_grpc.HealthStub(replica.peer.channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=0.5)
                return f"its health check took more than {CHECK_TIMEOUT:g} s"
            except Exception as e:  # noqa: BLE001 - the reason wanted
                error = e
        if isinstance(error, grpc.aio.AioRpcError):
            return f"{error.code().name}: {error.details()}"
        return str(error) or type(error).__name__

    async def start(self, timeout: float) -> pb.ModelInfo:
        """Wait until one replica is healthy (its model becomes the pool's, where `accept` takes it), then
        keep watching. It looks every 0.25 s; once `backoff` is set (a draft pool the coordinator went on
        without), less and less often, up to every resolve_every s."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        pause = 0.25
        while True:
            await self.refresh()
            if any(r.healthy for r in self.replicas.values()):
                break
            if loop.time() > deadline:
                found = ", ".join(f"{a} ({r.refused or r.why or r.state})" for a, r in self.replicas.items()) \
                    or "none found"
                raise self.unavailable(f"no replica SERVING after {timeout:.0f} s (addresses: {found})")
            await asyncio.sleep(pause)
            if self.backoff:
                pause = min(pause * 1.25, self.resolve_every)
        self._task = asyncio.ensure_future(self._watch())
        return self.reference

    async def _watch(self) -> None:
        """Re-resolve every resolve_every s, check every replica every check_every s, and the
        unhealthy ones four times as often: a replica that comes up gets traffic soon."""
        loop = asyncio.get_running_loop()
        resolved = checked = loop.time()
        while True:
            await asyncio.sleep(self.check_every / 4)
            now = loop.time()
            try:
                if now - checked >= self.check_every:
                    resolve = now - resolved >= self.resolve_every
                    resolved = now if resolve else resolved
                    checked = now
                    await self.refresh(resolve)
                else:
                    await asyncio.gather(*(self._check(r) for r in list(self.replicas.values())
                                           if not r.healthy and not r.refused and not r.removed))
            except Exception:  # keep watching whatever one round met
                log.exception("%s pool refresh failed", self.name)

    async def recheck(self, min_interval: float = 0.0) -> None:
        """Health-check every replica now, not at the next round of the watch: a request whose
        replica died looks for another, and the one it needs may have come up since the last
        round. A caller that comes while a check runs waits for that one; one that comes within
        `min_interval` s of the last takes its answer."""
        await asyncio.shield(self._recheck(min_interval))

    def recheck_soon(self) -> None:
        """`recheck` in the background (at most every 0.5 s), for a request that goes on without waiting for it."""
        self._recheck(0.5)

    def _recheck(self, min_interval: float) -> asyncio.Future:
        now = asyncio.get_running_loop().time()
        if self._rechecking is None or (self._rechecking.done() and now - self._rechecked >= min_interval):
            self._rechecked = now
            self._rechecking = asyncio.ensure_future(self._refresh_logged())
        return self._rechecking

    async def _refresh_logged(self) -> None:
        try:
            await self.refresh(resolve=False)
        except Exception:  # a request waiting on it goes on with what is known
            log.exception("%s pool recheck failed", self.name)

    # ------------------------------------------------------------ leasing

    def healthy(self) -> list[Replica]:
        return [r for r in self.replicas.values() if r.healthy and not r.removed and not r.refused]

    def none_serving(self) -> str:
        """Why no request can be leased a replica now: each known replica's state."""
        known = ", ".join(f"{a} {r.state}" for a, r in self.replicas.items()) or "none"
        return f"no healthy replica (known: {known})"

    def acquire(self, exclude: Collection[Replica] = (), prompt: list[int] | None = None) -> Replica:
        """The healthy replica with the least work in flight (ties in turn), for one request, or the one
        that held most of its `prompt` (the module docstring); give it back with `release`. `exclude`:
        replicas the request will not use now."""
        candidates = [r for r in self.healthy() if r not in exclude]
        if not candidates:
            raise self.unavailable(self.none_serving())
        turn = next(self._turn)
        replica = min(candidates, key=lambda r: (r.outstanding, (candidates.index(r) - turn) % len(candidates)))
        held = self.affinity.find(prompt) if prompt and len(candidates) > 1 else None
        if held is not None and 2 * held[1] >= len(prompt):
            holder = next((r for r in candidates if r.address == held[0]), None)
            if holder is not None and holder.outstanding <= replica.outstanding + AFFINITY_SLACK:
                replica = holder
        replica.outstanding += 1
        replica.served += 1
        return replica

    def release(self, replica: Replica) -> None:
        replica.outstanding -= 1

    def failed(self, replica: Replica, error: PeerError) -> None:
        """A call to `replica` failed: no new requests for it until its health check passes again."""
        if replica.healthy:
            log.warning("%s replica %s failed a call (%s): taken out until its health check passes",
                        self.name, replica.address, error)
            self.changed.set()
        replica.healthy = False

    @property
    def address(self) -> str:  # (with `name`, what PeerError names)
        return ",".join(self.entries)

    def unavailable(self, details: str) -> PeerError:
        """UNAVAILABLE naming the pool rather than one replica."""
        return PeerError(self, grpc.StatusCode.UNAVAILABLE, details)

    def describe(self) -> list[pb.ReplicaInfo]:
        return [pb.ReplicaInfo(role=self.name, address=r.address, state=r.state, outstanding=r.outstanding,
                               served=r.served, model_name=r.peer.info.model_name if r.peer.info else "",
                               detail=r.refused or r.why) for r in self.replicas.values()]

    async def close(self, wait: float = CLOSE_WAIT) -> None:
        """Stop looking at the replicas and close their channels, once the releases under way have been
        answered (up to `wait` s): a coordinator stopping past its grace cuts its generations, whose
        releases a closed channel would drop, leaving their sessions held until the services' idle timeout."""
        for task in (self._task, self._rechecking):
            if task is not None:
                task.cancel()
        await asyncio.sleep(0)  # (a generation cancelled just now starts its releases at the loop's next pass)
        if self.releasing:
            _, late = await asyncio.wait(set(self.releasing), timeout=wait)
            if late:
                log.warning("%s: %d session releases unanswered after %.0f s: their sessions wait for the"
                            " services' idle timeout", self.name, len(late), wait)
        await asyncio.gather(*(r.peer.close() for r in self.replicas.values()), return_exceptions=True)
