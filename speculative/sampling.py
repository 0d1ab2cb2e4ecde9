"""Sampling maths: target/draft distributions, sparse draft supports, rejection sampling.

Terms, used the same way everywhere in specdec:
  p            the target's distribution at a position, after the request's
               temperature / min-p / top-k / top-p (temperature 0: one-hot at the argmax).
  q            the distribution the draft sampled its token from at a position;
               it is the draft's p truncated to its `support` (the draft's
               top-`max_support` tokens) and renormalised: exactly what it sampled
               from, so it can be shipped sparsely without breaking exactness.
  accepted     draft tokens that pass the test u < p(x) / q(x).
  recovered    the token sampled from norm(max(0, p - q)) at the first rejection.
  bonus        the token sampled from p after all K draft tokens are accepted.

Rejection sampling (Leviathan et al. 2022, Chen et al. 2023) makes every emitted
token distributed exactly as p, whatever q is.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .errors import InvalidRequest
from .protocol import SamplingParams


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """p after temperature, then min-p, top-k and top-p (vLLM's order; transformers' for the last two).
    min-p keeps a token where (its logit - the largest) / temperature is at least log(min_p) as a float32:
    its probability at least min_p times the most likely one's.

    logits: [..., V] -> probs: [..., V] float32, rows summing to 1.
    """
    logits = logits.float()
    if params.greedy:
        # temperature -> 0: all mass on the argmax
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    # shifted so the largest logit is 0 before dividing: a tiny temperature (down to float32's
    # subnormals) then tends to the argmax (0 / t = 0, the rest -> -inf) instead of inf / inf = nan
    logits = (logits - row_max(logits)).div_(params.temperature)
    if params.min_p > 0:
        logits = logits.masked_fill(logits < min_p_floor(params.min_p), float("-inf"))
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        probs = nucleus(probs, params.top_p)
    return probs


def min_p_floor(min_p: float) -> float:
    """The least (logit - the largest) / temperature min-p keeps: log(min_p) rounded to float32, as the
    kernel compares it (model_service/csrc/q4_mm.cpp)."""
    return float(np.float32(math.log(min_p)))


# tokens nucleus() looks among first: at T = 0.7 a chat model's top 256 almost always hold 0.95 of p
NUCLEUS_FIRST = 256


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [..., V] cut to top-p: in each row the smallest set of its most probable tokens whose mass
    reaches top_p (the first always stays; a token stays when the mass before it is under top_p),
    renormalised. The set is found among the top NUCLEUS_FIRST tokens (torch.topk), 8x more while their
    mass falls short, up to a sort of the whole row: a full sort of SmolLM2's 49,152 took ~4 ms a row
    on 2 Xeon cores, 21 ms for a five-row verify (topk of 256: ~0.2 ms)."""
    vocab = probs.shape[-1]
    k = min(vocab, NUCLEUS_FIRST)
    while True:
        top, order = torch.topk(probs, k, dim=-1)  # each row's k largest, descending
        before = top.cumsum(-1) - top  # the mass ahead of each
        if k == vocab or bool(((before[..., -1] + top[..., -1]) >= top_p).all()):
            break  # every row's cut lies within its top k: the tokens after them have >= top_p before them
        k = min(vocab, 8 * k)
    top = top.masked_fill(before >= top_p, 0.0)
    probs = torch.zeros_like(probs).scatter_(-1, order, top)
    return probs / probs.sum(-1, keepdim=True)


