"""EngineScheduler.remove_stage: a drained stage leaves the engine; a busy one is refused."""

import pytest

from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.scheduler import EngineScheduler, ProtocolError


def test_a_drained_stage_leaves_and_another_stage_of_the_model_can_come():
    s = EngineScheduler(BlockPool(256, 4096))
    s.add_stage("m", 0, 2, 512, 2)
    s.add_stage("n", 0, 1, 512, 1)
    s.add_request("r1", "m", 8, 2, 0.0)
    with pytest.raises(ProtocolError, match="drain"):
        s.remove_stage("m")
    s.abort("r1")
    s.remove_stage("m")
    assert [st.model for st in s.stages] == ["n"] and len(s.order.queues) == 2
    s.add_stage("m", 1, 2, 512, 2)  # the same model, another stage: allowed once the old one is gone
    s.add_request("r2", "n", 8, 1, 1.0)
    assert s.schedule(1.0).model == "n"
