"""Free ports, for whatever starts servers on this host: coordinator.launch's local stacks, the
tests, the benches, a tensor-parallel group's rendezvous.

The port is free when asked for; it may be taken again before its server binds it.
"""

from __future__ import annotations

import socket


def free_port(preferred: int = 0, host: str = "127.0.0.1") -> int:
    """`preferred` if it is free on `host` ("": every interface), else a free port the OS picks."""
    for port in (preferred, 0) if preferred else (0,):
        with socket.socket() as s:
            try:
                s.bind((host, port))
            except OSError:
                continue
            return s.getsockname()[1]
    raise OSError("no free port")
