"""The suite's forked services (tests/prefork.py) behave as `python -m` processes do: the same
output, exit codes, environment and deaths by signal as coordinator.launch's plain launcher."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from coordinator.launch import ROOT, popen_service
from runtime.ports import free_port
from tests import prefork

LAUNCHERS = {"exec": popen_service, "fork": prefork.launch}


def run(launcher, tmp_path, *args, env=None):
    log = tmp_path / "out.log"
    proc = LAUNCHERS[launcher]([sys.executable, "-m", *args], tmp_path, {"PATH": "/usr/bin:/bin", **(env or {})},
                               log, "w")
    return proc, log


@pytest.mark.parametrize("args, env", [
    (["platform"], None),  # output, exit 0
    (["json.tool", "no-such-file.json"], None),  # argparse's error on stderr, exit 2
    (["site", "--user-base"], {"PYTHONUSERBASE": "/srv/from-the-environment"}),  # the command's environment
    (["this-is-no-module"], None),  # python's own error
], ids=["platform", "json.tool", "site", "no-module"])
def test_a_forked_command_prints_and_exits_as_the_command_does(tmp_path, args, env):
    results = {}
    for launcher in LAUNCHERS:
        (tmp_path / launcher).mkdir()
        proc, log = run(launcher, tmp_path / launcher, *args, env=env)
        code = proc.wait(60)
        assert proc.returncode == proc.poll() == code
        results[launcher] = code, log.read_text().replace(str(tmp_path / launcher), "TMP")
    assert results["fork"][0] == results["exec"][0]
    if args[0] != "this-is-no-module":  # (the message names the interpreter's way in: "-m" or runpy)
        assert results["fork"][1] == results["exec"][1]
        assert results["fork"][1]
    if env:
        assert "/srv/from-the-environment" in results["fork"][1]


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_a_forked_server_dies_of_a_signal_as_popen_reports_it(tmp_path, sig):
    port = free_port()
    proc, log = run("fork", tmp_path, "http.server", "--bind", "127.0.0.1", str(port))
    deadline = time.monotonic() + 60
    while True:  # serving: it is up, not just forked
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, "http.server never served"
            time.sleep(0.05)
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.01)
    proc.send_signal(sig)
    assert proc.wait(30) == -sig
    proc.send_signal(signal.SIGTERM)  # an exited process: nothing to signal, no error


def test_a_forked_process_left_stopped_does_not_hold_the_suites_exit(tmp_path):
    """multiprocessing joins its children at exit with no timeout: one a test left stopped (SIGSTOP)
    must not hold the suite's process for ever, nor outlive it."""
    script = f"""
import os, signal, sys
from pathlib import Path
from tests import prefork
proc = prefork.launch([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "{free_port()}"], Path("{tmp_path}"),
                      dict(os.environ), Path("{tmp_path}") / "out.log", "w")
os.kill(proc.pid, signal.SIGSTOP)
print(proc.pid, flush=True)
"""
    done = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    pid = int(done.stdout.split()[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # gone, or a zombie waiting for its reaper
        try:
            state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return
        if state == "Z":
            return
        time.sleep(0.05)
    raise AssertionError(f"the stopped child {pid} outlived the script (state {state})")
