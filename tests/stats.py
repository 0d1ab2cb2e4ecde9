"""Chi-squared goodness of fit for the statistical tests (no scipy needed)."""

from __future__ import annotations

import math

import torch


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Upper quantile of chi-squared(df) by the Wilson-Hilferty approximation (z = 3.719: alpha = 1e-4)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_stat(counts: torch.Tensor, p: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic of counts against p, pooling cells expected below 5. -> (stat, df)"""
    counts, p = counts.double(), p.double()
    n = float(counts.sum())
    assert float(counts[p == 0].sum()) == 0, "emitted a token the target gives probability 0"
    expected = p * n
    big = expected >= 5
    obs, exp = counts[big], expected[big]
    if (~big).any():
        obs = torch.cat([obs, counts[~big].sum().view(1)])
        exp = torch.cat([exp, expected[~big].sum().view(1)])
    keep = exp > 0
    return float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum()), int(keep.sum()) - 1


def fits(counts: torch.Tensor, p: torch.Tensor) -> bool:
    stat, df = chi2_stat(counts, p)
    return df == 0 or stat < chi2_critical(df)
