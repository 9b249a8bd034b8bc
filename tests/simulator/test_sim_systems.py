"""Each simulated system builds its documented layout (systems.py table) on the paper's base
case, and the ablations change exactly what they say."""

from __future__ import annotations

import pytest

from paraflex.config.schema import load_config
from paraflex.errors import UserError
from paraflex.simulator.runner import SimSettings
from paraflex.simulator.systems.layouts import SYSTEMS, build_system
from repo_paths import CONFIGS

BASE = str(CONFIGS / "paper-base.yaml")


@pytest.fixture(scope="module")
def config():
    return load_config(BASE)


def _layout(config, system, **kw):
    return build_system(config, SimSettings(system=system, **kw))


def _engines_of(placement, model):
    return {e for r in placement.models[model].replicas for e in r}


def test_registry_has_the_paper_systems_and_the_seed_systems():
    assert SYSTEMS.names() == sorted(["paraflex", "ray-serve", "sarathi", "alpaserve", "vllm-tp",
                                      "aegaeon", "prism", "muxserve"])


def test_ray_serve_dedicated_pp2_no_replication(config):
    lay = _layout(config, "ray-serve")
    seen = set()
    for m in lay.placement.models.values():
        assert m.num_stages == 2 and m.num_replicas == 1
        engines = set(m.replicas[0])
        assert not engines & seen  # dedicated: no engine shared between models
        seen |= engines
    assert lay.policy == "prefill-first"


def test_sarathi_every_model_on_every_engine_pp8(config):
    lay = _layout(config, "sarathi")
    for m in lay.placement.models.values():
        assert m.num_stages == config.cluster.num_engines == 8 and m.replicas == [list(range(8))]
    assert lay.policy == "sarathi" and lay.prefill_token_budget == 512


def test_alpaserve_size_groups(config):
    lay = _layout(config, "alpaserve")
    big = _engines_of(lay.placement, "llama-2-70b")
    small = _engines_of(lay.placement, "internlm2.5-20b-chat-1")
    assert big and small and not big & small  # two groups on disjoint engines
    assert _engines_of(lay.placement, "internlm2.5-20b-chat-2") == small
    assert len(big) + len(small) == config.cluster.num_engines


def test_vllm_tp_one_group_over_all_gpus(config):
    lay = _layout(config, "vllm-tp")
    assert lay.placement.num_engines == 1
    assert lay.gpus_per_engine == config.cluster.num_engines * config.cluster.tp == 64
    assert lay.memory_bytes == config.cluster.num_engines * config.cluster.memory_bytes


def test_paraflex_time_balanced_replicated_and_ablations(config):
    pf = _layout(config, "paraflex")
    assert pf.policy == "full-batch-first"
    stages = {n: m.num_stages for n, m in pf.placement.models.items()}
    assert stages["llama-2-70b"] > stages["internlm2.5-20b-chat-1"]  # unaligned pipelines
    assert pf.placement.models["internlm2.5-20b-chat-1"].num_replicas > 1
    ns = _layout(config, "paraflex", no_sharding=True)
    assert {m.num_stages for m in ns.placement.models.values()} == {8} and ns.policy == "full-batch-first"
    assert _layout(config, "paraflex", prefill_first=True).policy == "prefill-first"
    r1 = _layout(config, "paraflex", random_placement=True, seed=1).placement
    r1b = _layout(config, "paraflex", random_placement=True, seed=1).placement
    r2 = _layout(config, "paraflex", random_placement=True, seed=2).placement
    assert r1.to_dict() == r1b.to_dict() and r1.to_dict() != r2.to_dict()
    counts = [len(e.stages) for e in r1.engines]
    assert max(counts) - min(counts) <= 1  # uniform stage counts per engine
    for name, m in r1.models.items():
        assert m.stages == pf.placement.models[name].stages and m.num_replicas == pf.placement.models[name].num_replicas
        flat = [e for r in m.replicas for e in r]
        assert len(flat) == len(set(flat))  # replicas never overlap


