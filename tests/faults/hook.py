"""The coordinator's fault hook's other end (coordinator/peers.py, SPECDEC_FAULT_HOOK): a test
strikes a service at an exact moment of a round (a call about to be sent, sent and awaited, or
answered), not after a sleep or a race the request may win. Used by the fault matrix and by
tests/coordinator (failover, shutdown, the OpenAI API, metrics): a stack whose coordinator tells
the hook (`hooked_stack`), and a strike that freezes a service (`freezer`) to hold a request in
flight however fast the machine is."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from coordinator.launch import LocalStack


def wait_until(what: str, done, timeout: float = 30.0, every: float = 0.05):
    """Poll `done()` (a state, not a time) until it is true; fail naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = done()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout:.0f} s")
        time.sleep(every)


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP has landed): its state in /proc is T."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] in ("T", "t")


def freezer(process: subprocess.Popen):
    """A strike that stops `process` (SIGSTOP) and returns once it has: the coordinator's call goes
    on to a service that cannot answer, so the request is held at that call until SIGCONT."""

    def strike(address: str) -> None:
        process.send_signal(signal.SIGSTOP)
        wait_until("stopped", lambda: stopped(process.pid))

    return strike


class FaultHook:
    """The other end of SPECDEC_FAULT_HOOK: hears `<role> <address> <point> <start>` for every
    moment of every per-round call, answers at once, except the `nth` time the armed moment
    comes: then it strikes the service the call is to first, and answers after.

    `always`: it listens from the start (every moment heard); else only from `arm` to `disarm`, and the
    coordinator's other calls find no hook and go on at once (peers.moment), their time as a stack's
    without the hook: a draft call's round trips to the hook count in the time it may take before the
    round goes on without it, which in a stack serving other tests would make lost rounds likelier."""

    def __init__(self, path: Path, always: bool = True):
        self.path = str(path)
        self.server: socket.socket | None = None
        self.lock = threading.Lock()
        self.armed = None  # (role, point, start, nth, strike)
        self.seen = 0
        self.struck: str | None = None  # the address struck
        self.heard: list[tuple[str, str, bool]] = []  # every moment told, in order: (role, point, start)
        self.struck_at: int | None = None  # the index in `heard` of the moment struck
        self.done = threading.Event()  # the strike is over (a late draft call's request may have finished first)
        self.errors: list[BaseException] = []
        self.always = always
        if always:
            self._listen()

    def _listen(self) -> None:
        self.server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.server.bind(self.path)
        self.server.listen(64)
        threading.Thread(target=self._accept, args=(self.server,), daemon=True).start()

    def _stop_listening(self) -> None:
        if self.server is not None:
            self.server.close()
            self.server = None
            os.unlink(self.path)

    def arm(self, role: str, point: str, start: bool, nth: int, strike) -> None:
        with self.lock:
            self.armed, self.seen, self.struck = (role, point, start, nth, strike), 0, None
            self.done.clear()
            if self.server is None:
                self._listen()

    def disarm(self) -> None:
        with self.lock:
            self.armed = None
            if not self.always:
                self._stop_listening()

    def _accept(self, server: socket.socket) -> None:
        while True:
            try:
                connection, _ = server.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._answer, args=(connection,), daemon=True).start()

    def _answer(self, connection: socket.socket) -> None:
        with connection:
            line = connection.makefile().readline().split()
            strike = address = None
            if len(line) == 4:
                role, address, point, start = line
                with self.lock:
                    self.heard.append((role, point, start == "1"))
                    if self.armed is not None and self.armed[:3] == (role, point, start == "1"):
                        self.seen += 1
                        if self.seen == self.armed[3]:
                            strike, self.armed, self.struck = self.armed[4], None, address
                            self.struck_at = len(self.heard) - 1
            if strike is not None:
                try:
                    strike(address)
                except BaseException as e:  # the test reports it
                    self.errors.append(e)
                finally:
                    self.done.set()
            try:
                connection.sendall(b"go\n")
            except OSError:
                pass

    def close(self) -> None:
        with self.lock:
            self._stop_listening()


@contextlib.contextmanager
def hooked_stack(pair, **stack_args):
    """A started LocalStack (`stack_args` its keywords) whose coordinator tells a fault hook every
    moment of every per-round call, and the hook: (stack, hook); both closed after the block."""
    draft, target = pair
    workdir = Path(tempfile.mkdtemp(prefix="specdec-hooked-"))  # (short: a Unix socket's path is at most 107 bytes)
    hook = FaultHook(workdir / "hook.sock", always=False)  # (heard while armed only)
    env = {**stack_args.pop("coordinator_env", {}), "SPECDEC_FAULT_HOOK": hook.path}
    stack = LocalStack(draft, target, log_dir=workdir, coordinator_env=env, **stack_args)
    try:
        yield stack.start(), hook
    finally:
        stack.stop()
        hook.close()
        shutil.rmtree(workdir, ignore_errors=True)
