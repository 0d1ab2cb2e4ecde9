"""Incremental detokenization and stop strings."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

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


def test_min_tokens_holds_stop_strings_off_for_its_tokens(tokenizer):
    """vLLM's min_tokens: a stop string completed by the first min_tokens tokens does not end the text; one
    completed after them does, even where it began in them."""
    ids = tokenizer("a; b; c; d")["input_ids"]
    semis = [n for n, t in enumerate(ids) if tokenizer.decode(ids[: n + 1]).endswith(";")]
    assert len(semis) == 3  # (the test can fail)

    def stopped_at(stop: str | list[str], min_tokens: int) -> str | None:
        s = TextStream(tokenizer, [stop] if isinstance(stop, str) else stop, min_tokens=min_tokens)
        for t in ids:
            s.add(t)
            if s.stopped:
                return s.take(final=True)
        return None

    assert stopped_at(";", 0) == "a"
    assert stopped_at(";", semis[0] + 1) == "a; b"  # the first ";" came within min_tokens
    assert stopped_at(";", semis[2] + 1) is None
    before = next(n for n in range(len(ids)) if tokenizer.decode(ids[: n + 1]).endswith("; b"))
    assert stopped_at("; b;", before) == "a"  # begun within min_tokens, completed after them
    # a shorter stop string beside a longer one: the first ";" came within min_tokens, not a stop later either
    assert stopped_at([";", "a much longer stop"], semis[0] + 1) == "a; b"


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """Words with SentencePiece's word-start mark, decoded as Llama 2's and Mistral's tokenizers decode
    them: the space that starts the first token decoded is dropped."""
    vocab = {"<unk>": 0, "\u2581The": 1, "\u2581capital": 2, "\u2581is": 3, "\u2581Paris": 4, ".": 5}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="always")
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def test_a_completion_after_its_prompt_keeps_its_first_tokens_space():
    tokenizer = sentencepiece_like()
    prompt, completion = [1, 2, 3], [4, 5]
    assert tokenizer.decode([4]) == "Paris"  # (alone: the space dropped)
    s = TextStream(tokenizer, [], context=prompt)
    for t in completion:
        s.add(t)
    text = s.take(final=True)
    assert text == " Paris." and tokenizer.decode(prompt) + text == tokenizer.decode(prompt + completion)
    alone = TextStream(tokenizer, [])
    for t in completion:
        alone.add(t)
    assert alone.take(final=True) == "Paris."  # no prompt: as the tokenizer decodes it


def test_a_prompt_that_ends_inside_a_character_is_no_context(tokenizer):
    """Its unfinished character's bytes would join the completion's: the completion decodes alone."""
    euro = tokenizer("\u20ac", add_special_tokens=False)["input_ids"]  # three bytes
    head = tokenizer("price ", add_special_tokens=False)["input_ids"]
    assert len(euro) >= 2  # (byte-level BPE that never merged them)
    s = TextStream(tokenizer, [], context=head + euro[:1])
    for t in euro[1:]:
        s.add(t)
    assert s.take(final=True) == tokenizer.decode(euro[1:])


@pytest.mark.parametrize("stop", ["\ufffd", "t\ufffd"])
def test_a_stop_string_the_last_unfinished_character_completes_ends_the_text(tokenizer, stop):
    """The output's end releases a character left unfinished as U+FFFD: a stop string it completes is looked for
    there too (it was released past the stop string, the finish "length")."""
    euro = tokenizer("\u20ac", add_special_tokens=False)["input_ids"]  # three bytes
    s = TextStream(tokenizer, [stop])
    for t in tokenizer("set", add_special_tokens=False)["input_ids"] + euro[:1]:
        s.add(t)
    streamed = s.take()
    assert not s.stopped and streamed + s.take(final=True) == "se" + ("t" if stop == "\ufffd" else "")
    assert s.stopped
