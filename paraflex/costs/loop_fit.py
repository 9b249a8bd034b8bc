"""What the served engine loop adds to a stage step, fitted from an engine step log as a function
of what the step carries.

Place in the data flow: `paraflex serve --step-log DIR` (engine/step_log.py) writes one row per
batch each Ray engine ran, with `busy_s`, its loop iteration's wall time. `paraflex profile
CONFIG --step-log DIR` reads the rows (`read_step_log`) and calls `fit_loop_lines`: per row the
extra time `busy_s` minus the cost model's time for the same stage execution (op tables and
served-step residual, no engine loop term), per model and kind (prefill, decode) a least-squares
line of that extra in the step's size (prompt tokens; decode requests), fitted through the mean
extra at each size (each size weighted by its steps); on a shared host CPU the steps are first
divided by what the other engines stretched them by (paraflex/costs/host_cpu.py). Means, not medians: a request's TBT is the
mean of its steps, and an engine's capacity under load is set by its mean step. A step that took
more than OUTLIER_FACTOR times its expected time (its stage time plus the median extra of its
model and kind) is left out as a one-off (a kernel compiling on first use, a full garbage
collection), not what the loop adds to every step: on an H100 a served
calibration held prefills of 0.5-1.7 s (Triton compiles) among ones of ~15 ms, and they lifted
llama-1b-shape's fitted prefill line from ~8 to 41 ms per step. The lines go
into `EngineLoopTerm` (paraflex/costs/serving_terms.py, `engine_loop` in profile.json), which
the cost model adds to every stage execution at its size, with `step_spreads`, how the steps
spread around the lines' prediction, which the simulator draws each stage execution's time from.
Mixed (Sarathi) steps are not used.
Pure: rows are dicts, the stage time a function.
"""

from __future__ import annotations

import csv
import glob
import os
import statistics
from collections import defaultdict
from typing import Callable, Sequence

from paraflex.costs.latency_spread import spread_of
from paraflex.errors import UserError

OUTLIER_FACTOR = 20.0  # a logged step over this many times its expected time is a one-off, left out


def read_step_log(directory: str) -> list[dict]:
    """The rows of every engine-*.csv under `directory`."""
    paths = sorted(glob.glob(os.path.join(directory, "engine-*.csv")))
    if not paths:
        raise UserError(f"--step-log {directory}: no engine-*.csv in it; pass the DIR of `paraflex serve --step-log DIR`")
    rows = []
    for path in paths:
        with open(path, newline="", encoding="utf-8") as fh:
            rows += list(csv.DictReader(fh))
    return rows


def step_end(row: dict) -> float:
    """When a logged step ended: its start plus its loop iteration's wall time."""
    return float(row["start_s"]) + float(row["busy_s"])


def stage_time_fn(cost, placement, archs: dict) -> Callable[[dict], float]:
    """The cost model's time of a logged step (a row): its stage's layers on `placement`, its
    kind and size (`archs` by model name)."""
    def stage_time(r: dict) -> float:
        mp, stage = placement.models[r["model"]], int(r["stage"])
        a, b = mp.stages[stage]
        arch, first, last = archs[r["model"]], stage == 0, stage == mp.num_stages - 1
        batch = int(r["batch_size"])
        if r["kind"] == "prefill":
            return cost.prefill_time(arch, b - a, int(r["prefill_tokens"]), first, last, num_seqs=batch)
        return cost.decode_time(arch, b - a, batch, max(batch, int(r["total_context"])), first, last)

    return stage_time