def sample(probs: torch.Tensor, generator: torch.Generator | None, draw=None) -> int:
    """One token from a [V] distribution (non-negative, any positive total): the first whose
    cumulative mass (float64) exceeds one uniform draw of the generator times the total, so a token
    of probability 0 is never drawn. torch.multinomial draws one exponential per token instead
    (49,152 for SmolLM2): ~1.2 ms a token on 2 Xeon cores, against ~0.05. draw(probs, u) -> the id
    (-1: no positive finite total), where given and the row is float32 on the CPU: the same draw in one
    call (model_service.q4_kernel.draw: ~15 us, the sums 16 ids at a time)."""
    if draw is not None and probs.device.type == "cpu" and probs.dtype == torch.float32:
        i = draw(probs, float(torch.rand(1, dtype=torch.float64, generator=generator)))
        if i < 0:
            raise ValueError(f"cannot sample from a distribution of total mass {float(probs.double().sum())}")
        return i
    cdf = probs.double().cumsum(-1)
    total = float(cdf[-1])
    if not 0.0 < total < float("inf"):
        raise ValueError(f"cannot sample from a distribution of total mass {total}")
    u = torch.rand(1, dtype=torch.float64, device=probs.device, generator=generator)
    i = int(torch.searchsorted(cdf, u * total, right=True))
    if i >= cdf.shape[-1]:  # u * total rounded up to the total
        i = int(probs.nonzero()[-1])
    return i


