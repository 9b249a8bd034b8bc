"""The event loop's wake-up fast path (`EventLoop.schedule_last`, a FIFO beside the heap) gives
exactly the results of pushing every wake-up event through the heap, on workloads with many
same-instant ties (one-stage replicas whose tokens return at the instant their stage ends)."""

from __future__ import annotations

import pytest


from paraflex.config.schema import WorkloadConfig
from paraflex.simulator.core.event_loop import EventLoop
from paraflex.simulator.runner import SimSettings, simulate
from sim_cases import fingerprint, ring_config, ring_layout


class CountingLoop(EventLoop):
    """The fast loop, counting the wake-ups that took the fast path."""

    def __init__(self):
        super().__init__()
        self.fast = 0

    def schedule_last(self, event) -> None:
        self.fast += 1
        super().schedule_last(event)


class AllHeapLoop(EventLoop):
    """The straightforward loop: wake-ups are ordinary heap events (priority 90)."""

    def schedule_last(self, event) -> None:
        self.schedule(event)


def _run(loop, seed, policy):
    w = WorkloadConfig(arrival="lognormal", cv=3.0, num_requests=80, seed=seed, output_scale=1.0)
    cfg = ring_config(0.02, policy, 8, w)
    # fast paths off: they skip most wake-ups (tests/simulator/test_sim_fast_forward.py covers them)
    return simulate(cfg, SimSettings(system="ring", rate=60.0, seed=seed, fast_forward=False), layout=ring_layout(cfg, policy),
                    loop=loop)


@pytest.mark.parametrize("seed,policy", [(0, "full-batch-first"), (1, "prefill-first"), (2, "sarathi")])
def test_fast_wakeups_match_all_heap_loop(seed, policy):
    loop = CountingLoop()
    fast, plain = _run(loop, seed, policy), _run(AllHeapLoop(), seed, policy)
    assert loop.fast > 100  # the fast path ran
    assert fingerprint(fast) == fingerprint(plain)
    timing = ("wall_s", "setup_wall_s", "sim_requests_per_wall_s")
    assert {k: v for k, v in fast.summary.items() if k not in timing} == \
        {k: v for k, v in plain.summary.items() if k not in timing}


def test_schedule_last_only_at_the_current_instant():
    from paraflex.simulator.core.events import EngineWakeupEvent

    loop = EventLoop()
    with pytest.raises(ValueError, match="current instant"):
        loop.schedule_last(EngineWakeupEvent(1.0, None))
