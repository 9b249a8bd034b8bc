"""Per-model arrival rates the gateway measures, for /metrics (and the re-planning controller).

Place in the data flow: `generation.generate` tells `ArrivalRates.observe(model)` of every
request that reaches the backend; `/metrics` shows `rates()` as the gauge
`paraflex:arrival_rate{model_name}` (`ArrivalRateCollector`). The rate is an exponentially
weighted moving average in continuous time: it decays by exp(-dt / tau) and each arrival adds
1 / tau, so a steady Poisson stream of rate r reads r on average, and a change of traffic shows
within about tau seconds. With `paraflex serve --replan-interval`, the live re-planner
(paraflex/serving/live_replanner.py) takes this one's place: the gateway feeds it the same way
and the gauge shows its sliding-window rates, the ones the planner decides on (one meter).
"""

from __future__ import annotations

import math
import threading
import time

from prometheus_client.core import GaugeMetricFamily

TAU_S = 30.0


class ArrivalRates:
    """Requests per second per model, an EWMA with time constant `tau_s`."""

    def __init__(self, models: list[str], tau_s: float = TAU_S, clock=time.monotonic) -> None:
        self.tau_s = tau_s
        self.description = f"moving average, time constant {tau_s:g} s"
        self.clock = clock
        self._rate = {m: 0.0 for m in models}
        self._at = {m: clock() for m in models}
        self._lock = threading.Lock()

    def observe(self, model: str) -> None:
        """One request of `model` arrived now."""
        with self._lock:
            self._rate[model] = self._decayed(model, self.clock()) + 1.0 / self.tau_s

    def rates(self) -> dict[str, float]:
        """Per model, the rate now (requests/s)."""
        now = self.clock()
        with self._lock:
            return {m: self._decayed(m, now) for m in self._rate}

    def _decayed(self, model: str, now: float) -> float:
        rate = self._rate[model] * math.exp(-(now - self._at[model]) / self.tau_s)
        self._rate[model], self._at[model] = rate, now
        return rate


class ArrivalRateCollector:
    """`ArrivalRates` as the gauge family paraflex:arrival_rate, read at each scrape."""

    def __init__(self, rates: ArrivalRates) -> None:
        self.rates = rates

    def collect(self):
        family = GaugeMetricFamily(
            "paraflex:arrival_rate",
            f"Requests per second arriving for each model ({self.rates.description}).",
            labels=["model_name"])
        for model, rate in self.rates.rates().items():
            family.add_metric([model], rate)
        yield family
