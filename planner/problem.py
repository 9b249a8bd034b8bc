"""The planning problem as plain data: what the sharder hands to the replication/placement core.

`paraflex.planner.sharding.build_problem(config)` turns a config into a `Problem`; Alg. 1
(`replication`), Alg. 2 (`placement_optimizer`), the exact solver (`milp`) and the baselines
(`baselines`) read it; `assemble.to_placement` turns their answer into a `Placement` file.
Units: bytes. Pure Python, no config or cost-model imports, so tests build problems by hand.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

from paraflex.errors import UserError


class StageWeights(Protocol):
    """Anything that knows the weight bytes of a layer range (a `ModelArch` does)."""

    def stage_weight_bytes(self, layer_start: int, layer_end: int, first: bool, last: bool) -> int: ...


@dataclass(frozen=True)
class UniformLayers:
    """A `StageWeights` for hand-built problems: equal layers plus extra bytes on the ends."""

    layer_bytes: int
    first_bytes: int = 0
    last_bytes: int = 0

    def stage_weight_bytes(self, layer_start: int, layer_end: int, first: bool, last: bool) -> int:
        return (layer_end - layer_start) * self.layer_bytes + first * self.first_bytes + last * self.last_bytes


def split_layers(num_layers: int, num_stages: int) -> tuple[tuple[int, int], ...]:
    """§4.1: floor(L/S) layers per stage, the remainder one at a time from the first stage."""
    if not 1 <= num_stages <= num_layers:
        raise ValueError(f"cannot cut {num_layers} layers into {num_stages} stages")
    base, extra = divmod(num_layers, num_stages)
    out, start = [], 0
    for k in range(num_stages):
        end = start + base + (1 if k < extra else 0)
        out.append((start, end))
        start = end
    return tuple(out)


@dataclass(frozen=True)
class ModelSpec:
    """One model as the planner sees it: its stage cut, each stage's weight bytes, its demand."""

    name: str
    num_layers: int
    stages: tuple[tuple[int, int], ...]
    stage_weights: tuple[int, ...]
    rate: float  # workload ratio R_i; `Problem` normalises so that the R_i sum to 1
    arch: StageWeights = field(compare=False, repr=False, default=None)
    model_time: float = 0.0  # the cost model's reference time of the whole model, s (0: not known)

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def weight_bytes(self) -> int:
        return sum(self.stage_weights)

    def resplit(self, num_stages: int) -> "ModelSpec":
        """The same model cut into `num_stages` even stages (baselines use other cuts)."""
        return self.recut(split_layers(self.num_layers, num_stages))

    def recut(self, stages) -> "ModelSpec":
        """The same model cut at `stages` ((first layer, end layer) per stage, as a checked placement holds them)."""
        stages = tuple((int(a), int(b)) for a, b in stages)
        last = len(stages) - 1
        weights = tuple(
            self.arch.stage_weight_bytes(a, b, k == 0, k == last) for k, (a, b) in enumerate(stages)
        )
        return ModelSpec(self.name, self.num_layers, stages, weights, self.rate, self.arch, self.model_time)

    @classmethod
    def from_arch(cls, name: str, num_layers: int, num_stages: int, rate: float, arch: StageWeights,
                  model_time: float = 0.0) -> "ModelSpec":
        return cls(name, num_layers, (), (), rate, arch, model_time).resplit(num_stages)


@dataclass(frozen=True)
class Problem:
    """Models (with stage cuts), N_e engines of `memory_bytes` each, kappa, ring on/off, and
    the node of each engine (hops inside a node are cheaper than hops between nodes)."""

    models: tuple[ModelSpec, ...]
    num_engines: int
    memory_bytes: int
    kappa_bytes: int = 0
    ring: bool = False
    node_of: tuple[int, ...] | None = None  # engine -> node (None: one node); replicas prefer one node
    # Alg. 1's target share by work (weight bytes) rather than stage count (eq. 7, the default of a
    # hand-built problem); `build_problem` sets it from planner.replica_shares. planner/replication.py
    work_shares: bool = False
    # after Alg. 2, swap replicas where that evens the engines' compute load (`stage_work`) without
    # lowering Phi* (`ReplicaPlacer.even_out`); `build_problem` sets it from planner.balance_compute
    balance_compute: bool = False

    def __post_init__(self):
        if not self.models:
            raise ValueError("a problem needs at least one model")
        if self.num_engines < 1 or self.memory_bytes <= 0 or self.kappa_bytes < 0:
            raise ValueError("num_engines >= 1, memory_bytes > 0 and kappa_bytes >= 0 are required")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"model names must be unique: {names}")
        if any(m.rate <= 0 for m in self.models):
            raise ValueError("every model needs a rate > 0")
        if self.node_of is not None and len(self.node_of) != self.num_engines:
            raise ValueError(f"node_of names {len(self.node_of)} engines, the problem has {self.num_engines}")

    def with_rates(self, rates) -> "Problem":
        """The same problem with each model's rate from `rates` (name -> rate > 0; re-planning)."""
        missing = [m.name for m in self.models if m.name not in rates]
        if missing:
            raise UserError(f"no rate given for model {missing[0]!r}; give a rate for every planned model")
        return replace(self, models=tuple(replace(m, rate=rates[m.name]) for m in self.models))

    def with_cuts(self, cuts) -> "Problem":
        """The same problem with the stage cut of each model named in `cuts` (name -> stages) fixed
        to the one given (live re-planning keeps the serving cuts)."""
        return replace(self, models=tuple(m.recut(cuts[m.name]) if m.name in cuts else m for m in self.models))

    @property
    def ratios(self) -> list[float]:
        """Normalised workload ratios R_i (sum 1)."""
        total = sum(m.rate for m in self.models)
        return [m.rate / total for m in self.models]

    @property
    def stage_counts(self) -> list[int]:
        return [m.num_stages for m in self.models]

    def stage_work(self) -> list[tuple[float, ...]]:
        """Per model, the compute each of its stages spends on one request of that model: the
        stage's layer share of the model's reference time, or, unless every model has one
        (hand-built problems), of the model's weight bytes (a decode step reads every weight once)."""
        if all(m.model_time > 0 for m in self.models):
            return [tuple(m.model_time * (b - a) / m.num_layers for a, b in m.stages) for m in self.models]
        return [tuple(float(w) for w in m.stage_weights) for m in self.models]


class NoFeasiblePlan(UserError):
    """Not even one replica of every model fits (memory or kappa); the message says which."""


@dataclass
class Solution:
    """A solver's answer: per model, each replica's engine list (stage k -> engine)."""

    replicas: list[list[list[int]]]
    objective_bytes: float  # Phi* in bytes: the smallest per-stage KV grant of any model
    iterations: int = 1  # replication steps taken (Alg. 1 calls that added a replica, plus one)
    stop_reason: str = ""  # why replication stopped, for the CLI's report
    optimal: bool | None = None  # exact solvers: proven optimal for the final replica counts


def replica_engines(start: int, num_stages: int, num_engines: int) -> list[int]:
    """P1: stage k of a replica starting at `start` runs on engine start + k (mod N_e on a ring)."""
    return [(start + k) % num_engines for k in range(num_stages)]
