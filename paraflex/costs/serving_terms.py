"""Measured serving-path terms of a profile directory: the Ray hop between engines and the
gateway's per-request delay, stored in ``profile.json`` next to the op tables and the per-step
residuals (paraflex/costs/step_overheads.py).

Place in the data flow:

- `paraflex profile` measures the hop (paraflex/engine/transport/hop_probe.py) and stores
  `HopTerm.fit(...)` under ``hop``; `ClusterConfig.interconnect()` then returns its link for
  engines of one node (planner and simulator alike), in place of `cluster.interconnect_*`.
- `paraflex profile CONFIG --gateway-log FILE` reads a served request log (`paraflex serve
  --request-log`, whose ``http_arrival_s`` column the gateway stamps) and stores a
  `GatewayTerm` under ``gateway``: the gateway's share (HTTP arrival -> frontend) and the
  frontend <-> engines path (submission to the first engine and the tokens' way back through
  the output router: logged TTFT minus the simulated TTFT of the same request alone, computed by
  the profile command). The simulator (simulator/runner.py) delays every request by their sum
  (`request_delay_s`) between its arrival and the engines taking it; with a shared host CPU the
  gateway's part is `quiet_delay_s` stretched at each arrival instead (`GatewayTerm.delay_s_at`,
  simulator/core/events/gateway_arrival.py). From the same requests it
  stores an `EngineLoopTerm` under ``engine_loop``: what the served engine loop (the Ray engine
  actor's inbox, transport polling and output push, which the in-process step profiler does not
  run) adds to every engine step of a stage: per model, the logged mean TBT minus the simulated
  mean TBT of the same request alone, over the model's stages. `CostModel(profile_dir=...)` adds
  it to every stage execution (prefill and decode), so TBT and E2E see it too.
- `paraflex profile CONFIG --step-log DIR` fits the same term from an engine step log instead
  (paraflex/costs/loop_fit.py): per model and kind a line in the step's size
  (`EngineLoopTerm.from_lines`), which the cost model adds at each stage execution's size.
- With both logs, it also fits a `ReturnPathTerm` under ``return_path`` (paraflex/costs/
  return_path.py): the way back of each token from the end of its last-stage step to the
  frontend (output push, OutputRouter actor, the gateway's poller thread), a latency stretched by
  the shared host CPU (`host_cpu`, paraflex/costs/host_cpu.py, fitted from the same step log and
  stored under ``host_cpu``); the simulator (simulator/core/cluster.py) adds it to every token it
  records and stretches every stage execution of a `device: cpu` cluster by the same term.
  With both logs it also fits a `ServedHopTerm` under ``served_hop`` (paraflex/costs/
  served_hop.py): the hop to an idle engine and the token message back as the served engines
  take them, latencies the same term stretches, which the simulator charges in place of the
  probed hop's latency between engines of one node.
"""

from __future__ import annotations

import csv
import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, field

from paraflex.costs.host_cpu import HOST_CPU_KEY, HostCpu
from paraflex.costs.interconnect import Interconnect
from paraflex.costs.latency_spread import spread_ratio
from paraflex.costs.loop_fit import line_at
from paraflex.costs.step_overheads import PROFILE_FILE, arch_key
from paraflex.errors import UserError

HOP_KEY = "hop"
GATEWAY_KEY = "gateway"
ENGINE_LOOP_KEY = "engine_loop"
RETURN_PATH_KEY = "return_path"
SERVED_HOP_KEY = "served_hop"
LINE_KEYS = ("prefill_s", "prefill_per_token_s", "decode_s", "decode_per_seq_s")


