"""The coordinator: serves clients over gRPC and runs speculative rounds between the
draft service and the target service."""
