"""Errors the engines raise; servicers translate them into gRPC status codes."""


class InvalidRequest(ValueError):
    """The request is malformed or out of range (INVALID_ARGUMENT). `param`: the request's field at
    fault where one is (GenerationRequest's name: a front door names it as its clients do)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


MAX_DETAILS = 4000  # characters of a status's message: at most 16,000 bytes of UTF-8


def status_details(message: str) -> str:
    """A message as a gRPC status's details: gRPC refuses metadata past 16 KiB, and a message that
    quoted a long input (a constraint's text, a chat role) reached the client as RESOURCE_EXHAUSTED
    'received metadata size exceeds hard limit' instead of its own status. Cut past MAX_DETAILS."""
    if len(message) <= MAX_DETAILS:
        return message
    return f"{message[: MAX_DETAILS - 40]}... ({len(message):,} characters in all)"


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
