"""The text of a growing generation, in pieces that add up to the whole, cut at the first stop string.

A piece never ends inside a UTF-8 character (the tokens that finish it come later) nor with text that may begin
a stop string: that text waits until the next tokens show whether the stop string follows. When the text first
contains a stop string, the stream keeps the tokens up to the one that completed it (tokens are not cut, so they
may decode past the stop string) and the text before it, and takes nothing more.
"""
from __future__ import annotations

from collections.abc import Sequence

from deltaspec.shared.model.tokenizer import Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop_strings: Sequence[str] = ()) -> None:
        self.tokenizer, self.stop_strings = tokenizer, tuple(stop_strings)
        self.ids: list[int] = []
        self.sent = 0  # characters of the text already handed out
        self.stopped: str | None = None  # the stop string the text reached

    def push(self, ids: list[int], final: bool = False) -> tuple[list[int], str]:
        """The tokens of `ids` this stream keeps (all of them until a stop string) and the new piece of text;
        `final` hands out what was held back."""
        if self.stopped is not None:
            return [], ""
        text = self.tokenizer.decode(self.ids + ids)
        if self._first_stop(text) is not None:
            n = next(n for n in range(1, len(ids) + 1) if self._first_stop(self.tokenizer.decode(self.ids + ids[:n])))
            ids = ids[:n]
            text = self.tokenizer.decode(self.ids + ids)
            end, self.stopped = self._first_stop(text)  # type: ignore[misc]
        elif final:
            end = len(text)
        else:
            end = len(text.rstrip("\ufffd"))
            end -= self._held(text[:end])
        self.ids += ids
        piece, self.sent = text[self.sent:end], max(self.sent, end)
        return ids, piece

    def _first_stop(self, text: str) -> tuple[int, str] | None:
        """Where the text first contains a stop string, and which (the longest of those starting there)."""
        hits = [(i, -len(s), s) for s in self.stop_strings if (i := text.find(s, max(self.sent - len(s), 0))) >= 0]
        return (min(hits)[0], min(hits)[2]) if hits else None

    def _held(self, text: str) -> int:
        """Length of the longest end of `text` that begins a stop string."""
        return max((k for s in self.stop_strings for k in range(1, len(s)) if text.endswith(s[:k])), default=0)
