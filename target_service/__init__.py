"""The target service: the large model that verifies draft tokens over gRPC."""
