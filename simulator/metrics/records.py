"""Latency, throughput, SLO and utilisation metrics of one simulation.

The simulated cluster reports into a `MetricsStore` as it runs (dispatch, every generated
token, finish, every executed batch, every swap); `summary()` turns that into the JSON
summary, `request_rows()` into the per-request CSV (output.py). Definitions:

- E2E = finish - arrival; TTFT = first token - arrival; TBT = gap between consecutive tokens
  of one request (every gap counts once). Median and P99 over requests (E2E, TTFT) or gaps.
- Throughput = finished requests (or output tokens) / (last finish - first arrival).
- SLO attainment (Aegaeon §2.1): the share of generated tokens that meet their deadline; token
  k (0-based) of a request arriving at a is due at a + TTFT_slo + k * TBT_slo, so output
  buffered ahead of schedule hides a later stall.
- Goodput = requests per second whose every token met its deadline.
- TTFT / TPOT attainment (Prism §7.2): the share of requests whose TTFT, and whose mean time
  per output token after the first (TPOT), is within the model's TTFT / TBT SLO.
- Switch latency: each time a seed system brings a model's weights onto a GPU (an Aegaeon
  switch, a Prism activation), the time the GPU waited for it (0 when prefetching hid it);
  median, P99 and the CDF plot.
- Active-GPU share (Fig. 16): in each time bin, the fraction of engine-time spent executing
  a stage (an engine is `tp` GPUs, so this is also the GPU share).
"""

from __future__ import annotations

from array import array
from operator import sub
from dataclasses import dataclass

import numpy as np


class RequestRecord:
    """Timeline of one request; `on_time` counts tokens that met their deadline."""

    __slots__ = ("id", "model", "arrival", "prompt_len", "output_len", "replica", "first_token",
                 "last_token", "finish", "tokens", "on_time", "max_tbt", "ttft_slo", "tbt_slo")

    def __init__(self, rid, model, arrival, prompt_len, output_len, ttft_slo, tbt_slo):
        self.id = rid
        self.model = model
        self.arrival = arrival
        self.prompt_len = prompt_len
        self.output_len = output_len
        self.replica = -1
        self.first_token = -1.0
        self.last_token = -1.0
        self.finish = -1.0
        self.tokens = 0
        self.on_time = 0
        self.max_tbt = 0.0
        self.ttft_slo = ttft_slo
        self.tbt_slo = tbt_slo


@dataclass(frozen=True)
class ModelSLO:
    ttft_s: float
    tbt_s: float


# Aegaeon's production SLOs (§7.1 there), used for models whose config sets none.
DEFAULT_TTFT_MS, DEFAULT_TBT_MS = 10_000.0, 100.0


def model_slos(models) -> dict[str, ModelSLO]:
    """Per model of the config (`ModelConfig`s): its SLOs in seconds, or the defaults where it sets none."""
    return {m.name: ModelSLO((m.slo_ttft_ms or DEFAULT_TTFT_MS) / 1000, (m.slo_tbt_ms or DEFAULT_TBT_MS) / 1000)
            for m in models}


# The per-request CSV's columns (the simulator's requests.csv, `paraflex serve --request-log`).
REQUEST_COLUMNS = ("id", "model", "replica", "arrival_s", "prompt_tokens", "output_tokens", "first_token_s",
                   "finish_s", "e2e_s", "ttft_s", "mean_tbt_s", "max_tbt_s", "tokens_on_time")


def request_row(r: RequestRecord) -> tuple:
    """One finished request as a row of REQUEST_COLUMNS."""
    mean_tbt = (r.last_token - r.first_token) / (r.tokens - 1) if r.tokens > 1 else 0.0
    return (r.id, r.model, r.replica, r.arrival, r.prompt_len, r.output_len, r.first_token, r.finish,
            r.finish - r.arrival, r.first_token - r.arrival, mean_tbt, r.max_tbt, r.on_time)


def _pct(values, q: float) -> float | None:
    if len(values) == 0:
        return None
    return float(np.percentile(np.asarray(values, dtype=float), q))


