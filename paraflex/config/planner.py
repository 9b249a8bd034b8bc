"""The config's `planner:` section: the target stage time T_s, the KV floor kappa, ring layout.

Place in the data flow: `paraflex.config.schema` parses the section with `parse_planner` into a
`PlannerConfig`; the planner (paraflex.planner) resolves T_s against its `auto` value (the
execution time of the smallest model) with `resolve_target_stage_time` and keeps at least
`kappa_bytes` of KV per stage. Keys and defaults: docs/config.md.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from paraflex.config.fields import GIB, Section, value_kind
from paraflex.errors import ConfigError

_MS_RE = re.compile(r"^([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*(?:ms)?$")
REPLICA_SHARES = ("work", "stages")
_STAGE_TIME_RE = re.compile(r"^(x|/)\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)$", re.IGNORECASE)


@dataclass
class PlannerConfig:
    target_stage_time: str | float = "auto"  # "auto" | ms | "x2" | "/2"
    kappa_gb: float = 0.1  # minimum KV bytes per stage (GiB)
    ring: bool = False
    # replicate the other models while any fits when the one Alg. 1 chose cannot get another
    # replica; False is the paper's rule (stop there). planner/replication.py
    fill_engines: bool = True
    # Alg. 1's target share of a model: "stages" (rate x stage count, the paper's eq. 7, the
    # default) or "work" (rate x weight bytes). planner/replication.py
    replica_shares: str = "stages"
    # after Alg. 2, swap replicas of equal stage count where that evens the engines' compute load
    # without lowering Phi*; False is the paper's memory-only placement. planner/replica_placer.py
    balance_compute: bool = True

    @property
    def kappa_bytes(self) -> int:
        return int(self.kappa_gb * GIB)

    def resolve_target_stage_time(self, auto_s: float) -> float:
        """T_s in seconds given the `auto` value (execution time of the smallest model)."""
        ts = self.target_stage_time
        if isinstance(ts, (int, float)):
            return float(ts) / 1000.0
        if ts == "auto":
            return auto_s
        op, num = _STAGE_TIME_RE.match(ts).groups()
        return auto_s * float(num) if op.lower() == "x" else auto_s / float(num)


def parse_planner(raw) -> PlannerConfig:
    s = Section(raw, "planner", tuple(PlannerConfig.__dataclass_fields__))
    return PlannerConfig(
        target_stage_time=_parse_stage_time(s.data.get("target_stage_time", "auto")),
        kappa_gb=s.num("kappa_gb", 0.1, nonneg=True),
        ring=s.bool("ring", False),
        fill_engines=s.bool("fill_engines", True),
        replica_shares=s.str("replica_shares", "stages", choices=REPLICA_SHARES),
        balance_compute=s.bool("balance_compute", True),
    )


def _parse_stage_time(ts) -> str | float:
    """T_s: "auto", "xK" / "/K" (kept as text), or milliseconds (a number, "50", "50ms")."""
    path = "planner.target_stage_time"
    if isinstance(ts, bool) or not isinstance(ts, (str, int, float)):
        raise ConfigError(path, f"expected auto, milliseconds, 'x2' or '/2', got {value_kind(ts)}")
    if isinstance(ts, str):
        ts = ts.strip().lower()
        ms = _MS_RE.match(ts)
        if ms is None:
            factor = _STAGE_TIME_RE.match(ts)
            if ts != "auto" and factor is None:
                raise ConfigError(path, f"{ts!r} is not auto, a number of milliseconds, 'xK' or '/K' (e.g. x2, /2)")
            if factor is not None and float(factor.group(2)) <= 0:
                raise ConfigError(path, f"the factor in {ts!r} must be > 0")
            return ts
        ts = ms.group(1)
    ts = float(ts)
    if not math.isfinite(ts) or ts <= 0:
        raise ConfigError(path, f"must be > 0 ms, got {ts:g}")
    return ts