def draft_support(probs: torch.Tensor, max_support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q: the draft's p restricted to its top-`max_support` tokens, renormalised.

    probs: [V] -> (ids [S], q [S]) with S <= max_support, q > 0, sorted by q descending.
    """
    values, ids = torch.topk(probs, min(max_support, probs.shape[-1]))
    keep = values > 0
    values, ids = values[keep], ids[keep]
    return ids, values / values.sum()


class ProbRows:
    """logits_to_probs(logits, params) for logits [R, V], each row computed when first read (`rows[i]`):
    rejection sampling reads the rows only up to its first rejection, ~1.3 of a K = 4 verify's 5 at an
    acceptance of 0.25, and a row of p costs its softmax and top-k or top-p (SmolLM2's 49,152 ids on 2
    Xeon cores: ~0.07 ms a row at top_p 1, ~0.4-0.8 ms with top-p 0.9's cut: `make bench-sampling`).
    to_probs(logits, params): how a row is computed (logits_to_probs where not given; the target service
    passes the kernel's model_service.q4_kernel.target_probs, ~0.05-0.07 ms a row, where it is built)."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams, to_probs=None):
        self.logits, self.params = logits, params
        self.to_probs = to_probs or logits_to_probs
        self.device = logits.device
        self._rows: dict[int, torch.Tensor] = {}

    def __len__(self) -> int:
        return self.logits.shape[0]

    def __getitem__(self, i: int) -> torch.Tensor:
        row = self._rows.get(i)
        if row is None:
            row = self._rows[i] = self.to_probs(self.logits[i], self.params)
        return row


def rejection_sample(
    p: torch.Tensor | ProbRows,
    draft_tokens: torch.Tensor,
    q_ids: list[torch.Tensor],
    q_probs: list[torch.Tensor],
    generator: torch.Generator | None,
    draw=None,
) -> tuple[int, int]:
    """Verify K draft tokens against the target.

    p: [K+1, V] target distributions, or ProbRows computing them as read; row i is at draft position
       i, row K is the bonus position (rows past the first rejection are not read).
    draft_tokens: [K]; q_ids[i], q_probs[i]: [S_i], the support of q at position i.
    draw: sample's (the kernel's draw, where given).
    Returns (accepted, token): the number of accepted draft tokens and the
    recovered token (accepted < K) or the bonus token (accepted == K).
    """
    k = draft_tokens.shape[0]
    if k:
        u = torch.rand(k, generator=generator, device=p.device)  # one a position, drawn before any is tested
        for i in range(k):
            p_i, x = p[i], draft_tokens[i]
            q_x = q_probs[i][q_ids[i] == x].sum()
            # accept x with probability min(1, p(x) / q(x)), i.e. when u * q(x) < p(x):
            # q(x) <= p(x) always accepts, p(x) = 0 never does
            if bool(u[i] * q_x >= p_i[x]):
                # recovered token ~ norm(max(0, p - q))
                residual = p_i.clone()
                residual.index_put_((q_ids[i],), -q_probs[i], accumulate=True)
                residual.clamp_(min=0.0)
                if residual.sum() <= 0:  # p == q up to rounding: rejection was a rounding event
                    residual = p_i
                return i, sample(residual / residual.sum(), generator, draw)
    # every draft token accepted: bonus token ~ p at position K
    return k, sample(p[k], generator, draw)


def argmax_rows(logits: torch.Tensor) -> list[int] | int:
    """The argmax of each row of `logits` [..., V] (of a row [V]: one int), the first maximum on
    ties, as torch's. float32 on the CPU goes through numpy: torch's CPU argmax is ~10x slower
    (5 x 49,152 logits: 233 us against 22, 9 rows 466 against 37; 2 Zen 3 cores) and splits its rows
    over the threads, so a core another process holds stalls it (6.6 ms with a stack at work)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return logits.detach().numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def row_max(logits: torch.Tensor) -> torch.Tensor:
    """The largest value of each row of `logits` [..., V], kept as [..., 1]; float32 on the CPU through
    numpy, as argmax_rows (5 x 49,152 logits: ~15 us against torch's ~150)."""
    if logits.device.type == "cpu" and logits.dtype == torch.float32:
        return torch.from_numpy(logits.detach().numpy().max(-1, keepdims=True))
    return logits.max(-1, keepdim=True).values


def greedy_verify(logits: torch.Tensor, draft_tokens: list[int]) -> tuple[int, int]:
    """`rejection_sample` where p is one-hot at the argmax (temperature 0), without building p.

    logits: [K+1, V]; draft_tokens: K ids. With p one-hot, p(x) / q(x) is 0 or >= 1: a draft
    token is accepted exactly when it is the argmax; at the first other one, norm(max(0, p - q))
    is one-hot at the argmax (q(argmax) < 1 there, as q(x) > 0), and so is the bonus p. Ties go
    to the first maximum, as in logits_to_probs. -> (accepted, recovered or bonus token)
    """
    best = argmax_rows(logits)  # [K+1]
    for i, x in enumerate(draft_tokens):
        if best[i] != x:
            return i, best[i]
    return len(draft_tokens), best[len(draft_tokens)]


# ------------------------------------------------------------- wire encoding

_IDS = np.dtype("<i4")
_PROBS = np.dtype("<f4")


def encode_supports(q_ids: list[torch.Tensor], q_probs: list[torch.Tensor]) -> tuple[list[int], bytes, bytes]:
    """Sparse q for the wire: (support_sizes, support_ids bytes, support_probs bytes)."""
    if not q_ids:
        return [], b"", b""
    ids = torch.cat(q_ids).cpu().numpy().astype(_IDS)
    probs = torch.cat(q_probs).float().cpu().numpy().astype(_PROBS)
    return [int(t.shape[0]) for t in q_ids], ids.tobytes(), probs.tobytes()


def one_hot_supports(tokens: list[int]) -> tuple[list[int], bytes, bytes]:
    """encode_supports for a greedy draft: each token's q is one-hot at the token."""
    return [1] * len(tokens), np.asarray(tokens, dtype=_IDS).tobytes(), np.ones(len(tokens), dtype=_PROBS).tobytes()


def check_supports(
    tokens: list[int] | int, sizes: list[int], ids: bytes, probs: bytes, vocab: int
) -> tuple[np.ndarray, np.ndarray, list[int]]:
    """Check a proposal's sparse q for everything a peer could get wrong; with the draft tokens
    themselves (not just their count), also that each has probability in its own q.
    -> (ids, probs, sizes) as arrays, one slice per token"""
    num_tokens = tokens if isinstance(tokens, int) else len(tokens)
    if len(sizes) != num_tokens:
        raise InvalidRequest(f"proposal has {num_tokens} tokens but {len(sizes)} support sizes")
    if len(ids) % 4 or len(probs) % 4:
        raise InvalidRequest("support_ids and support_probs must be whole int32 / float32 arrays")
    ids_np = np.frombuffer(ids, dtype=_IDS)
    probs_np = np.frombuffer(probs, dtype=_PROBS)
    sizes = [int(s) for s in sizes]
    total = sum(sizes)
    if any(s <= 0 for s in sizes) or ids_np.size != total or probs_np.size != total:
        raise InvalidRequest(
            f"support sizes {sizes} do not match {ids_np.size} support ids and {probs_np.size} probabilities"
        )
    if not total:
        return ids_np, probs_np, sizes
    (_check_few if total <= FEW_SUPPORT_ENTRIES else _check_many)(tokens, sizes, ids_np, probs_np, vocab)
    return ids_np, probs_np, sizes


# supports of at most this many entries in all (a greedy K <= 16 proposal's one-hot ones) are checked in
# plain Python: numpy's dozen calls cost ~0.1 ms a verify call there, more than the checks themselves
FEW_SUPPORT_ENTRIES = 32


def _check_many(tokens: list[int] | int, sizes: list[int], ids: np.ndarray, probs: np.ndarray, vocab: int) -> None:
    """check_supports' checks of the values (ids in the vocabulary, q finite, non-negative and summing to 1
    at each position, each id once at a position, each draft token in its q), over numpy arrays."""
    if ids.min() < 0 or ids.max() >= vocab:
        raise InvalidRequest(f"support ids must lie in [0, {vocab})")
    if not np.all(np.isfinite(probs)) or probs.min() < 0:
        raise InvalidRequest("draft probabilities must be finite and non-negative")
    starts = np.cumsum([0, *sizes[:-1]])
    mass = np.add.reduceat(probs, starts, dtype=np.float64)
    off = np.abs(mass - 1.0) > 1e-3
    if off.any():
        i = int(off.argmax())
        raise InvalidRequest(f"draft probabilities at position {i} sum to {mass[i]:.6f}, not 1")
    keys = np.sort(np.repeat(np.arange(len(sizes), dtype=np.int64), sizes) * vocab + ids)  # (position, id) pairs
    repeated = keys[1:][keys[1:] == keys[:-1]]
    if repeated.size:  # (q(x) would be ambiguous)
        raise InvalidRequest(f"support ids repeat at position {int(repeated.min() // vocab)}: each id once")
    if not isinstance(tokens, int):
        owner = np.repeat(np.asarray(tokens, dtype=np.int64), sizes)  # each support entry's draft token
        found = np.logical_or.reduceat((ids == owner) & (probs > 0), starts)
        if not found.all():
            i = int(found.argmin())
            raise InvalidRequest(f"draft token {tokens[i]} at position {i} has no probability in its q")


def _check_few(tokens: list[int] | int, sizes: list[int], ids: np.ndarray, probs: np.ndarray, vocab: int) -> None:
    """_check_many's checks, in the same order and with the same messages, in plain Python."""
    id_list, p_list = ids.tolist(), probs.tolist()
    if min(id_list) < 0 or max(id_list) >= vocab:
        raise InvalidRequest(f"support ids must lie in [0, {vocab})")
    if not all(math.isfinite(p) and p >= 0 for p in p_list):
        raise InvalidRequest("draft probabilities must be finite and non-negative")
    bounds, start = [], 0
    for size in sizes:
        bounds.append((start, start + size))
        start += size
    for i, (a, b) in enumerate(bounds):
        mass = sum(p_list[a:b])  # (float64, in order, as numpy's reduceat sums)
        if abs(mass - 1.0) > 1e-3:
            raise InvalidRequest(f"draft probabilities at position {i} sum to {mass:.6f}, not 1")
    for i, (a, b) in enumerate(bounds):
        if len(set(id_list[a:b])) != b - a:
            raise InvalidRequest(f"support ids repeat at position {i}: each id once")
    if not isinstance(tokens, int):
        for i, (a, b) in enumerate(bounds):
            if not any(id_list[j] == tokens[i] and p_list[j] > 0 for j in range(a, b)):
                raise InvalidRequest(f"draft token {tokens[i]} at position {i} has no probability in its q")


def supports_to_tensors(
    ids: np.ndarray, probs: np.ndarray, sizes: list[int], device: torch.device | str = "cpu"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """check_supports' arrays as per-token tensors (ids int64, probs float32) on `device`."""
    ids_t = torch.from_numpy(ids.astype(np.int64)).to(device)
    probs_t = torch.from_numpy(probs.copy()).to(device)
    return list(torch.split(ids_t, sizes)), list(torch.split(probs_t, sizes))


def decode_supports(
    num_tokens: int, sizes: list[int], ids: bytes, probs: bytes, vocab: int, device: torch.device | str = "cpu"
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Inverse of encode_supports, checking everything a peer could get wrong."""
    return supports_to_tensors(*check_supports(num_tokens, sizes, ids, probs, vocab), device)


def draft_token(row: torch.Tensor, params, p_min: float, max_support: int, generator: torch.Generator | None,
                support=None) -> tuple[int, torch.Tensor | None, torch.Tensor | None] | None:
    """A draft's next token from its logits `row` [V]: the argmax (greedy) or a draw from its sparse
    support -> (token, support ids, q), ids and q None when greedy; None where the draft's top
    probability (greedy: of softmax(row); sampled: of p after temperature, min-p and top-k, before top-p)
    is under p_min, or where no token has probability (drafting stops there).

    Sampled, q is draft_support(logits_to_probs(row, params), max_support) (up to rounding) without
    building p over the whole row: temperature, min-p, top-k and top-p keep the order of the logits, so the
    support is the row's top `max_support` tokens (one torch.topk), and p there needs only the mass
    of the tokens top-k keeps (one sum of exponentials); top-p's cut is a prefix of them, or lies past
    them, where the support ends anyway (`make bench-sampling`, 2 Xeon cores, the EAGLE head's 11,264
    ids: ~105 us a token as building p over the row took; with top_p 0.9 ~160 against ~980).

    support: a function computing the sampled q as this does, (row, params, p_min, max_support) -> (ids, q)
    or None where the draft stops (a model service's kernel, model_service.q4_kernel.draft_support); the
    token is then drawn from it here, with the generator's one uniform."""
    if params.greedy:
        if p_min > 0 and float(torch.softmax(row.float(), -1).max()) < p_min:
            return None
        return argmax_rows(row), None, None
    if support is not None:
        found = support(row, params, p_min, max_support)
        if found is None:
            return None
        ids, q = found
        return int(ids[sample(q, generator)]), ids, q
    row = row.float()
    vocab = row.shape[-1]
    kept = params.top_k if 0 < params.top_k < vocab else vocab  # the tokens top-k keeps
    logits, ids = torch.topk(row, min(max_support, kept))  # descending
    shift = float(logits[0])  # the largest logit: exp(0) = 1 at most, and a tiny temperature tends to the argmax
    # (top-k: the first k of torch.topk's order where the k-th logit ties others, as the support takes them)
    top = row if kept == vocab else logits if kept <= logits.shape[0] else torch.topk(row, kept).values
    top, logits = top.sub(shift).div_(params.temperature), logits.sub(shift).div_(params.temperature)
    if params.min_p > 0:  # (the largest, 0, always stays)
        floor = min_p_floor(params.min_p)
        top, logits = top.masked_fill(top < floor, float("-inf")), logits.masked_fill(logits < floor, float("-inf"))
    mass = top.exp_().sum()
    p = logits.exp_().div_(mass)  # p at the support's tokens
    if p_min > 0 and not float(p[0]) >= p_min:
        return None
    if params.top_p < 1.0:
        p = p.masked_fill(p.cumsum(0) - p >= params.top_p, 0.0)
    keep = p > 0
    if not bool(keep.any()):
        return None
    ids, p = ids[keep], p[keep]
    q = p / p.sum()
    return int(ids[sample(q, generator)]), ids, q
