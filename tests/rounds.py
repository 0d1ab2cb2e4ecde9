"""Generation through the speculative round in one process, for the tests that compare its output."""

from __future__ import annotations

import asyncio

from speculative.protocol import SamplingParams
from speculative.round import Stats, generate


def run(draft, target, params: SamplingParams, k: int, seed: int, n: int, prompt: list[int]):
    """n new tokens of `prompt` through draft and target (peers), params with `seed`. -> (tokens, Stats)"""
    stats = Stats()

    async def go():
        out = []
        async for new in generate(draft, target, prompt, max_new_tokens=n, k=k,
                                  params=SamplingParams(params.temperature, params.top_k, params.top_p, seed),
                                  max_context=256, stats=stats, session_id=f"s{seed}"):
            out.extend(new)
        return out

    return asyncio.run(go()), stats
