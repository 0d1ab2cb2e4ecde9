"""`python -m tests.services.broken_draft ARGS`: the draft service (draft_service's ARGS) whose model thread
breaks as it takes its first pass, a stand-in for a fault of the thread's own (tests/services/test_services.py)."""

from __future__ import annotations

import sys

from draft_service.__main__ import main
from model_service.batcher import Batcher

ready = Batcher.ready


def broken(self: Batcher, now: float):
    if self.waiting:
        raise RuntimeError("taking a pass broke")
    return ready(self, now)


if __name__ == "__main__":
    Batcher.ready = broken
    main(sys.argv[1:])