def test_bad_system_and_ablation_combinations(config):
    with pytest.raises(UserError, match="unknown system 'nope'"):
        _layout(config, "nope")
    with pytest.raises(UserError, match="ablations of --system paraflex"):
        _layout(config, "sarathi", no_sharding=True)


def test_simulated_engines_batch_prompts_as_served_engines_do(config):
    """CPU engines pack waiting prompts (as engine_builder's served engines do), and so do GPU
    engines by default (`scheduler.pack_prompts`); `--one-prompt-prefills` gives the paper's one
    prompt per prefill batch."""
    from paraflex.config.schema import Config
    from paraflex.simulator.runner import simulate

    cpu = Config.from_dict({
        "cluster": {"num_engines": 1, "device": "cpu", "memory_gb": 1},
        "models": [{"name": "a", "arch": "tiny-2l"}],
        "scheduler": {"max_batch_size": 8, "block_bytes": 4096},
        "workload": {"arrival": "poisson", "num_requests": 60, "seed": 1},
    })
    res = simulate(cpu, SimSettings(system="paraflex", rate=2000.0))
    assert all(e.scheduler.prefill_max_requests == 8 for e in res.engines)
    assert res.summary["finished"] == res.summary["requests"]
    assert res.metrics.prefill_batches < res.summary["requests"]  # a burst shares prefill batches
    gpu = _layout(config, "paraflex")
    gpu_res = simulate(config, SimSettings(system="paraflex", rate=1.0), layout=gpu,
                       requests=[])
    assert all(e.scheduler.prefill_max_requests == config.scheduler.max_batch_size for e in gpu_res.engines)
    one = _layout(config, "paraflex", one_prompt_prefills=True)
    assert one.describe()["prefill_max_requests"] == 1
    one_res = simulate(config, SimSettings(system="paraflex", rate=1.0, one_prompt_prefills=True), layout=one,
                       requests=[])
    assert all(e.scheduler.prefill_max_requests == 1 for e in one_res.engines)
    with pytest.raises(UserError, match="ablations of --system paraflex"):
        _layout(config, "alpaserve", one_prompt_prefills=True)


def test_packed_prompts_share_prefill_batches_and_the_ablation_runs_one_each(config):
    """A burst on the base case: by default waiting prompts share prefill batches; with
    `one_prompt_prefills` every prefill batch holds one prompt (per stage of its model)."""
    import dataclasses

    from paraflex.simulator.runner import simulate

    burst = dataclasses.replace(config, workload=dataclasses.replace(config.workload, arrival="poisson",
                                                                     num_requests=200, duration_s=None))
    stages = {m: mp.num_stages for m, mp in _layout(config, "paraflex").placement.models.items()}
    packed = simulate(burst, SimSettings(system="paraflex", rate=400.0, seed=1))
    one = simulate(burst, SimSettings(system="paraflex", rate=400.0, seed=1, one_prompt_prefills=True))
    assert packed.summary["finished"] == one.summary["finished"] == one.summary["requests"]
    prompt_batches = sum(stages[r.model] for r in one.metrics.requests.values())
    assert one.metrics.prefill_batches == prompt_batches
    assert packed.metrics.prefill_batches < prompt_batches


def test_departures_from_the_paper_are_the_default_and_their_ablations_restore_it(config):
    """The in-flight bound on decode batches and Alg. 1's fill are on by default; the ablation
    flags give the paper's rules (unbounded, stop with the chosen model)."""
    from paraflex.simulator.runner import simulate

    pf = _layout(config, "paraflex")
    res = simulate(config, SimSettings(system="paraflex", rate=1.0), layout=pf, requests=[])
    assert all(str(e.scheduler.decode_inflight_limit) == "stages" for e in res.engines)
    unb = _layout(config, "paraflex", unbounded_decode_batches=True)
    assert unb.describe()["decode_batches_in_flight"] == "unbounded"
    res = simulate(config, SimSettings(system="paraflex", rate=1.0, unbounded_decode_batches=True), layout=unb, requests=[])
    assert all(e.scheduler.decode_inflight_limit is None for e in res.engines)
    paper = _layout(config, "paraflex", paper_replication=True).placement
    assert "Alg. 1" in paper.params["stop_reason"]
    assert config.planner.fill_engines  # the ablation planned from a copy
    with pytest.raises(UserError, match="ablations of --system paraflex"):
        _layout(config, "sarathi", paper_replication=True)


