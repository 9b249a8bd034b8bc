"""DRF over engines' KV capacities: hand-computed water levels and invariants."""

from hypothesis import given
from hypothesis import strategies as st

from paraflex.planner.drf import min_level, water_fill


def test_min_level_ignores_idle_engines():
    assert min_level([10, 6, 100], [1, 2, 0]) == 3
    assert min_level([5, 5], [0, 0]) == float("inf")


def test_shared_engine_freezes_both_models():
    # engine 1 (6 bytes) holds a stage of A and of B: both stop at 3, engine 0 keeps 7 unused
    assert water_fill([10, 6], {"A": [0, 1], "B": [1]}) == {"A": 3.0, "B": 3.0}


def test_unconstrained_model_keeps_filling_after_others_freeze():
    # engine 1 saturates at 6/2 = 3 for B and C; A alone on engine 0 then gets all 10
    grant = water_fill([10, 6, 8], {"A": [0], "B": [1], "C": [1, 2]})
    assert grant == {"A": 10.0, "B": 3.0, "C": 3.0}


def test_second_water_level():
    # engine 0 (4 bytes, A and B) fills first at level 2 and freezes A and B;
    # engine 1 holds A (frozen at 2) and C, so C rises to 9 - 2 = 7
    grant = water_fill([4, 9], {"A": [0, 1], "B": [0], "C": [1]})
    assert grant == {"A": 2.0, "B": 2.0, "C": 7.0}


def test_overloaded_engine_grants_zero():
    assert water_fill([-5, 10], {"A": [0, 1]}) == {"A": 0.0}


@given(
    st.lists(st.floats(1.0, 1000.0), min_size=1, max_size=8),
    st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True), min_size=1, max_size=6),
)
def test_water_fill_is_feasible_and_pareto(capacity, stage_engines):
    n = len(capacity)
    residency = {f"m{i}": [e % n for e in es] for i, es in enumerate(stage_engines)}
    residency = {m: sorted(set(es)) for m, es in residency.items()}
    grant = water_fill(capacity, residency)
    used = [0.0] * n
    for m, es in residency.items():
        for e in es:
            used[e] += grant[m]
    assert all(u <= c * (1 + 1e-9) for u, c in zip(used, capacity))
    counts = [sum(e in es for es in residency.values()) for e in range(n)]
    assert abs(min(grant.values()) - min_level(capacity, counts)) <= 1e-9 * max(capacity)
    for m, es in residency.items():  # every model is stopped by a full engine (Pareto efficiency)
        assert any(used[e] >= capacity[e] * (1 - 1e-9) for e in es)
