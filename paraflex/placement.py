"""The placement file: the single hand-off from the planner to the simulator and the server.

`paraflex plan` writes it; `paraflex simulate` and `paraflex serve` read it. It says, for every
model, how its layers are cut into pipeline stages and on which engines each replica's stages
live, and, for every engine, which stages are resident there with their weight bytes and the
KV bytes the planner budgeted for each model (DRF, see `paraflex.planner.drf`).

JSON layout (version 1; docs/plan.md has the full reference)::

    {"format": "paraflex-placement", "version": 1,
     "planner": "paraflex", "params": {...}, "objective": 0.31,
     "models": {"m": {"num_layers": 32, "stages": [[0, 16], [16, 32]],
                      "replicas": [[0, 1], [2, 3]]}},
     "engines": [{"id": 0, "stages": [{"model": "m", "replica": 0, "stage": 0}],
                  "weight_bytes": 123, "kv_bytes": {"m": 456}}, ...]}

`stages` are half-open layer ranges [a, b); `replicas[j][k]` is the engine id of stage k of
replica j. `kv_bytes` is the planner's DRF share per resident model, a planning figure:
an engine's KV pool at run time may use all of `engine_memory_bytes - weight_bytes`. `objective` is the planner's Phi*: the smallest per-stage KV allocation of any model,
as a fraction of one engine's memory (`params["engine_memory_bytes"]`).

`Placement.load` checks the structure (every layer of every replica placed exactly once, engine
ids in range, engines' resident stages matching the models' replicas); `check_models` checks
that a loaded plan serves exactly a config's models with all their layers (what `paraflex serve`
needs before it loads weights); the other constraints that need the config (memory, kappa) are
checked by `paraflex.planner.validate`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from paraflex.errors import UserError

FORMAT = "paraflex-placement"
VERSION = 1


@dataclass(frozen=True)
class StageRef:
    """One resident stage: stage `stage` of replica `replica` of model `model`."""

    model: str
    replica: int
    stage: int


@dataclass
class ModelPlacement:
    """How one model is cut into stages and where each replica's stages live."""

    name: str
    num_layers: int
    stages: list[tuple[int, int]]
    replicas: list[list[int]]

    @property
    def num_stages(self) -> int:
        return len(self.stages)

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    def engine_of(self, replica: int, stage: int) -> int:
        return self.replicas[replica][stage]


@dataclass
class EnginePlacement:
    """What one engine holds: resident stages, their weight bytes, planned KV bytes per model."""

    id: int
    stages: list[StageRef] = field(default_factory=list)
    weight_bytes: int = 0
    kv_bytes: dict[str, int] = field(default_factory=dict)


