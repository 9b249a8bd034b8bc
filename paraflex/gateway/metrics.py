"""Prometheus metrics for the gateway, under vLLM's metric names with a `model_name` label.

Data flow: app.py records each request's timings here as its tokens stream out (TTFT,
inter-token latency, time per output token, end-to-end latency, token counts, finish
reasons) and each model's arrival rate (arrival_rates.py); `render` adds the backend's scheduler
state (running / waiting / swapped requests per model, KV-cache usage and swaps per engine,
preemptions, live placement actions and the weight bytes they moved) and writes the Prometheus text
exposition format (0.0.4, `CONTENT_TYPE`) served at /metrics. Names follow vLLM's V1 engine so existing
dashboards work. Counters, histograms and the exposition are prometheus-client's, in one
`CollectorRegistry` per gateway (several gateways may live in one process).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from paraflex.gateway.arrival_rates import ArrivalRateCollector, ArrivalRates
from paraflex.serving.backend import BackendMetrics

# No `<name>_created` series (a process-wide switch of prometheus-client): /metrics keeps the
# series it has always had, and Prometheus tracks counter resets itself.
disable_created_metrics()

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# Bucket bounds as vLLM uses them (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

# Per-engine swap counters: (key in `BackendMetrics.swaps[engine]`, metric name, help).
SWAP_COUNTERS = (
    ("swap_outs", "paraflex:swap_outs", "Cumulative number of requests whose KV was swapped out to host memory."),
    ("swap_ins", "paraflex:swap_ins", "Cumulative number of requests whose KV was swapped back in from host memory."),
    ("swap_out_bytes", "paraflex:swap_out_bytes", "Cumulative bytes of KV copied from device to host memory."),
    ("swap_in_bytes", "paraflex:swap_in_bytes", "Cumulative bytes of KV copied from host to device memory."),
)


class BackendStateCollector:
    """The backend's scheduler state as metric families, read when /metrics is scraped
    (`render` hands it the state of that scrape): gauges of running, waiting and swapped
    requests per model and of KV-cache usage per engine, the backend's cumulative preemption
    count per model, and swap counters (requests and bytes each way) per engine."""

    def __init__(self, model_names: list[str]):
        self.model_names = model_names
        self.state = BackendMetrics()

    def collect(self):
        state = self.state
        yield self._per_model(GaugeMetricFamily, "vllm:num_requests_running",
                              "Number of requests in model execution batches.", state.running)
        yield self._per_model(GaugeMetricFamily, "vllm:num_requests_waiting",
                              "Number of requests waiting to be processed.", state.waiting)
        usage = GaugeMetricFamily("vllm:kv_cache_usage_perc",
                                  "KV-cache usage of each engine's shared block pool. 1 means 100 percent usage.",
                                  labels=["engine"])
        for engine, value in sorted(state.kv_cache_usage.items()):
            usage.add_metric([str(engine)], float(value))
        yield usage
        yield self._per_model(CounterMetricFamily, "vllm:num_preemptions",
                              "Cumulative number of preemptions (requests stopped to free KV, restarted by recompute).",
                              state.preemptions)
        yield self._per_model(GaugeMetricFamily, "vllm:num_requests_swapped",
                              "Number of requests whose KV cache is swapped out to host memory.", state.swapped)
        for key, name, doc in SWAP_COUNTERS:
            family = CounterMetricFamily(name, doc, labels=["engine"])
            for engine, totals in sorted(state.swaps.items()):
                family.add_metric([str(engine)], float(totals.get(key, 0)))
            yield family
        actions = CounterMetricFamily("paraflex:placement_actions",
                                      "Live placement actions (replica add/remove) by outcome: done, failed, rolled_back.",
                                      labels=["op", "outcome"])
        for (op, outcome), n in sorted(state.placement_actions.items()):
            actions.add_metric([op, outcome], float(n))
        yield actions
        yield CounterMetricFamily("paraflex:placement_moved_bytes",
                                  "Weight bytes loaded by live placement changes (rollbacks' reloads included).",
                                  value=float(state.placement_moved_bytes))

    def _per_model(self, family_type, name: str, doc: str, values: dict):
        family = family_type(name, doc, labels=["model_name"])
        for m in self.model_names:
            family.add_metric([m], float(values.get(m, 0)))
        return family


class GatewayMetrics:
    """Per-model request metrics the gateway measures itself, plus the backend's state at
    each scrape, in this gateway's own registry."""

    def __init__(self, model_names: list[str], arrivals=None):
        """arrivals: the rate meter the gateway feeds and /metrics shows (`observe(model)`,
        `rates()`, `description`; default: an `ArrivalRates`)."""
        self.model_names = list(model_names)
        self.registry = CollectorRegistry()
        self.backend_state = BackendStateCollector(self.model_names)
        self.registry.register(self.backend_state)
        self.arrivals = arrivals if arrivals is not None else ArrivalRates(self.model_names)
        self.registry.register(ArrivalRateCollector(self.arrivals))

        def per_model(metric):  # every model's series shows from the start, at 0
            for m in self.model_names:
                metric.labels(m)
            return metric

        def counter(name: str, doc: str, labels=("model_name",)) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return per_model(Histogram(name, doc, ["model_name"], buckets=buckets, registry=self.registry))

        self.prompt_tokens = per_model(counter("vllm:prompt_tokens", "Number of prefill tokens processed."))
        self.generation_tokens = per_model(counter("vllm:generation_tokens",
                                                   "Number of generation tokens processed."))
        # Requests that ended without an error, by finish reason (series appear as they occur).
        self.finished = counter("vllm:request_success", "Count of successfully processed requests.",
                                ("model_name", "finished_reason"))
        self.errors = per_model(counter(
            "paraflex:request_errors",
            "Count of requests that ended with an error (an engine failure, a shutdown, ...)."))
        self.ttft = histogram("vllm:time_to_first_token_seconds",
                              "Histogram of time to first token in seconds.", TTFT_BUCKETS)
        self.itl = histogram("vllm:inter_token_latency_seconds",
                             "Histogram of inter-token latency in seconds.", ITL_BUCKETS)
        self.tpot = histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (mean over a request's decode phase).",
                              ITL_BUCKETS)
        self.e2e = histogram("vllm:e2e_request_latency_seconds",
                             "Histogram of end to end request latency in seconds.", E2E_BUCKETS)

    def observe_request(self, model: str, arrival: float, token_times: list[float], end: float,
                        prompt_tokens: int, finish_reason: str) -> None:
        """Record one finished request. token_times: wall time each output token arrived."""
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.generation_tokens.labels(model).inc(len(token_times))
        if finish_reason == "error":
            self.errors.labels(model).inc()
        else:
            self.finished.labels(model, finish_reason).inc()
        self.e2e.labels(model).observe(end - arrival)
        if token_times:
            self.ttft.labels(model).observe(token_times[0] - arrival)
        itl = self.itl.labels(model)
        for a, b in zip(token_times, token_times[1:]):
            itl.observe(b - a)
        if len(token_times) > 1:
            self.tpot.labels(model).observe((token_times[-1] - token_times[0]) / (len(token_times) - 1))

    def render(self, state: BackendMetrics) -> str:
        """The exposition text of every metric, with `state` as the backend's current state."""
        self.backend_state.state = state
        return generate_latest(self.registry).decode()
