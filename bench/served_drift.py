"""Does a served engine's step change over the run, and whose time is it? The server's threads'
CPU and the host's speed, measured while bench/sim_fidelity.py serves, beside its step log.

    python bench/served_drift.py RESULTS_DIR [--bin 20]      # a bench/sim_fidelity.py results folder

Why: on an H100 the in-process server's prefill steps shortened over a served run, whatever the
load (llama-1b-shape's from 21.5 ms in the first minute to ~15 ms after two and a half), while
the engine alone (bench/prefill_drift.py) seemed not to (docs/simulate.md, "Fidelity on a GPU").
Three measurements split a served step's time:

* the step log's `cpu_s` (engine/step_log.py): the engine loop thread's own CPU time in the
  step, so `busy_s - cpu_s` is what it waited for (the device, or the interpreter lock; on a CPU
  engine also the kernels' worker threads, whose share is not the loop thread's CPU time);
* `ThreadSampler`: every thread's CPU time (utime + stime of /proc/PID/task/TID/stat) every
  second into threads.csv, so the gateway's thread (the main thread: uvicorn's event loop) shows
  its cores' worth per bin;
* `HostProbe`: a process of its own times a fixed pure-Python workload (no torch, no device) four
  times a second into host.csv, the host CPU's speed at that moment; `host_speeds` gives each
  load window's speed against the calibration's (1.00: the same; 0.80: its work took 1.25x as
  long). On the H200 machine the bare engine's prefills and this workload moved together by up to
  1.7x within a minute (docs/simulate.md, fourth session). Where the server keeps every core busy
  (the 2-core VM) the probe also waits for a core, so there it measures the contention as well.

Per bin the report prints the prefill and decode steps' median wall and CPU time (the most
frequent model's) and the main thread's and the other threads' cores. On a GPU engine a drift in
`busy_s` that `cpu_s` follows is the engine thread's own work (as on the H200: the host), one in
the wait that follows the main thread's cores the lock. bench/ is no package: sim_fidelity.py
imports this module from its folder.
"""

from __future__ import annotations

import argparse
import csv
import glob
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter

THREAD_COLUMNS = ("t", "tid", "name", "cpu_s")