@dataclass(frozen=True)
class HopTerm:
    """One engine-to-engine hop as latency + bytes / bandwidth (bandwidth None: no measurable
    growth with bytes), fitted through the measured medians."""

    latency_s: float
    bandwidth_Bps: float | None
    points: list  # [(tensor bytes, median seconds)] measured

    @classmethod
    def fit(cls, measured: dict[str, tuple[float, int]]) -> "HopTerm":
        """A line through the smallest and largest payload of `measured` (case -> (s, bytes))."""
        pts = sorted((b, s) for s, b in measured.values())
        (b0, s0), (b1, s1) = pts[0], pts[-1]
        slope = (s1 - s0) / (b1 - b0) if b1 > b0 and s1 > s0 else 0.0
        return cls(max(0.0, s0 - slope * b0), 1.0 / slope if slope > 0 else None, [list(p) for p in pts])

    def link(self):
        return Interconnect(self.bandwidth_Bps or math.inf, self.latency_s)


@dataclass(frozen=True)
class GatewayTerm:
    """Per-request delays beyond the engines' steps, medians over `requests` logged requests:
    `delay_s` from the HTTP arrival to the frontend taking the request (parse, tokenize,
    admission), `engine_path_s` from the frontend to the engines and the first token back; on a
    shared host CPU (paraflex/costs/host_cpu.py) `quiet_delay_s`, the gateway's delay as a latency
    the host's stretch at the HTTP arrival lengthens (None: not fitted, `delay_s` for every request),
    and `spread`, how the logged delays spread around it (paraflex/costs/latency_spread.py)."""

    delay_s: float
    requests: int
    engine_path_s: float = 0.0
    quiet_delay_s: float | None = None
    spread: list = field(default_factory=list)

    @classmethod
    def from_log(cls, rows: list[dict], path: str, engine_ttft_s: list[float] | None = None,
                 quiet_delay_s: float | None = None, spread: list | None = None) -> "GatewayTerm":
        """From the rows of request log `path` that carry an http_arrival_s; `engine_ttft_s`, one
        per such row, the simulated TTFT of that request alone (None: no engine path)."""
        rows = [r for r in rows if r.get("http_arrival_s")]
        if not rows:
            raise _no_http_rows(path)
        delay = statistics.median(float(r["arrival_s"]) - float(r["http_arrival_s"]) for r in rows)
        path_s = 0.0 if engine_ttft_s is None else statistics.median(
            float(r["ttft_s"]) - t for r, t in zip(rows, engine_ttft_s))
        return cls(max(0.0, delay), len(rows), max(0.0, path_s), quiet_delay_s, spread or [])

    def delay_s_at(self, stretch: float | None, u: float | None = None) -> float:
        """The gateway's delay for a request arriving while the shared host stretches work by
        `stretch` (None: no host term, the median `delay_s`), at quantile `u` of its spread (None:
        the fitted latency)."""
        if stretch is None or self.quiet_delay_s is None:
            return self.delay_s
        return self.quiet_delay_s * spread_ratio(self.spread, u) * stretch


def gateway_delays(rows: list[dict]) -> list[tuple[float, float]]:
    """(HTTP arrival, seconds to the frontend) of each request-log row that carries an http_arrival_s."""
    return [(float(r["http_arrival_s"]), float(r["arrival_s"]) - float(r["http_arrival_s"]))
            for r in rows if r.get("http_arrival_s")]


