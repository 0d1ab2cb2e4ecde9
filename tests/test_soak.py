"""A short `make soak`: 8 clients for 8 s of mixed greedy, long-prompt (fed in parts), sampled, cancelled
and deadline-bound requests. No unexpected error, every greedy output equal to its reference, no process lost, and
no session left behind (a request cancelled before its first round used to leak its draft session)."""

from __future__ import annotations

from bench.soak import main as soak_main


def test_short_soak(pair, capsys):
    draft, target = pair
    code = soak_main(["--draft-model", str(draft), "--target-model", str(target), "--clients", "8",
                      "--seconds", "8", "--new-tokens", "24", "--long-chars", "400"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "unexpected errors: 0" in out and "sessions still held after the load: draft 0, target 0" in out
    assert "deadline: DEADLINE_EXCEEDED" in out and "cancelled by the client" in out and "long: OK" in out
