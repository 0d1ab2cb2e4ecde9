"""OpenAI's `logprobs` objects from the target's (speculative/protocol.py Logprobs).

Each generated token's log-probability is the target's, at the position the token was committed in
(a verify pass's row, or a decode step's): speculation changes how many passes it takes, never the
figure. It is the log-softmax of the model's logits, a structured output's mask applied, before
temperature, top-k and top-p (vLLM's default), so a request sampled at any temperature reads the
model's own confidence. A token the mask forbids has -inf: such a token is left out of the top lists, which
then hold fewer than n (a constrained position where few tokens are allowed), and -9999.0 stands
for any other -inf (JSON has none; OpenAI's figure for "never").

Chat completions (`logprobs: true`, `top_logprobs: n`): `{"content": [{"token", "logprob", "bytes",
"top_logprobs": [{"token", "logprob", "bytes"}...]}...], "refusal": null}`. Completions (`logprobs:
n`): `{"tokens", "token_logprobs", "top_logprobs": [{token: logprob}...], "text_offset"}`, each
top dict with the sampled token beside the n most likely (OpenAI's "up to logprobs + 1"); a token's
offset is where its text starts in the completion's text, in characters (the bytes of the tokens
before it decoded as the text is: a token that ends a character split over several starts where
the character does; special tokens, which the text leaves out, take no room). With `echo` the
prompt's tokens come first, scored by the target's pass over the prompt (the first one has null for
its logprob and top: nothing comes before it), and the offsets count from the prompt's start, as the
echoed text does. A token's text is what
the tokenizer decodes it to alone (special tokens as written; part of a character is U+FFFD), its
bytes the UTF-8 bytes it stands for (a byte-level BPE token's own bytes, which may be part of a
character).
"""

from __future__ import annotations

import codecs
import functools
import math
import re
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

from speculative.protocol import Logprobs

NEVER = -9999.0  # a masked-out token's log-probability, as sent
BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback
SPACE_MARK = "\u2581"  # SentencePiece's word start ("▁")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (transformers' bytes_to_unicode), reversed: character -> byte."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


class TokenText:
    """A tokenizer's tokens as logprobs show them: (text, UTF-8 bytes), each worked out once (one of
    these serves every request: at most a vocabulary's entries)."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.known: dict[int, tuple[str, list[int]]] = {}
        self.special = frozenset(getattr(tokenizer, "all_special_ids", ()))  # left out of the text

    def __call__(self, token: int) -> tuple[str, list[int]]:
        if token not in self.known:
            text = self.tokenizer.decode([token], skip_special_tokens=False)
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and piece.startswith(SPACE_MARK) and not text.startswith(" "):
                text = " " + text  # (a SentencePiece decoder drops the space of the first token it decodes)
            self.known[token] = (text, list(self._bytes(token, text)))
        return self.known[token]

    def _bytes(self, token: int, text: str) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(token)
        if isinstance(piece, str):
            byte = BYTE_TOKEN.fullmatch(piece)
            if byte:
                return bytes([int(byte.group(1), 16)])
            decoder = _byte_decoder()
            if piece and "\ufffd" in text and all(c in decoder for c in piece):
                return bytes(decoder[c] for c in piece)  # part of a character: the bytes it carries
        return text.encode("utf-8")


def _figure(value: float) -> float:
    return value if math.isfinite(value) else NEVER


class ChoiceLogprobs:
    """One choice's logprobs object, made from the Logprobs of its tokens as they come (a streamed
    choice sends each event's part: the completions' text offsets run on across them)."""

    def __init__(self, texts: TokenText, chat: bool):
        self.texts, self.chat = texts, chat
        self.offset = 0  # characters of completion before the next token (completions)
        self.said: str | None = None  # an echoed prompt's text
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")  # the tokens' bytes, as the text decodes

    def __call__(self, tokens: list[int], scores: Logprobs | None, prompt: Any = None) -> dict | None:
        """The object for `tokens` and their `scores`; a completion's echoed prompt (generation.ScoredPrompt)
        before them, its first token with null for its logprob and top (OpenAI's echo)."""
        if self.chat:
            return None if scores is None else self._chat(tokens, scores)
        parts = []
        if prompt is not None:
            parts.append(self._completion(prompt.token_ids, [None, *prompt.logprobs.values],
                                          [None, *map(prompt.logprobs.tops, range(len(prompt.logprobs)))], self.said))
            # the echoed text is the prompt's decoded apart from the completion's: a character the prompt's
            # last tokens leave unfinished is its own U+FFFD there
            self.offset += len(self.decoder.decode(b"", final=True))
            self.decoder.reset()
        if scores is not None:
            parts.append(self._completion(tokens, scores.values, list(map(scores.tops, range(len(scores))))))
        if not parts:
            return None
        return {key: [v for part in parts for v in part[key]] for key in parts[0]}

    def _entry(self, token: int, value: float) -> dict:
        text, raw = self.texts(token)
        return {"token": text, "logprob": _figure(value), "bytes": raw}

    def _chat(self, tokens: list[int], scores: Logprobs) -> dict:
        content = [{**self._entry(token, value),
                    "top_logprobs": [self._entry(t, v) for t, v in scores.tops(i) if math.isfinite(v)]}
                   for i, (token, value) in enumerate(zip(tokens, scores.values))]
        return {"content": content, "refusal": None}

    def _completion(self, tokens: list[int], values: list[float | None],
                    likeliest: list[list[tuple[int, float]] | None], said: str | None = None) -> dict:
        """`said`: the text these tokens are echoed as (the prompt), where a special token's text that it spells
        out takes its room (a completion's text has none of theirs) and a word's space that it leaves out (a
        SentencePiece decoder drops the first's) takes none."""
        texts, offsets, tops = [], [], []
        for token, value, best in zip(tokens, values, likeliest):
            text, raw = self.texts(token)
            texts.append(text)
            special = token in self.texts.special
            if not special and self.decoder.getstate()[0] and raw and not 0x80 <= raw[0] < 0xC0:
                # bytes of a character that this token does not go on with: U+FFFD before its own text
                self.offset += len(self.decoder.decode(b"", final=True))
                self.decoder.reset()
            offsets.append(self.offset)
            if not special:
                piece = self.decoder.decode(bytes(raw))
                if said is not None and piece.startswith(" ") and not said.startswith(piece, self.offset) \
                        and said.startswith(piece[1:], self.offset):
                    piece = piece[1:]  # (a SentencePiece word's mark where the echoed text has no space: its first)
                self.offset += len(piece)
            elif said is not None and said.startswith(text, self.offset):
                self.offset += len(text)
            if value is None:  # (a prompt's first token: nothing before it to score it)
                tops.append(None)
                continue
            top: dict[str, float] = {}
            # (texts that coincide: the sampled token's, or the likelier)
            for t, v in [(token, value), *((t, v) for t, v in best if math.isfinite(v))]:
                top.setdefault(self.texts(t)[0], _figure(v))
            tops.append(dict(sorted(top.items(), key=lambda item: -item[1])))
        return {"tokens": texts, "token_logprobs": [None if v is None else _figure(v) for v in values],
                "top_logprobs": tops, "text_offset": offsets}
