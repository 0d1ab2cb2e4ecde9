"""The suite's service processes, forked from one process that has loaded torch, transformers
and gRPC once (multiprocessing's forkserver), instead of started afresh.

A local stack is three Python processes, and on two cores most of a start is each of them
importing the same libraries (~3 s of CPU apiece): the suite starts ~40 stacks and replicas.
`launch` has the signature of `LocalStack.launcher` and returns a process with the part of
`subprocess.Popen` that LocalStack and the tests use (pid, poll, wait, send_signal, kill,
terminate, returncode; a signal's death is -signal, as Popen's).

What a child shares with the real thing and what it does not:
- it runs the same `python -m MODULE ARGS` (runpy, as `-m` does), with the command's
  environment, working directory and log file (stdout and stderr, unbuffered);
- the forkserver preloads third-party libraries only (PRELOAD): specdec's own modules load in
  the child, so what they read from the environment at import (coordinator.peers' fault hook)
  is the child's. The preloaded libraries read theirs when the forkserver starts: it starts
  with HF_HUB_OFFLINE=1, as every service does, and with model_service.openmp's OpenMP setting
  applied before torch loads, as the model services do (the coordinator then has it too: it
  runs no parallel torch work);
- nothing in the forkserver runs a torch op, so a child starts its OpenMP threads itself,
  with its own --threads.
Commands that are not `PYTHON -m MODULE ...` start as plain processes. `pytest --exec-services`
starts every service as a plain process (tests/conftest.py).
"""

from __future__ import annotations

import atexit
import ctypes
import io
import multiprocessing
import multiprocessing.util  # (its exit handler, which joins the children, runs after ours: see _kill_left)
import os
import runpy
import signal
import subprocess
import sys
import threading
from pathlib import Path

# imported once by the forkserver; model_service.openmp first: it sets OpenMP's spin before torch loads it
PRELOAD = ["model_service.openmp", "numpy", "torch", "transformers", "transformers.models.auto.modeling_auto",
           "transformers.models.auto.tokenization_auto", "transformers.models.llama.modeling_llama", "tokenizers",
           "safetensors", "grpc", "grpc_health.v1.health", "grpc_reflection.v1alpha.reflection", "google.protobuf",
           "prometheus_client", "starlette", "uvicorn", "pydantic", "llguidance"]

_context = None
_lock = threading.Lock()
_started: list[multiprocessing.Process] = []


@atexit.register
def _kill_left() -> None:
    """At the suite's exit, kill what a test left running, stopped ones too: multiprocessing's own
    handler (registered before this one, so run after it) SIGTERMs its daemons and joins them with
    no timeout, and a process a test stopped (SIGSTOP) would hold the exit for ever."""
    for process in _started:
        if process.exitcode is None:
            for sig in (signal.SIGKILL, signal.SIGCONT):
                try:
                    os.kill(process.pid, sig)
                except ProcessLookupError:
                    pass
            process.join(10)


def _forkserver():
    global _context
    with _lock:
        if _context is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read by huggingface_hub when the forkserver imports it
            _context = multiprocessing.get_context("forkserver")
            _context.set_forkserver_preload(PRELOAD)
        return _context


PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent ends


def _die_with_the_suite() -> None:
    """In the forked child: be killed when the forkserver, its parent, ends, which it does when the
    suite's process does (it reads the end of its pipe from it), however that ends. _kill_left runs
    only at a normal exit: a suite that was SIGTERMed or killed left its services listening (nine
    of them, one evening, on loopback ports a later run's stacks were given). Linux only."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return
    suite = multiprocessing.parent_process()
    if suite is not None and not suite.is_alive():  # it ended before the prctl: no signal will come
        os._exit(1)


def _run(module: str, args: list[str], env: dict[str, str], cwd: str, log: str, mode: str) -> None:
    """In the forked child: become `python -m module *args` writing to `log`."""
    _die_with_the_suite()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | (os.O_TRUNC if mode == "w" else 0), 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), write_through=True)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = [module, *args]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


class ForkedProcess:
    """A forked service, as much of subprocess.Popen as LocalStack and the tests use."""

    def __init__(self, process: multiprocessing.Process, args: list[str]):
        self._process, self.args, self.pid = process, args, process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self._process.exitcode

    def send_signal(self, sig: int) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, sig)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def launch(command: list[str], cwd: str | Path, env: dict[str, str], log: Path, mode: str):
    """LocalStack.launcher: `command` forked from the forkserver where it is `sys.executable -m MODULE ...`.
    One a test leaves running is killed when the suite's process exits (_kill_left), or is killed
    (_die_with_the_suite)."""
    if len(command) < 3 or command[0] != sys.executable or command[1] != "-m":
        return subprocess.Popen(command, cwd=cwd, env=env, stdout=log.open(mode), stderr=subprocess.STDOUT)
    process = _forkserver().Process(target=_run, args=(command[2], command[3:], env, str(cwd), str(log), mode),
                                    daemon=True)
    process.start()
    with _lock:
        _started[:] = [p for p in _started if p.exitcode is None] + [process]
    return ForkedProcess(process, command)
