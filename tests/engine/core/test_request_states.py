"""Per (request, stage) states: every legal move of Fig. 7 works, every other one raises."""

import itertools

import pytest

from paraflex.engine.core import request as R


def _at(state):
    req = R.StageRequest("r", "m", 0, 0.0, 1, 8, 4)
    req.state = state
    return req


@pytest.mark.parametrize("src,dst", list(itertools.product(R.STATES, R.STATES)))
def test_transition_matrix(src, dst):
    req = _at(src)
    if dst in R.LEGAL[src]:
        req.transition(dst)
        assert req.state == dst
    else:
        with pytest.raises(R.IllegalTransition, match=f"{src} -> {dst}"):
            req.transition(dst)
        assert req.state == src


def test_paper_lifecycle_and_history():
    req = R.StageRequest("r", "m", 1, 0.0, 1, 8, 4, track_history=True)
    for s in (R.RUNNING, R.BLOCKED, R.SWAPPED_BLOCKED, R.SWAPPED_DECODE, R.WAITING_DECODE, R.RUNNING,
              R.BLOCKED, R.WAITING_DECODE, R.SWAPPED_DECODE, R.WAITING_DECODE, R.RUNNING, R.BLOCKED, R.FINISHED):
        req.transition(s)
    assert req.done and req.history[0] == R.WAITING_PREFILL and req.history[-1] == R.FINISHED


def test_terminal_states_are_final_and_abort_reaches_from_everywhere_else():
    for s in R.TERMINAL:
        assert not R.LEGAL[s]
    for s in set(R.STATES) - R.TERMINAL:
        assert R.ABORTED in R.LEGAL[s]


def test_finish_only_after_the_stage_is_done():
    # a request finishes when its last token is produced: it is blocked (or swapped) everywhere
    assert {s for s in R.STATES if R.FINISHED in R.LEGAL[s]} == {R.BLOCKED, R.SWAPPED_BLOCKED}


def test_error_names_request_and_stage():
    req = _at(R.WAITING_PREFILL)
    with pytest.raises(R.IllegalTransition, match="'r' at m stage 0"):
        req.transition(R.BLOCKED)
