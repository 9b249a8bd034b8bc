"""Which engines share a Ray node (paraflex/serving/ray_nodes.py): the planned nodes, or
consecutive engines over the Ray cluster's nodes, at the largest CPU share that fits."""

from __future__ import annotations

import pytest

from paraflex.errors import UserError
from paraflex.serving.ray_nodes import NodeRoom, plan_groups


def _nodes(*cpus, gpus=0):
    return [NodeRoom(f"n{k}", f"10.0.0.{k}", c, gpus) for k, c in enumerate(cpus)]


def test_one_node_holds_every_engine():
    assert plan_groups(3, None, _nodes(4), use_gpu=False) == (1.0, [[0, 1, 2]])


def test_consecutive_engines_fill_the_roomiest_node_first():
    share, groups = plan_groups(4, None, _nodes(2, 3), use_gpu=False)
    assert share == 1.0 and groups == [[0, 1, 2], [3]]


def test_the_share_shrinks_until_the_engines_fit_whole_per_node():
    """3 CPUs for 4 engines: 0.75 each fits 1 + 2 engines on nodes of 1 and 2 CPUs; 2/3 fits 1 + 3."""
    share, groups = plan_groups(4, None, _nodes(1, 2), use_gpu=False)
    assert share == 0.666 and groups == [[0, 1, 2], [3]]


def test_planned_nodes_are_kept_as_groups():
    share, groups = plan_groups(4, [2, 2], _nodes(2, 2), use_gpu=False)
    assert share == 1.0 and groups == [[0, 1], [2, 3]]
    share, groups = plan_groups(4, [1, 3], _nodes(2, 2), use_gpu=False)
    assert share == 0.666 and groups == [[0], [1, 2, 3]]  # 3 engines on a 2-CPU node


def test_gpus_one_per_engine():
    assert plan_groups(4, None, _nodes(8, 8, gpus=2), use_gpu=True) == (1.0, [[0, 1], [2, 3]])
    with pytest.raises(UserError, match=r"nodes \[4\].*set cluster.nodes"):
        plan_groups(4, [4], _nodes(8, 8, gpus=2), use_gpu=True)
    with pytest.raises(UserError, match="need 5 GPU"):
        plan_groups(5, None, _nodes(8, 8, gpus=2), use_gpu=True)
