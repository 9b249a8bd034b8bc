"""Prometheus rendering: vLLM names, model_name labels, consistent cumulative histograms."""

import re

from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.serving.backend import BackendMetrics
from paraflex.gateway.metrics import GatewayMetrics


LABEL_ORDER = ("model_name", "engine")  # first, then the others by name, `le` last


def canonical(text: str) -> str:
    """The exposition with each sample's labels in one fixed order (model_name first, le last):
    Prometheus gives label order no meaning, and prometheus-client writes them sorted by name."""
    def order(match):
        labels = re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(2))
        rank = lambda kv: (LABEL_ORDER.index(kv[0]) if kv[0] in LABEL_ORDER else len(LABEL_ORDER),  # noqa: E731
                           kv[0] == "le", kv[0])
        return match.group(1) + "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels, key=rank)) + "}"
    return re.sub(r"^([^#\s{]+)\{([^}]*)\}", order, text, flags=re.M)


def parse(text: str) -> dict[str, float]:
    samples = {}
    for line in canonical(text).splitlines():
        if line.startswith("#") or not line:
            continue
        name, value = line.rsplit(" ", 1)
        samples[name] = float(value)
    return samples


class RenderedHistogram:
    """One model's histogram as /metrics shows it: cumulative (le, count) pairs and the count."""

    def __init__(self, text: str, name: str, model: str) -> None:
        self.buckets = [(le, float(n)) for le, n in
                        re.findall(rf'^{name}_bucket{{model_name="{model}",le="([^"]+)"}} (\S+)$', canonical(text), re.M)]
        self.count = parse(text)[f'{name}_count{{model_name="{model}"}}']

    def cumulative(self) -> list[tuple[str, float]]:
        return self.buckets


def test_request_is_counted_under_vllm_names():
    m = GatewayMetrics(["a", "b"])
    # arrival 0, tokens at 0.5, 0.6, 0.8, end 1.0
    m.observe_request("a", 0.0, [0.5, 0.6, 0.8], 1.0, prompt_tokens=7, finish_reason="length")
    s = parse(m.render(BackendMetrics(running={"a": 2}, waiting={"b": 1}, kv_cache_usage={0: 0.25, 1: 0.0},
                                      preemptions={"b": 3})))
    assert s['vllm:num_preemptions_total{model_name="b"}'] == 3
    assert s['vllm:num_preemptions_total{model_name="a"}'] == 0
    assert s['vllm:prompt_tokens_total{model_name="a"}'] == 7
    assert s['vllm:generation_tokens_total{model_name="a"}'] == 3
    assert s['vllm:generation_tokens_total{model_name="b"}'] == 0
    assert s['vllm:num_requests_running{model_name="a"}'] == 2
    assert s['vllm:num_requests_waiting{model_name="b"}'] == 1
    assert s['vllm:kv_cache_usage_perc{engine="0"}'] == 0.25
    assert s['vllm:request_success_total{model_name="a",finished_reason="length"}'] == 1
    m.observe_request("b", 0.0, [0.5], 1.0, prompt_tokens=2, finish_reason="error")
    s = parse(m.render(BackendMetrics()))
    assert not any(k.startswith('vllm:request_success_total{model_name="b"') for k in s)  # an error is no success
    assert s['paraflex:request_errors_total{model_name="b"}'] == 1 and s['paraflex:request_errors_total{model_name="a"}'] == 0
    assert s['vllm:time_to_first_token_seconds_sum{model_name="a"}'] == 0.5
    assert s['vllm:time_to_first_token_seconds_bucket{model_name="a",le="0.5"}'] == 1
    assert s['vllm:time_to_first_token_seconds_bucket{model_name="a",le="0.25"}'] == 0
    assert s['vllm:inter_token_latency_seconds_count{model_name="a"}'] == 2
    assert abs(s['vllm:time_per_output_token_seconds_sum{model_name="a"}'] - 0.15) < 1e-9
    assert s['vllm:e2e_request_latency_seconds_count{model_name="a"}'] == 1


def test_swaps_are_counted_per_engine_and_swapped_requests_per_model():
    m = GatewayMetrics(["a", "b"])
    text = m.render(BackendMetrics(
        swapped={"a": 2},
        swaps={0: {"swap_outs": 3, "swap_ins": 1, "swap_out_bytes": 3 * 4096, "swap_in_bytes": 4096},
               1: {"swap_outs": 0, "swap_ins": 0, "swap_out_bytes": 0, "swap_in_bytes": 0}}))
    s = parse(text)
    assert s['vllm:num_requests_swapped{model_name="a"}'] == 2
    assert s['vllm:num_requests_swapped{model_name="b"}'] == 0
    assert s['paraflex:swap_outs_total{engine="0"}'] == 3
    assert s['paraflex:swap_ins_total{engine="0"}'] == 1
    assert s['paraflex:swap_out_bytes_total{engine="0"}'] == 3 * 4096
    assert s['paraflex:swap_in_bytes_total{engine="0"}'] == 4096
    assert s['paraflex:swap_outs_total{engine="1"}'] == 0
    assert re.search(r"^# TYPE paraflex:swap_out_bytes_total counter$", text, re.M)
    assert re.search(r"^# TYPE vllm:num_requests_swapped gauge$", text, re.M)


def test_every_family_has_help_and_type():
    text = GatewayMetrics(["m"]).render(BackendMetrics())
    families = re.findall(r"^# TYPE (\S+) (\w+)$", text, re.M)
    assert {f for f, _ in families} >= {
        "vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
        "vllm:prompt_tokens_total", "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds",
        "vllm:inter_token_latency_seconds", "vllm:e2e_request_latency_seconds"}
    assert len(re.findall(r"^# HELP ", text, re.M)) == len(families)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.floats(0, 5000, allow_nan=False), max_size=50))
def test_histogram_buckets_are_cumulative_and_end_at_count(values):
    m = GatewayMetrics(["m"])
    for v in values:  # arrival 0, first token at v: a time to first token of v
        m.observe_request("m", 0.0, [v], v, prompt_tokens=1, finish_reason="stop")
    h = RenderedHistogram(m.render(BackendMetrics()), "vllm:time_to_first_token_seconds", "m")
    cum = h.cumulative()
    counts = [n for _, n in cum]
    assert counts == sorted(counts) and counts[-1] == len(values) == h.count
    for le, n in cum[:-1]:
        assert n == sum(1 for v in values if v <= float(le))
