"""stage_load_time: the host-link load cost, checked against CoCoServe's Table 2."""

import pytest

from paraflex.costs.weight_load import stage_load_time

# CoCoServe Table 2 (Llama-2-13B on A100-40GB PCIe): layers, replication time (s), memory (MB)
COCOSERVE_TABLE_2 = [(1, 0.2987, 1107), (10, 0.3581, 6579), (20, 0.3826, 12659), (30, 0.4947, 18739), (40, 0.8938, 24819)]


@pytest.mark.parametrize("layers,seconds,mb", COCOSERVE_TABLE_2)
def test_load_time_is_within_2x_of_cocoserve_table_2(layers, seconds, mb):
    t = stage_load_time(mb * 2**20, tp=1)
    assert seconds <= t <= 2 * seconds  # host-link loads are the conservative side of CoCoServe's copies


def test_tp_shards_load_in_parallel_and_nothing_costs_nothing():
    one, eight = stage_load_time(40 * 2**30, tp=1, overhead_s=0), stage_load_time(40 * 2**30, tp=8, overhead_s=0)
    assert eight == pytest.approx(one / 8)
    assert stage_load_time(0) == 0.0
