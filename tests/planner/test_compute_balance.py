"""Compute balance after Alg. 2 (`ReplicaPlacer.even_out`, planner.balance_compute): swaps that
even the engines' compute load without lowering Phi*, off for hand-built problems and for
`balance_compute: false` (the paper's memory-only placement)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from repo_paths import CONFIGS

from paraflex.config.schema import load_config
from paraflex.errors import ConfigError
from paraflex.planner import plan
from paraflex.planner.placement_optimizer import optimize
from paraflex.planner.problem import ModelSpec, Problem, UniformLayers
from paraflex.planner.replica_placer import ReplicaPlacer, water_levels


def _model(name, rate, model_time=0.0, layers=4, stages=1):
    return ModelSpec.from_arch(name, layers, stages, rate, UniformLayers(10), model_time)


def _state(placer, placed, weights, memory=100):
    cap, cnt = np.full(placer.n, float(memory)), np.zeros(placer.n, dtype=np.int64)
    for w, starts in zip(weights, placed):
        for p in starts:
            placer.shift(cap, cnt, w, p, +1)
    return cap, cnt


def test_even_out_spreads_two_hot_replicas_that_memory_alone_stacked():
    """Two hot and two cold one-stage models, two replicas each, on 4 engines: the memory-only
    greedy (order hot-1, cold-1, hot-2, cold-2, ties to the lowest start) puts both hot models
    on engines 0 and 1 and both cold ones on 2 and 3; every engine holds the same weights, so
    Phi* cannot tell, but engines 0-1 carry 9x the compute of engines 2-3. even_out pairs each
    hot replica with a cold one."""
    models = (_model("hot-1", 9.0), _model("cold-1", 1.0), _model("hot-2", 9.0), _model("cold-2", 1.0))
    problem = Problem(models, num_engines=4, memory_bytes=100)
    placer = ReplicaPlacer(problem)
    weights = [np.asarray(m.stage_weights, dtype=float) for m in models]
    placed = [[0, 1], [2, 3], [0, 1], [2, 3]]
    cap, cnt = _state(placer, placed, weights)
    phi = water_levels(cap, cnt).min()
    works = [np.array([m.rate / 2]) for m in models]
    load = placer.even_out(cap, cnt, placed, weights, works)
    assert load.max() == pytest.approx(5.0) and load.min() == pytest.approx(5.0)  # 9/2 + 1/2 everywhere
    for e in range(4):
        on = [models[i].name for i, starts in enumerate(placed) for p in starts if p == e]
        assert sorted(n.split("-")[0] for n in on) == ["cold", "hot"], (e, on)
    assert water_levels(cap, cnt).min() >= phi
    assert list(cnt) == [2, 2, 2, 2]
    assert all(len(set(starts)) == len(starts) for starts in placed)  # (4): no model twice on an engine


@pytest.mark.parametrize("memory", [120, 100])
def test_even_out_never_lowers_phi_nor_overflows_memory_and_leaves_even_loads_alone(memory):
    """hot-a, hot-b (40 bytes each, rate 9) and cold-big (70), cold-c (20) (rate 1) on 2 engines.
    Stacked hot on engine 0: every swap that pairs hot with cold puts 110 bytes on one engine,
    which lowers Phi* from 15 to 5 (memory 120) or overflows it (memory 100): nothing moves.
    Already paired (even loads, memory 120): nothing moves either."""
    models = (_model("hot-a", 9.0), _model("hot-b", 9.0), _model("cold-big", 1.0, layers=7), _model("cold-c", 1.0, layers=2))
    problem = Problem(models, num_engines=2, memory_bytes=memory)
    placer = ReplicaPlacer(problem)
    weights = [np.asarray(m.stage_weights, dtype=float) for m in models]
    works = [np.array([m.rate]) for m in models]
    layouts = [[[0], [0], [1], [1]]] + ([[[0], [1], [1], [0]]] if memory == 120 else [])  # (paired: 110 bytes on e1)
    for placed in layouts:
        cap, cnt = _state(placer, placed, weights, memory)
        phi = water_levels(cap, cnt).min()
        before = [list(s) for s in placed]
        placer.even_out(cap, cnt, placed, weights, works)
        assert placed == before
        assert water_levels(cap, cnt).min() == phi


def test_stage_work_is_the_model_time_split_by_layers_or_else_the_weights():
    timed = Problem((_model("a", 1.0, model_time=0.4, layers=4, stages=2), _model("b", 1.0, model_time=0.1)), 2, 100)
    assert timed.stage_work() == [(pytest.approx(0.2), pytest.approx(0.2)), (pytest.approx(0.1),)]
    untimed = Problem((_model("a", 1.0, layers=4, stages=2), _model("b", 1.0, model_time=0.1)), 2, 100)
    assert untimed.stage_work() == [(20.0, 20.0), (40.0,)]  # weight bytes when any model lacks a time
    resplit = timed.models[0].resplit(4)
    assert resplit.model_time == 0.4 and len(resplit.stages) == 4


def test_hand_built_problems_keep_the_papers_placement_unless_asked():
    models = (_model("hot-1", 9.0), _model("cold-1", 1.0), _model("hot-2", 9.0), _model("cold-2", 1.0))
    base = Problem(models, num_engines=4, memory_bytes=100, kappa_bytes=1)
    assert not base.balance_compute
    paper = optimize(base, fill=False)
    balanced = optimize(dataclasses.replace(base, balance_compute=True), fill=False)
    assert paper.objective_bytes == pytest.approx(balanced.objective_bytes)
    assert [len(r) for r in paper.replicas] == [len(r) for r in balanced.replicas]


def _base(popularity_alpha):
    config = load_config(str(CONFIGS / "paper-base.yaml"))
    if popularity_alpha is None:
        config.workload.zipf_alpha = None
        for m in config.models:
            m.rate = 1.0
    return config


def _loads(config, placement):
    cost = config.cluster.cost_model()
    total = sum(m.rate for m in config.models)
    load = np.zeros(placement.num_engines)
    for m in config.models:
        mp = placement.models[m.name]
        for rep in mp.replicas:
            for k, e in enumerate(rep):
                a, b = mp.stages[k]
                load[e] += cost.model_time(m.arch) * m.rate / total / mp.num_replicas * (b - a) / mp.num_layers
    return load


def test_base_cluster_balanced_gets_the_even_pairing_and_zipf_keeps_its_plan():
    """Balanced base cluster: the memory-only plan pairs codellama with internlm-2 twice and
    internlm-1 only with llama-2-70b stages (load CV 0.091); the default swaps internlm replicas
    to CV 0.079 (the lowest of the 540 same-order placements with its Phi*, bench/placement_seeds.py)
    with the same Phi*, the same replica counts and llama-2-70b where it was. Under Zipf 1.01
    the memory-only plan is already as even as any, and nothing moves."""
    config = _base(None)
    assert config.planner.balance_compute
    ours = plan(config)
    config.planner.balance_compute = False
    paper = plan(config)
    assert ours.objective == pytest.approx(paper.objective)
    assert {n: m.num_replicas for n, m in ours.models.items()} == {n: m.num_replicas for n, m in paper.models.items()}
    assert ours.models["llama-2-70b"].replicas == paper.models["llama-2-70b"].replicas
    a, b = _loads(config, ours), _loads(config, paper)
    assert a.max() == pytest.approx(b.max())
    assert a.std() / a.mean() < b.std() / b.mean() - 0.01
    zipf = _base(1.01)
    ours = plan(zipf)
    zipf.planner.balance_compute = False
    assert {n: m.replicas for n, m in plan(zipf).models.items()} == {n: m.replicas for n, m in ours.models.items()}


def test_balance_compute_is_a_boolean_planner_key(tmp_path):
    cfg = tmp_path / "c.yaml"
    text = (CONFIGS / "paper-base.yaml").read_text()
    cfg.write_text(text.replace("  ring: false", "  ring: false\n  balance_compute: false"))
    assert load_config(str(cfg)).planner.balance_compute is False
    cfg.write_text(text.replace("  ring: false", "  ring: false\n  balance_compute: maybe"))
    with pytest.raises(ConfigError, match="planner.balance_compute"):
        load_config(str(cfg))
