"""Committed token ids to streamed text, with stop strings."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


class TextStream:
    """Incremental detokenization with stop strings.

    Each push decodes only a short window of recent ids (the text of ids[prefix:] minus that of
    ids[prefix:read], as vLLM does), so a long reply costs linear time, and a character still missing
    bytes waits for its next token. Text that may yet turn out to start a stop string is held back.
    """

    def __init__(
        self, tokenizer: Any, stop_strings: Sequence[str], *, special: bool = False, skip_ids: Sequence[int] = ()
    ) -> None:
        """`special`: keep special tokens in the text (a tool parser reads them); `skip_ids`: ids never shown (the
        end-of-turn ids, for a tool parser's raw text)."""
        self.tokenizer = tokenizer
        self.special, self.skip_ids = special, frozenset(skip_ids)
        self.stop_strings = tuple(s for s in stop_strings if s)
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.ids: list[int] = []
        self.prefix = self.read = 0  # ids[:read] are in `text`; ids[prefix:read] give the next decode its context
        self.text = ""
        self.emitted = 0

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=not self.special)

    def _current(self, final: bool = False) -> str:
        """All text so far. Text up to a character still missing bytes is kept; the rest waits."""
        before = self._decode(self.ids[self.prefix : self.read])
        new = self._decode(self.ids[self.prefix :])[len(before) :]
        if final or not new.endswith("\ufffd"):
            # At the end, a character still missing bytes (the token limit cut it) is dropped, not shown as
            # U+FFFD: the reply ends before it, as llama.cpp's does.
            self.text += new.rstrip("\ufffd") if final else new
            self.prefix, self.read = self.read, len(self.ids)
            return self.text
        return self.text + new.rstrip("\ufffd")

    def _find_stop(self, text: str) -> int | None:
        hits = [text.find(s, max(0, self.emitted - len(s))) for s in self.stop_strings]
        return min((at for at in hits if at != -1), default=None)

    def push(self, ids: list[int]) -> tuple[str, int | None]:
        """Add committed ids. Returns the new text safe to show, and None; or, when a stop string
        is hit, the text up to it and how many of `ids` it took to complete the stop string."""
        if self.tokenizer is None:
            return "", None
        if self.skip_ids:
            ids = [i for i in ids if i not in self.skip_ids]
        self.ids.extend(ids)
        current = self._current()
        at = self._find_stop(current) if self.stop_strings else None
        if at is not None:
            # A verify step commits several tokens at once: keep only those up to the one that completes
            # the stop string, so token ids and counts are what one-token-at-a-time decoding gives.
            done = len(self.ids) - len(ids)
            # (the text as a one-token step would have seen it: a trailing partial character not yet there)
            used = next(
                k
                for k in range(1, len(ids) + 1)
                if self._find_stop(self._decode(self.ids[: done + k]).rstrip("\ufffd")) is not None
            )
            del self.ids[done + used :]
            self.text, self.read = current[:at], len(self.ids)
            return self.flush(), used
        safe = len(current) - self.hold
        if safe <= self.emitted:
            return "", None
        delta, self.emitted = current[self.emitted : safe], safe
        return delta, None

    def flush(self) -> str:
        """All text not yet shown (at the end of generation)."""
        if self.tokenizer is not None and self.read < len(self.ids):
            self._current(final=True)
        delta, self.emitted = self.text[self.emitted :], len(self.text)
        return delta
