"""Flags every specdec process reads (each also from an environment variable), and its logging."""

from __future__ import annotations

import argparse
import atexit
import logging
import math
import os
import sys
from collections.abc import Callable
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
                elif "choices" in kwargs and kwargs.get("type", str)(value) not in kwargs["choices"]:
                    # (argparse checks a flag's choices, not a default's)
                    self.error(f"{env}: invalid choice {value!r} (choose from"
                               f" {', '.join(map(str, kwargs['choices']))})")
                kwargs["default"] = value
                kwargs["required"] = False
            default = kwargs.get("default")
            shown = "" if default is None or kwargs.get("action") == "store_true" else f" (default: {default})"
            kwargs["help"] = f"{kwargs.get('help', '')}{shown} [env {env}]".strip()
        return super().add_argument(*names, **kwargs)


def number(kind: type = int, least: float | None = None, most: float | None = None,
           above: float | None = None, infinite: bool = False) -> Callable[[str], Any]:
    """An argparse type: a `kind` (int or float) >= least, <= most and > above (None: no such bound), finite unless
    `infinite`; refused as argparse refuses, the flag named (from the environment too: argparse parses a string
    default)."""
    def parse(text: str) -> Any:
        value = kind(text)
        if not ((infinite and not math.isnan(value) or math.isfinite(value)) and (least is None or value >= least) and (most is None or value <= most)
                and (above is None or value > above)):
            bounds = [f"{sign} {bound:g}" for sign, bound in ((">=", least), (">", above), ("<=", most))
                      if bound is not None]
            raise argparse.ArgumentTypeError(f"must be {' and '.join(bounds)}, not {text}")
        return value

    parse.__name__ = kind.__name__  # (argparse's "invalid int value" for what is no number)
    return parse


PORT = number(int, 0, 65535)
MAX_THREADS = 1024  # a process's torch threads: past some such number it fails to make them (a crash, not an error)
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def add_common_flags(parser: EnvArgumentParser, port: int) -> None:
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 for all interfaces)")
    parser.add_argument("--port", type=PORT, default=port, help="port to serve on (0: pick a free one)")
    parser.add_argument("--log-level", type=str.upper, choices=LOG_LEVELS, default="INFO", help="logging level")
    parser.add_argument("--shutdown-grace", type=number(float, 0), default=20.0,
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
