"""Timers wrapped around the functions a request passes through, in this process and in Ray's
worker processes (bench/ttft_split.py's probe).

Place in the data flow: bench/ttft_split.py wraps the gateway-side functions with a `Probe`
here, and passes `worker_runtime_env(dir)` to `start_cluster`, so each Ray worker runs
`install_in_worker` at start: it wraps the engine actor's path (the actor call's arrival, the
loop's inbox, scheduler, forward, projections, attention, sampling, the output sink and its
push) and writes its events to `dir/<pid>.pkl` when the bench asks (`collect`). Times are
`time.perf_counter()`, CLOCK_MONOTONIC on Linux: one clock for every process of the machine.

bench/ is no package: the scripts put their own folder on sys.path to import this module, and
the workers get it on PYTHONPATH.
"""

from __future__ import annotations

import functools
import glob
import os
import pickle
import threading
import time

DUMP_FLAG = "dump"  # the bench creates this file in the probe folder to ask the workers for their events


def scalar(arg) -> bool:
    """Whether a call's first argument is kept in its event (request ids, counts)."""
    return isinstance(arg, (str, int, float))


class Probe:
    """Timers wrapped around functions: each call appends (label, start, end, first argument if a scalar, else None) to
    `events` (perf_counter seconds, any thread); with `when`, only the calls whose result it accepts."""

    def __init__(self) -> None:
        self.events: list[tuple[str, float, float, object]] = []
        self.lock = threading.Lock()
        self.undo: list[tuple[object, str, object]] = []

    def wrap(self, owner, name: str, label: str, when=None) -> None:
        original = getattr(owner, name)

        @functools.wraps(original)
        def timed(*args, **kwargs):
            start = time.perf_counter()
            result = None
            try:
                result = original(*args, **kwargs)
                return result
            finally:
                if when is None or when(result):
                    arg = args[1] if len(args) > 1 else None
                    with self.lock:  # a scalar only: a kept tensor (a projection's input) is memory the
                        # allocator cannot reuse, and the prefill then faults in fresh pages (2x its TTFT)
                        self.events.append((label, start, time.perf_counter(), arg if scalar(arg) else None))

        setattr(owner, name, timed)
        self.undo.append((owner, name, original))

    def add(self, events) -> None:
        with self.lock:
            self.events.extend(events)

    def between(self, t0: float, t1: float) -> list[tuple[str, float, float, object]]:
        """The calls that started in [t0, t1]."""
        with self.lock:
            return [e for e in self.events if t0 <= e[1] <= t1]

    def restore(self) -> None:
        for owner, name, original in reversed(self.undo):
            setattr(owner, name, original)


def wrap_engine(probe: Probe) -> None:
    """Timers on the engine's step: scheduler, forward, projections, attention, sampling (the
    functions both backends share)."""
    from paraflex.engine.core.scheduler import EngineScheduler
    from paraflex.engine.engine_loop import EngineLoop
    from paraflex.engine.worker.model import layers
    from paraflex.engine.worker.model.linear import Linear
    from paraflex.engine.worker.stage_worker import Worker

    probe.wrap(EngineScheduler, "schedule", "schedule")
    probe.wrap(Worker, "run", "forward")
    probe.wrap(Linear, "__call__", "projections")
    probe.wrap(layers, "paged_attention", "attention")
    probe.wrap(EngineLoop, "_sample", "sample")


# ---------------------------------------------------------------------- inside Ray's workers
def worker_runtime_env(folder: str) -> dict:
    """Ray's runtime environment that installs the probe in every worker, events to `folder`."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return {"env_vars": {"PYTHONPATH": path, "PARAFLEX_PROBE_DIR": folder},
            "worker_process_setup_hook": "call_probe.install_in_worker"}


def install_in_worker() -> None:
    """Ray's worker setup hook: wrap the engine actor's path, then answer `collect` requests."""
    from paraflex.engine import ray_output
    from paraflex.engine.ray_engine import EngineActor

    probe = Probe()
    wrap_engine(probe)
    probe.wrap(EngineActor, "add_request", "actor add")
    probe.wrap(EngineActor, "_apply_inbox", "apply", when=bool)  # only the calls that applied something
    probe.wrap(ray_output.BatchingSink, "on_output", "sink")
    probe.wrap(ray_output, "pack_records", "push")  # the sender thread starts a push
    threading.Thread(target=_answer, args=(probe, os.environ["PARAFLEX_PROBE_DIR"]), name="pf-probe",
                     daemon=True).start()


def _answer(probe: Probe, folder: str) -> None:
    flag, target = os.path.join(folder, DUMP_FLAG), os.path.join(folder, f"{os.getpid()}.pkl")
    while not os.path.exists(flag):
        time.sleep(0.25)
    with probe.lock:
        events = list(probe.events)
    with open(target + ".tmp", "wb") as fh:
        pickle.dump(events, fh)
    os.replace(target + ".tmp", target)


def collect(folder: str, pids: list[int], timeout_s: float = 10.0) -> list:
    """Ask the workers for their events; those of processes `pids` (waits for each)."""
    open(os.path.join(folder, DUMP_FLAG), "w").close()
    deadline = time.monotonic() + timeout_s
    wanted = {os.path.join(folder, f"{pid}.pkl") for pid in pids}
    while not wanted <= set(glob.glob(os.path.join(folder, "*.pkl"))):
        if time.monotonic() > deadline:
            raise SystemExit(f"ttft_split: no probe events from worker(s) {sorted(pids)} within {timeout_s:g} s")
        time.sleep(0.1)
    events = []
    for path in sorted(wanted):
        with open(path, "rb") as fh:
            events += pickle.load(fh)
    return events
