"""Tensor parallelism for a model service: N ranks, each holding 1/N of every layer, placed by Ray.

    ModelRunner(dir, tensor_parallel=2)                  # a local Ray instance, started and stopped with it
    ModelRunner(dir, tensor_parallel=4, ray_address="head:6379")   # an existing Ray cluster (this node in it)

The split is Megatron's (`sharding.shard`): attention heads and MLP columns are divided
between the ranks, and one all-reduce after each attention and each MLP block completes
the residual update; the vocabulary of lm_head is divided too and the logits all-gathered.
Each rank reads only its own slices of a safetensors checkpoint (`loading.load_model`).

Rank 0 runs in the service process: it hosts the gRPC server, the session table and the
sampling (rejection sampling runs once, on the gathered logits). Ranks 1..N-1 are Ray
actors, one per bundle of a placement group (a GPU each on GPU machines, a CPU each on
CPU); all N join one `torch.distributed` group (NCCL on GPU, gloo on CPU) plus a gloo
group for control messages. Every pass, rank 0 first broadcasts its *plan*: for each
sequence, the key of its KV cache, the length to roll that cache back to, the new token
ids and the rows of logits wanted; and the keys of caches dropped since the last pass.
Each rank then crops its shard of those caches to the same lengths and runs the same
pass, so rollback is identical on every rank by construction.

A rank that dies or fails to start is named in the error; the service turns NOT_SERVING
(see `wait_lost`) instead of hanging in a collective.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
import weakref
from collections import deque
from datetime import timedelta
from pathlib import Path

import torch

from runtime.ports import free_port
from speculative.errors import WorkerLost

from .sharding import adopt_shard, shard

log = logging.getLogger("specdec.tp")

PG_TIMEOUT = timedelta(seconds=120)  # a collective of a pass that waits longer than this raises
# how long a rank may wait for rank 0's next plan: as long as the service may stay idle (a rank that
# dies meanwhile is seen by Ray, not by this timeout)
IDLE_TIMEOUT = timedelta(days=365)
LOCAL_RAY_ATTEMPTS = 2  # starts of a local Ray instance whose raylet timed out (see Placement._start_local_ray)
# what Ray's errors say when a local start ran out of time (the raylet's registration, the GCS's port file)
STARTUP_TIMEOUTS = ("timed out during startup", "Timed out waiting for file")


def _join(rank: int, world: int, init_method: str, backend: str, timeout: timedelta, idle: timedelta):
    """Join the model group (collectives time out after `timeout`) and the control group, over gloo,
    whose broadcasts wait up to `idle` for the next plan. -> the control group."""
    import torch.distributed as dist

    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world, timeout=timeout)
    return dist.new_group(backend="gloo", timeout=idle)


def attach(fast, rank: int, world: int) -> None:
    """Shard `fast` for `rank` (unless its model was loaded sharded) and give it the collectives of
    the default process group."""
    import torch.distributed as dist

    if fast.world == 1:
        shard(fast, rank, world)
    vocab = fast.vocab_size

    def reduce(partial: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(partial)
        return partial

    def gather(logits: torch.Tensor) -> torch.Tensor:  # [rows, V / world] -> [rows, V]
        blocks = [torch.empty_like(logits) for _ in range(world)]
        dist.all_gather(blocks, logits.contiguous())
        return torch.cat(blocks, dim=-1)[:, :vocab]

    fast.reduce, fast.gather = reduce, gather


class Worker:
    """Rank r >= 1: loads the model, keeps its shard, and replays rank 0's passes until told to stop.

    Run as a Ray actor (`ray.remote(Worker)`); its methods are called in this order:
    load -> join -> serve (which returns when rank 0 broadcasts the stop, or raises).
    """

    def __init__(self, rank: int, world: int, model_dir: str, dtype: str, device: str, max_context: int,
                 threads: int, pool_capacity: int):
        import model_service.openmp  # noqa: F401  (before torch's first parallel region)

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        if threads > 0:
            torch.set_num_threads(threads)
        self.rank, self.world = rank, world
        self.model_dir, self.dtype, self.device, self.max_context = model_dir, dtype, device, max_context
        self.pool_capacity = pool_capacity
        self.fast = None
        self.control = None
        self.caches: dict[int, object] = {}

    def load(self) -> tuple[int, dict]:
        """Load this rank's slices onto the device (loading.load_model; a checkpoint that is not
        safetensors: the whole model into host memory, sharded and moved to the device by `join`).
        -> (pid, its LoadMeter record)"""
        from .fast_forward import DTYPES, FastForward
        from .loading import LoadMeter, import_model_code, load_model

        import_model_code(self.model_dir)
        with LoadMeter() as meter:
            loaded = load_model(self.model_dir, DTYPES[self.dtype], self._device(), self.rank, self.world)
            self.fast = FastForward.build(loaded.model, self.max_context, self.pool_capacity)
            if self.fast is None:
                raise ValueError(f"{loaded.model.config.model_type} has no lean forward to shard")
            if loaded.world > 1:
                adopt_shard(self.fast, loaded.world, loaded.logits_size)
        return os.getpid(), meter.record()

    def _device(self) -> torch.device:
        return torch.device("cuda" if self.device.startswith("cuda") else self.device)  # Ray set CUDA_VISIBLE_DEVICES

    def join(self, init_method: str, backend: str, timeout: timedelta, idle: timedelta) -> None:
        self.control = _join(self.rank, self.world, init_method, backend, timeout, idle)
        whole = self.fast.world == 1
        attach(self.fast, self.rank, self.world)
        if whole:
            self.fast.to(self._device())  # only the shard reaches the device

    def held(self) -> list[int]:
        """Keys of the KV caches this rank holds (runs beside `serve`: the actor has 2 threads)."""
        return sorted(self.caches)

    @torch.inference_mode()
    def serve(self) -> None:
        import torch.distributed as dist

        try:
            while True:
                box = [None]
                dist.broadcast_object_list(box, src=0, group=self.control)
                if box[0] is None:  # stop
                    return
                plan, dropped = box[0]
                for key in dropped:
                    self.caches.pop(key, None)
                feeds = []
                for key, length, input_ids, num_logits in plan:
                    cache = self.caches.get(key)
                    if cache is None:
                        cache = self.caches[key] = self.fast.new_cache()
                    cache.crop(length)
                    feeds.append((input_ids, cache, num_logits))
                self.fast.many(feeds)
        finally:
            self.caches.clear()
            dist.destroy_process_group()


class ShardedForward:
    """Rank 0's tensor-parallel forward: FastForward's interface (`many`, `new_cache`), each pass
    announced to the other ranks first. Made by `Placement.start`; `close` stops the workers."""

    def __init__(self, fast, control, placement: Placement, served: list, pids: list[int], loads: list[dict]):
        self.fast, self.control = fast, control
        self.placement, self.ray, self.served, self.pids = placement, placement.ray, served, pids
        self.loads = loads  # ranks 1..N-1's LoadMeter records
        self._keys = itertools.count()
        self._dropped: deque[int] = deque()  # keys of caches gone on rank 0, still held by the others
        self.failed: str | None = None
        self.broken = threading.Event()  # set when rank 0 itself finds the group broken
        self.closed = False
        self.backend = placement.backend

    def new_cache(self):
        cache = self.fast.new_cache()
        cache.key = next(self._keys)
        weakref.finalize(cache, self._dropped.append, cache.key)
        return cache

    def many(self, feeds):
        return self.many_capturing(feeds, ())[0]

    def many_capturing(self, feeds, capture: tuple[int, ...]):
        """FastForward.many_capturing over the ranks: the pass announced, then run on every rank;
        rank 0 alone copies the `capture` layers' inputs out. Those are whole on every rank (each
        attention and MLP block's all-reduce completes the residual stream before the next layer
        reads it), and copying them out adds no collective: the other ranks' plain pass makes the
        same ones in the same order."""
        import torch.distributed as dist

        if self.failed:
            raise WorkerLost(self.failed)
        dropped = []
        while self._dropped:
            dropped.append(self._dropped.popleft())
        plan = [(cache.key, cache.length, list(input_ids), num_logits) for input_ids, cache, num_logits in feeds]
        try:
            dist.broadcast_object_list([(plan, dropped)], src=0, group=self.control)
            return self.fast.many_capturing(feeds, capture)
        except (RuntimeError, dist.DistBackendError) as exc:
            self.failed = self._lost_message(exc)
            self.broken.set()
            raise WorkerLost(self.failed) from exc

    def _lost_message(self, exc: BaseException | None = None) -> str:
        """Which rank is gone, from Ray's record of the actors' `serve` calls."""
        ray = self.ray
        done, _ = ray.wait(self.served, num_returns=1, timeout=5.0)
        for rank, ref in enumerate(self.served, start=1):
            if ref in done:
                try:
                    ray.get(ref)
                    why = "stopped"
                except Exception as err:  # noqa: BLE001  (the actor's death, as Ray reports it)
                    why = f"died: {_first_line(err)}"
                return f"tensor-parallel worker rank {rank} (pid {self.pids[rank - 1]}) {why}"
        return f"tensor-parallel collective failed: {exc}"

    def wait_lost(self) -> str:
        """Block until a worker rank ends or rank 0 finds the group broken (or `close`). -> what
        happened, naming the rank."""
        while not self.broken.is_set():
            done, _ = self.ray.wait(self.served, num_returns=1, timeout=1.0)
            if done:
                break
        if self.closed:
            return ""
        if not self.failed:
            self.failed = self._lost_message()
        return self.failed

    def close(self) -> None:
        """Stop the workers (a broadcast stop, then kill), free the placement, stop a local Ray."""
        import torch.distributed as dist

        if self.closed:
            return
        self.closed = True
        ray = self.ray
        if not self.failed:
            try:
                dist.broadcast_object_list([None], src=0, group=self.control)
                ray.wait(self.served, num_returns=len(self.served), timeout=10.0)
            except Exception:  # noqa: BLE001  (a dead rank: killed below)
                pass
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
        self.placement.give_up("closed")


def _gpu_ids() -> list:
    import ray

    return ray.get_gpu_ids()


class Placement:
    """Ray placement of the ranks: `world` bundles (a GPU each on GPU machines, a CPU each on CPU), one of
    them on this node for rank 0. Made before the weights load, since it decides rank 0's GPU;
    `start` then starts the workers. Raises RuntimeError saying what the cluster lacks; nothing is
    left running then.
    """

    def __init__(self, world: int, device: torch.device, ray_address: str | None = None, timeout: float = 120.0):
        # Ray's C++ core would otherwise take over SIGTERM in this process and print a stack trace
        os.environ.setdefault("RAY_DISABLE_FAILURE_SIGNAL_HANDLER", "1")
        import ray
        from ray.util.placement_group import placement_group, placement_group_table
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if ray_address and ray_address.startswith("ray://"):
            raise ValueError("--ray-address: Ray Client (ray://) is not supported: rank 0 runs in this process and "
                             "must be a node of the cluster; give the cluster's HOST:PORT, or auto on one of its nodes")
        self.ray, self.world, self.timeout = ray, world, timeout
        self.gpu = device.type == "cuda"
        self.backend = "nccl" if self.gpu else "gloo"  # of the model group (control messages: gloo)
        self.own_ray = not ray.is_initialized() and not ray_address
        self.done = False
        if ray_address:
            ray.init(address=ray_address, log_to_driver=False, ignore_reinit_error=True)
        elif self.own_ray:  # a new local instance (never one a RAY_ADDRESS names), stopped by close()
            self._start_local_ray()
        self.bundle = {"GPU": 1.0, "CPU": 1.0} if self.gpu else {"CPU": 1.0}
        self.group = placement_group([dict(self.bundle) for _ in range(world)], strategy="PACK")
        self.workers: list = []
        ready, _ = ray.wait([self.group.ready()], timeout=timeout)
        if not ready:
            raise self.give_up(f"cannot place {world} tensor-parallel ranks of {self.bundle} each within "
                               f"{timeout:.0f} s: the Ray cluster has {ray.cluster_resources()}")
        here = ray.get_runtime_context().get_node_id()
        nodes = placement_group_table(self.group)["bundles_to_node_id"]
        local = [i for i, node in nodes.items() if node == here]
        if not local:
            raise self.give_up("no bundle of the placement group is on this node, where rank 0 runs")
        self.own_bundle = local[0]
        self.worker_bundles = [i for i in sorted(nodes) if i != self.own_bundle]
        self.strategy = lambda index: PlacementGroupSchedulingStrategy(self.group, placement_group_bundle_index=index)
        self.device = device
        if self.gpu:  # rank 0 takes the GPU Ray gave its bundle (whatever --device said: another is a worker's)
            try:
                probe = ray.remote(num_gpus=1, num_cpus=0)(_gpu_ids).options(
                    scheduling_strategy=self.strategy(self.own_bundle))
                physical = str(ray.get(probe.remote(), timeout=timeout)[0])
                visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
                self.device = torch.device("cuda", visible.index(physical) if visible else int(physical))
            except Exception as exc:  # noqa: BLE001
                raise self.give_up(f"cannot tell which GPU Ray gave rank 0: {exc}") from exc
            torch.cuda.set_device(self.device)  # NCCL's communicator of rank 0 lives on it

    def _start_local_ray(self, attempts: int = LOCAL_RAY_ATTEMPTS) -> None:
        """Start a local Ray instance. Ray gives its raylet a fixed 30 s to register with its GCS, and
        waits a fixed time for the GCS to write its port file; on a busy machine (every core taken by
        other services' passes) each has been seen to run out once. Such a start is stopped and tried
        again, up to `attempts` times."""
        for attempt in range(1, attempts + 1):
            try:
                self.ray.init(address="local", num_cpus=os.cpu_count() or 1, num_gpus=torch.cuda.device_count(),
                              include_dashboard=False, log_to_driver=False, object_store_memory=100 << 20,
                              configure_logging=False)
                return
            except Exception as exc:  # noqa: BLE001  (Ray raises a bare Exception for it)
                if not any(m in str(exc) for m in STARTUP_TIMEOUTS) or attempt == attempts:
                    raise
                log.warning("local Ray did not start (%s); trying again (%d of %d)", exc, attempt + 1, attempts)
                self.ray.shutdown()

    def give_up(self, message: str) -> RuntimeError:
        """Undo everything (once); -> the error to raise."""
        if not self.done:
            self.done = True
            workers, self.workers = self.workers, []
            try:
                for worker in workers:
                    self.ray.kill(worker)
                self.ray.util.remove_placement_group(self.group)
            except Exception:  # noqa: BLE001  (a Ray gone already: nothing left to undo there)
                pass
            if self.own_ray:
                self.ray.shutdown()
        return RuntimeError(message)

    def start(self, fast, model_dir: str | Path, dtype: str, max_context: int, threads: int = 0) -> ShardedForward:
        """Start the workers on the other bundles, join them in a process group, shard `fast` as rank 0."""
        ray, world, timeout = self.ray, self.world, self.timeout
        remote = ray.remote(max_concurrency=2)(Worker)  # serve, and held() beside it
        for rank, index in enumerate(self.worker_bundles, start=1):
            self.workers.append(remote.options(scheduling_strategy=self.strategy(index), num_cpus=1,
                                               num_gpus=1 if self.gpu else 0)
                                .remote(rank, world, str(model_dir), dtype, str(self.device), max_context, threads,
                                        fast.pool_capacity))

        def each(calls, what: str) -> list:
            results = []
            for rank, ref in enumerate(calls, start=1):
                try:
                    results.append(ray.get(ref, timeout=timeout))
                except ray.exceptions.GetTimeoutError:
                    raise self.give_up(f"tensor-parallel worker rank {rank} did not {what} within {timeout:.0f} s"
                                       ) from None
                except Exception as exc:  # noqa: BLE001  (the worker's own error, or its death)
                    raise self.give_up(f"tensor-parallel worker rank {rank} failed to {what}: "
                                       f"{_first_line(exc)}") from exc
            return results

        pids, loads = map(list, zip(*each([w.load.remote() for w in self.workers], "load the model")))
        backend = self.backend
        init_method = f"tcp://{ray.util.get_node_ip_address()}:{free_port(host='')}"
        step, idle = PG_TIMEOUT, IDLE_TIMEOUT
        joins = [w.join.remote(init_method, backend, step, idle) for w in self.workers]
        try:
            control = _join(0, world, init_method, backend, step, idle)
        except Exception as exc:  # noqa: BLE001
            raise self.give_up(f"tensor-parallel group did not form: {exc}") from exc
        each(joins, "join the process group")
        whole = fast.world == 1
        attach(fast, 0, world)
        if whole:
            fast.to(self.device)
        served = [w.serve.remote() for w in self.workers]
        log.info("tensor parallel: %d ranks over %s; worker pids %s", world, backend, pids)
        return ShardedForward(fast, control, self, served, pids, loads)


def _first_line(exc: BaseException) -> str:
    """A Ray error's message without its traceback: the last line naming the exception."""
    lines = [line for line in str(exc).splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line.split(":")[0]]
    return (named[-1] if named else lines[0] if lines else type(exc).__name__).strip()


def watch(sharded: ShardedForward, on_lost) -> threading.Thread:
    """Call `on_lost(message)` from a daemon thread when a worker rank ends (not on `close`)."""

    def run() -> None:
        try:
            message = sharded.wait_lost()
        except Exception as exc:  # noqa: BLE001  (Ray shut down under it)
            message = "" if sharded.closed else f"tensor-parallel workers unreachable: {exc}"
        if not message:
            return
        on_lost(message)
        if sharded.backend == "nccl":
            # NCCL does not fail a collective whose peer died: the model thread would block in it
            # until the watchdog aborts the process. Exit now, loudly, so that the orchestrator
            # restarts the service (the coordinator moves its requests to other target replicas).
            log.critical("%s; exiting: a broken NCCL group cannot be recovered in this process", message)
            time.sleep(2.0)  # NOT_SERVING reaches the health checks first
            os._exit(70)

    thread = threading.Thread(target=run, name="tp-watch", daemon=True)
    thread.start()
    return thread
