"""Flags from the environment, and how a process ends."""

from __future__ import annotations

import subprocess
import sys

import pytest

from runtime.cli import EnvArgumentParser, add_common_flags
from runtime.transport import channel_credentials, server_credentials


def test_environment_sets_flags_and_flags_win(monkeypatch):
    def parse(*argv):
        parser = EnvArgumentParser("SPECDEC_TEST")
        add_common_flags(parser, 1234)
        parser.add_argument("--model", required=True)
        parser.add_argument("--fast", action="store_true")
        return parser.parse_args(list(argv))

    monkeypatch.setenv("SPECDEC_TEST_PORT", "999")
    monkeypatch.setenv("SPECDEC_TEST_MODEL", "/models/x")  # satisfies a required flag
    monkeypatch.setenv("SPECDEC_TEST_FAST", "true")
    args = parse()
    assert (args.port, args.model, args.fast, args.host) == (999, "/models/x", True, "127.0.0.1")
    assert parse("--port", "7").port == 7


def test_tls_flags_make_credentials_or_fail_clearly(monkeypatch, tmp_path):
    """Plaintext without flags; a half-given pair, --tls-ca alone or a file that is not PEM stop the process."""
    parser = EnvArgumentParser("SPECDEC_TEST")
    add_common_flags(parser, 1234)
    assert server_credentials(parser.parse_args([])) is None
    assert channel_credentials(None) is None
    monkeypatch.setenv("SPECDEC_TEST_TLS_CA", str(tmp_path / "ca.pem"))
    parser = EnvArgumentParser("SPECDEC_TEST")
    add_common_flags(parser, 1234)
    args = parser.parse_args([])
    assert args.tls_ca == str(tmp_path / "ca.pem")
    with pytest.raises(SystemExit, match="needs both --tls-cert and --tls-key"):
        server_credentials(args)
    (tmp_path / "cert.pem").write_text("not a certificate")
    (tmp_path / "key.pem").write_text("-----BEGIN PRIVATE KEY-----\n")
    with pytest.raises(SystemExit, match=r"--tls-cert .*cert.pem: no BEGIN CERTIFICATE in it"):
        server_credentials(parser.parse_args(["--tls-cert", str(tmp_path / "cert.pem"),
                                              "--tls-key", str(tmp_path / "key.pem")]))
    with pytest.raises(SystemExit, match="--peer-tls-ca .*ca.pem: No such file"):
        channel_credentials(str(tmp_path / "ca.pem"), prefix="--peer-tls")
    with pytest.raises(SystemExit, match="needs both --peer-tls-cert and --peer-tls-key"):
        channel_credentials(None, str(tmp_path / "cert.pem"), prefix="--peer-tls")


def test_thread_defaults_follow_the_role_and_the_cpus(monkeypatch):
    """Left at 0, --threads / --batched-threads come from the service's role and the CPUs it may
    use: the target takes them all, for one session's pass and for batched passes; the draft takes
    one. A flag given wins."""
    import argparse

    from model_service import threads as serving

    monkeypatch.setattr(serving, "available_cpus", lambda: 2)
    resolved = []
    for role, threads, batched in (("target", 0, 0), ("draft", 0, 0), ("target", 3, 0), ("target", 0, 2)):
        args = argparse.Namespace(role=role, threads=threads, batched_threads=batched)
        serving.resolve_threads(args)
        resolved.append((args.threads, args.batched_threads))
    assert resolved == [(2, 2), (1, 1), (3, 3), (2, 2)]
    monkeypatch.setattr(serving, "available_cpus", lambda: 16)
    assert serving.default_threads("target", 16) == (16, 16)
    assert serving.default_threads("draft", 16) == (1, 1)


def test_available_cpus_is_at_least_one():
    from model_service.threads import available_cpus

    assert 1 <= available_cpus() <= (__import__("os").cpu_count() or 1)


def test_exit_process_runs_the_exit_handlers_and_flushes_before_it_exits(tmp_path):
    """What a stopped service leaves (its log's last lines, what its atexit handlers write, its exit
    code) is what a normal exit leaves, though it skips the interpreter's teardown."""
    marker = tmp_path / "atexit"
    script = f"""
import atexit, logging, sys
from pathlib import Path
from runtime.cli import exit_process
logging.basicConfig(stream=sys.stderr, level="INFO")
atexit.register(lambda: Path({str(marker)!r}).write_text("ran"))
sys.stdout.write("buffered, no newline")
logging.getLogger("x").info("the last log line")
exit_process(3)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert out.returncode == 3
    assert out.stdout == "buffered, no newline"
    assert "the last log line" in out.stderr
    assert marker.read_text() == "ran"
