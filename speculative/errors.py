"""Errors the engines raise; servicers translate them into gRPC status codes."""


class InvalidRequest(ValueError):
    """The request is malformed or out of range (INVALID_ARGUMENT). `param`: the request's field at
    fault where one is (GenerationRequest's name: a front door names it as its clients do)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class SessionNotFound(KeyError):
    """No session with that id (NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the message
        return str(self.args[0]) if self.args else "session not found"


class SessionExists(ValueError):
    """A session with that id already exists (ALREADY_EXISTS)."""


class CapacityExceeded(RuntimeError):
    """The service holds as many sessions as it may (RESOURCE_EXHAUSTED)."""


class WorkerLost(RuntimeError):
    """A tensor-parallel worker rank died; the service cannot run its model any more (UNAVAILABLE)."""
