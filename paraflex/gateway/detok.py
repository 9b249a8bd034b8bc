"""Incremental detokenization with stop strings, between the token stream and the HTTP client.

Data flow: app.py feeds each `Output.token_ids` delta from the backend into a `TextStream`
and sends the returned text delta to the client. Text is never emitted half-way through a
multi-byte character (a trailing U+FFFD is held back) nor while it could still become a
stop string; when a stop string appears, the text is cut before it and the stream reports
`stopped`, after which the gateway aborts the request so the engines free its KV.

Each feed decodes a window, not the whole output: the new tokens and `CONTEXT_TOKENS` before
them, taking the new text as what the window's decode adds to the decode of its context (a
decoder's spacing at a word boundary, a character split over tokens, need that context; vLLM
detokenizes the same way). Decoding everything each time made a stream's gateway work grow
with the square of its length: 4,096 tokens one at a time took 1.6-2.3 s of the gateway's
thread with SmolLM2's tokenizer (382-552 us per token; now 6-10 us: bench/detok_speed.py), the
event loop every stream shares.
"""

from __future__ import annotations

from typing import Callable

_REPLACEMENT = "\ufffd"
CONTEXT_TOKENS = 4  # decoded before the new tokens, and taken away again


class TextStream:
    """Turns a growing list of token ids into text deltas, honouring stop strings."""

    def __init__(self, decode: Callable[[list[int]], str], stop: list[str]):
        self._decode = decode
        self._stop = [s for s in stop if s]
        self._hold = max((len(s) for s in self._stop), default=1) - 1
        self.token_ids: list[int] = []
        self.decoded = ""  # the text of token_ids[:self._read]
        self._read = 0
        self.sent = 0  # characters of `decoded` emitted so far
        self.stopped = False

    def _decode_new(self, final: bool) -> None:
        """Extend `decoded` by the text of the tokens past `_read`, unless it ends in a character
        still incomplete (U+FFFD; kept when `final`) or is empty (tokens that decode to nothing)."""
        start = max(0, self._read - CONTEXT_TOKENS)
        context = self._decode(self.token_ids[start:self._read]) if start < self._read else ""
        window = self._decode(self.token_ids[start:])
        if len(window) > len(context) and (final or not window.endswith(_REPLACEMENT)):
            self.decoded += window[len(context):]
            self._read = len(self.token_ids)

    def feed(self, token_ids: list[int], final: bool = False) -> str:
        """Add new tokens; return the text that can be emitted now (all of it when `final`)."""
        if self.stopped:
            return ""
        self.token_ids.extend(token_ids)
        self._decode_new(final)
        end = len(self.decoded)
        cut = self._find_stop()
        if cut is not None:  # (at or past `sent`: the held-back tail covers a stop string's start)
            self.stopped, end, final = True, cut, True
        if not final:  # (`decoded` ends in a complete character here: _decode_new held it back)
            end = max(self.sent, end - self._hold)
        delta = self.decoded[self.sent:end]  # `decoded` only grows: what was sent stays sent
        self.sent += len(delta)
        return delta

    @property
    def text(self) -> str:
        """Everything emitted so far."""
        return self.decoded[:self.sent]

    def _find_stop(self) -> int | None:
        if not self._stop:
            return None
        start = max(0, self.sent - self._hold - 1)
        hits = [i for i in (self.decoded.find(s, start) for s in self._stop) if i >= 0]
        return min(hits) if hits else None
