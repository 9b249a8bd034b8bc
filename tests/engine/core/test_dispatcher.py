"""Dispatcher: least outstanding requests over replicas, ties to the lowest id."""

from types import SimpleNamespace

import pytest

from paraflex.engine.core.dispatcher import Dispatcher
from paraflex.errors import ConfigError, ParaflexError, UserError


def test_least_outstanding_with_ties_to_lowest_id():
    d = Dispatcher({"m": 3})
    assert [d.pick("m") for _ in range(4)] == [0, 1, 2, 0]
    d.done("m", 1)
    assert d.pick("m") == 1  # 1 has the fewest now
    d.done("m", 0)
    d.done("m", 0)
    assert d.outstanding("m") == [0, 1, 1]
    assert d.pick("m") == 0


def test_models_are_counted_separately():
    d = Dispatcher({"a": 2, "b": 2})
    d.pick("a")
    assert d.pick("b") == 0


def test_errors():
    with pytest.raises(ConfigError, match="replicas"):
        Dispatcher({"m": 0})
    d = Dispatcher({"m": 1})
    with pytest.raises(UserError, match="unknown model 'x'"):
        d.pick("x")
    with pytest.raises(ParaflexError, match="without a matching pick"):
        d.done("m", 0)


def test_from_placement():
    placement = SimpleNamespace(models={"a": SimpleNamespace(replicas=[[0, 1], [2, 3]]), "b": SimpleNamespace(replicas=[[1]])})
    d = Dispatcher.from_placement(placement)
    assert d.outstanding("a") == [0, 0] and d.outstanding("b") == [0]


def test_pick_among_a_subset():
    d = Dispatcher({"m": 3})
    assert [d.pick("m", among=[1, 2]) for _ in range(3)] == [1, 2, 1]
    assert d.pick("m", among=[]) is None and d.outstanding("m") == [0, 2, 1]


def test_home_first_packs_until_the_margin_then_spills():
    d = Dispatcher({"m": 3}, homes={"m": 1}, margin=2)
    assert [d.pick("m") for _ in range(2)] == [1, 1]  # home holds 2 = least loaded (0) + margin
    assert d.pick("m") == 0  # spills by least outstanding
    assert d.pick("m") == 2
    assert d.pick("m") == 1  # home 2 < least loaded 1 + 2: home again
    d.done("m", 1)
    d.done("m", 1)
    assert d.pick("m") == 1 and d.outstanding("m") == [1, 2, 1]


def test_home_first_with_margin_zero_is_least_outstanding():
    lor, home = Dispatcher({"m": 3}), Dispatcher({"m": 3}, homes={"m": 2}, margin=0)
    assert [lor.pick("m") for _ in range(7)] == [home.pick("m") for _ in range(7)]


def test_home_outside_among_falls_back_to_least_outstanding():
    d = Dispatcher({"m": 3}, homes={"m": 0}, margin=5)
    assert [d.pick("m", among=[1, 2]) for _ in range(3)] == [1, 2, 1]
    assert d.pick("m") == 0


def test_home_follows_remove_and_reorder():
    d = Dispatcher({"m": 3, "n": 2}, homes={"m": 2, "n": 0}, margin=4)
    d.remove_replica("m", 0)
    assert d.homes["m"] == 1 and d.pick("m") == 1
    d.reorder("m", [1, 0])
    assert d.homes["m"] == 0
    d.remove_replica("n", 0)  # its home leaves: least outstanding from now on
    assert "n" not in d.homes and d.pick("n") == 0


def test_negative_margin_is_a_config_error():
    with pytest.raises(ConfigError, match="home_margin"):
        Dispatcher({"m": 1}, margin=-1)


def _config(dispatch: str, margin: int = 4):
    arch = SimpleNamespace(weight_bytes=lambda: 10)
    return SimpleNamespace(scheduler=SimpleNamespace(dispatch=dispatch, home_margin=margin),
                           models=[SimpleNamespace(name="a", rate=2.0, arch=arch),
                                   SimpleNamespace(name="b", rate=1.0, arch=arch)])


def test_from_placement_with_a_config_takes_its_rule():
    placement = SimpleNamespace(models={"a": SimpleNamespace(replicas=[[0], [1]]), "b": SimpleNamespace(replicas=[[0], [1]])})
    home = Dispatcher.from_placement(placement, _config("home-first", 3))
    assert home.homes == {"a": 0, "b": 1} and home.margin == 3
    assert [home.pick("b") for _ in range(3)] == [1, 1, 1]
    lor = Dispatcher.from_placement(placement, _config("least-outstanding"))
    assert lor.homes == {} and [lor.pick("b") for _ in range(3)] == [0, 1, 0]