@dataclass
class Placement:
    """A complete plan: models' stages and replicas, engines' contents, objective, provenance."""

    version: int
    planner: str
    params: dict
    objective: float
    models: dict[str, ModelPlacement]
    engines: list[EnginePlacement]

    @property
    def num_engines(self) -> int:
        return len(self.engines)

    def engine(self, engine_id: int) -> EnginePlacement:
        return self.engines[engine_id]

    def stage_layers(self, model: str, stage: int) -> tuple[int, int]:
        return self.models[model].stages[stage]

    # ---- serialisation -------------------------------------------------------------------

    def to_dict(self) -> dict:
        return {
            "format": FORMAT,
            "version": self.version,
            "planner": self.planner,
            "params": self.params,
            "objective": self.objective,
            "models": {
                name: {
                    "num_layers": m.num_layers,
                    "stages": [list(s) for s in m.stages],
                    "replicas": [list(r) for r in m.replicas],
                }
                for name, m in self.models.items()
            },
            "engines": [
                {
                    "id": e.id,
                    "stages": [{"model": s.model, "replica": s.replica, "stage": s.stage} for s in e.stages],
                    "weight_bytes": e.weight_bytes,
                    "kv_bytes": dict(e.kv_bytes),
                }
                for e in self.engines
            ],
        }

    @classmethod
    def from_dict(cls, d: dict, source: str = "placement", check: bool = True) -> "Placement":
        """Build from parsed JSON; raises UserError naming the field on a malformed document.

        With `check=True` (the default) the structural invariants are enforced too
        (see `structural_problems`); `check=False` keeps a well-typed but inconsistent plan so
        `paraflex plan --validate` can list every violation.
        """
        if not isinstance(d, dict):
            raise UserError(f"{source}: expected a JSON object, got {type(d).__name__}")
        if d.get("format") != FORMAT:
            raise UserError(f"{source}: format: expected {FORMAT!r}, got {d.get('format')!r} (not a placement file?)")
        version = _get(d, "version", int, source)
        if version != VERSION:
            raise UserError(f"{source}: version: this paraflex reads version {VERSION}, file has {version}; re-run `paraflex plan`")
        models_raw = _get(d, "models", dict, source)
        models = {}
        for name, m in models_raw.items():
            path = f"{source}: models.{name}"
            if not isinstance(m, dict):
                raise UserError(f"{path}: expected an object")
            stages = [_pair(s, f"{path}.stages[{k}]") for k, s in enumerate(_get(m, "stages", list, path))]
            replicas = []
            for j, r in enumerate(_get(m, "replicas", list, path)):
                if not isinstance(r, list) or not all(_is_int(x) for x in r):
                    raise UserError(f"{path}.replicas[{j}]: expected a list of engine ids")
                replicas.append(list(r))
            models[name] = ModelPlacement(name, _get(m, "num_layers", int, path), stages, replicas)
        engines = []
        for n, e in enumerate(_get(d, "engines", list, source)):
            path = f"{source}: engines[{n}]"
            if not isinstance(e, dict):
                raise UserError(f"{path}: expected an object")
            refs = []
            for k, s in enumerate(_get(e, "stages", list, path)):
                spath = f"{path}.stages[{k}]"
                if not isinstance(s, dict):
                    raise UserError(f"{spath}: expected an object")
                refs.append(StageRef(_get(s, "model", str, spath), _get(s, "replica", int, spath), _get(s, "stage", int, spath)))
            kv = _get(e, "kv_bytes", dict, path)
            if not all(_is_int(v) for v in kv.values()):
                raise UserError(f"{path}.kv_bytes: expected integer byte counts")
            engines.append(EnginePlacement(_get(e, "id", int, path), refs, _get(e, "weight_bytes", int, path), dict(kv)))
        objective = d.get("objective")
        if not isinstance(objective, (int, float)) or isinstance(objective, bool):
            raise UserError(f"{source}: objective: expected a number")
        placement = cls(version, _get(d, "planner", str, source), _get(d, "params", dict, source), float(objective), models, engines)
        if check:
            problems = placement.structural_problems()
            if problems:
                more = f" (and {len(problems) - 3} more; run `paraflex plan --validate`)" if len(problems) > 3 else ""
                raise UserError(f"{source}: inconsistent placement: " + "; ".join(problems[:3]) + more)
        return placement

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path, check: bool = True) -> "Placement":
        p = Path(path)
        try:
            d = json.loads(p.read_text())
        except FileNotFoundError:
            raise UserError(f"{p}: placement file not found (write one with `paraflex plan CONFIG -o {p}`)") from None
        except IsADirectoryError:
            raise UserError(f"{p} is a directory; pass a placement JSON file") from None
        except json.JSONDecodeError as exc:
            raise UserError(f"{p}: not valid JSON: {exc}") from None
        return cls.from_dict(d, source=str(p), check=check)

    @classmethod
    def load_for(cls, path: str, config) -> "Placement":
        """The placement file `path` to run `config` with (serve, generate): its structure and
        its models checked against the config before any engine loads the wrong layers."""
        placement = cls.load(path)
        placement.check_models(config, source=path)
        return placement

    # ---- structure -----------------------------------------------------------------------

    def check_models(self, config, source: str = "placement") -> None:
        """Raise a UserError unless this plan places exactly the config's models, each with the
        layer count of the model's architecture in the config (a plan made for another config
        would serve a model with the wrong layers). Its stages cover [0, num_layers) without gaps
        already: `load` checks the structure."""
        fix = f"re-run `paraflex plan {config.source} -o {source}` for this config"
        placed, configured = sorted(self.models), sorted(m.name for m in config.models)
        if placed != configured:
            raise UserError(f"{source}: places models {', '.join(placed)} but {config.source} has "
                            f"{', '.join(configured)}; {fix}")
        for mc in config.models:
            m = self.models[mc.name]
            if m.num_layers != mc.arch.num_layers:
                covered = ", ".join(f"{a}-{b - 1}" for a, b in m.stages)
                raise UserError(f"{source}: model {mc.name}: stages cover layers {covered} but its "
                                f"architecture {mc.arch.name} in {config.source} has {mc.arch.num_layers} "
                                f"layers (0-{mc.arch.num_layers - 1}); {fix}")

    def structural_problems(self) -> list[str]:
        """Violations of the file's own invariants, one readable line each (empty when sound)."""
        out: list[str] = []
        n = len(self.engines)
        for k, e in enumerate(self.engines):
            if e.id != k:
                out.append(f"engines[{k}].id is {e.id}; engine ids must be 0..{n - 1} in order")
        expected: dict[int, set[StageRef]] = {k: set() for k in range(n)}
        for name, m in self.models.items():
            if m.num_layers < 1:
                out.append(f"model {name}: num_layers must be >= 1")
            if not m.stages:
                out.append(f"model {name}: no stages")
            pos = 0
            for k, (a, b) in enumerate(m.stages):
                if a != pos or b <= a:
                    out.append(f"model {name}: stage {k} covers layers [{a}, {b}), expected to start at {pos} and be non-empty")
                pos = max(pos, b)
            if m.stages and pos != m.num_layers:
                out.append(f"model {name}: stages cover layers [0, {pos}) but the model has {m.num_layers}")
            if not m.replicas:
                out.append(f"model {name}: no replicas")
            for j, r in enumerate(m.replicas):
                if len(r) != len(m.stages):
                    out.append(f"model {name} replica {j}: {len(r)} engines for {len(m.stages)} stages")
                for k, eid in enumerate(r):
                    if not 0 <= eid < n:
                        out.append(f"model {name} replica {j} stage {k}: engine {eid} out of range 0..{n - 1}")
                    else:
                        expected[eid].add(StageRef(name, j, k))
        for k, e in enumerate(self.engines):
            have = set(e.stages)
            for ref in sorted(have - expected.get(k, set()), key=_ref_key):
                out.append(f"engine {k} lists {_ref_str(ref)}, which the models section places elsewhere")
            for ref in sorted(expected.get(k, set()) - have, key=_ref_key):
                out.append(f"engine {k} does not list {_ref_str(ref)}, which the models section places there")
            if len(e.stages) != len(have):
                out.append(f"engine {k} lists a stage twice")
            for model in e.kv_bytes:
                if model not in self.models:
                    out.append(f"engine {k}: kv_bytes names unknown model {model!r}")
        return out


def _ref_key(ref: StageRef):
    return (ref.model, ref.replica, ref.stage)


def _ref_str(ref: StageRef) -> str:
    return f"{ref.model} replica {ref.replica} stage {ref.stage}"


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _get(d: dict, key: str, typ: type, path: str):
    if key not in d:
        raise UserError(f"{path}: missing field {key!r}")
    v = d[key]
    ok = _is_int(v) if typ is int else isinstance(v, typ)
    if not ok:
        raise UserError(f"{path}.{key}: expected {typ.__name__}, got {type(v).__name__}")
    return v


def _pair(s, path: str) -> tuple[int, int]:
    if not (isinstance(s, list) and len(s) == 2 and all(_is_int(x) for x in s)):
        raise UserError(f"{path}: expected a layer range [start, end]")
    return (s[0], s[1])
