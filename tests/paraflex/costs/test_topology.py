"""Nodes of a cluster (`cluster.nodes`, the two interconnects): the config keys, the link each
hop takes, and the planner's preference for replicas whose stages share a node."""

from __future__ import annotations

import pytest

from paraflex.config.schema import Config
from paraflex.errors import ConfigError
from paraflex.planner import plan


def _config(**cluster) -> Config:
    return Config.from_dict({
        "cluster": {"num_engines": 4, "device": "cpu", "memory_gb": 1, "interconnect_gbps": 100,
                    "interconnect_latency_us": 5, **cluster},
        "models": [{"name": "m", "arch": "tiny-8l", "stages": 2}],
    })


def test_nodes_as_a_count_or_engines_per_node():
    assert _config(nodes=2).cluster.topology().node_of == (0, 0, 1, 1)
    assert _config(nodes=[1, 3]).cluster.topology().node_engines() == [[0], [1, 2, 3]]
    assert _config().cluster.topology().num_nodes == 1


@pytest.mark.parametrize("nodes, fix", [(3, "evenly"), ([2, 1], "adds up to 3"), ([2, 0, 2], "positive"),
                                        (0, ">= 1"), ("two", "integer")])
def test_bad_nodes_name_the_field(nodes, fix):
    with pytest.raises(ConfigError) as info:
        _config(nodes=nodes)
    assert info.value.path == "cluster.nodes" and fix in str(info.value)


def test_a_hop_takes_the_link_of_its_two_engines():
    topo = _config(nodes=2, node_interconnect_gbps=8, node_interconnect_latency_us=1000).cluster.topology()
    assert topo.link(0, 1) is topo.intra and topo.link(1, 2) is topo.inter
    assert topo.hop_time(0, 1, 10**6) == pytest.approx(5e-6 + 10**6 / 12.5e9)
    assert topo.hop_time(1, 2, 10**6) == pytest.approx(1e-3 + 10**6 / 1e9)
    assert topo.cross_node_hops([0, 1, 2, 3]) == 1 and topo.cross_node_hops([3, 0]) == 1


def test_the_link_between_nodes_defaults_to_the_interconnect():
    topo = _config(nodes=2).cluster.topology()
    assert topo.inter == topo.intra


def _model(num_engines: int, stages: int, **cluster) -> Config:
    return Config.from_dict({
        "cluster": {"num_engines": num_engines, "device": "cpu", "memory_gb": 1, **cluster},
        "models": [{"name": "m", "arch": "tiny-8l", "stages": stages}],
    })


def test_the_planner_keeps_a_replicas_stages_on_one_node_when_it_costs_no_replica():
    """Five engines, engine 0 alone on its node: two 2-stage replicas fit either way; on one
    node the lowest starts win (0-1 crosses the boundary), on these nodes 1-2 and 3-4."""
    assert plan(_model(5, 2)).models["m"].replicas == [[0, 1], [2, 3]]
    placement = plan(_model(5, 2, nodes=[1, 4]))
    assert placement.models["m"].replicas == [[1, 2], [3, 4]]
    assert placement.params["nodes"] == [1, 4]


def test_the_node_preference_never_costs_a_replica():
    """Six engines as 2 + 4, a 3-stage model: 2-3-4 would be the only replica inside a node,
    while 0-1-2 and 3-4-5 make two; the plan with two replicas (one hop across) is kept."""
    assert plan(_model(6, 3, nodes=[2, 4])).models["m"].replicas == [[0, 1, 2], [3, 4, 5]]


def test_the_plan_table_counts_the_hops_that_cross_nodes():
    from paraflex.planner.render import table

    assert "0 of 2 pipeline hops cross nodes" in table(plan(_model(5, 2, nodes=[1, 4])))
    assert "1 of 4 pipeline hops cross nodes" in table(plan(_model(6, 3, nodes=[2, 4])))  # 0-1|2, 3-4-5
    assert "cross nodes" not in table(plan(_model(5, 2)))