def test_pipeline_first_replaces_paraflex_policy_only(config):
    assert _layout(config, "paraflex", pipeline_first=True).policy == "pipeline-first"
    with pytest.raises(UserError, match="ablations of --system paraflex"):
        _layout(config, "sarathi", pipeline_first=True)
    with pytest.raises(UserError, match="pass one of them"):
        _layout(config, "paraflex", pipeline_first=True, prefill_first=True)


def test_work_shares_are_an_option_beside_the_papers_stage_shares():
    """dispersion-4x cut at T_s x2: by stage count (eq. 7, the default) each llama-20b gets four
    replicas; `--work-shares` gives them two, one beside each llama-80b stage (the shipped
    dispersion-4x config sets `replica_shares: work`)."""
    config = load_config(str(CONFIGS / "dispersion-4x.yaml"))
    assert config.planner.replica_shares == "work"
    config.planner.replica_shares = "stages"
    stages = _layout(config, "paraflex").placement
    work = _layout(config, "paraflex", work_shares=True).placement
    assert [m.num_replicas for m in work.models.values()] == [4, 2, 2, 2, 2]
    assert [m.num_replicas for m in stages.models.values()] == [4, 4, 4, 4, 4]
    assert config.planner.replica_shares == "stages"  # the option planned from a copy
    with pytest.raises(UserError, match="ablations of --system paraflex"):
        _layout(config, "sarathi", work_shares=True)


def test_head_starts_reach_paraflex_engines_only_and_the_ablation_drops_them():
    """dispersion-4x sets `scheduler.head_start_s: {llama-80b: 5}`: ParaFlex's engine
    schedulers get it, `--no-head-start` and the baselines get none."""
    from paraflex.simulator.runner import simulate

    cfg = load_config(str(CONFIGS / "dispersion-4x.yaml"))
    assert cfg.scheduler.head_start_s == {"llama-80b": 5.0}
    for kw, want in (({}, {"llama-80b": 5.0}), ({"no_head_start": True}, {})):
        settings = SimSettings(system="paraflex", rate=1.0, **kw)
        res = simulate(cfg, settings, layout=build_system(cfg, settings), requests=[])
        assert all(e.scheduler.head_start_s == want for e in res.engines)
    assert _layout(cfg, "sarathi").head_start_s == {}
    with pytest.raises(UserError, match="ablations of --system paraflex"):
        _layout(cfg, "sarathi", no_head_start=True)


def test_memory_only_placement_is_the_papers_alg2_and_an_ablation_of_paraflex_only():
    """Balanced base cluster: the default evens the engines' compute load after Alg. 2 (other
    internlm engines); `--memory-only-placement` plans as the paper does, from a copy of the config."""
    config = load_config(BASE)
    config.workload.zipf_alpha = None
    for m in config.models:
        m.rate = 1.0
    ours = _layout(config, "paraflex").placement
    paper = _layout(config, "paraflex", memory_only_placement=True).placement
    assert config.planner.balance_compute
    assert _engines_of(ours, "internlm2.5-20b-chat-1") != _engines_of(paper, "internlm2.5-20b-chat-1")
    assert ours.models["llama-2-70b"].replicas == paper.models["llama-2-70b"].replicas
    with pytest.raises(UserError, match="ablations of --system paraflex"):
        _layout(config, "sarathi", memory_only_placement=True)
