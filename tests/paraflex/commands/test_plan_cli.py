"""`paraflex plan` end to end on every shipped config, and `--validate` on planted violations."""

import json
from pathlib import Path

import pytest

from paraflex.cli import main
from paraflex.placement import Placement
from repo_paths import CONFIGS

CONFIGS = sorted(str(p) for p in CONFIGS.glob("*.yaml"))
DEMO = next(c for c in CONFIGS if c.endswith("demo.yaml"))
BASE = next(c for c in CONFIGS if c.endswith("paper-base.yaml"))


def test_configs_are_shipped():
    assert len(CONFIGS) >= 5


@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: Path(c).stem)
def test_plan_and_validate_every_shipped_config(config, tmp_path, capsys):
    out = tmp_path / "placement.json"
    assert main(["plan", config, "-o", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "Phi* =" in printed and "engine" in printed
    placement = Placement.load(out)
    assert placement.planner == "paraflex"
    assert 0 < placement.objective <= 1
    assert main(["plan", "--validate", str(out), config]) == 0
    assert "valid for" in capsys.readouterr().out


@pytest.mark.parametrize("solver", ["milp", "dedicated", "shared", "grouped", "tensor"])
def test_other_solvers_write_valid_placements(solver, tmp_path, capsys):
    config = DEMO if solver == "milp" else BASE
    out = tmp_path / f"{solver}.json"
    assert main(["plan", config, "-o", str(out), "--solver", solver, "-q"]) == 0
    placement = Placement.load(out)
    assert placement.planner == solver
    assert main(["plan", "--validate", str(out), config]) == 0


def test_milp_is_at_least_the_heuristic_on_the_demo(tmp_path):
    main(["plan", DEMO, "-o", str(tmp_path / "h.json"), "-q"])
    main(["plan", DEMO, "-o", str(tmp_path / "m.json"), "--solver", "milp", "-q", "--time-limit", "60"])
    h, m = Placement.load(tmp_path / "h.json"), Placement.load(tmp_path / "m.json")
    # both follow Alg. 1 to the end on the roomy demo cluster, so the replica counts agree
    assert [r.num_replicas for r in h.models.values()] == [r.num_replicas for r in m.models.values()]
    assert m.objective >= h.objective * (1 - 1e-9)
    assert m.params["proven_optimal"] is True


def test_png_is_written(tmp_path):
    png = tmp_path / "p.png"
    assert main(["plan", DEMO, "-o", str(tmp_path / "p.json"), "--png", str(png), "-q"]) == 0
    assert png.read_bytes()[:4] == b"\x89PNG"


@pytest.fixture(scope="module")
def base_plan(tmp_path_factory):
    out = tmp_path_factory.mktemp("plan") / "placement.json"
    assert main(["plan", BASE, "-o", str(out), "-q"]) == 0
    return json.loads(out.read_text())


def _multi_stage(d):
    return next((name, j) for name, m in d["models"].items() for j, r in enumerate(m["replicas"]) if len(r) >= 3)


def _relist(d):
    """Rebuild the engines' stage lists from the models section (so only the planted fault remains)."""
    for e in d["engines"]:
        e["stages"] = []
    for name, m in d["models"].items():
        for j, rep in enumerate(m["replicas"]):
            for k, e in enumerate(rep):
                d["engines"][e]["stages"].append({"model": name, "replica": j, "stage": k})


def _plant_p1(d):
    name, j = _multi_stage(d)
    rep = d["models"][name]["replicas"][j]
    rep[0], rep[1] = rep[1], rep[0]
    _relist(d)


def _plant_two_stages_one_engine(d):
    name, j = _multi_stage(d)
    rep = d["models"][name]["replicas"][j]
    rep[1] = rep[0]
    _relist(d)


def _plant_kappa(d):
    e = next(e for e in d["engines"] if e["kv_bytes"])
    model = next(iter(e["kv_bytes"]))
    e["kv_bytes"][model] = 1


def _plant_memory(d):
    e = next(e for e in d["engines"] if e["kv_bytes"])
    model = next(iter(e["kv_bytes"]))
    e["kv_bytes"][model] = 10**15


def _plant_layer_gap(d):
    name, _ = _multi_stage(d)
    stages = d["models"][name]["stages"]
    stages[1][0] += 1


def _plant_weights(d):
    d["engines"][0]["weight_bytes"] += 12345


def _plant_objective(d):
    d["objective"] *= 1.1  # a better plan than the stages give


def _plant_objective_bytes(d):
    d["params"]["objective_bytes"] *= 1.1


@pytest.mark.parametrize(
    "plant, expected",
    [
        (_plant_p1, "P1:"),
        (_plant_two_stages_one_engine, "(4):"),
        (_plant_kappa, "(6):"),
        (_plant_memory, "(5):"),
        (_plant_layer_gap, "covers layers"),
        (_plant_weights, "records"),
        (_plant_objective, "objective: the file records Phi*"),
        (_plant_objective_bytes, "objective: params.objective_bytes"),
    ],
    ids=["p1", "overlap", "kappa", "memory", "layer-gap", "weights", "objective", "objective-bytes"],
)
def test_validate_catches_planted_violation(base_plan, plant, expected, tmp_path, capsys):
    d = json.loads(json.dumps(base_plan))
    plant(d)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(d))
    assert main(["plan", "--validate", str(path), BASE]) == 2
    out = capsys.readouterr()
    assert expected in out.out
    assert "violation" in out.err


def test_missing_config_is_a_user_error(tmp_path, capsys):
    assert main(["plan", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml does not exist" in capsys.readouterr().err


def test_no_config_plans_the_shipped_demo(tmp_path, monkeypatch):
    """Issue 24: `paraflex plan` with no CONFIG plans the demo shipped in the package (it was exit 2)."""
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "-q"]) == 0
    assert Placement.load(tmp_path / "placement.json").planner == "paraflex"


def _plan_balanced(tmp_path, *flags) -> Placement:
    """`paraflex plan` of the base cluster under balanced popularity with `flags`, loaded."""
    cfg = tmp_path / "balanced.yaml"
    cfg.write_text(Path(BASE).read_text().replace("zipf_alpha: 1.01", ""))
    out = tmp_path / f"plan{''.join(flags)}.json"
    main(["plan", str(cfg), "-o", str(out), "-q", *flags])
    return Placement.load(out)


def test_fill_uses_every_engine_and_paper_replication_is_the_ablation(tmp_path, capsys):
    """The base cluster under balanced popularity: the paper's Alg. 1 stops every model at two
    replicas when llama-2-70b's third does not fit (engines 0 and 3 then hold one 43 GiB stage
    each); by default the one-stage models go on replicating onto the engines that hold fewer stages than
    the busiest."""
    fill, paper = _plan_balanced(tmp_path), _plan_balanced(tmp_path, "--paper-replication")
    assert [m.num_replicas for m in paper.models.values()] == [2, 2, 2, 2]
    assert [m.num_replicas for m in fill.models.values()] == [4, 3, 3, 2]
    assert [len(e.stages) for e in fill.engines] == [2] * 8
    assert "Alg. 1" in paper.params["stop_reason"]
    assert "no model can get another replica" in fill.params["stop_reason"]
    assert all(e.stages for e in fill.engines)


def test_stage_shares_are_the_default_and_work_shares_the_option(tmp_path, capsys):
    """Balanced base cluster: codellama (34B) is one stage of 1.7x internlm's work; by stage
    count (eq. 7, the default) it gets a replica fewer than internlm-1, by weight bytes one more."""
    work, stages = _plan_balanced(tmp_path, "--work-shares"), _plan_balanced(tmp_path)
    assert [m.num_replicas for m in work.models.values()] == [3, 3, 4, 2]
    assert [m.num_replicas for m in stages.models.values()] == [4, 3, 3, 2]
    assert all(e.stages for e in work.engines)


def test_other_solvers_default_to_their_own_file(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", BASE]) == 0
    first = (tmp_path / "placement.json").read_text()
    assert main(["plan", BASE, "--solver", "grouped"]) == 0
    assert "wrote placement-grouped.json" in capsys.readouterr().out
    assert Placement.load(tmp_path / "placement-grouped.json").planner == "grouped"
    assert (tmp_path / "placement.json").read_text() == first


def test_memory_only_placement_flag_plans_the_papers_alg2(tmp_path, capsys):
    """Balanced base cluster: `--memory-only-placement` gives the plan without the compute
    balance (planner.balance_compute: false), with the same replica counts and Phi*."""
    ours, paper = _plan_balanced(tmp_path), _plan_balanced(tmp_path, "--memory-only-placement")
    assert ours.objective == pytest.approx(paper.objective)
    assert [m.num_replicas for m in ours.models.values()] == [m.num_replicas for m in paper.models.values()]
    assert [sorted(r[0] for r in m.replicas) for m in ours.models.values()] != \
        [sorted(r[0] for r in m.replicas) for m in paper.models.values()]
