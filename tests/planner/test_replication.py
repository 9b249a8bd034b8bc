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


def _replicate(stages, ratios, work, num_engines=8):
    """Alg. 1 from one replica each until it stops (the paper's stop), as the optimizer asks."""
    replicas = [1] * len(stages)
    while (i := choose_next(num_engines, stages, replicas, ratios, work=work)) >= 0:
        replicas[i] += 1
    return replicas


def test_work_shares_give_a_large_model_cut_in_fewer_stages_its_share():
    """dispersion-4x at T_s x2: llama-80b (4x the work) in 2 stages, four llama-20b in 1 stage
    each (half a T_s of work). Eq. 7 counts each llama-20b stage as much as each llama-80b
    stage: four replicas of everything, three stages per engine. By work (the embeddings make
    the one-stage models a little heavier than a quarter) llama-80b holds half of the stages."""
    stages, ratios = [2, 1, 1, 1, 1], [0.2] * 5
    assert _replicate(stages, ratios, None) == [4, 4, 4, 4, 4]
    assert _replicate(stages, ratios, [4.0, 1.02, 1.02, 1.02, 1.02]) == [4, 2, 2, 2, 2]
    assert _replicate(stages, ratios, [4.0, 0.98, 0.98, 0.98, 0.98]) == [4, 2, 2, 2, 2]


def test_work_shares_equal_the_paper_when_stages_follow_the_work():
    """Stage counts proportional to the work: the same choices as eq. 7 at every step."""
    stages, ratios = [4, 1, 1, 2], [0.1, 0.4, 0.3, 0.2]
    replicas = [1, 1, 1, 1]
    for _ in range(12):
        paper = choose_next(16, stages, replicas, ratios)
        assert choose_next(16, stages, replicas, ratios, work=[8.0, 2.0, 2.0, 4.0]) == paper
        if paper < 0:
            break
        replicas[paper] += 1


def test_work_shares_tie_within_five_percent_not_beyond():
    # actual 1:1 stage slots; targets by work 1 : 1.04 -> tied: the larger target (model 1) wins
    assert choose_next(8, [1, 1], [1, 1], [0.5, 0.5], work=[1.0, 1.04]) == 1
    # 1 : 0.9 -> model 0 is the less provisioned one by more than the tie
    assert choose_next(8, [1, 1], [1, 1], [0.5, 0.5], work=[1.0, 0.9]) == 0
    assert choose_next(8, [1, 1], [1, 1], [0.5, 0.5], work=[0.9, 1.0]) == 1
