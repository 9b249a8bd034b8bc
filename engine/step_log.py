"""`paraflex serve --step-log DIR`: one CSV row per batch an engine ran, timed by its own loop.

Place in the data flow: the Ray engine actor (engine/ray_engine.py) opens a `StepLog` at
DIR/engine-<id>.csv when the serve command asks (`start_step_log`), the in-process engines
(paraflex/serving/in_process_engines.py, `start_step_logs`) one per engine, and each records
every loop iteration that ran a batch (`record_last_run`): what the batch carried (model, stage,
kind, batch size, prompt tokens, decode context, how many stages the engine holds, whether its
output crosses engines) and how long it took: `busy_s` the whole iteration (inbox, transport
poll, schedule, forward, sampling, sending the hidden state or tokens, the output push),
`run_s` the forward pass and sampling alone, and `cpu_s` the CPU time the loop's thread spent in
the iteration (`time.thread_time`; `busy_s - cpu_s` is the time it waited: for the device, for
the interpreter lock another thread of the process held, or on a CPU engine for the kernels'
worker threads, whose share of the step is not the loop thread's CPU time); `req_ids` the
batch's engine request ids (space-separated: the request log's `id` unless a restart re-issued
it), so a request's steps can be found. The loop takes `step_clock()` when an iteration starts
and hands it to `record_last_run`. `paraflex profile CONFIG --step-log DIR` (paraflex/costs/loop_fit.py) compares `busy_s`
with the cost model's stage time of the same batch and fits what the served loop adds per stage
step as a function of what the step carries (`engine_loop` in profile.json). Rows are buffered
and flushed at least every FLUSH_EVERY_S; the engine's (or the in-process loop's) thread is the only
writer.
"""

from __future__ import annotations

import csv
import os
import time

FLUSH_EVERY_S = 0.2  # the longest a logged row waits in the buffer (a Ray engine flushes with its stats refresh)
STEP_LOG_COLUMNS = ("engine", "model", "stage", "num_stages", "kind", "batch_size", "prefill_tokens",
                    "total_context", "resident_stages", "crosses", "start_s", "busy_s", "run_s", "cpu_s", "req_ids")


def step_clock() -> tuple[float, float, float]:
    """Taken when a loop iteration starts, for `StepLog.record_last_run`: the Unix time, the
    performance counter and the calling thread's CPU time."""
    return time.time(), time.perf_counter(), time.thread_time()


class StepLog:
    """The step rows of one engine, appended to DIR/engine-<id>.csv."""

    def __init__(self, directory: str, engine_id: int) -> None:
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, f"engine-{engine_id}.csv")
        self.engine_id = engine_id
        self.file = open(self.path, "w", newline="", encoding="utf-8")
        self.writer = csv.writer(self.file)
        self.writer.writerow(STEP_LOG_COLUMNS)

    def record(self, batch, route: list[int], resident_stages: int, start_s: float, busy_s: float,
               run_s: float, cpu_s: float) -> None:
        """One batch `batch` (a ScheduledBatch) of the replica on engines `route`."""
        crosses = any(e != self.engine_id for e in route)  # hidden state or tokens leave this engine
        self.writer.writerow((self.engine_id, batch.model, batch.stage, len(route), batch.kind, batch.batch_size,
                              batch.prefill_tokens, batch.total_context, resident_stages, int(crosses),
                              f"{start_s:.6f}", f"{busy_s:.7f}", f"{run_s:.7f}", f"{cpu_s:.7f}",
                              " ".join(batch.req_ids)))

    def record_last_run(self, loop, clock: tuple[float, float, float]) -> None:
        """The batch `loop` (an EngineLoop) last ran, if it has not been logged yet, in an
        iteration that started at `clock` (`step_clock()` then, on this thread) and ends now."""
        if loop.last_run is None:
            return
        start_s, t0, c0 = clock
        busy_s, cpu_s = time.perf_counter() - t0, time.thread_time() - c0
        batch, run_s = loop.last_run
        loop.last_run = None
        route = loop.routes.get(batch.model, [self.engine_id])
        self.record(batch, route, len(loop.routes), start_s, busy_s, run_s, cpu_s)

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()
