"""One request's outputs, from whichever thread the frontend runs on to the gateway's event loop.

Place in the data flow: both gateway backends (paraflex/serving/in_process_backend.py,
paraflex/serving/ray_backend.py) give the serving frontend (paraflex/serving/frontend.py) one
`StreamSink` per streamed request; its `on_output` turns each output call into an `Output`
(paraflex/serving/backend.py) and hands it to the request's asyncio queue with
`call_soon_threadsafe`, and the backend's `stream` awaits that queue.
"""

from __future__ import annotations

import asyncio

from paraflex.serving.backend import Output


class StreamSink:
    """Forwards one request's outputs to an asyncio queue of the event loop that streams it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[Output] = asyncio.Queue()

    def on_output(self, request_id, token_ids, finish_reason, error, **extra) -> None:
        out = Output(list(token_ids), finish_reason, error)
        self.loop.call_soon_threadsafe(self.queue.put_nowait, out)
