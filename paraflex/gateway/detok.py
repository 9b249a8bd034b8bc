"""Incremental detokenization with stop strings, between the token stream and the HTTP client.

Data flow: app.py feeds each `Output.token_ids` delta from the backend into a `TextStream`
and sends the returned text delta to the client. Text is never emitted half-way through a
multi-byte character (a trailing U+FFFD is held back) nor while it could still become a
stop string; when a stop string appears, the text is cut before it and the stream reports
`stopped`, after which the gateway aborts the request so the engines free its KV.
"""

from __future__ import annotations

from typing import Callable

_REPLACEMENT = "\ufffd"


class TextStream:
    """Turns a growing list of token ids into text deltas, honouring stop strings."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.text = ""  # everything emitted so far
        self.stopped = False

    def feed(self, token_ids: list[int], final: bool = False) -> str:
        """Add new tokens; return the text that can be emitted now (all of it when `final`)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        full = self._decode(self.token_ids)
        cut = self._find_stop(full)
        if cut is not None:
            self.stopped = True
            full, final = full[:cut], True
        if not final:
            end = len(full)
            while end > len(self.text) and full[end - 1] == _REPLACEMENT:
                end -= 1
            end = max(len(self.text), end - self._hold)
            full = full[:end]
        # A later token can change how earlier bytes decode; what was sent stays sent.
        delta = full[len(self.text):]
        self.text += delta
        return delta

    def _find_stop(self, full: str) -> int | None:
        if not self._stop:
            return None
        start = max(0, len(self.text) - self._hold - 1)
        hits = [i for i in (full.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None
