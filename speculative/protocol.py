"""What the coordinator and the model services say to each other, free of torch.

The round (round.py), both model services and the coordinator share these words:

  SamplingParams   how a request samples (temperature 0 = greedy); `validate` is the one check
  Proposal         K draft tokens and the sparse q each was sampled from (wire layout below)
  Verdict          how many of them the target accepted, and its own next token (or tokens: a
                   call with no proposal may ask the target to decode several on its own)
  Cost             what one peer call cost (time in the service, bytes on the wire, its batch)
  PassCost         a model pass's time as a service measured it (adaptive K reads it)
  DraftPeer, TargetPeer   the two interfaces the round calls: in-process engines
                   (model_service/local.py) or gRPC stubs (coordinator/peers.py)

and the to/from-protobuf pairs, written once. A Proposal's q travels as bytes: for token i,
`support_sizes[i]` (id, probability) pairs, ids int32 and probabilities float32, little-endian,
concatenated in `support_ids` / `support_probs` (specdec.proto, DraftProposal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

from specdec.v1 import specdec_pb2 as pb

from .errors import InvalidRequest


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0        # 1 = off
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> "SamplingParams":
        """Raise InvalidRequest naming the first field out of range; return self."""
        t = self.temperature
        if not math.isfinite(t) or t < 0:  # also NaN
            raise InvalidRequest(f"temperature must be a finite number >= 0, not {t}")
        if self.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, not {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:  # also NaN
            raise InvalidRequest(f"top_p must lie in (0, 1], not {self.top_p}")
        return self


@dataclass
class Proposal:
    """K draft tokens and the sparse q each was sampled from (wire layout: the module docstring)."""

    tokens: list[int] = field(default_factory=list)
    support_sizes: list[int] = field(default_factory=list)
    support_ids: bytes = b""
    support_probs: bytes = b""

    def slice(self, start: int, stop: int | None = None) -> "Proposal":
        """Tokens [start:stop] with their q (ids and probabilities are 4 bytes each on the wire)."""
        stop = len(self.tokens) if stop is None else min(stop, len(self.tokens))
        a, b = 4 * sum(self.support_sizes[:start]), 4 * sum(self.support_sizes[:stop])
        return Proposal(self.tokens[start:stop], self.support_sizes[start:stop], self.support_ids[a:b],
                        self.support_probs[a:b])


@dataclass
class Cost:
    """What one peer call cost: time inside the service, and bytes on the wire (0 in one process);
    and the model pass it shared with other sessions' calls (batched serving)."""

    service_ms: float = 0.0
    wire_bytes: int = 0
    batch_size: int = 1     # sessions served by that pass
    batch_tokens: int = 0   # tokens it fed (target: tokens scored)
    pass_ms: float = 0.0    # its time on the model


@dataclass
class Verdict:
    accepted: int  # draft tokens accepted, a prefix of the proposal
    token: int     # recovered (accepted < K) or bonus (accepted == K) token
    decoded: list[int] = field(default_factory=list)  # tokens after `token` the target decoded on its own


@dataclass(frozen=True)
class PassCost:
    """A model pass's time: ms = fixed + per_token * tokens + per_session * sessions, + multi_row
    where the pass feeds more than one token in all: a one-token pass multiplies each weight by a
    vector, which on CPU streams the weights faster than any product over a few rows (SmolLM2,
    float32, 2 threads: 27.6 ms for 1 token, 36.6 for 2, 42.2 for 5), so a linear fit alone would
    price a round's first draft token far below what it costs."""

    fixed: float = 0.0
    per_token: float = 0.0
    per_session: float = 0.0
    multi_row: float = 0.0

    def __call__(self, tokens: float, sessions: float) -> float:
        return (self.fixed + self.per_token * tokens + self.per_session * sessions
                + (self.multi_row if tokens > 1 else 0.0))


class DraftPeer(Protocol):
    async def propose(
        self, session_id: str, start: bool, rollback: int, append: list[int], k: int, params: SamplingParams,
        p_min: float = 0.0,
    ) -> tuple[Proposal, Cost]: ...

    async def release(self, session_id: str) -> None: ...


class TargetPeer(Protocol):
    async def verify(
        self, session_id: str, start: bool, append: list[int], proposal: Proposal, params: SamplingParams,
        steps: int = 1,
    ) -> tuple[Verdict, Cost]:
        """steps > 1 (no proposal only): the target decodes up to that many tokens on its own in this
        one call (Verdict.decoded holds those after the first), a pass each, stopping after an EOS."""

    async def release(self, session_id: str) -> None: ...


# ------------------------------------------------------------------ protobuf


def params_to_proto(params: SamplingParams) -> pb.SamplingParams:
    return pb.SamplingParams(temperature=params.temperature, top_k=params.top_k, top_p=params.top_p,
                             seed=params.seed)


def params_from_proto(msg: pb.SamplingParams) -> SamplingParams:
    return SamplingParams(msg.temperature, msg.top_k, msg.top_p, msg.seed)


def proposal_to_proto(proposal: Proposal) -> pb.DraftProposal:
    return pb.DraftProposal(tokens=proposal.tokens, support_sizes=proposal.support_sizes,
                            support_ids=proposal.support_ids, support_probs=proposal.support_probs)


def proposal_from_proto(msg: pb.DraftProposal) -> Proposal:
    return Proposal(list(msg.tokens), list(msg.support_sizes), msg.support_ids, msg.support_probs)


def pass_cost_from_info(info: pb.ModelInfo) -> PassCost:
    return PassCost(info.pass_ms_fixed, info.pass_ms_per_token, info.pass_ms_per_session, info.pass_ms_multi_row)
