"""Predicted outputs (OpenAI's `prediction`): the client sends the text it expects the answer to be
(a file with a few lines to change, a form to fill in), and rounds verify the prediction's tokens as
draft tokens, with q one-hot at each (accepted with probability p(x), so greedy output is the target's
token for token and sampled output has exactly its distribution). Where the output parts from the
prediction, the prediction is found again by the output's last few tokens (where they occur in it, the
nearest at or after where the output last followed it), and copying goes on from there; where they occur
nowhere, the request's own draft drafts (speculative/round.py's `generate`, its `prediction`).

A round offers at most `size` tokens: it doubles after a round that keeps its whole offer and halves
after one that keeps less, between MIN_SIZE and the largest K a call may carry, since each offered
token costs the target a row of its pass (dear on a CPU, nearly free on a GPU).
"""

from __future__ import annotations

import bisect

import numpy as np

from .protocol import Proposal

MATCH_SIZES = (8, 6, 4, 3, 2)  # the output's last n tokens that find the prediction again, longest first
MIN_SIZE = 2
FIRST_SIZE = 4


def as_proposal(tokens: list[int]) -> Proposal:
    """The prediction's tokens as a draft's proposal: q one-hot at each (the wire's little-endian int32 ids
    and float32 probabilities, as sampling.one_hot_supports makes them; torch-free, as round.py is)."""
    return Proposal(list(tokens), [1] * len(tokens), np.asarray(tokens, dtype="<i4").tobytes(),
                    np.ones(len(tokens), dtype="<f4").tobytes())


class Prediction:
    """Where a generation's output stands in its prediction, and what the prediction says comes next."""

    def __init__(self, tokens: list[int], most: int):
        self.tokens = list(tokens)
        self.most = max(1, most)  # the most tokens a round may offer (the largest K a call carries)
        self.size = min(FIRST_SIZE, self.most)
        self.at: int | None = 0  # the prediction's position the output's end stands at (None: lost)
        self.seen = 0  # output tokens taken into account
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> the positions after its occurrences
        for n in MATCH_SIZES:
            for end in range(n, len(self.tokens) + 1):
                self.ends.setdefault(tuple(self.tokens[end - n : end]), []).append(end)
        self.offered = 0  # tokens offered so far...
        self.accepted = 0  # ... and kept

    def offer(self, output: list[int], limit: int) -> list[int]:
        """The prediction's next tokens after `output` (the tokens generated so far), at most `limit`
        and the round's size; [] where the output has left the prediction and not found it again."""
        new, self.seen = output[self.seen :], len(output)
        if new:
            if self.at is not None and self.tokens[self.at : self.at + len(new)] == new:
                self.at += len(new)
            else:
                self.at = self._found(output)
        if self.at is None or limit <= 0:
            return []
        return self.tokens[self.at : self.at + min(limit, self.size)]

    def kept(self, offered: int, accepted: int) -> None:
        """A round verified `offered` of the prediction's tokens and kept `accepted` of them."""
        self.offered += offered
        self.accepted += accepted
        self.size = min(self.most, self.size * 2) if accepted == offered else max(MIN_SIZE, self.size // 2)

    def _found(self, output: list[int]) -> int | None:
        """Where the prediction goes on after the output's longest tail that occurs in it: the occurrence
        nearest that starts at or after where the output last stood in it (an edit moves forward), else
        the last one."""
        for n in MATCH_SIZES:
            if len(output) < n:
                continue
            ends = self.ends.get(tuple(output[-n:]))
            if ends:
                i = bisect.bisect_left(ends, self.at + n) if self.at is not None else 0
                return ends[i] if i < len(ends) else ends[-1]
        return None
