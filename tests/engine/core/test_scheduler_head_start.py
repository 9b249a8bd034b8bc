"""Head starts (`scheduler.head_start_s`, engine/core/scheduler.py): a model's requests are
ordered as if they had arrived that many seconds earlier, at its first stage and, through the
arrival its batches carry, at its later stages; none configured keeps arrival order."""

from engine_core_harness import engine


def _two_models(**kw):
    s = engine(batch=4, **kw)
    s.add_stage("A", 0, 1, 256, 1)
    s.add_stage("B", 0, 1, 256, 1)
    s.add_request("b", "B", 4, 5, 1.0)
    s.add_request("a", "A", 4, 5, 3.0)
    return s


def test_without_head_starts_the_older_prompt_goes_first():
    assert _two_models().schedule().req_ids == ["b"]


def test_a_head_start_puts_a_later_prompt_of_its_model_first():
    s = _two_models(head_start_s={"A": 5.0})
    assert s.schedule().req_ids == ["a"]  # counts as arrived at -2.0, before b's 1.0
    assert s.request("a").arrival == -2.0


def test_a_head_start_shorter_than_the_gap_keeps_arrival_order():
    assert _two_models(head_start_s={"A": 1.5}).schedule().req_ids == ["b"]


def test_later_stages_order_by_the_shifted_arrival():
    first = engine(batch=4, head_start_s={"M": 5.0})
    first.add_stage("M", 0, 1, 256, 2)
    first.add_request("m", "M", 4, 5, 3.0)
    msg = first.schedule().message
    assert msg.prefills[0].arrival == -2.0
    later = engine(batch=4)  # the head start travels in the batch: a later stage needs no setting
    later.add_stage("M", 1, 1, 256, 2)
    later.add_stage("B", 0, 1, 256, 1)
    later.add_request("b", "B", 4, 5, 1.0)
    later.receive_batch(msg)
    assert later.schedule().model == "M"


def test_the_config_reaches_served_and_simulated_engines_alike():
    from paraflex.config.scheduler import SchedulerConfig
    from paraflex.engine.core.block_pool import BlockPool
    from paraflex.engine.core.scheduler import EngineScheduler

    cfg = SchedulerConfig(head_start_s={"A": 5.0})
    assert cfg.engine_options(on_cpu=False)["head_start_s"] == {"A": 5.0}  # the simulator's and engine_builder's path
    assert EngineScheduler.from_config(BlockPool(10, 1024, 0), cfg).head_start_s == {"A": 5.0}
    assert EngineScheduler.from_config(BlockPool(10, 1024, 0), SchedulerConfig()).head_start_s == {}
