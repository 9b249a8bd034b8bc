"""Progress output of long simulations, on stderr: the sweep's bar and one run's status line.

Place in the data flow: `run_sweep` (sweep.py) steps a `Progress` bar as points finish;
`paraflex simulate` (one run) hands a `RunProgress` to `runner.simulate`, which calls it
between slices of simulated time. Neither changes what is simulated. `RunProgress` stays
silent for the first seconds (short runs print nothing), then rewrites one line on a terminal
(at most twice a second) or prints a line every ten seconds into a log.

Hand-written rather than tqdm or rich: into a log (a stream that is no terminal) tqdm keeps
writing carriage-return rewrites of one line and rich prints only the final state, where this
prints a full line every ten seconds; and both time themselves by their own wall clock, where
`RunProgress` takes a clock (its quiet start and pacing are tested with a fake one).
"""

from __future__ import annotations

import sys
import time


class Progress:
    """A one-line text progress bar on stderr."""

    def __init__(self, total: int, label: str, stream=None):
        self.total, self.label, self.done, self.t0 = total, label, 0, time.perf_counter()
        self.stream = stream if stream is not None else sys.stderr

    def step(self, note: str = "") -> None:
        self.done += 1
        width = 30
        fill = int(width * self.done / self.total)
        el = time.perf_counter() - self.t0
        eta = el / self.done * (self.total - self.done)
        self.stream.write(f"\r{self.label} [{'#' * fill}{'.' * (width - fill)}] {self.done}/{self.total} "
                          f"{el:5.0f}s elapsed, ~{eta:4.0f}s left {note[:40]:<40}")
        if self.done == self.total:
            self.stream.write("\n")
        self.stream.flush()


class RunProgress:
    """`paraflex simulate`'s status line: requests finished, simulated and wall time, events."""

    def __init__(self, label: str, stream=None, quiet_s: float = 2.0, clock=time.perf_counter):
        self.label, self.quiet_s, self.clock = label, quiet_s, clock
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every_s = 0.5 if self.tty else 10.0
        self.t0 = clock()
        self.shown = None  # wall time of the last line written (None: nothing yet)

    def __call__(self, simulated_s: float, finished: int, total: int, events: int) -> None:
        now = self.clock() - self.t0
        if now < self.quiet_s or (self.shown is not None and now - self.shown < self.every_s):
            return
        self.shown = now
        line = (f"{self.label}: {finished}/{total} requests finished, simulated {simulated_s:.1f} s, "
                f"{events} events, {now:.0f} s wall")
        self.stream.write(f"\r{line:<100}" if self.tty else line + "\n")
        self.stream.flush()

    def close(self) -> None:
        """Clear the status line on a terminal (the run's results follow)."""
        if self.tty and self.shown is not None:
            self.stream.write("\r" + " " * 100 + "\r")
            self.stream.flush()
