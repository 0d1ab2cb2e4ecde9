"""Incremental detokenization with stop strings, for streaming.

Text is released as soon as it is final: not while a multi-byte character is
still incomplete, and not while its tail could be the start of a stop string.
"""

from __future__ import annotations


# the prompt's last tokens a stream decodes its first tokens after (as vLLM's detokenizer does): a
# SentencePiece tokenizer's decoder drops the space that starts the first token it decodes ("▁Paris"
# alone is "Paris"), which after the prompt reads " Paris"
CONTEXT = 5


class TextStream:
    def __init__(self, tokenizer, stop: list[str], context: list[int] = (), min_tokens: int = 0):
        """`context`: the prompt's ids (its last CONTEXT are decoded before the text, not part of it);
        `min_tokens`: stop strings are looked for once more tokens than this were added (vLLM's: a stop
        string the first min_tokens complete does not end the text; one completed later does, even where
        it began in them)."""
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.min_tokens = min_tokens
        self.added = 0  # tokens added
        self.ids: list[int] = list(context)[-CONTEXT:]
        if self.ids and self._decode(self.ids).endswith("\ufffd"):  # a character the prompt leaves unfinished
            self.ids = []
        self.text = ""
        self.sent = 0          # characters of text already released
        self.stopped = False   # a stop string was produced; text ends before it
        self._prefix = 0       # ids[_prefix:_read] decode to the text's tail
        self._read = len(self.ids)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def add(self, token: int) -> None:
        """Append one generated token; sets `stopped` if it completes a stop string."""
        self.ids.append(token)
        self.added += 1
        before = self._decode(self.ids[self._prefix : self._read])
        after = self._decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):  # \ufffd: a character still incomplete
            self._prefix, self._read = self._read, len(self.ids)
            self._grow(after[len(before) :])

    def _grow(self, new: str) -> None:
        """Append `new` text, ended before a stop string it completes (then `stopped`)."""
        old = len(self.text)
        self.text += new
        if self.stop and self.added > self.min_tokens:
            # each stop string where it would end in the new text (one that ended before it was looked
            # for then, or came within min_tokens: not a stop)
            hits = [i for i in (self.text.find(s, max(0, old - len(s) + 1)) for s in self.stop) if i >= 0]
            if hits:
                self.text = self.text[: min(hits)]
                self.stopped = True

    def take(self, final: bool = False) -> str:
        """Text not yet released that is final (all of it when `final` or stopped). A trailing incomplete
        character released by `final` may complete a stop string too (one with U+FFFD in it)."""
        if final and not self.stopped:  # release a trailing incomplete character as decoded
            before = self._decode(self.ids[self._prefix : self._read])
            after = self._decode(self.ids[self._prefix :])
            self._prefix = self._read = len(self.ids)
            self._grow(after[len(before) :])
        end = len(self.text)
        if not (final or self.stopped):
            end -= self._held_back()
        out = self.text[self.sent : end]
        self.sent = max(self.sent, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest tail of text that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(self.text)), best, -1):
                if self.text.endswith(s[:n]):
                    best = n
                    break
        return best
