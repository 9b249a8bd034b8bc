"""Prometheus metrics for the gateway, under vLLM's metric names with a `model_name` label.

Data flow: app.py records each request's timings here as its tokens stream out (TTFT,
inter-token latency, time per output token, end-to-end latency, token counts, finish
reasons); `render` adds the backend's scheduler state (running / waiting requests per
model, KV-cache usage per engine) and writes the Prometheus text exposition format (0.0.4)
served at /metrics. Names follow vLLM's V1 engine so existing dashboards work.
"""

from __future__ import annotations

import bisect
import math
from collections import defaultdict

from paraflex.serving.backend import BackendMetrics

# Bucket bounds as vLLM uses them (seconds).
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
               10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)

HISTOGRAMS = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:inter_token_latency_seconds": ("Histogram of inter-token latency in seconds.", ITL_BUCKETS),
    "vllm:time_per_output_token_seconds": (
        "Histogram of time per output token in seconds (mean over a request's decode phase).", ITL_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of end to end request latency in seconds.", E2E_BUCKETS),
}


class Histogram:
    """Cumulative-bucket histogram with sum and count."""

    def __init__(self, bounds: tuple[float, ...]):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # last = +Inf
        self.sum = 0.0
        self.count = 0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value
        self.count += 1

    def cumulative(self) -> list[tuple[str, int]]:
        out, running = [], 0
        for bound, n in zip(list(self.bounds) + [math.inf], self.counts):
            running += n
            out.append(("+Inf" if bound == math.inf else repr(float(bound)), running))
        return out


def _labels(**kv) -> str:
    def esc(v) -> str:
        return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{esc(v)}"' for k, v in kv.items()) + "}"


class GatewayMetrics:
    """Per-model request metrics the gateway measures itself."""

    def __init__(self, model_names: list[str]):
        self.model_names = list(model_names)
        self.hist = {name: {m: Histogram(b) for m in self.model_names} for name, (_, b) in HISTOGRAMS.items()}
        self.prompt_tokens = defaultdict(int)
        self.generation_tokens = defaultdict(int)
        self.finished = defaultdict(int)  # (model, reason) -> count of requests that ended without an error
        self.errors = defaultdict(int)  # model -> requests that ended with an error

    def observe_request(self, model: str, arrival: float, token_times: list[float], end: float,
                        prompt_tokens: int, finish_reason: str) -> None:
        """Record one finished request. token_times: wall time each output token arrived."""
        self.prompt_tokens[model] += prompt_tokens
        self.generation_tokens[model] += len(token_times)
        if finish_reason == "error":
            self.errors[model] += 1
        else:
            self.finished[(model, finish_reason)] += 1
        self.hist["vllm:e2e_request_latency_seconds"][model].observe(end - arrival)
        if token_times:
            self.hist["vllm:time_to_first_token_seconds"][model].observe(token_times[0] - arrival)
        for a, b in zip(token_times, token_times[1:]):
            self.hist["vllm:inter_token_latency_seconds"][model].observe(b - a)
        if len(token_times) > 1:
            tpot = (token_times[-1] - token_times[0]) / (len(token_times) - 1)
            self.hist["vllm:time_per_output_token_seconds"][model].observe(tpot)

    def render(self, state: BackendMetrics) -> str:
        lines: list[str] = []

        def family(name: str, kind: str, doc: str) -> None:
            lines.append(f"# HELP {name} {doc}")
            lines.append(f"# TYPE {name} {kind}")

        def per_model(name: str, kind: str, doc: str, values) -> None:
            family(name, kind, doc)
            for m in self.model_names:
                lines.append(f"{name}{_labels(model_name=m)} {float(values.get(m, 0))}")

        per_model("vllm:num_requests_running", "gauge", "Number of requests in model execution batches.",
                  state.running)
        per_model("vllm:num_requests_waiting", "gauge", "Number of requests waiting to be processed.",
                  state.waiting)
        family("vllm:kv_cache_usage_perc", "gauge",
               "KV-cache usage of each engine's shared block pool. 1 means 100 percent usage.")
        for engine, usage in sorted(state.kv_cache_usage.items()):
            lines.append(f"vllm:kv_cache_usage_perc{_labels(engine=engine)} {float(usage)}")
        per_model("vllm:num_preemptions_total", "counter",
                  "Cumulative number of preemptions (requests stopped to free KV, restarted by recompute).",
                  state.preemptions)
        per_model("vllm:prompt_tokens_total", "counter", "Number of prefill tokens processed.",
                  self.prompt_tokens)
        per_model("vllm:generation_tokens_total", "counter", "Number of generation tokens processed.",
                  self.generation_tokens)
        family("vllm:request_success_total", "counter", "Count of successfully processed requests.")
        for (m, reason), n in sorted(self.finished.items()):
            lines.append(f"vllm:request_success_total{_labels(model_name=m, finished_reason=reason)} {float(n)}")
        per_model("paraflex:request_errors_total", "counter",
                  "Count of requests that ended with an error (an engine failure, a shutdown, ...).", self.errors)
        for name, (doc, _) in HISTOGRAMS.items():
            family(name, "histogram", doc)
            for m in self.model_names:
                h = self.hist[name][m]
                for le, n in h.cumulative():
                    lines.append(f"{name}_bucket{_labels(model_name=m, le=le)} {float(n)}")
                lines.append(f"{name}_sum{_labels(model_name=m)} {h.sum}")
                lines.append(f"{name}_count{_labels(model_name=m)} {float(h.count)}")
        return "\n".join(lines) + "\n"
