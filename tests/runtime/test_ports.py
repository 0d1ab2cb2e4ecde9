"""runtime/ports.py: a free port, and never one this process handed out lately."""

from __future__ import annotations

import socket

from runtime.ports import free_port


def test_ports_asked_one_after_another_are_distinct():
    """The OS picks a closed probe's port at random and may pick it again: 400 picks from its ~28,000
    would repeat one with probability ~0.94. A stack's services asked one after another then shared a
    port (gRPC binds with SO_REUSEPORT: both listened)."""
    ports = [free_port() for _ in range(400)]
    assert len(set(ports)) == len(ports)


def test_a_preferred_port_is_given_where_free_and_another_where_taken():
    port = free_port()
    assert free_port(port) == port  # asked for by number: that one, handed out before or not
    with socket.socket() as held:
        held.bind(("127.0.0.1", port))
        held.listen()
        other = free_port(port)
        assert other != port
        with socket.socket() as s:
            s.bind(("127.0.0.1", other))
