"""GPUs-needed search (Prism Table 1's metric): the fewest engines at which a system meets a
target attainment on a workload.

Place in the data flow: `paraflex simulate --find-min-engines TARGET` calls `find_min_engines`,
which re-runs `runner.simulate` with `cluster.num_engines` = n (same workload and seed), by
bisection between 1 and an upper bound: attainment rises with engines (not strictly, so the
answer is the smallest n found passing with n - 1 failing). A system that cannot lay out the
models on n engines (a planner or placement UserError) fails at n. A progress bar shows each try.
"""

from __future__ import annotations

import dataclasses

from paraflex.errors import UserError
from paraflex.simulator.progress import Progress

ATTAINMENTS = {"slo": "slo_attainment", "ttft": "ttft_attainment", "tpot": "tpot_attainment"}


def with_engines(config, n: int):
    return dataclasses.replace(config, cluster=dataclasses.replace(config.cluster, num_engines=n))


def attainment_at(config, settings, n: int, key: str) -> tuple[float, str]:
    """(attainment, note) of `settings.system` on n engines; 0 when it cannot lay out."""
    from paraflex.simulator.runner import simulate

    try:
        s = simulate(with_engines(config, n), settings).summary
    except UserError as exc:
        return 0.0, f"no layout: {exc}"
    value = s.get(key)
    return (value if value is not None else 0.0), f"{s['finished']} requests"


def find_min_engines(config, settings, target: float, attainment: str = "slo", max_engines: int | None = None,
                     stream=None) -> tuple[int | None, dict[int, tuple[float, str]]]:
    """(fewest engines meeting `target`, or None within `max_engines`; {engines: (attainment, note)})."""
    if not 0 < target <= 1:
        raise UserError(f"--find-min-engines {target:g}: give the target attainment as a fraction in (0, 1], e.g. 0.99")
    if attainment not in ATTAINMENTS:
        raise UserError(f"--attainment {attainment}: choose one of {', '.join(ATTAINMENTS)}")
    key = ATTAINMENTS[attainment]
    hi = max_engines or config.cluster.num_engines
    if hi < 1:
        raise UserError(f"--max-engines must be >= 1, got {hi}")
    tries: dict[int, tuple[float, str]] = {}
    bar = Progress(max(1, hi.bit_length() + 1), f"{settings.system}: fewest engines for {attainment} >= {target:g}",
                   stream=stream)

    def meets(n: int) -> bool:
        if n not in tries:
            tries[n] = attainment_at(config, settings, n, key)
            bar.step(f"{n} engines: {tries[n][0]:.3f}")
        return tries[n][0] >= target

    if not meets(hi):
        bar.done = bar.total - 1
        bar.step("target not met")
        return None, tries
    lo = 0  # fails by definition
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if meets(mid):
            hi = mid
        else:
            lo = mid
    if bar.done < bar.total:
        bar.done = bar.total - 1
        bar.step(f"{hi} engines")
    return hi, tries
