"""The local launcher's flags reach the services it starts."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import coordinator.launch as launch
from runtime.ports import free_port


class Started(Exception):
    """Raised by the stand-in LocalStack: the flags are what the test reads, nothing starts."""


@pytest.fixture
def stacks(monkeypatch, tmp_path) -> list[dict]:
    """The launcher's stacks, started nowhere; no EAGLE head in the checkout unless a test makes
    one at tmp_path / "eagle"."""
    made = []
    monkeypatch.setattr(launch, "EAGLE", tmp_path / "eagle")
    monkeypatch.setattr(launch, "DRAFT", tmp_path / "draft")
    (tmp_path / "draft").mkdir()
    (tmp_path / "draft" / "distill.json").write_text('{"acceptance": {"acceptance_rate_pooled": 0.12}}')

    class LocalStack:
        """Takes the flags, says where it would serve, and starts nothing."""

        addr, target_addrs, draft_addrs, log_dir = "127.0.0.1:1", ["127.0.0.1:2"], ["127.0.0.1:3"], Path("logs")
        discovery = {"draft": Path("draft.txt"), "target": Path("target.txt")}

        def __init__(self, *args, **kwargs):
            made.append(kwargs)

        def __enter__(self):
            raise Started

        def __exit__(self, *exc):
            return False

    monkeypatch.setattr(launch, "LocalStack", LocalStack)
    monkeypatch.setattr(launch, "default_model", lambda role: Path(f"models/{role}"))
    return made


@pytest.mark.parametrize("argv, target_tail, draft_args", [
    ([], ["--tensor-parallel-size", "1"], []),
    (["--quantize", "int4"], ["--tensor-parallel-size", "1", "--quantize", "int4"], ["--quantize", "int4"]),
    # the n-gram method loads no model: nothing to quantize there
    (["--quantize", "int4", "--draft-method", "ngram"], ["--tensor-parallel-size", "1", "--quantize", "int4"], []),
])
def test_quantize_reaches_both_model_services(stacks, capsys, argv, target_tail, draft_args):
    with pytest.raises(Started):
        launch.main(argv)
    (kwargs,) = stacks
    assert kwargs["target_args"] == target_tail and list(kwargs.get("draft_args", [])) == draft_args
    said = capsys.readouterr().out  # what it starts, with the weights it serves
    assert "starting target (models/target" + (", int4)" if "int4" in argv else ")") in said
    drafting = "n-gram lookup" if "ngram" in argv else "models/draft" + (", int4" if draft_args else "")
    assert f"draft ({drafting})" in said


@pytest.mark.parametrize("argv, acceptance, method", [([], 0.3, "eagle"), (["--quantize", "int4"], 0.3, "eagle"),
                                                      ([], 0.1, "model"), ([], None, "model"),
                                                      (["--tensor-parallel-size", "3"], 0.3, "eagle"),
                                                      (["--draft-model", "elsewhere"], 0.3, "model"),
                                                      (["--draft-method", "model"], 0.3, "model")])
def test_auto_drafts_with_the_eagle_head_where_it_beats_the_draft(stacks, capsys, tmp_path, argv, acceptance,
                                                                  method):
    """models/eagle present and its card's acceptance at least the distilled draft's: the head
    drafts, from the target's hidden states (a tensor-parallel target's too: its rank 0 sends them),
    not where another draft is named; a head that accepts less, or never measured, does not."""
    (tmp_path / "eagle").mkdir()
    (tmp_path / "eagle" / "config.json").write_text("{}")
    if acceptance is not None:
        (tmp_path / "eagle" / "eagle.json").write_text(f'{{"acceptance": {{"acceptance_rate_pooled": {acceptance}}}}}')
    with pytest.raises(Started):
        launch.main(argv)
    (kwargs,) = stacks
    assert kwargs["draft_method"] == method
    said = capsys.readouterr().out
    if method == "eagle":
        assert "draft (EAGLE-3 head models/eagle)" in said and list(kwargs.get("draft_args", [])) == []


def _children(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@contextlib.contextmanager
def serving_launcher(pair, code: list[str], tmp: Path | None = None):
    """A launcher (`python` + `code`) of the pair, serving until stopped (`tmp`: its and its services' TMPDIR).
    -> (its process, its three services' pids); whatever is left of them is killed after"""
    draft, target = pair
    env = None if tmp is None else {**os.environ, "TMPDIR": str(tmp)}
    proc = subprocess.Popen([sys.executable, *code, "--draft-model", str(draft), "--target-model", str(target),
                             "--port", str(free_port()), "--http-port", "0"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=launch.ROOT, env=env)
    try:
        for line in proc.stdout:
            if "SERVING" in line:
                break
        services = _children(proc.pid)
        assert len(services) == 3, services
        yield proc, services
    finally:
        left = _children(proc.pid)  # (before the kill: the launcher's orphans are no longer its children)
        proc.kill()
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_launcher_stops_its_services_on_sigterm_and_ctrl_c(pair, sig):
    """A launcher told to stop (a container stop, systemd, `kill`: SIGTERM; Ctrl-C: SIGINT) stops the
    three services it started instead of leaving them running, also when it inherited SIGINT ignored (a
    non-interactive shell's background job: how CI runs)."""
    ignoring_sigint = "import runpy, signal; signal.signal(signal.SIGINT, signal.SIG_IGN); " \
                      "runpy.run_module('coordinator.launch', run_name='__main__', alter_sys=True)"
    with serving_launcher(pair, ["-c", ignoring_sigint]) as (proc, services):
        proc.send_signal(sig)
        assert proc.wait(timeout=60) == 0  # LocalStack.stop waited for each service before the launcher exited
        assert all(_gone(pid) for pid in services), [pid for pid in services if not _gone(pid)]


def test_the_launcher_stops_its_services_when_its_coordinator_ends(pair, tmp_path):
    """A coordinator that ends (stopped by itself, killed) leaves nothing serving: the launcher stops the draft
    and the target and exits, instead of running on with them. Serving, the coordinator keeps no copy of the
    target's tokenizer files (each start's would stay behind in the temporary directory)."""
    with serving_launcher(pair, ["-m", "coordinator.launch"], tmp_path) as (proc, services):
        assert list(tmp_path.glob("specdec-logs-*")) and not list(tmp_path.glob("specdec-*-tokenizer-*"))
        [coordinator] = [pid for pid in services if b"-m\0coordinator\0" in Path(f"/proc/{pid}/cmdline").read_bytes()]
        os.kill(coordinator, signal.SIGTERM)
        assert proc.wait(timeout=60) == 0  # (it stopped cleanly: code 0)
        assert "the coordinator exited (code 0)" in proc.stdout.read()
        assert all(_gone(pid) for pid in services), [pid for pid in services if not _gone(pid)]
