"""The oracle drafting method (benchmark only): replays known continuations instead of drafting.

Given the target's own greedy output for the benchmark's prompts, it proposes the reference's
next tokens after the session's sequence, each with q one-hot at its token, and runs no model:
acceptance is 1.0 and the draft costs ~nothing, so what is left of a round is the machinery's
own cost, its ceiling (the bench's configuration e). It keeps DraftEngine's sessions and deltas
(drafting.py) and replaces only how tokens are drafted.

A synthetic draft of a set quality and cost (`make bench-gpu`): `acceptance` a < 1 corrupts
each proposed position with probability 1 - a (the first corrupted one is rejected by a greedy
target, so each token is accepted with probability a given the ones before it), and
`run_model` drafts with the model first, as the model method would, and proposes the replay
instead: each call costs what the model's K steps cost.

    python -m draft_service --oracle references.json   # a JSON list of token sequences
    python -m draft_service --model DRAFT --oracle references.json --oracle-acceptance 0.8 --oracle-cost model
"""

from __future__ import annotations

import random

import torch

from .engines import DraftEngine
from .model_runner import ModelRunner
from .sessions import Session


class OracleDraftEngine(DraftEngine):
    """Proposes the continuation of the first reference that extends the session's sequence
    (none: an empty proposal)."""

    method = "oracle"

    def __init__(self, runner: ModelRunner, references: list[list[int]], max_tokens: int = 16,
                 acceptance: float = 1.0, run_model: bool = False, seed: int = 0):
        super().__init__(runner, max_support=1, max_tokens=max_tokens)
        if not 0.0 <= acceptance <= 1.0:
            raise ValueError(f"the oracle's acceptance must lie in [0, 1], not {acceptance}")
        self.references = [tuple(r) for r in references]
        self.acceptance, self.run_model = acceptance, run_model
        self.rng = random.Random(seed)

    def _draft(self, live):
        if self.run_model:  # the model's passes, as the model method drafts; its tokens give way to the replay
            starts = [len(session.tokens) for _, _, session in live]
            super()._draft(live)
            for (_, _, session), start in zip(live, starts):
                del session.tokens[start:]
        out = [self._replay(session, call.k) for _, call, session in live]
        for _, _, session in live:  # (a replay shorter than the model's draft: drop the positions it cached)
            session.truncate(len(session.tokens))
        return out

    def _replay(self, session: Session, k: int):
        """-> (tokens, q_ids, q_probs): up to k tokens of the reference, each q one-hot at it."""
        n = len(session.tokens)
        prefix = tuple(session.tokens)
        reference = next((r for r in self.references if len(r) > n and r[:n] == prefix), ())
        tokens = list(reference[n : n + k])
        for j, token in enumerate(tokens):
            if self.acceptance < 1.0 and self.rng.random() >= self.acceptance:
                tokens[j] = (token + 1) % self.runner.vocab_size  # not the target's greedy choice
                break  # (the positions after it are never reached)
        session.tokens.extend(tokens)
        return tokens, [torch.tensor([t]) for t in tokens], [torch.ones(1) for _ in tokens]
