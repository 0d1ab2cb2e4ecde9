"""training/everyday.py: the everyday requests are reproducible, distinct, and keep the benches' held-out
prompts out, by text and by topic."""

from assets.prompts import CHAT, HELD_OUT, normalized
from training.everyday import requests

BENCH_TOPICS = ["capital of france", "fibonacci", "photosynthesis", "focused while studying", "pancake", "sky blue",
                "autumn leaves", "tuple", "bicycle", "romeo and juliet", "hiking", "black hole", "reverse a string",
                "drinking water", "day off", "water cycle"]


def test_requests_are_reproducible_distinct_and_varied():
    first = requests(600, seed=3)
    assert first == requests(600, seed=3) and first != requests(600, seed=4)
    assert len(first) == 600 == len(set(first))
    openings = {r.split()[0] for r in first}
    assert len(openings) >= 10, openings  # explanations, recipes, code, emails, lists, facts...


def test_no_request_is_a_held_out_prompt_or_on_one_of_their_topics():
    topics = [t for t in BENCH_TOPICS if any(t in normalized(p) for p in CHAT)]
    assert len(topics) == len(BENCH_TOPICS)  # (each names a topic the bench's prompts really have)
    drawn = requests(3000, seed=0)
    assert not {normalized(r) for r in drawn} & HELD_OUT
    assert not [r for r in drawn if any(t in normalized(r) for t in topics)]


def test_excluded_texts_are_never_drawn():
    some = requests(50, seed=1)
    assert not set(requests(50, seed=1, exclude=set(some[:10]))) & set(some[:10])
