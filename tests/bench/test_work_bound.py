"""bench/work_bound.py: a request's engine-seconds are its prefill plus its share of full decode
steps, packing prompts lowers the bound's work, and no simulated system beats the bound on its
own requests (a short overloaded window of the paper's base case)."""

from __future__ import annotations

import pytest
from repo_paths import CONFIGS, load_bench

from paraflex.costs.costmodel import CostModel
from paraflex.models.catalog import get_arch


def test_request_seconds_is_its_prefill_plus_a_share_of_full_decode_steps():
    bench = load_bench("work_bound")
    cost, arch = CostModel("a100-80g", tp=8), get_arch("internlm2.5-20b-chat")
    layers = arch.num_layers
    got = bench.request_seconds(cost, arch, prompt_len=1000, output_len=201, batch=64)
    prefill = cost.prefill_time(arch, layers, 1000, True, True)
    step = cost.decode_time(arch, layers, 64, 64 * 1100, True, True)
    assert got == pytest.approx(prefill + 200 * step / 64)
    assert bench.request_seconds(cost, arch, 1000, 201, batch=64, packed=4096) < got
    assert bench.request_seconds(cost, arch, 1000, 201, batch=8) > got  # smaller batches cost more per token
    assert bench.bound_rps(num_requests=100, engine_seconds=50.0, num_engines=8) == pytest.approx(16.0)


def test_no_system_beats_the_bound_on_its_own_requests():
    bench = load_bench("work_bound")
    config = bench.point_config(str(CONFIGS / "paper-base.yaml"), "2.1", duration=3.0, trace=None)
    summaries, bounds = bench.measure(config, ["paraflex", "alpaserve"], rate=256.0, seed=1, packed=4096)
    (one, work_one), (packed, work_packed) = bounds.values()
    assert set(work_one) == {m.name for m in config.models}
    assert packed > one > 0
    assert 0 < summaries["paraflex"]["throughput_rps"] <= one  # one prompt per prefill batch, as ParaFlex runs
    assert 0 < summaries["alpaserve"]["throughput_rps"] <= packed  # prefill-first packs prompts
