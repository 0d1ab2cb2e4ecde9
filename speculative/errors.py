"""Errors the engines raise; servicers translate them into gRPC status codes."""


class InvalidRequest(ValueError):
    """The request is malformed or out of range (INVALID_ARGUMENT). `param`: the request's field at
    fault where one is (GenerationRequest's name: a front door names it as its clients do)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


MAX_DETAILS = 4000  # bytes a status's message may take on the wire (gRPC's metadata: 8 KiB soft, 16 KiB hard)


def status_details(message: str) -> str:
    """A message as a gRPC status's details: gRPC refuses metadata past 16 KiB (and past 8 KiB now and
    then), and a message that quoted a long input (a constraint's text, a chat role) reached the
    client as RESOURCE_EXHAUSTED 'received metadata size exceeds hard limit' instead of its own
    status. Cut where it would take more than MAX_DETAILS bytes on the wire, where grpc-message is
    percent-encoded: a byte outside printable ASCII, or a '%', takes 3."""
    budget, end = MAX_DETAILS - 60, 0  # (room for the note)
    for end, char in enumerate(message):
        code = ord(char)
        budget -= 1 if 0x20 <= code < 0x7F and char != "%" else 3 * len(char.encode("utf-8", "replace"))
        if budget < 0:
            return f"{message[:end]}... ({len(message):,} characters in all)"
    return message


class SessionNotFound(KeyError):
    """No session with that id (NOT_FOUND)."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the message
        return str(self.args[0]) if self.args else "session not found"


class SessionExists(ValueError):
    """A session with that id already exists (ALREADY_EXISTS)."""


class CapacityExceeded(RuntimeError):
    """The service holds as many sessions as it may (RESOURCE_EXHAUSTED)."""


# the end of a refusal for a call that finds all sessions' tokens at --max-kv-tokens, where the call
# alone would fit: room comes back as other sessions end (a coordinator's request gives its own back
# and waits for it: coordinator/failover.py). Other RESOURCE_EXHAUSTED refusals (a full queue, the
# session cap, a session that alone would pass the cap) do not end so.
ROOM_LATER = "(--max-kv-tokens); there is room as other sessions end"


class WorkerLost(RuntimeError):
    """A tensor-parallel worker rank died; the service cannot run its model any more (UNAVAILABLE)."""
