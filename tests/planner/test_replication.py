"""Alg. 1 (replication planner): which model gets the next replica, and when to stop."""

from hypothesis import given
from hypothesis import strategies as st

from paraflex.planner.replication import choose_next


def test_unplaced_models_first_heaviest_target_first():
    # targets R*s: 0.2*1, 0.3*4, 0.5*2 -> model 1 has the largest target among the unplaced
    assert choose_next(8, [1, 4, 2], [0, 0, 0], [0.2, 0.3, 0.5]) == 1
    assert choose_next(8, [1, 4, 2], [0, 1, 0], [0.2, 0.3, 0.5]) == 2


def test_least_relative_resources_gets_the_replica():
    # equal sizes, rates 3:1, one replica each -> model 0 is under-provisioned
    assert choose_next(8, [2, 2], [1, 1], [0.75, 0.25]) == 0
    # after 3:1 replicas the ratios match; ties go to the larger target (model 0)
    assert choose_next(16, [2, 2], [3, 1], [0.75, 0.25]) == 0
    assert choose_next(16, [2, 2], [4, 1], [0.75, 0.25]) == 1


def test_size_counts_in_the_target():
    # same rate, model 1 is 4x larger: target resources 1:4; with one replica each, actual 1:4
    # -> tie on relative ratio, larger target (model 1) wins, if it fits
    assert choose_next(8, [1, 4], [1, 1], [0.5, 0.5]) == 1
    assert choose_next(7, [1, 4], [1, 1], [0.5, 0.5]) == -1  # 2 * 4 > 7 engines


def test_equal_everything_picks_lowest_index():
    assert choose_next(8, [2, 2, 2], [1, 1, 1], [1 / 3] * 3) == 0


def test_stops_when_chosen_model_runs_out_of_engines():
    assert choose_next(4, [2, 1], [2, 1], [0.9, 0.1]) == -1  # model 0 would need 6 engines


@given(
    st.integers(1, 32),
    st.lists(st.tuples(st.integers(1, 8), st.floats(0.01, 10.0)), min_size=1, max_size=6),
)
def test_repeated_choices_track_demand_and_respect_engines(num_engines, models):
    stages = [s for s, _ in models]
    total = sum(r for _, r in models)
    ratios = [r / total for _, r in models]
    replicas = [0] * len(models)
    for _ in range(200):
        i = choose_next(num_engines, stages, replicas, ratios)
        if i < 0:
            break
        if all(r > 0 for r in replicas):
            target = [ratios[k] * stages[k] for k in range(len(stages))]
            rel = [replicas[k] * stages[k] / target[k] for k in range(len(stages))]
            assert rel[i] <= min(rel) * (1 + 1e-9)  # the least provisioned model is chosen
        replicas[i] += 1
    else:
        raise AssertionError("Alg. 1 never stopped")
    placed = [r for r in replicas if r > 0]
    assert all(replicas[k] * stages[k] <= max(num_engines, stages[k]) for k in range(len(stages)) if replicas[k] > 1)
    assert placed