@dataclass(frozen=True)
class EngineLoopTerm:
    """Seconds the served engine loop adds to each engine step of a stage, per model (`per_model`:
    [{model, key (its arch_key), step_s}], and, fitted from an engine step log, lines in the
    step's size: prefill_s + prefill_per_token_s * tokens, decode_s + decode_per_seq_s * batch),
    and `step_s` for a model not logged (the median of the logged models' step_s), fitted from
    `requests` logged requests (or `steps` logged steps: `source` "requests" or "steps")."""

    per_model: list
    step_s: float
    requests: int
    source: str = "requests"
    # "prefill" / "decode" -> how the logged steps spread around the lines (loop_fit.step_spreads;
    # empty: every stage execution takes its predicted time)
    step_spread: dict = field(default_factory=dict)

    @classmethod
    def fit(cls, rows: list[dict], alone_tbt_s: list[float], stages: dict[str, int], archs: dict) -> "EngineLoopTerm":
        """From log `rows` (requests sent one at a time) and `alone_tbt_s`, one per row, the
        simulated mean TBT of that request alone without this term; `stages` and `archs` by model.
        Per model the median of (logged - simulated) / stages over its rows of >= 2 output tokens;
        a negative median (the simulator is already slower) counts as zero."""
        extra: dict[str, list[float]] = {}
        for r, tbt in zip(rows, alone_tbt_s):
            if int(r["output_tokens"]) > 1 and r.get("mean_tbt_s"):
                extra.setdefault(r["model"], []).append((float(r["mean_tbt_s"]) - tbt) / stages[r["model"]])
        per_model = [{"model": m, "key": list(arch_key(archs[m])), "step_s": max(0.0, statistics.median(v))}
                     for m, v in sorted(extra.items())]
        step = statistics.median(e["step_s"] for e in per_model) if per_model else 0.0
        return cls(per_model, step, sum(len(v) for v in extra.values()))

    @classmethod
    def from_lines(cls, lines: dict[str, dict], archs: dict, step_spread: dict | None = None) -> "EngineLoopTerm":
        """From `paraflex.costs.loop_fit.fit_loop_lines`' lines per model (`archs` by model) and
        the steps' `step_spread` around them; `step_s` of an entry (and for a model not logged) is
        its decode line at batch 1."""
        per_model = [{"model": m, "key": list(arch_key(archs[m])), "step_s": max(0.0, e["decode_s"] + e["decode_per_seq_s"]),
                      **{k: e[k] for k in LINE_KEYS}} for m, e in sorted(lines.items())]
        step = statistics.median(e["step_s"] for e in per_model) if per_model else 0.0
        return cls(per_model, step, sum(e["steps"] for e in lines.values()), "steps", step_spread or {})

    def stage_step_s(self, arch, prefill: bool = False, size: int = 1) -> float:
        """What the engine loop adds to one stage execution of `arch` over `size` prompt tokens
        (prefill) or requests (decode): the model's line where one was fitted from a step log (may be
        negative: the cost model keeps residual + loop >= 0), else a constant >= 0."""
        key = list(arch_key(arch))
        e = next((e for e in self.per_model if e["key"] == key), None)
        if e is None:
            return self.step_s
        if "decode_s" not in e:
            return e["step_s"]
        return line_at(e, prefill, size)


@dataclass(frozen=True)
class ReturnPathTerm:
    """A token's way back from the end of its last-stage step to the frontend: `latency_s` on a
    quiet host, stretched by the shared host CPU (the output path's threads wait for a core the
    engines hold: paraflex/costs/host_cpu.py), fitted over `tokens` logged first and last tokens."""

    latency_s: float
    tokens: int
    spread: list = field(default_factory=list)  # around latency_s (paraflex/costs/latency_spread.py)

    def delay_s(self, stretch: float = 1.0, u: float | None = None) -> float:
        """The way back while the host stretches work by `stretch`, at quantile `u` of the spread
        (None: the fitted latency)."""
        return self.latency_s * spread_ratio(self.spread, u) * stretch


@dataclass(frozen=True)
class ServedHopTerm:
    """A hand-over between engines of one node as the served engines see it (paraflex/costs/
    served_hop.py): `latency_s` of a forward hop (its bytes go on top at the measured hop's
    bandwidth) and `token_latency_s` of a token message back to the first stage, on a quiet host,
    each stretched by the shared host CPU; fitted over `hops` and `tokens` logged hand-overs."""

    latency_s: float
    token_latency_s: float
    hops: int
    tokens: int
    hop_spread: list = field(default_factory=list)  # around each latency (paraflex/costs/latency_spread.py)
    token_spread: list = field(default_factory=list)

    def hop_latency_s(self, stretch: float, u: float | None = None) -> float:
        return self.latency_s * spread_ratio(self.hop_spread, u) * stretch

    def token_message_s(self, stretch: float, u: float | None = None) -> float:
        return self.token_latency_s * spread_ratio(self.token_spread, u) * stretch


