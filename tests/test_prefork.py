"""The suite's forked services (tests/prefork.py) behave as `python -m` processes do: the same
output, exit codes, environment and deaths by signal as coordinator.launch's plain launcher."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys

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
    proc, log = run("fork", tmp_path, "http.server", "--bind", "127.0.0.1", str(free_port()))
    with pytest.raises(subprocess.TimeoutExpired):  # a server: it runs until signalled
        proc.wait(0.01)
    proc.send_signal(sig)  # neither its start nor http.server handles the signal: it dies of it
    assert proc.wait(30) == -sig, log.read_text()
    proc.send_signal(signal.SIGTERM)  # an exited process: nothing to signal, no error


@pytest.mark.slow  # ~8 s
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
sys.stdin.readline()  # exits once the test holds the child's pidfd
"""
    suite = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    line = suite.stdout.readline()
    assert line, suite.communicate(timeout=60)[1]
    child = os.pidfd_open(int(line))  # readable once the child has ended (a zombie too)
    try:
        suite.stdin.close()
        assert suite.wait(120) == 0, suite.stderr.read()
        assert select.select([child], [], [], 30)[0], "the stopped child outlived the suite's process"
    finally:
        os.close(child)
        suite.stdout.close()
        suite.stderr.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["term", "kill"])
def test_a_forked_server_ends_with_a_suite_that_was_signalled(tmp_path, sig):
    """A suite's process ended by a signal runs no exit handler (_kill_left): its forked services
    must end with it all the same, not stay listening on their ports."""
    script = f"""
import os, sys
from pathlib import Path
from tests import prefork
prefork.PRELOAD = []  # (the forkserver need not load torch for http.server)
proc = prefork.launch([sys.executable, "-m", "http.server", "--bind", "127.0.0.1", "{free_port()}"], Path("{tmp_path}"),
                      dict(os.environ), Path("{tmp_path}") / "out.log", "w")
print(proc.pid, flush=True)
sys.stdin.readline()  # held until the test signals this process
"""
    suite = subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    line = suite.stdout.readline()
    assert line, suite.communicate(timeout=60)[1]
    child = os.pidfd_open(int(line))  # readable once the child has ended
    try:
        assert not select.select([child], [], [], 0)[0], "the server ended before the suite did"
        suite.send_signal(sig)
        assert suite.wait(60) == -sig
        assert select.select([child], [], [], 60)[0], "the forked server outlived the suite's process"
    finally:
        if not select.select([child], [], [], 0)[0]:  # (the test failed, or the suite was not signalled)
            signal.pidfd_send_signal(child, signal.SIGKILL)
        if suite.poll() is None:
            suite.kill()
        os.close(child)
        for stream in (suite.stdin, suite.stdout, suite.stderr):
            stream.close()
