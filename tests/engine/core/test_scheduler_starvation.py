"""No model starves: a chatty small model beside a large one on the same engine (paper §5)."""

import pytest

from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.scheduler import EngineScheduler


def chatty_engine(starvation_limit):
    """Engine 0 hosts a one-stage small model and the first stage of a large model.

    The large model has one request in flight (an under-sized decode batch every time); the
    small model gets a new request before every decision, so a prefill is always waiting.
    """
    s = EngineScheduler(BlockPool(4000, 1024, 4000), max_batch_size=8, starvation_limit=starvation_limit, watermark=0.0)
    s.add_stage("small", 0, 1, 256, 1)
    s.add_stage("large", 0, 4, 256, 1)
    s.add_request("L", "large", 16, 6, 0.0)
    large_steps = []
    for i in range(600):
        s.add_request(f"s{i}", "small", 4, 2, 1.0 + i)
        b = s.schedule(float(i))
        if b is None:
            continue
        if b.model == "large":
            large_steps.append(s.decisions)
        d = s.complete(b)
        s.receive_tokens(d.token_message)
        s.check()
    return s, large_steps


def test_without_promotion_the_large_model_starves():
    s, large_steps = chatty_engine(0)
    assert large_steps == [1]  # its prefill ran (oldest), then its under-sized decodes never did
    assert s.state_of("L") == "waiting-decode"


@pytest.mark.parametrize("limit", [8, 64])
def test_large_model_served_within_the_stated_bound(limit):
    s, large_steps = chatty_engine(limit)
    assert s.state_of("L") == "finished"
    assert len(large_steps) == 6  # prefill + 5 decode steps
    queues = sum(len(st.queues()) for st in s.stages)
    gaps = [b - a for a, b in zip(large_steps, large_steps[1:])]
    assert max(gaps) <= limit + queues + 1
    assert s.stats["starvation_promotions"] >= 5


def test_small_model_keeps_flowing_beside_the_large_one():
    s, _ = chatty_engine(64)
    finished_small = sum(1 for i in range(600) if s.state_of(f"s{i}") == "finished")
    assert finished_small > 500


def test_default_limit_scales_with_the_queues_on_the_engine():
    s = EngineScheduler(BlockPool(100, 1024))
    s.add_stage("a", 0, 1, 256, 1)
    assert s.effective_starvation_limit == 64
    for i in range(20):
        s.add_stage(f"m{i}", 1, 1, 256, 2)  # later stages: 3 queues each
    assert s.effective_starvation_limit == 4 * (2 + 20 * 3)