def served_alone(rows: list[dict]) -> list[dict]:
    """The request-log `rows` whose time in the server (frontend arrival to finish) overlaps no
    other row's: the requests the server ran alone."""
    spans = sorted((float(r["arrival_s"]), float(r["finish_s"]), i) for i, r in enumerate(rows))
    alone, latest_end = [], float("-inf")
    for k, (start, end, i) in enumerate(spans):
        next_start = spans[k + 1][0] if k + 1 < len(spans) else float("inf")
        if start > latest_end and end < next_start:
            alone.append(rows[i])
        latest_end = max(latest_end, end)
    return alone


def read_log(path: str) -> list[dict]:
    """The rows of a `paraflex serve --request-log` file that carry an http_arrival_s (at least one)."""
    try:
        with open(path, newline="", encoding="utf-8") as fh:
            rows = [r for r in csv.DictReader(fh) if r.get("http_arrival_s")]
    except OSError as exc:
        raise UserError(f"--gateway-log {path}: cannot read it ({exc.strerror}); pass a `paraflex serve "
                        f"--request-log` file") from None
    if not rows:
        raise _no_http_rows(path)
    return rows


def _no_http_rows(path: str) -> UserError:
    return UserError(f"--gateway-log {path}: no row has an http_arrival_s; log requests served over HTTP by "
                     f"`paraflex serve --request-log FILE`")


def _read(profile_dir: str | None) -> dict:
    path = os.path.join(profile_dir, PROFILE_FILE) if profile_dir else None
    if not path or not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as fh:
        return json.load(fh)


def measured_hop(profile_dir: str | None) -> HopTerm | None:
    d = _read(profile_dir).get(HOP_KEY)
    return HopTerm(**d) if d else None


def engine_loop(profile_dir: str | None) -> EngineLoopTerm | None:
    d = _read(profile_dir).get(ENGINE_LOOP_KEY)
    return EngineLoopTerm(**d) if d else None


def return_path(profile_dir: str | None) -> ReturnPathTerm | None:
    d = _read(profile_dir).get(RETURN_PATH_KEY)
    if d and "per_busy_engine_s" in d:
        raise UserError(f"{os.path.join(profile_dir, PROFILE_FILE)}: its return_path is a line in the busy engines "
                        f"from before the shared host CPU term; fit it again: paraflex profile CONFIG --gateway-log "
                        f"FILE --step-log DIR -o {profile_dir}")
    return ReturnPathTerm(**d) if d else None


def served_hop(profile_dir: str | None) -> ServedHopTerm | None:
    d = _read(profile_dir).get(SERVED_HOP_KEY)
    return ServedHopTerm(**d) if d else None


def host_cpu(cluster) -> HostCpu | None:
    """The shared host CPU fitted for `cluster` (a ClusterConfig): its profile's ``host_cpu``;
    None for a GPU cluster (a GPU's host threads are not its compute) or a profile without one."""
    if cluster.device != "cpu":
        return None
    d = _read(cluster.profile_dir).get(HOST_CPU_KEY)
    return HostCpu(**d) if d else None


def gateway(profile_dir: str | None) -> GatewayTerm | None:
    d = _read(profile_dir).get(GATEWAY_KEY)
    return GatewayTerm(**d) if d else None


def request_delay_s(profile_dir: str | None) -> float:
    """The measured delay per request between its HTTP arrival and the engines (gateway plus
    frontend <-> engines path); 0 without a profile or a measured one."""
    term = gateway(profile_dir)
    return 0.0 if term is None else term.delay_s + term.engine_path_s


def store(profile_dir: str, key: str, term) -> None:
    """Set `key` of `profile_dir`'s profile.json to `term`, or drop it where `term` is None (the
    rest of the file unchanged)."""
    data = _read(profile_dir)
    if term is None:
        data.pop(key, None)
    else:
        data[key] = asdict(term)
    os.makedirs(profile_dir, exist_ok=True)
    with open(os.path.join(profile_dir, PROFILE_FILE), "w", encoding="utf-8") as fh:
        json.dump(data, fh, indent=2)
