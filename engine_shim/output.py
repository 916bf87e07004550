"""Generated tokens to response text: streaming detokenization, special tokens left out (vLLM's
``skip_special_tokens`` default), and stop strings that end the answer before the stop text."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any


class TextAssembler:
    """Accumulates one answer's text; ``add`` returns the text that may be sent now.

    With stop strings, the last ``len(longest stop) - 1`` characters are held back until it is
    clear they do not begin a stop string, so no stop text ever reaches the client.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Iterable[int], stops: list[str]):
        self._detokenizer = tokenizer.detokenizer  # a fresh copy per call (mlx-lm TokenizerWrapper)
        self._skip = set(eos_token_ids) | set(getattr(tokenizer, "all_special_ids", ()) or ())
        self._stops = stops
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._sent = 0
        self.stopped = False  #: a stop string matched

    @property
    def text(self) -> str:
        """Everything sent so far."""
        return self._detokenizer.text[: self._sent]

    def add(self, token: int, final: bool = False, reason: str | None = None) -> tuple[str, bool]:
        """Feed one token (negative: none); returns (text to send now, whether a stop string matched)."""
        if self.stopped:
            return "", True
        if token >= 0 and token not in self._skip:
            self._detokenizer.add_token(token)
        if final:
            self._detokenizer.finalize()
        full = self._detokenizer.text
        if self._stops:
            found = self._find_stop(full)
            if found is not None:
                self.stopped = True
                return self._take(full, found), True
            limit = len(full) if final else max(self._sent, len(full) - self._hold)
        else:
            limit = len(full)
        return self._take(full, limit), False

    def _find_stop(self, full: str) -> int | None:
        start = max(0, self._sent - self._hold)
        hits = [pos for pos in (full.find(stop, start) for stop in self._stops) if pos >= 0]
        return min(hits) if hits else None

    def _take(self, full: str, limit: int) -> str:
        piece = full[self._sent : limit]
        self._sent = max(self._sent, limit)
        return piece
