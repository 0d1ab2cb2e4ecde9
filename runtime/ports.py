"""Free ports, for whatever starts servers on this host: coordinator.launch's local stacks, the
tests, the benches, a tensor-parallel group's rendezvous.

The port is free when asked for; it may be taken again before its server binds it.
"""

from __future__ import annotations

import socket
from collections import deque

# ports this process handed out lately: the OS may pick one again once its probe socket is closed (a
# stack's draft, target and coordinator asked one after another then shared a port, and gRPC's servers,
# which bind with SO_REUSEPORT, both listened there: a client's Generate reached a model service,
# "Method not found")
_handed: deque[int] = deque(maxlen=1024)


def free_port(preferred: int = 0, host: str = "127.0.0.1") -> int:
    """`preferred` if it is free on `host` ("": every interface), else a free port the OS picks, none
    this process handed out lately."""
    for port in (preferred, 0) if preferred else (0,):
        for _ in range(64):
            with socket.socket() as s:
                if port:  # (as the servers bind it: a port whose last connections linger in TIME_WAIT is free)
                    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind((host, port))
                except OSError:
                    break
                got = s.getsockname()[1]
            if port or got not in _handed:
                _handed.append(got)
                return got
    raise OSError("no free port")
