"""`paraflex serve --request-log FILE`: one CSV row per finished request, as the server saw it.

Place in the data flow: the serving frontend (paraflex/serving/frontend.py) tells its
`RequestLog` when it starts a request (`started`), each time tokens come back from the last
stage (`tokens`), and when the request finishes (`finished`) or is aborted (`dropped`); both
backends share that frontend, so both log. The row is written (and flushed) as the request
ends, in the columns of the simulator's requests.csv (`REQUEST_COLUMNS`, `request_row`, and the
token bookkeeping of `MetricsStore`, paraflex/simulator/metrics/records.py), so one script
compares a served run with a simulated one (bench/sim_fidelity.py).

Times are Unix seconds (`time.time()`): arrival is when the frontend took the request (after
the gateway parsed and tokenized it), token times when the frontend got them. One more column
than the simulator's, `http_arrival_s`: when the gateway's handler got the HTTP request (it sets
`HTTP_ARRIVAL`, a context variable the frontend's `start` sees on the Ray backend; the
in-process backend, whose loop thread starts requests between engine steps, hands it over with
`awaiting` as it queues one, and its arrival is that moment, not the loop's (the wait for the
step in progress is the engines' queue, which the simulator models: counted in the gateway's share
too, it was counted twice); empty for requests that did not come over HTTP). arrival_s -
http_arrival_s is the gateway's share (parse, tokenize, admission) that `paraflex profile
--gateway-log` turns into the simulator's gateway delay. `output_tokens`
is the request's max_tokens; `id` the client-visible request id. Aborted or failed requests are
not logged. Thread-safe: the gateway's loop starts requests, the engines' output thread ends them.
"""

from __future__ import annotations

import contextvars
import csv
from array import array
import threading
import time

from paraflex.errors import UserError
from paraflex.simulator.metrics.output import csv_cells
from paraflex.simulator.metrics.records import REQUEST_COLUMNS, MetricsStore, model_slos, request_row


HTTP_ARRIVAL: contextvars.ContextVar[float | None] = contextvars.ContextVar("http_arrival", default=None)
LOG_COLUMNS = REQUEST_COLUMNS + ("http_arrival_s",)


class RequestLog:
    """Per-request records of a running server, appended to a CSV as requests end."""

    def __init__(self, path: str, models, clock=time.time) -> None:
        """`models`: the config's ModelConfigs (their SLOs give `tokens_on_time`)."""
        try:
            self.file = open(path, "w", newline="", encoding="utf-8")
        except OSError as exc:
            raise UserError(f"--request-log {path}: cannot write it ({exc.strerror}); pass a file path you can write") from None
        self.path = path
        self.writer = csv.writer(self.file)
        self.writer.writerow(LOG_COLUMNS)
        self.file.flush()
        self.store = MetricsStore(model_slos(models), num_engines=0, gpus_per_engine=1)
        self.clock = clock
        self.lock = threading.Lock()
        self.written = 0
        self.http_arrival: dict[str, float] = {}
        self.queued_at: dict[str, float] = {}  # `awaiting`: when the backend queued it for the loop

    def started(self, rid: str, model: str, replica: int, prompt_tokens: int, max_tokens: int) -> None:
        with self.lock:
            queued = self.queued_at.pop(rid, None)
            arrival = self.clock() if queued is None else queued
            rec = self.store.add_request(rid, model, arrival, prompt_tokens, max_tokens)
            rec.replica = replica
            t_http = HTTP_ARRIVAL.get()
            if t_http is not None:
                self.http_arrival[rid] = t_http

    def awaiting(self, rid: str) -> None:
        """`rid` is queued now for another thread to start (the in-process backend's loop, between
        engine steps): its arrival is now, and this context's HTTP arrival is kept for it;
        `dropped` forgets both if the request never starts."""
        t_http = HTTP_ARRIVAL.get()
        with self.lock:
            self.queued_at[rid] = self.clock()
            if t_http is not None:
                self.http_arrival[rid] = t_http

    def tokens(self, rid: str, count: int) -> None:
        with self.lock:
            rec = self.store.requests.get(rid)
            if rec is not None and count:
                t = self.clock()
                for _ in range(count):
                    self.store.tokens([rec], t)

    def finished(self, rid: str) -> None:
        with self.lock:
            rec = self.store.requests.pop(rid, None)
            t_http = self.http_arrival.pop(rid, None)
            if rec is None or self.file.closed:
                return
            rec.finish = self.clock()
            self.writer.writerow(csv_cells(request_row(rec) + ("" if t_http is None else t_http,)))
            self.file.flush()
            self.written += 1
            self.store.tbt[rec.model] = array("d")  # its gaps are in the row: keep memory flat

    def dropped(self, rid: str) -> None:
        with self.lock:
            self.store.requests.pop(rid, None)
            self.http_arrival.pop(rid, None)
            self.queued_at.pop(rid, None)

    def close(self) -> None:
        with self.lock:
            self.file.close()