def _latency_block(e2e, ttft, tbt) -> dict:
    return {
        "e2e_median_s": _pct(e2e, 50), "e2e_p99_s": _pct(e2e, 99), "e2e_mean_s": float(np.mean(e2e)) if len(e2e) else None,
        "ttft_median_s": _pct(ttft, 50), "ttft_p99_s": _pct(ttft, 99),
        "tbt_median_s": _pct(tbt, 50), "tbt_p99_s": _pct(tbt, 99),
    }


class MetricsStore:
    """Collects what happens during a run; cheap per token (counters and a compact array)."""

    def __init__(self, slos: dict[str, ModelSLO], num_engines: int, gpus_per_engine: int):
        self.slos = slos
        self.num_engines = num_engines
        self.gpus_per_engine = gpus_per_engine
        self.requests: dict[int, RequestRecord] = {}
        self.finished = 0  # requests finished so far (progress output)
        self.tbt: dict[str, array] = {m: array("d") for m in slos}
        self.busy: list[array] = [array("d") for _ in range(num_engines)]  # start, end pairs
        self.batches = 0
        self.batch_tokens = 0
        self.decode_batches = 0
        self.decode_batch_sizes = array("i")
        self.prefill_batches = 0
        self.swap_out_bytes = 0
        self.swap_in_bytes = 0
        self.swap_outs = 0
        self.swap_ins = 0
        self.hops = 0
        self.hop_bytes = 0
        self.switch_latencies = array("d")
        # seconds between a request's arrival at the gateway and the engines taking it (the
        # simulator delays every arrival by it; records keep the gateway arrival)
        self.request_delay = 0.0
        # seconds a token takes from its last-stage step to the frontend, as a function of the
        # time it was produced (paraflex/costs/return_path.py; None: it is there at once)
        self.token_delay = None

    # --- recording -------------------------------------------------------------------
    def add_request(self, rid: int, model: str, arrival: float, prompt_len: int, output_len: int) -> RequestRecord:
        slo = self.slos[model]
        rec = RequestRecord(rid, model, arrival - self.request_delay, prompt_len, output_len, slo.ttft_s, slo.tbt_s)
        self.requests[rid] = rec
        return rec

    def tokens(self, recs: list[RequestRecord], t: float) -> None:
        """One token for each of `recs` produced at `t`; at the frontend `token_delay` later,
        never before the request's previous token."""
        if self.token_delay is not None:
            t += self.token_delay(t)
            late = [rec for rec in recs if rec.last_token > t]
            if late:  # (the delay fell faster than time passed)
                recs = [rec for rec in recs if rec.last_token <= t]
                for rec in late:
                    self.record(rec, rec.last_token)
        for rec in recs:
            self.record(rec, t)

    def record(self, rec: RequestRecord, t: float) -> None:
        """One token of `rec` at the frontend at `t`."""
        k = rec.tokens
        if k == 0:
            rec.first_token = t
        else:
            gap = t - rec.last_token
            self.tbt[rec.model].append(gap)
            if gap > rec.max_tbt:
                rec.max_tbt = gap
        if t <= rec.arrival + rec.ttft_slo + k * rec.tbt_slo:
            rec.on_time += 1
        rec.last_token = t
        rec.tokens = k + 1

    def token_steps(self, recs: list[RequestRecord], times) -> None:
        """For each time in order: one token for each of `recs` (the fast-forward's replay).
        Request by request: the TBT arrays only feed percentiles, so their order is free."""
        tbt = self.tbt
        n = len(times)
        for rec in recs:
            k = rec.tokens
            i = 0
            if k == 0:
                rec.first_token = times[0]
                if times[0] <= rec.arrival + rec.ttft_slo + 0 * rec.tbt_slo:
                    rec.on_time += 1
                k = i = 1
            if i < n:
                prev = [rec.last_token if i == 0 else times[0], *times[i:n - 1]]
                gaps = list(map(sub, times[i:], prev))
                tbt[rec.model].extend(gaps)
                worst = max(gaps)
                if worst > rec.max_tbt:
                    rec.max_tbt = worst
                # token k + j is due at arrival + TTFT + (k + j) x TBT; deadlines and times both
                # rise, so if the last token meets the first deadline all do
                a, ttft, slo = rec.arrival, rec.ttft_slo, rec.tbt_slo
                if times[n - 1] <= a + ttft + k * slo:
                    rec.on_time += n - i
                else:
                    rec.on_time += sum(1 for j in range(i, n) if times[j] <= a + ttft + (k + j - i) * slo)
            rec.last_token = times[n - 1]
            rec.tokens += n

    def finish(self, rec: RequestRecord, t: float) -> None:
        rec.finish = max(t, rec.last_token)  # its last token's way back (token_delay)
        self.finished += 1

    def batch(self, engine: int, start: float, end: float, is_prefill: bool, size: int, tokens: int) -> None:
        b = self.busy[engine]
        if b and b[-1] >= start:  # back-to-back: extend the interval
            b[-1] = end
        else:
            b.append(start)
            b.append(end)
        self.batches += 1
        self.batch_tokens += tokens
        if is_prefill:
            self.prefill_batches += 1
        else:
            self.decode_batches += 1
            self.decode_batch_sizes.append(size)

    def decode_steps(self, engine: int, runs: list[tuple[float, float, int]]) -> None:
        """`batch` for each decode batch (start, end, size) of one engine, in time order (the
        joint replay's)."""
        b = self.busy[engine]
        sizes = self.decode_batch_sizes
        tokens = 0
        for start, end, size in runs:
            if b and b[-1] >= start:
                b[-1] = end
            else:
                b.append(start)
                b.append(end)
            sizes.append(size)
            tokens += size
        self.batches += len(runs)
        self.batch_tokens += tokens
        self.decode_batches += len(runs)

    def decode_run(self, engine: int, start: float, ends: list[float], size: int) -> None:
        """Back-to-back decode batches of `size` requests on one engine, the first starting at
        `start`, each ending at `ends[i]` and the next starting there: `batch` for each."""
        b = self.busy[engine]
        if b and b[-1] >= start:
            b[-1] = ends[-1]
        else:
            b.append(start)
            b.append(ends[-1])
        k = len(ends)
        self.batches += k
        self.batch_tokens += size * k
        self.decode_batches += k
        self.decode_batch_sizes.extend([size] * k)

    def swap(self, out_bytes: int, in_bytes: int) -> None:
        if out_bytes:
            self.swap_outs += 1
            self.swap_out_bytes += out_bytes
        if in_bytes:
            self.swap_ins += 1
            self.swap_in_bytes += in_bytes

    def switch(self, seconds: float) -> None:
        """A model was brought onto a GPU; the GPU waited `seconds` for it."""
        self.switch_latencies.append(seconds)

    def hop(self, nbytes: int) -> None:
        self.hops += 1
        self.hop_bytes += nbytes

    # --- results -----------------------------------------------------------------------
    def active_share(self, bin_s: float | None = None, bins: int = 200) -> tuple[np.ndarray, np.ndarray]:
        """(bin start times, share of engines busy in each bin) from first arrival to last finish."""
        recs = self.requests.values()
        t0 = min((r.arrival for r in recs), default=0.0)
        t1 = max((r.finish for r in recs), default=t0)
        if t1 <= t0:
            return np.array([t0]), np.zeros(1)
        if bin_s is None:
            bin_s = (t1 - t0) / bins
        edges = np.arange(t0, t1 + bin_s, bin_s)
        busy_at = np.zeros(len(edges))  # busy engine-seconds in [t0, edge], summed over engines
        for b in self.busy:
            if not len(b):
                continue
            iv = np.frombuffer(b, dtype=float).reshape(-1, 2)  # sorted, disjoint per engine
            starts, lengths = iv[:, 0], iv[:, 1] - iv[:, 0]
            before = np.concatenate(([0.0], np.cumsum(lengths)))  # busy time of the first k intervals
            k = np.searchsorted(starts, edges, side="right")  # intervals started by each edge
            last = np.maximum(k - 1, 0)
            partial = np.where(k > 0, np.clip(edges - starts[last], 0.0, lengths[last]), 0.0)
            busy_at += before[last] * (k > 0) + partial
        busy = np.diff(busy_at)
        return edges[:-1], busy / (bin_s * self.num_engines)

    def summary(self) -> dict:
        recs = sorted(self.requests.values(), key=lambda r: r.id)
        done = [r for r in recs if r.finish >= 0]
        out: dict = {"requests": len(recs), "finished": len(done)}
        out.update(self._group(done, [a for a in self.tbt.values()]))
        out["per_model"] = {}
        for m in self.slos:
            rs = [r for r in done if r.model == m]
            out["per_model"][m] = {"requests": sum(1 for r in recs if r.model == m), "finished": len(rs), **self._group(rs, [self.tbt[m]])}
        busy_total = sum(sum(b[i + 1] - b[i] for i in range(0, len(b), 2)) for b in self.busy)
        span = out.get("span_s") or 0.0
        sizes = np.frombuffer(self.decode_batch_sizes, dtype=np.int32) if len(self.decode_batch_sizes) else np.zeros(0)
        _, share = self.active_share()
        out.update({
            "engines": self.num_engines,
            "gpus": self.num_engines * self.gpus_per_engine,
            "active_gpu_share_mean": busy_total / (span * self.num_engines) if span > 0 else 0.0,
            "active_gpu_share_median": float(np.median(share)) if len(share) else 0.0,
            "batches": self.batches,
            "prefill_batches": self.prefill_batches,
            "decode_batches": self.decode_batches,
            "decode_batch_size_mean": float(sizes.mean()) if len(sizes) else 0.0,
            "decode_batch_size_median": float(np.median(sizes)) if len(sizes) else 0.0,
            "swap_outs": self.swap_outs, "swap_ins": self.swap_ins,
            "swap_out_bytes": self.swap_out_bytes, "swap_in_bytes": self.swap_in_bytes,
            "hops": self.hops, "hop_bytes": self.hop_bytes,
            "switches": len(self.switch_latencies),
            "switch_latency_median_s": _pct(self.switch_latencies, 50),
            "switch_latency_p99_s": _pct(self.switch_latencies, 99),
            "switch_seconds_total": float(sum(self.switch_latencies)),
        })
        return out

    @staticmethod
    def _group(done: list[RequestRecord], tbt_arrays: list[array]) -> dict:
        if not done:
            return {"span_s": 0.0, "throughput_rps": 0.0, "throughput_tok_s": 0.0, "slo_attainment": None,
                    "goodput_rps": 0.0, "ttft_attainment": None, "tpot_attainment": None, **_latency_block([], [], [])}
        t0 = min(r.arrival for r in done)
        t1 = max(r.finish for r in done)
        span = t1 - t0
        tokens = sum(r.tokens for r in done)
        e2e = [r.finish - r.arrival for r in done]
        ttft = [r.first_token - r.arrival for r in done]
        tbt = np.concatenate([np.frombuffer(a, dtype=float) for a in tbt_arrays if len(a)]) if any(len(a) for a in tbt_arrays) else []
        good = sum(1 for r in done if r.on_time == r.tokens)
        ttft_ok = sum(1 for r in done if r.first_token - r.arrival <= r.ttft_slo)
        tpot_ok = sum(1 for r in done if r.tokens < 2 or (r.last_token - r.first_token) / (r.tokens - 1) <= r.tbt_slo)
        return {
            "span_s": span,
            "throughput_rps": len(done) / span if span > 0 else 0.0,
            "throughput_tok_s": tokens / span if span > 0 else 0.0,
            "output_tokens": tokens,
            "slo_attainment": sum(r.on_time for r in done) / tokens if tokens else None,
            "goodput_rps": good / span if span > 0 else 0.0,
            "ttft_attainment": ttft_ok / len(done),
            "tpot_attainment": tpot_ok / len(done),
            **_latency_block(e2e, ttft, tbt),
        }

    def request_rows(self):
        yield REQUEST_COLUMNS
        for r in sorted(self.requests.values(), key=lambda r: r.id):
            yield request_row(r)