class ThreadSampler:
    """Every `every` seconds, each thread of process `pid`: its CPU seconds so far, appended to
    `path` (THREAD_COLUMNS) by a daemon thread until `stop()`; the pid (whose main thread's tid it
    is) goes to threads.json beside it, for `drift_report`. Without /proc (not Linux) it records
    nothing and says so once."""

    def __init__(self, pid: int, path: str, every: float = 1.0) -> None:
        self.pid, self.path, self.every = pid, path, every
        self.ticks = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._stop = threading.Event()
        self.available = os.path.isdir(f"/proc/{pid}/task")
        if not self.available:
            print(f"served_drift: no /proc/{pid}/task here: threads' CPU not sampled", flush=True)
            return
        self.file = open(path, "w", newline="", encoding="utf-8")
        self.writer = csv.writer(self.file)
        self.writer.writerow(THREAD_COLUMNS)
        with open(os.path.join(os.path.dirname(path), "threads.json"), "w") as fh:
            json.dump({"pid": pid}, fh)
        self.thread = threading.Thread(target=self._run, name="thread-sampler", daemon=True)
        self.thread.start()

    def sample(self) -> list[tuple[int, str, float]]:
        """(tid, name, CPU seconds) of every thread of the process now; [] once it has exited."""
        rows = []
        for task in glob.glob(f"/proc/{self.pid}/task/*/stat"):
            try:
                with open(task) as fh:
                    text = fh.read()
            except OSError:  # the thread (or the process) ended between the listing and the read
                continue
            name = text[text.index("(") + 1:text.rindex(")")]
            fields = text[text.rindex(")") + 2:].split()  # fields from the 3rd (state) on
            rows.append((int(task.split("/")[-2]), name, (int(fields[11]) + int(fields[12])) / self.ticks))
        return rows

    def _run(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            for tid, name, cpu in self.sample():
                self.writer.writerow((f"{now:.3f}", tid, name, f"{cpu:.2f}"))
            self.file.flush()
            self._stop.wait(self.every)

    def stop(self) -> None:
        if self.available:
            self._stop.set()
            self.thread.join(5)
            self.file.close()


PROBE_EVERY_S = 0.25
PROBE_ITERATIONS = 20000  # the probe's workload: ~1.3 ms on the 2-vCPU Xeon, 0.5% of a core at 4 runs a second


def python_workload_s(iterations: int = PROBE_ITERATIONS) -> float:
    """Seconds of a fixed pure-Python workload (no torch, no device): the host CPU's own speed now
    (bench/prefill_drift.py times it after each call too)."""
    t0, total = time.perf_counter(), 0
    for k in range(iterations):
        total += k * k % 7
    return time.perf_counter() - t0


def probe_loop(path: str, every: float) -> None:
    """The probe process's body: `python_workload_s` timed every `every` seconds, one CSV line per
    run into `path`, until the process is terminated."""
    with open(path, "w", buffering=1) as out:
        out.write("t,probe_s\n")
        while True:
            took = python_workload_s()
            out.write(f"{time.time():.3f},{took:.6f}\n")
            time.sleep(every)


class HostProbe:
    """The host CPU's speed over a run: a process of its own (so it shares no interpreter lock with
    the caller) runs `probe_loop` into `path` until `stop()`."""

    def __init__(self, path: str, every: float = PROBE_EVERY_S) -> None:
        self.path = path
        code = (f"import sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
                f"import served_drift; served_drift.probe_loop(sys.argv[1], float(sys.argv[2]))")
        self.proc = subprocess.Popen([sys.executable, "-c", code, path, str(every)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def host_speeds(path: str, reference: list[tuple[float, float]], windows: dict[str, tuple[float, float]]
                ) -> dict[str, float]:
    """Each window's host speed against the `reference` windows' (their median probe time over
    the window's): name -> ratio; a window without probe runs (or no reference ones) is left out."""
    rows = [(float(r["t"]), float(r["probe_s"])) for r in _read(path)] if os.path.isfile(path) else []
    ref = [dt for t, dt in rows if any(a <= t <= b for a, b in reference)]
    if not ref:
        return {}
    base = statistics.median(ref)
    out = {}
    for name, (a, b) in windows.items():
        inside = [dt for t, dt in rows if a <= t <= b]
        if inside:
            out[name] = base / statistics.median(inside)
    return out


def _read(path: str) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def thread_cores(rows: list[dict], pid: int, start: float, end: float) -> tuple[float, float]:
    """(the main thread's, all other threads') cores' worth over [start, end): CPU seconds
    between the first and the last sample inside it, over their time apart."""
    inside = [r for r in rows if start <= float(r["t"]) < end]
    times = sorted({float(r["t"]) for r in inside})
    if len(times) < 2:
        return float("nan"), float("nan")
    first, last = times[0], times[-1]
    cpu_at = {t: {} for t in (first, last)}
    for r in inside:
        if float(r["t"]) in cpu_at:
            cpu_at[float(r["t"])][int(r["tid"])] = float(r["cpu_s"])
    span = last - first
    main = (cpu_at[last].get(pid, 0.0) - cpu_at[first].get(pid, 0.0)) / span
    others = sum(cpu - cpu_at[first].get(tid, 0.0) for tid, cpu in cpu_at[last].items() if tid != pid) / span
    return main, others


def drift_report(out: str, bin_s: float = 20.0) -> str:
    """The per-bin table of a results folder (its steps/ and threads.csv, threads.json's pid)."""
    steps = [r for path in sorted(glob.glob(os.path.join(out, "steps", "engine-*.csv"))) for r in _read(path)]
    if not steps:
        return "served_drift: no step log in " + out
    has_cpu = "cpu_s" in steps[0]
    threads_csv, pid = os.path.join(out, "threads.csv"), None
    threads = _read(threads_csv) if os.path.isfile(threads_csv) else []
    if threads:
        with open(os.path.join(out, "threads.json")) as fh:
            pid = int(json.load(fh)["pid"])
    model = Counter(r["model"] for r in steps if r["kind"] == "prefill").most_common(1)
    model = model[0][0] if model else steps[0]["model"]
    t0 = min(float(r["start_s"]) for r in steps)
    t_end = max(float(r["start_s"]) for r in steps)
    lines = [f"served steps over the run ({model}'s, medians in ms; cpu: the engine thread's own; "
             f"cores: the server's main thread (gateway) / its other threads), {bin_s:.0f} s bins:",
             f"{'from s':>7} {'prefills':>8} {'busy':>6} {'cpu':>6} {'decodes':>8} {'busy':>6} {'cpu':>6} "
             f"{'main':>5} {'others':>6}"]
    t = t0
    while t <= t_end:
        inside = [r for r in steps if t <= float(r["start_s"]) < t + bin_s and r["model"] == model]
        cells = [f"{t - t0:7.0f}"]
        for kind in ("prefill", "decode"):
            rows = [r for r in inside if r["kind"] == kind]
            busy = 1e3 * statistics.median(float(r["busy_s"]) for r in rows) if rows else float("nan")
            cpu = 1e3 * statistics.median(float(r["cpu_s"]) for r in rows) if rows and has_cpu else float("nan")
            cells += [f"{len(rows):8d}", f"{busy:6.2f}", f"{cpu:6.2f}"]
        main, others = thread_cores(threads, pid, t, t + bin_s) if pid else (float("nan"), float("nan"))
        cells += [f"{main:5.2f}", f"{others:6.2f}"]
        lines.append(" ".join(cells))
        t += bin_s
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="a bench/sim_fidelity.py results folder (steps/, threads.csv)")
    ap.add_argument("--bin", type=float, default=20.0, help="seconds per bin (default 20)")
    args = ap.parse_args(argv)
    if not os.path.isdir(os.path.join(args.out, "steps")):
        print(f"served_drift: {args.out} has no steps/ folder: give a bench/sim_fidelity.py results folder",
              file=sys.stderr)
        return 2
    print(drift_report(args.out, args.bin))
    return 0


if __name__ == "__main__":
    sys.exit(main())
