"""What every specdec process runs: flags from the environment and logging (cli.py), TLS and
message limits (transport.py), free loopback ports (ports.py), the gRPC server's life (server.py,
interceptors.py), the API key (auth.py), the `specdec` command (command.py), and the
Prometheus endpoint (metrics.py)."""
