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
