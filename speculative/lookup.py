"""Prompt lookup's matching, shared by the n-gram drafter (model_service/ngram.py), the target's own
copies (model_service/engines.py, VerifyCall.lookup) and adaptive K's estimate of what those copies
bring (coordinator/adaptive.py): where the context's last n tokens occurred before, what followed them.
"""

from __future__ import annotations

LOOKUP_SIZES = range(2, 5)  # the n-gram lengths the target's copies match (the n-gram drafter's defaults)


class NgramIndex:
    """Where each n-gram of a sequence starts, for n in `sizes`: a session's cache. crop(-m)
    forgets the last m tokens, as a KV cache's crop does."""

    def __init__(self, sizes: range):
        self.sizes = sizes
        self.tokens: list[int] = []  # the sequence indexed
        self.starts: dict[tuple[int, ...], list[int]] = {}  # n-gram -> its start positions, increasing

    def get_seq_length(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            end = len(self.tokens)
            for n in self.sizes:
                if end >= n:
                    self.starts.setdefault(tuple(self.tokens[end - n :]), []).append(end - n)

    def crop(self, length: int) -> None:
        """Keep the first `length` tokens, or drop the last -length where negative."""
        keep = length if length >= 0 else len(self.tokens) + length
        while len(self.tokens) > keep:
            end = len(self.tokens)
            for n in self.sizes:
                if end >= n:
                    key = tuple(self.tokens[end - n :])
                    starts = self.starts[key]
                    starts.pop()  # the last start of this n-gram is the one ending here
                    if not starts:
                        del self.starts[key]
            self.tokens.pop()

    def continuation(self, k: int) -> list[int]:
        """Up to k tokens that followed the most recent earlier occurrence of the longest suffix
        that has one; [] when none has (or k is 0)."""
        tokens = self.tokens
        for n in reversed(self.sizes):
            starts = self.starts.get(tuple(tokens[-n:])) if k and len(tokens) > n else None
            if starts and len(starts) > 1:  # starts[-1] is the suffix itself
                source = starts[-2] + n  # the token after the earlier occurrence (< len(tokens))
                copied: list[int] = []
                for i in range(source, source + k):  # past the end, the copy reads itself
                    copied.append(tokens[i] if i < len(tokens) else copied[i - len(tokens)])
                return copied
        return []


class CopyYield:
    """What the passes of rounds that draft nothing would commit on a sequence where each also verifies
    up to `lookup` tokens copied from the context (the target's copies, VerifyCall.lookup): replayed
    over the committed tokens as they come, a pass keeps the copy's prefix that the sequence goes on
    with (under greedy params what the target keeps; sampled, it keeps x with probability p(x), which
    is the chance the sequence goes on with x) and one token of its own, in calls of `steps` tokens
    whose copies stay within them (TargetEngine: the last pass of a call copies nothing). The copies'
    extra rows are counted too (`rows`), which a pass pays for where its rows do not come free. Of the prompt, the
    last PROMPT_TAIL tokens are indexed (an estimate: a long prompt's indexing stays short work for
    the caller's event loop)."""

    PROMPT_TAIL = 4096

    def __init__(self, prompt: list[int], lookup: int, steps: int = 1 << 30):
        self.index = NgramIndex(LOOKUP_SIZES)
        self.index.extend(prompt[-self.PROMPT_TAIL:])
        self.lookup, self.steps = lookup, steps
        self.in_call = 0  # tokens the replayed call has committed
        self.pending: list[int] = []  # committed tokens not yet replayed
        self.tokens = 0  # replayed: tokens committed...
        self.passes = 0  # ... in as many passes...
        self.rows = 0  # ... that fed as many rows (a token and its copy each)

    def add(self, tokens: list[int]) -> None:
        self.pending += tokens
        while len(self.pending) > self.lookup:  # the tokens a pass's copy is checked against, and its own
            copy = self.index.continuation(min(self.lookup, self.steps - self.in_call - 1))
            kept = 0
            while kept < len(copy) and copy[kept] == self.pending[kept]:
                kept += 1
            self.index.extend(self.pending[: kept + 1])
            del self.pending[: kept + 1]
            self.in_call = (self.in_call + kept + 1) % self.steps if self.steps > 1 else 0
            self.tokens, self.passes, self.rows = self.tokens + kept + 1, self.passes + 1, self.rows + 1 + len(copy)
