"""CopyYield: the passes of rounds that draft nothing, replayed as the target's copies would take them."""

from __future__ import annotations

from speculative.lookup import CopyYield


def test_a_sequence_that_goes_on_as_its_context_is_copied_several_tokens_a_pass():
    prompt = [9, 1, 2, 3, 4, 5, 6, 7, 8, 9, 1]  # "9 1" occurred at 0: the copy is 2, 3, 4, 5
    copies = CopyYield(prompt, 4)
    copies.add([2, 3, 4, 5, 6])
    assert (copies.tokens, copies.passes, copies.rows) == (5, 1, 5)  # the copy kept whole, and a token of its own
    copies.add([40, 41, 42, 43, 44, 45])  # nothing to copy from: one token a pass
    assert copies.passes - 1 == copies.tokens - 5
    assert copies.tokens + len(copies.pending) == 11


def test_a_copy_is_kept_up_to_where_the_sequence_parts_from_it():
    copies = CopyYield([9, 1, 2, 3, 4, 5, 9, 1], 4)  # copies 2, 3, 4, 5
    copies.add([2, 3, 7, 7, 7])  # the sequence parts after 2, 3: the pass keeps those and draws 7
    assert (copies.tokens, copies.passes, copies.rows) == (3, 1, 5)


def test_copies_stay_within_a_calls_tokens():
    """In calls of 3 tokens a pass copies at most 3 - 1 - what the call has committed: a text that
    copies its context throughout commits 3 tokens a pass (2 of them copies), not 5."""
    prompt = list(range(1, 30)) + [1, 2]  # "1 2" occurred at 0: the copy goes on 3, 4, 5...
    copies = CopyYield(prompt, 4, steps=3)
    copies.add(list(range(3, 30)))
    assert (copies.tokens, copies.passes, copies.rows) == (24, 8, 24)
    unbounded = CopyYield(prompt, 4)
    unbounded.add(list(range(3, 30)))
    assert (unbounded.tokens, unbounded.passes) == (25, 5)


def test_the_prompts_tail_is_what_is_indexed():
    prompt = [1, 2, 3] + [100 + i for i in range(CopyYield.PROMPT_TAIL)] + [1, 2]
    copies = CopyYield(prompt, 4)
    copies.add([3, 100, 101, 102, 103])  # "1 2" fell out of the tail: no copy
    assert copies.passes == copies.tokens
