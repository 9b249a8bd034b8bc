"""paraflex.simulator.core.events: one event type per module (Vidur style).

Order among events at the same instant (lower first): a stage finishing (stage_end, or replay_end for a stage the
joint replay accounted for, or replay_finish for last tokens inside a joint replay), a batch
arriving at the next engine (batch_arrival), a token reaching the first stage (token_arrival),
a new request at the gateway or the engines (gateway_arrival, request_arrival), live re-planning's tick (live_tick), then an engine's scheduling decision (engine_wakeup), so an
engine decides only after everything that happened at that instant has been delivered.
"""

from paraflex.simulator.core.events.base import Event
from paraflex.simulator.core.events.batch_arrival import BatchArrivalEvent
from paraflex.simulator.core.events.engine_wakeup import EngineWakeupEvent
from paraflex.simulator.core.events.gateway_arrival import GatewayArrivalEvent
from paraflex.simulator.core.events.live_tick import LiveTickEvent
from paraflex.simulator.core.events.replay_end import ReplayEndEvent
from paraflex.simulator.core.events.replay_finish import ReplayFinishEvent
from paraflex.simulator.core.events.request_arrival import RequestArrivalEvent
from paraflex.simulator.core.events.stage_end import StageEndEvent
from paraflex.simulator.core.events.token_arrival import TokenArrivalEvent

__all__ = ["Event", "BatchArrivalEvent", "EngineWakeupEvent", "GatewayArrivalEvent", "LiveTickEvent", "ReplayEndEvent", "ReplayFinishEvent", "RequestArrivalEvent", "StageEndEvent", "TokenArrivalEvent"]
