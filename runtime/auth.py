"""An API key on the coordinator's front doors, as vLLM's --api-key: callers present
`Authorization: Bearer <key>` (HTTP header, or gRPC metadata `authorization`), compared in constant
time. Health checks stay open (gRPC's grpc.health.v1.Health; the HTTP adapter's /health).

    --api-key KEY          or SPECDEC_COORDINATOR_API_KEY=KEY (kept out of `ps`)
    --api-key-file PATH    the key is the file's first line (a mounted Secret)

No torch here: the command-line client imports this module.
"""

from __future__ import annotations

import argparse
import hmac
from pathlib import Path

import grpc

from .interceptors import refusal

OPEN_METHODS = ("/grpc.health.v1.Health/",)  # probes need no key
UNAUTHORIZED = "a valid API key is required: send `authorization: Bearer <key>`"


def add_api_key_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--api-key", help="require `Authorization: Bearer KEY` from HTTP and gRPC callers (health"
                                          " checks stay open); prefer the environment variable or --api-key-file")
    parser.add_argument("--api-key-file", help="as --api-key, the key being this file's first line")


def api_key(args: argparse.Namespace) -> str | None:
    """The key --api-key / --api-key-file give; None: callers need none."""
    if args.api_key and args.api_key_file:
        raise SystemExit("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        try:
            lines = Path(args.api_key_file).read_text().splitlines()
        except (OSError, UnicodeDecodeError) as e:  # (missing, a directory, unreadable)
            raise SystemExit(f"--api-key-file {args.api_key_file}: cannot read it: {e}") from None
        key = lines[0].strip() if lines else ""
        if not key:
            raise SystemExit(f"--api-key-file {args.api_key_file} holds no key")
        return key
    return args.api_key or None


def bearer_ok(authorization: str | None, key: str) -> bool:
    """Whether an `authorization` value is `Bearer <key>`; the key is compared in constant time."""
    scheme, _, given = (authorization or "").partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode())


def bearer(key: str | None) -> list[tuple[str, str]]:
    """A gRPC caller's metadata presenting `key` (none without one)."""
    return [("authorization", f"Bearer {key}")] if key else []


class RequireApiKey(grpc.aio.ServerInterceptor):
    """Calls without the key end UNAUTHENTICATED before their handler runs; health checks pass."""

    def __init__(self, key: str):
        self.key = key

    async def intercept_service(self, continuation, details):
        handler = await continuation(details)
        if handler is None or details.method.startswith(OPEN_METHODS):
            return handler
        metadata = dict(details.invocation_metadata or ())
        if bearer_ok(metadata.get("authorization"), self.key):
            return handler
        return refusal(handler, grpc.StatusCode.UNAUTHENTICATED, UNAUTHORIZED)
