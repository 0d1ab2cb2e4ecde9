"""A short `make soak SOAK_ARGS=--chaos` on the tiny pair: 8 clients for 20 s on two draft and two
target replicas killed, hung and restarted at random meanwhile. No request fails for it, every
greedy output is the reference, and no session is left behind."""

from __future__ import annotations

import pytest

from bench.soak import main as soak_main


@pytest.mark.slow
def test_a_chaos_soak(pair, capsys):
    draft, target = pair
    code = soak_main(["--draft-model", str(draft), "--target-model", str(target), "--clients", "8",
                      "--seconds", "20", "--new-tokens", "24", "--chaos"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "faults: 0" not in out and "wrong: 0" in out and "unexpected errors: 0" in out
    assert "sessions still held after the load: draft 0, target 0" in out
