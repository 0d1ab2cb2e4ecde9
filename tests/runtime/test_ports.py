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


def test_a_preferred_port_whose_last_connection_lingers_in_time_wait_is_free():
    """A stack stopped and started again on the same port: the port's closed connections sit in TIME_WAIT,
    which servers bind over (SO_REUSEADDR); the probe took the port for taken and the launcher moved to
    another (an explicit --http-port ignored)."""
    port = free_port()
    with socket.create_server(("127.0.0.1", port)) as server:
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # (the server's side closes first: its end lingers in TIME_WAIT)
            assert client.recv(1) == b""
    with socket.socket() as plain:  # (the test can fail: a bind without SO_REUSEADDR is refused)
        try:
            plain.bind(("127.0.0.1", port))
            lingering = False
        except OSError:
            lingering = True
    assert lingering
    assert free_port(port) == port
