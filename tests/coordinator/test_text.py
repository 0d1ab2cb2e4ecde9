"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from coordinator.text import TextStream


@pytest.fixture(scope="module")
def tokenizer(pair):
    return AutoTokenizer.from_pretrained(pair[1])


def stream_all(tokenizer, text: str, stop: list[str], final: bool = True) -> tuple[list[str], TextStream]:
    s = TextStream(tokenizer, stop)
    pieces = []
    for t in tokenizer(text)["input_ids"]:
        s.add(t)
        pieces.append(s.take())
        if s.stopped:
            break
    pieces.append(s.take(final=final))
    return pieces, s


def test_streamed_text_equals_decoding(tokenizer):
    text = "def f(x):\n    return x * 2  # é ünïcode ✓\n"
    pieces, s = stream_all(tokenizer, text, [])
    assert "".join(pieces) == tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert not s.stopped
    assert all("\ufffd" not in p for p in pieces)  # never half a character


def test_stop_string_cuts_and_is_never_streamed(tokenizer):
    pieces, s = stream_all(tokenizer, "print(i, i * i)\nfor j in x", ["\nfor"])
    assert s.stopped and "".join(pieces) == "print(i, i * i)"
    assert not any("\n" in p for p in pieces)  # the held-back prefix of the stop never leaked


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tokenizer):
    pieces, s = stream_all(tokenizer, "abc fo bar", ["foo"])
    assert not s.stopped and "".join(pieces) == "abc fo bar"
