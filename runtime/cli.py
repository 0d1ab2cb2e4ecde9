"""Flags every specdec process reads (each also from an environment variable), and its logging."""

from __future__ import annotations

import argparse
import atexit
import logging
import os
import sys
from typing import Any, NoReturn

from .transport import add_tls_flags


class EnvArgumentParser(argparse.ArgumentParser):
    """argparse whose every flag may also come from an environment variable PREFIX_FLAG."""

    def __init__(self, env_prefix: str, **kwargs: Any):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        self.env_prefix = env_prefix
        super().__init__(**kwargs)

    def add_argument(self, *names: str, **kwargs: Any):  # type: ignore[override]
        flag = next((n for n in names if n.startswith("--")), None)
        if flag is not None and flag != "--help":
            env = f"{self.env_prefix}_{flag[2:].replace('-', '_').upper()}"
            if env in os.environ:
                value = os.environ[env]
                if kwargs.get("action") == "store_true":
                    value = value.lower() in ("1", "true", "yes", "on")
                kwargs["default"] = value
                kwargs["required"] = False
            default = kwargs.get("default")
            shown = "" if default is None or kwargs.get("action") == "store_true" else f" (default: {default})"
            kwargs["help"] = f"{kwargs.get('help', '')}{shown} [env {env}]".strip()
        return super().add_argument(*names, **kwargs)


def add_common_flags(parser: EnvArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    parser.add_argument("--port", type=int, default=port, help="port to serve on (0: pick a free one)")
    parser.add_argument("--log-level", default="INFO", help="logging level")
    parser.add_argument("--shutdown-grace", type=float, default=20.0,
                        help="seconds in-flight calls get to finish after SIGTERM (health turns NOT_SERVING at once)")
    add_tls_flags(parser)


def setup_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")


def exit_process(code: int | None = 0) -> NoReturn:
    """End a process whose work is done (a service that has stopped): run the atexit handlers
    (logging's flush, Ray's shutdown), flush stdout and stderr, and exit without the interpreter's
    teardown of every module, which with torch loaded took ~1 s a process after a stop that took
    5 ms (2 cores; each of a local stack's three processes, so every stop and rolling restart)."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a pipe whose reader went
            pass
    os._exit(code or 0)
