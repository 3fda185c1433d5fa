"""Incremental detokenization with stop strings.

Text is only emitted once it is final: never half a UTF-8 character (the decoder shows it as
U+FFFD until the rest arrives), and never a suffix that could still grow into a stop string
(the client must not see the start of a stop string that is then cut off).
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        self._ids: list[int] = []
        self._text = ""
        self._num_emitted = 0

    def push(self, token_id: int, stops: Sequence[str]) -> tuple[str, bool]:
        """Adds a token; returns (text now final, whether a stop string was reached). After a
        stop, the text up to (not including) the stop string has been returned."""
        self._ids.append(token_id)
        text = self._tokenizer.decode(self._ids, skip_special_tokens=True)
        if text.endswith(_INCOMPLETE):
            return "", False
        self._text = text
        search_from = max(0, self._num_emitted - max((len(s) for s in stops), default=0))
        cuts = [i for s in stops if s and (i := text.find(s, search_from)) >= 0]
        if cuts:
            return self._emit_until(min(cuts)), True
        held = max((_overlap(text, s) for s in stops if s), default=0)
        return self._emit_until(len(text) - held), False

    def flush(self) -> str:
        """Whatever was held back (the stream ended without a stop string)."""
        return self._emit_until(len(self._text))

    def _emit_until(self, end: int) -> str:
        new = self._text[self._num_emitted : end]
        self._num_emitted = max(self._num_emitted, end)
        return new


def _overlap(text: str, stop: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `stop`."""
    for size in range(min(len(stop) - 1, len(text)), 0, -1):
        if text.endswith(stop[:size]):
            return size
    return 0
