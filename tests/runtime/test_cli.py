"""Flags from the environment, and how a process ends."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import grpc
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


@pytest.mark.parametrize("module, flags, named", [
    ("target_service", ["--port", "-1"], "--port: must be >= 0 and <= 65535, not -1"),
    ("coordinator", ["--port", "70000"], "--port: must be >= 0 and <= 65535, not 70000"),
    ("target_service", ["--metrics-port", "-3"], "--metrics-port: must be >= 0"),
    ("target_service", ["--log-level", "bogus"], "--log-level: invalid choice: 'BOGUS'"),
    ("target_service", ["--threads", "100000"], "--threads: must be >= 0 and <= 1024"),
    ("target_service", ["--max-context", "-1"], "--max-context: must be >= 0, not -1"),
    ("draft_service", ["--session-idle-timeout", "-1"], "--session-idle-timeout: must be > 0, not -1"),
    ("target_service", ["--max-sessions", "0"], "--max-sessions: must be >= 1, not 0"),
    ("draft_service", ["--max-tokens-per-call", "0"], "--max-tokens-per-call: must be >= 1, not 0"),
    ("coordinator", ["--shutdown-grace", "nan"], "--shutdown-grace: must be >= 0, not nan"),
    ("coordinator.launch", ["--target-replicas", "0"], "--target-replicas: must be >= 1, not 0"),
    ("coordinator.launch", ["--http-port", "-5"], "--http-port: must be >= 0 and <= 65535, not -5"),
])
def test_a_number_out_of_its_flags_range_is_refused_naming_it(module, flags, named, capsys):
    """Each served on (a negative port as 65535, 70000 as 4464), spun a core (a negative idle timeout), served and
    refused every request (0 sessions, 0 tokens a call), crashed (100,000 threads) or raised a traceback."""
    import importlib

    main = importlib.import_module(f"{module}.__main__" if module != "coordinator.launch" else module)
    parse = main.parse_args if hasattr(main, "parse_args") else main.main
    with pytest.raises(SystemExit) as refused:
        parse(["--model", "m", *flags] if module.endswith("service") else flags)
    assert refused.value.code == 2 and named in capsys.readouterr().err


def test_a_choice_from_the_environment_is_checked_as_the_flags_are(monkeypatch, capsys):
    """argparse checks a flag's choices, not a default's: SPECDEC_DRAFT_METHOD=bogus served the model method."""
    from draft_service.__main__ import parse_args

    monkeypatch.setenv("SPECDEC_DRAFT_METHOD", "bogus")
    with pytest.raises(SystemExit) as refused:
        parse_args(["--model", "m"])
    assert refused.value.code == 2 and "SPECDEC_DRAFT_METHOD: invalid choice 'bogus'" in capsys.readouterr().err
    monkeypatch.setenv("SPECDEC_DRAFT_METHOD", "ngram")
    assert parse_args(["--model", "m"]).method == "ngram"


def test_a_port_taken_or_an_unreadable_key_file_is_one_line_not_a_traceback(tmp_path):
    """A port another server listens on (gRPC's SO_REUSEPORT let a second service bind it too and take half its
    calls; a plain socket's port raised grpc's RuntimeError), and an --api-key-file that is not there."""
    import asyncio
    import socket
    from argparse import Namespace

    from runtime.auth import api_key
    from runtime.server import serve

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]

        async def start():  # (one that binds serves until stopped: the wait fails the test)
            await asyncio.wait_for(serve("target", "127.0.0.1", port, lambda server: [], lambda: asyncio.sleep(0)), 30)

        with pytest.raises(SystemExit, match=f"target: cannot listen on 127.0.0.1:{port} \\(taken"):
            asyncio.run(start())
    first = grpc.server(ThreadPoolExecutor(1))  # (a service already there: grpc's default SO_REUSEPORT)
    port = first.add_insecure_port("127.0.0.1:0")
    first.start()
    try:
        with pytest.raises(SystemExit, match=f"target: cannot listen on 127.0.0.1:{port} \\(taken"):
            asyncio.run(start())
    finally:
        first.stop(0)
    with pytest.raises(SystemExit, match="--api-key-file .*nope: cannot read it"):
        api_key(Namespace(api_key=None, api_key_file=str(tmp_path / "nope")))
