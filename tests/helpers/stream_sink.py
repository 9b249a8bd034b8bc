"""A request sink that collects one request's tokens and signals its end (the serving tests that
submit streams to an `LLMCluster` and wait for each to finish)."""

from __future__ import annotations

import threading


class StreamSink:
    def __init__(self):
        self.tokens, self.end, self.done = [], None, threading.Event()

    def on_output(self, rid, token_ids, finish_reason, error, **extra):
        self.tokens.extend(token_ids)
        if finish_reason is not None:
            self.end = (finish_reason, error)
            self.done.set()