def weighted_line(points: dict[int, list[float]]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the mean of each size's values,
    weighted by their count (one size: a flat line at its mean)."""
    n = sum(len(v) for v in points.values())
    mx = sum(x * len(v) for x, v in points.items()) / n
    my = sum(sum(v) for v in points.values()) / n
    sxx = sum(len(v) * (x - mx) ** 2 for x, v in points.items())
    if sxx == 0:
        return my, 0.0
    sxy = sum(len(v) * (x - mx) * (sum(v) / len(v) - my) for x, v in points.items())
    slope = sxy / sxx
    return my - slope * mx, slope


def step_size(row: dict) -> tuple[bool, int] | None:
    """(prefill?, size) of a logged step: prompt tokens or decode requests; None for a mixed one."""
    if row["kind"] == "prefill":
        return True, int(row["prefill_tokens"])
    if row["kind"] == "decode":
        return False, int(row["batch_size"])
    return None


def fit_loop_lines(rows: list[dict], stage_time: Callable[[dict], float],
                   stretches: Sequence[float] | None = None) -> dict[str, dict]:
    """model -> {prefill_s, prefill_per_token_s, decode_s, decode_per_seq_s, steps, outliers}: the
    lines of `busy_s / stretch - stage_time(row)` per model and kind (a kind without rows: zero),
    over the steps within OUTLIER_FACTOR of their expected time, their stage time plus the median
    extra of their model and kind (`outliers`: those left out); `stretches`, one per row, what the
    shared host CPU stretched each step by (host_cpu.py; None: 1 each)."""
    measured: dict[tuple[str, bool], list[tuple[int, float, float]]] = defaultdict(list)  # (size, took, stage)
    for i, r in enumerate(rows):
        sized = step_size(r)
        if sized is not None:
            took = float(r["busy_s"]) / (stretches[i] if stretches is not None else 1.0)
            measured[(r["model"], sized[0])].append((sized[1], took, stage_time(r)))
    out: dict[str, dict] = {}
    for (model, prefill), steps in sorted(measured.items()):
        typical = statistics.median(took - compute for _, took, compute in steps)
        points: dict[int, list[float]] = defaultdict(list)
        for size, took, compute in steps:
            if took <= OUTLIER_FACTOR * max(compute + typical, compute):
                points[size].append(took - compute)
        a, b = weighted_line(points)
        e = out.setdefault(model, {"prefill_s": 0.0, "prefill_per_token_s": 0.0, "decode_s": 0.0,
                                   "decode_per_seq_s": 0.0, "steps": 0, "outliers": 0})
        e.update({"prefill_s": a, "prefill_per_token_s": b} if prefill else {"decode_s": a, "decode_per_seq_s": b})
        kept = sum(len(v) for v in points.values())
        e["steps"] += kept
        e["outliers"] += len(steps) - kept
    return out


def step_spreads(rows: list[dict], stage_time: Callable[[dict], float], lines: dict[str, dict],
                 stretches: Sequence[float] | None = None) -> dict[str, list]:
    """"prefill" / "decode" -> how the logged steps `rows` spread around what `lines` (fitted on
    them) predict: each step's `busy_s` over `(stage_time + line) x stretch`, over their mean, as
    quantiles (latency_spread.py); the one-offs `fit_loop_lines` leaves out are left out here too.
    The simulator draws each stage execution's time from it (simulator/core/cluster.py)."""
    ratios: dict[str, list[float]] = {"prefill": [], "decode": []}
    for i, r in enumerate(rows):
        line = loop_line_s(lines, r)
        if line is None:
            continue
        compute = stage_time(r)
        expected = max(compute + line, compute) * (stretches[i] if stretches is not None else 1.0)
        took = float(r["busy_s"])
        if expected > 0 and took <= OUTLIER_FACTOR * expected:
            ratios[r["kind"]].append(took / expected)
    return {kind: spread_of([x / statistics.fmean(v) for x in v]) for kind, v in ratios.items() if v}


def line_at(e: dict, prefill: bool, size: int) -> float:
    """A model's fitted lines (`fit_loop_lines`' entry, or `engine_loop`'s in profile.json) at a
    step of `size` prompt tokens (prefill) or requests (decode)."""
    return e["prefill_s"] + e["prefill_per_token_s"] * size if prefill else e["decode_s"] + e["decode_per_seq_s"] * size


def loop_line_s(lines: dict[str, dict], row: dict) -> float | None:
    """The value of `fit_loop_lines`' line for a logged step `row` at its size; None for a mixed
    step or a model without lines."""
    sized, e = step_size(row), lines.get(row["model"])
    if sized is None or e is None:
        return None
    return line_at(e, *sized)
