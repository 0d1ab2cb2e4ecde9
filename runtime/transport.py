"""How the processes connect: plaintext or TLS, and how large a message may be, for every server
and every channel.

A server (draft_service, target_service, coordinator) takes --tls-cert / --tls-key / --tls-ca:

    no flag                          plaintext (the default)
    --tls-cert CERT --tls-key KEY    TLS: the server presents CERT
    ... and --tls-ca CA              mutual TLS: a client must present a certificate CA signed, or its
                                     handshake fails (the client sees UNAVAILABLE)

A client takes the mirror image (`add_dial_flags`): a CA to verify the server with, and a
certificate and key to present where the server asks for one. coordinator.client has them as
--tls-ca / --tls-cert / --tls-key; the coordinator, a client of its model services, as
--peer-tls-ca / --peer-tls-cert / --peer-tls-key. A server's certificate must name (SubjectAltName)
the host it is dialled as.

No torch here: the command-line client imports this module.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import grpc

# What a client may send the coordinator (--max-request-bytes): a prompt and its settings. 4 MiB
# holds a prompt of about a million tokens, more than any context; gRPC refuses a larger one with
# RESOURCE_EXHAUSTED before it is parsed, and nothing else on the server notices.
MAX_REQUEST_BYTES = 4 * 1024 * 1024
# Every other message. The largest: a session's first Propose / Verify, the whole prompt as token
# ids (at most 5 bytes each, after the coordinator has checked it fits the context); the
# GetTokenizer chunks (1 MiB); a whole generation's text and ids in the coordinator's answer.
MAX_MESSAGE_BYTES = 16 * 1024 * 1024
MESSAGE_LIMITS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
]
CHANNEL_OPTIONS = MESSAGE_LIMITS + [("grpc.enable_retries", 0)]  # the coordinator's, to its model services

CERTIFICATE, PRIVATE_KEY = b"-----BEGIN CERTIFICATE-----", b"PRIVATE KEY-----"


def add_tls_flags(parser: argparse.ArgumentParser) -> None:
    """A server's --tls-cert / --tls-key / --tls-ca (read by `server_credentials`)."""
    parser.add_argument("--tls-cert", help="PEM certificate (chain) to serve TLS with, with --tls-key"
                                           " (default: plaintext)")
    parser.add_argument("--tls-key", help="PEM private key of --tls-cert")
    parser.add_argument("--tls-ca", help="PEM CA certificate(s): require mutual TLS, accepting only clients"
                                         " presenting a certificate signed by one of them")


def add_dial_flags(parser: argparse.ArgumentParser, prefix: str, server: str) -> None:
    """A client's --PREFIX-ca / --PREFIX-cert / --PREFIX-key, for reaching `server` (read by
    `channel_credentials`)."""
    parser.add_argument(f"--{prefix}-ca", help=f"PEM CA certificate(s) to verify {server} with: connect over TLS"
                                               " (default: plaintext)")
    parser.add_argument(f"--{prefix}-cert", help=f"PEM certificate to present to {server} (for mutual TLS),"
                                                 f" with --{prefix}-key")
    parser.add_argument(f"--{prefix}-key", help=f"PEM private key of --{prefix}-cert")


def read_pem(path: str, flag: str, marker: bytes) -> bytes:
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise SystemExit(f"{flag} {path}: {e.strerror}") from None
    if marker not in data:
        raise SystemExit(f"{flag} {path}: no {marker.decode().strip('-')} in it")
    return data


def server_credentials(args: argparse.Namespace) -> grpc.ServerCredentials | None:
    """--tls-cert / --tls-key / --tls-ca -> None (plaintext), TLS, or mutual TLS."""
    cert, key, ca = args.tls_cert, args.tls_key, args.tls_ca
    if not (cert or key or ca):
        return None
    if not (cert and key):
        raise SystemExit("TLS needs both --tls-cert and --tls-key (--tls-ca adds client certificates to TLS)")
    pair = (read_pem(key, "--tls-key", PRIVATE_KEY), read_pem(cert, "--tls-cert", CERTIFICATE))
    roots = read_pem(ca, "--tls-ca", CERTIFICATE) if ca else None
    return grpc.ssl_server_credentials([pair], root_certificates=roots, require_client_auth=roots is not None)


def channel_credentials(ca: str | None, cert: str | None = None, key: str | None = None,
                        prefix: str = "--tls") -> grpc.ChannelCredentials | None:
    """TLS that verifies the server against `ca` (no ca: the system's roots) and presents `cert`
    if given; None (plaintext) when no file is given. `prefix` names the flags in errors."""
    if not (ca or cert or key):
        return None
    if bool(cert) != bool(key):
        raise SystemExit(f"a client certificate needs both {prefix}-cert and {prefix}-key")
    return grpc.ssl_channel_credentials(
        root_certificates=read_pem(ca, f"{prefix}-ca", CERTIFICATE) if ca else None,
        private_key=read_pem(key, f"{prefix}-key", PRIVATE_KEY) if key else None,
        certificate_chain=read_pem(cert, f"{prefix}-cert", CERTIFICATE) if cert else None,
    )


def open_channel(address: str, credentials: grpc.ChannelCredentials | None = None,
                 options: list[tuple[str, object]] = MESSAGE_LIMITS, aio: bool = False):
    """A channel to `address`: TLS with `credentials`, plaintext without; grpc.aio's if `aio`."""
    module = grpc.aio if aio else grpc
    if credentials is None:
        return module.insecure_channel(address, options=options)
    return module.secure_channel(address, credentials, options=options)
