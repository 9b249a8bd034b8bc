"""Home replicas: homes spread over the engines by demand (engine/core/home_replicas.py)."""

from paraflex.engine.core.home_replicas import home_replicas


def test_every_model_on_both_engines_gets_homes_balanced_by_demand():
    # issue 25's balanced plan: three models, each with a replica on engine 0 and one on engine 1
    routes = {m: [[0], [1]] for m in ("small", "large", "small-ft")}
    homes = home_replicas(routes, {"small": 1.0, "large": 2.7, "small-ft": 1.0})
    assert homes == {"large": 0, "small": 1, "small-ft": 1}


def test_a_model_with_one_replica_weighs_on_its_engine():
    routes = {"hot": [[0], [1]], "big": [[0]], "other": [[1]]}
    homes = home_replicas(routes, {"hot": 1.0, "big": 3.0, "other": 0.5})
    assert homes == {"big": 0, "hot": 1, "other": 0}


def test_pipeline_replicas_compare_their_busiest_engine():
    routes = {"a": [[0, 1], [2, 3]], "b": [[1, 2], [3, 0]], "c": [[0], [1], [2], [3]]}
    homes = home_replicas(routes, {"a": 4.0, "b": 2.0, "c": 1.0})
    # a takes 0-1 (2 each); b: 1-2 would peak at 2+1, 3-0 at 2+1: tie, lowest index
    assert homes["a"] == 0 and homes["b"] == 0
    # loads now 0:2, 1:3, 2:1, 3:0 -> c goes to engine 3
    assert homes["c"] == 3


def test_ties_go_by_name_then_lowest_index_and_missing_demand_is_zero():
    routes = {"b": [[0], [1]], "a": [[0], [1]], "z": [[0], [1]]}
    assert home_replicas(routes, {"a": 1.0, "b": 1.0}) == {"a": 0, "b": 1, "z": 0}
