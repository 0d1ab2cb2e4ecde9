"""The oracle drafting method (benchmark only): replays known continuations instead of drafting.

Given the target's own greedy output for the benchmark's prompts, it proposes the reference's
next tokens after the session's sequence, each with q one-hot at its token, and runs no model:
acceptance is 1.0 and the draft costs ~nothing, so what is left of a round is the machinery's
own cost, its ceiling (the bench's configuration e). It keeps DraftEngine's sessions and deltas
(drafting.py) and replaces only how tokens are drafted.

    python -m draft_service --oracle references.json   # a JSON list of token sequences
"""

from __future__ import annotations

import torch

from .engines import DraftEngine
from .model_runner import ModelRunner
from .sessions import Session


class OracleDraftEngine(DraftEngine):
    """Proposes the continuation of the first reference that extends the session's sequence
    (none: an empty proposal)."""

    method = "oracle"

    def __init__(self, runner: ModelRunner, references: list[list[int]], max_tokens: int = 16):
        super().__init__(runner, max_support=1, max_tokens=max_tokens)
        self.references = [tuple(r) for r in references]

    def _draft(self, live):
        return [self._replay(session, call.k) for _, call, session in live]

    def _replay(self, session: Session, k: int):
        """-> (tokens, q_ids, q_probs): up to k tokens of the reference, each q one-hot at it."""
        n = len(session.tokens)
        prefix = tuple(session.tokens)
        reference = next((r for r in self.references if len(r) > n and r[:n] == prefix), ())
        tokens = list(reference[n : n + k])
        session.tokens.extend(tokens)
        return tokens, [torch.tensor([t]) for t in tokens], [torch.ones(1) for _ in tokens]
