"""The `specdec` command: each subcommand runs its module's main with the rest of argv."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.command import COMMANDS, main

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("command", list(COMMANDS))
def test_a_command_passes_the_rest_of_argv_to_its_module(command, monkeypatch):
    module = importlib.import_module(COMMANDS[command][0])
    seen = []
    monkeypatch.setattr(module, "main", lambda argv, prog: seen.append((argv, prog)) or 3)
    assert main([command, "--port", "0", "--help-me", "prompt"]) == 3
    assert seen == [(["--port", "0", "--help-me", "prompt"], f"specdec {command}")]


@pytest.mark.parametrize("command", list(COMMANDS))
def test_each_command_has_its_help_under_its_own_name(command, capsys):
    with pytest.raises(SystemExit) as exited:
        main([command, "--help"])
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: specdec {command} [-h]")


def test_help_lists_every_command_on_one_line(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["--help"])
    assert exited.value.code == 0
    lines = capsys.readouterr().out.splitlines()
    for command, (_, summary) in COMMANDS.items():
        assert sum(line.split() == [command, *summary.split()] for line in lines) == 1


@pytest.mark.parametrize("argv, message", [
    (["serve"], "invalid choice: 'serve' (choose from 'coordinator', 'draft', 'target', 'client', 'launch')"),
    ([], "the following arguments are required: COMMAND"),
])
def test_an_unknown_or_missing_command_is_refused_by_name(argv, message, capsys):
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2 and message in capsys.readouterr().err


def test_the_installed_script_and_python_m_run_the_command():
    script = Path(sys.executable).parent / "specdec"  # pip install -e . (make setup) writes it
    assert script.is_file(), "run: .venv/bin/pip install --no-deps -e ."
    for argv in ([str(script)], [sys.executable, "-m", "runtime.command"]):
        out = run(*argv, "client", "--help")
        assert out.returncode == 0 and out.stdout.startswith("usage: specdec client"), out.stderr
    out = run(str(script), "serve")
    assert out.returncode == 2 and "invalid choice: 'serve'" in out.stderr


@pytest.mark.parametrize("command", ["draft", "target"])
def test_a_model_service_sets_openmp_before_torch_loads(command, tmp_path):
    """model_service.openmp must run before torch loads OpenMP: the command imports a service's
    module only once chosen, and that module imports openmp first; torch loads only once the flags
    have parsed (--help does not load it), before the model (here a directory that holds none)."""
    script = f"""
import sys

class Order:
    seen = []
    def find_spec(self, name, path=None, target=None):
        if name in ("torch", "model_service.openmp") and name not in self.seen:
            self.seen.append(name)

sys.meta_path.insert(0, Order())
from runtime.command import main
for argv in (["--help"], ["--model", {str(tmp_path)!r}, "--port", "0", "--threads", "1"]):
    try:
        main([{command!r}, *argv])
    except SystemExit:
        pass
    print(Order.seen)
"""
    out = run(sys.executable, "-c", script)
    assert out.returncode == 0, out.stderr
    seen = [line for line in out.stdout.splitlines() if line.startswith("[")]  # (the service prints its own lines)
    assert seen == ["['model_service.openmp']", "['model_service.openmp', 'torch']"], out.stdout + out.stderr
