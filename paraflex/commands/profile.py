"""`paraflex profile`: measure the torch engine's per-layer op times on this machine and write
them as Vidur ``mlp.csv`` tables that the cost model reads (`cluster.profile_dir`).

Thin edge over `paraflex.engine.worker.op_profiler`: loads the config, checks that the device at hand
is the kind the config names, profiles every distinct model shape once (progress on stderr),
writes ``DIR/compute/<cluster.device>/paraflex/<model>/mlp.csv`` plus ``DIR/profile.json``
(machine, torch, threads, dtypes, token counts) and says how to use them. Unless `--no-steps`,
it then times whole engine steps of each model (paraflex/serving/step_profiler.py) and stores
their residual over the tables' prediction in profile.json (`step_overheads`, read by the cost
model: paraflex/costs/step_overheads.py). Both measurements run in rounds and re-measure points
that break monotonicity (paraflex/costs/robust_timing.py); profile.json's `noise` keeps the
rounds' spread and what was re-measured or pooled, per model, so a bench can warn. Unless `--no-hop`, it measures the Ray hop between two
engine actors (paraflex/engine/transport/hop_probe.py) and stores it as `hop`, the link between
engines of one node. `--gateway-log FILE` measures nothing: it reads a served request log and
stores per-request delays as `gateway` in OUTPUT/profile.json, keeping the rest
(paraflex/costs/serving_terms.py): the gateway's share from the log alone, and the frontend <->
engines path as the logged TTFT minus the TTFT the simulator predicts for the same requests at
their logged arrivals with this profile, on the config's placement (`--placement`, or planned);
and first, as `engine_loop`, what the served engine loop adds per stage step: the logged mean TBT
minus the simulated one of the same request alone, over the model's stages (with `--step-log
DIR`: lines fitted from the logged steps, paraflex/costs/loop_fit.py). With both logs of one
served run it also stores `return_path`, each token's way back to the frontend, `served_hop`, the
hop to an idle engine and the token message back as the served engines take them, and on a
`device: cpu` cluster (with `--step-log`) `host_cpu`, the shared host CPU that stretches steps,
hops and tokens while other engines run (paraflex/costs/return_path.py, paraflex/costs/
served_hop.py, paraflex/costs/host_cpu.py).
"""

from __future__ import annotations

import datetime
from dataclasses import asdict
import json
import os
import platform
import sys

from paraflex.config.schema import load_config
from paraflex.costs.serving_terms import (ENGINE_LOOP_KEY, GATEWAY_KEY, HOP_KEY, RETURN_PATH_KEY, SERVED_HOP_KEY,
                                          EngineLoopTerm, GatewayTerm, HopTerm, gateway_delays, measured_hop, read_log,
                                          served_alone, store)
from paraflex.costs.host_cpu import HOST_CORES_KEY, HOST_CPU_KEY
from paraflex.costs.loop_fit import OUTLIER_FACTOR
from paraflex.costs.step_overheads import KEY as STEP_KEY, NOISE_KEY
from paraflex.errors import UserError
from paraflex.models.engine_support import require_runnable

NAME = "profile"
HELP = "Measure per-layer op times of the config's models on this machine (cost-model tables)."


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?", help="cluster/model config (YAML or JSON)")
    parser.add_argument("-o", "--output", default="profiles", help="directory to write (default: %(default)s)")
    parser.add_argument("--models", help="comma-separated model names of the config (default: all)")
    parser.add_argument("--tokens", default=None,
                        help="comma-separated token counts (default: 1,2,4,...,4096)")
    parser.add_argument("--repeats", type=int, default=10, help="timed runs per op and token count (default: %(default)s)")
    parser.add_argument("--device", default="auto", help="auto (CUDA if visible), cpu, cuda, cuda:1")
    parser.add_argument("--no-steps", action="store_true",
                        help="skip timing whole engine steps (the per-step residual over the op tables)")
    parser.add_argument("--no-hop", action="store_true",
                        help="skip measuring the Ray hop between engine actors (the link between engines)")
    parser.add_argument("--gateway-log", metavar="FILE",
                        help="only store the per-request delays measured in this `paraflex serve --request-log` "
                             "file (log requests sent one at a time) in OUTPUT/profile.json")
    parser.add_argument("--step-log", metavar="DIR",
                        help="only store the engine loop's time per stage step fitted from this `paraflex serve "
                             "--step-log DIR` (lines in the step's size; with --gateway-log, in place of its "
                             "constant) in OUTPUT/profile.json")
    parser.add_argument("--placement", metavar="FILE",
                        help="with --gateway-log / --step-log: the placement the logged server ran (default: plan CONFIG)")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress lines")


def _tokens(text: str | None) -> tuple[int, ...]:
    from paraflex.engine.worker.op_profiler import DEFAULT_TOKENS

    if text is None:
        return DEFAULT_TOKENS
    try:
        values = tuple(sorted({int(v) for v in text.split(",") if v.strip()}))
    except ValueError:
        raise UserError(f"--tokens: {text!r} is not a comma-separated list of integers, e.g. 1,8,64") from None
    if not values or values[0] < 1:
        raise UserError("--tokens: give token counts >= 1, e.g. 1,8,64")
    return values


def run(args) -> int:
    from paraflex.engine.kernels import omp_policy

    omp_policy.apply_here()  # before torch loads: measure the engines as `paraflex serve` runs them
    if not args.config:
        raise UserError("missing CONFIG: usage `paraflex profile CONFIG -o DIR`")
    if args.repeats < 1:
        raise UserError("--repeats must be >= 1")
    config = load_config(args.config)
    if args.gateway_log or args.step_log:
        return _store_gateway(config, args)
    tokens = _tokens(args.tokens)
    names = [m.name for m in config.models]
    if args.models:
        wanted = [n.strip() for n in args.models.split(",") if n.strip()]
        unknown = [n for n in wanted if n not in names]
        if unknown:
            raise UserError(f"--models: {unknown[0]!r} is not a model of the config; choose from {', '.join(names)}")
        names = wanted
    require_runnable(config, names)

    import torch

    from paraflex.engine.engine_builder import choose_device, choose_dtype
    from paraflex.engine.worker.model.layers import unsupported_reason
    from paraflex.engine.worker.op_profiler import profile_layer_ops
    from paraflex.costs.profile_tables import shape_of, table_path, write_mlp_csv

    device = choose_device(args.device)
    wants_cpu = config.cluster.device == "cpu"
    if wants_cpu != (device.type == "cpu"):
        raise UserError(
            f"cluster.device is {config.cluster.device!r} but the device at hand is {device}: profile on the "
            f"machine the config describes ({'--device cpu' if wants_cpu else 'a CUDA GPU'})"
        )
    if config.cluster.tp != 1:
        print(f"warning: tables are measured at TP 1; the cost model uses them only for TP 1, not this "
              f"config's tp={config.cluster.tp}", file=sys.stderr)
    hardware = torch.cuda.get_device_name(device) if device.type == "cuda" else (platform.processor() or platform.machine())
    progress = None if args.quiet else (lambda line: print(f"[profile] {line}", file=sys.stderr, flush=True))
    if progress:
        progress(f"{hardware} ({device}), torch {torch.__version__}, {torch.get_num_threads()} threads; "
                 f"tokens {','.join(map(str, tokens))}, {args.repeats} repeats")
    done: dict = {}  # (shape, dtype) -> model whose table covers it
    noise: dict = {"ops": {}, "steps": {}}  # what the rounds' spread was, what was re-measured or pooled
    written = []
    for name in names:
        arch = config.model(name).arch
        reason = unsupported_reason(arch)
        if reason:
            raise UserError(f"model {name!r}: {reason}")
        dtype = choose_dtype(device)
        key = (shape_of(arch), arch.vocab_size, dtype)
        if key in done:
            if progress:
                progress(f"{name}: same shape and dtype as {done[key]}, its table covers it")
            continue
        ops = profile_layer_ops(arch, device, dtype, tokens, repeats=args.repeats, progress=progress)
        noise["ops"][name] = ops.noise()
        path = table_path(args.output, config.cluster.device, f"paraflex/{name}")
        write_mlp_csv(path, ops.rows)
        done[key] = name
        written.append({"model": name, "table": os.path.relpath(path, args.output), "dtype": str(dtype).split(".")[-1]})
    overheads, noise["steps"] = ([], {}) if args.no_steps else _step_overheads(config, names, args, device, progress)
    meta = {"created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "cluster_device": config.cluster.device, "hardware": hardware, "torch": torch.__version__,
            "threads": torch.get_num_threads(), HOST_CORES_KEY: os.cpu_count(), "tokens": list(tokens), "repeats": args.repeats, "tables": written,
            STEP_KEY: [o.to_dict() for o in overheads], NOISE_KEY: noise}
    if not args.no_hop:
        meta[HOP_KEY] = asdict(_hop(progress))
    with open(os.path.join(args.output, "profile.json"), "w", encoding="utf-8") as fh:
        json.dump(meta, fh, indent=2)
    print(f"wrote {len(written)} table(s) under {args.output}; to use them, set `cluster.profile_dir: "
          f"{os.path.abspath(args.output)}` in the config (plan and simulate then use the measured op times)")
    return 0


def _step_overheads(config, names, args, device, progress) -> tuple[list, dict]:
    """Each model's served-step residual over the op tables just written, and the noise seen per
    model (CPU runs only: the in-process cluster runs where the config's device is)."""
    from paraflex.costs.costmodel import CostModel
    from paraflex.serving.step_profiler import measure_steps

    if device.type != "cpu" and config.cluster.device == "cpu":
        return [], {}
    cost = CostModel(config.cluster.device, tp=1, profile_dir=args.output)
    cost.overheads = cost.engine_loop = None  # the tables alone: an older profile.json's terms must not count
    overheads, noise = measure_steps(config, names, cost, repeats=max(1, args.repeats), progress=progress)
    return overheads, {name: n.to_dict() for name, n in noise.items()}


def _hop(progress) -> HopTerm:
    """The Ray hop between two engine actors on this machine (a local Ray instance for the run)."""
    from paraflex.engine.transport.hop_probe import measure_hop

    hop = HopTerm.fit(measure_hop())
    if progress:
        bw = f"{hop.bandwidth_Bps / 1e9:.2f} GB/s" if hop.bandwidth_Bps else "no growth with bytes"
        progress(f"Ray hop between engines: {1e6 * hop.latency_s:.0f} us + bytes at {bw}")
    return hop


def _store_gateway(config, args) -> int:
    """Store the served terms: the engine loop's time per stage step (from `args.step_log`'s
    steps against the cost model's stage times, else from `args.gateway_log`'s TBT against the
    simulated TBT of each request alone, without an earlier engine loop term); with both logs the
    tokens' return path (the logged requests' way back against the busy engines before it); then
    the gateway's delay and the engine path (logged TTFT against the simulated TTFT of the same
    requests at their logged arrivals, now with the terms before), all in OUTPUT's profile."""
    rows = read_log(args.gateway_log) if args.gateway_log else []
    names = {m.name for m in config.models}
    unknown = [r["model"] for r in rows if r["model"] not in names]
    if unknown:
        raise UserError(f"--gateway-log {args.gateway_log}: model {unknown[0]!r} is not in the config; pass the "
                        f"config the logged server ran")
    for key in (ENGINE_LOOP_KEY, RETURN_PATH_KEY, SERVED_HOP_KEY, HOST_CPU_KEY, GATEWAY_KEY):  # fitted afresh, none from an earlier fit
        store(args.output, key, None)
    profiled, layout = _profiled(config, args)
    archs = {m.name: m.arch for m in profiled.models}
    loop = host = None
    if args.step_log:
        lines, host, spread = _loop_lines(profiled, layout, args.step_log, args.output, rows)
        loop = EngineLoopTerm.from_lines(lines, archs, spread)
        if left_out := sum(e["outliers"] for e in lines.values()):
            print(f"engine loop: {left_out} logged step(s) over {OUTLIER_FACTOR:g}x their expected time left out as "
                  f"one-offs (a kernel compiling on first use, a full garbage collection)")
        store(args.output, HOST_CPU_KEY, host)
        if host is not None:
            print(f"shared host CPU, fitted from {host.steps} logged steps: {host.cores} cores; each busy engine "
                  f"{host.demand_per_engine:g} and each request in flight {host.demand_per_request:g} cores' worth "
                  f"of runnable work")
    elif alone := served_alone(rows):  # the TBT of a request alone, logged against simulated: what each step adds
        stages = {name: mp.num_stages for name, mp in layout.placement.models.items()}
        loop = EngineLoopTerm.fit(alone, [tbt for _, tbt in _simulated(profiled, layout, alone)], stages, archs)
    store(args.output, ENGINE_LOOP_KEY, loop)
    if loop is not None:
        steps = ", ".join(_describe(e) for e in loop.per_model)
        print(f"engine loop per stage step, fitted from {loop.requests} logged {loop.source}: {steps or 'none'}")
    if not args.gateway_log:
        return 0
    quiet_gateway, gateway_spread = None, []
    if args.step_log:
        from paraflex.costs.host_cpu import fit_stretched_latency
        from paraflex.costs.loop_fit import read_step_log
        from paraflex.costs.return_path import fit_return_path

        steps = read_step_log(args.step_log)
        back = fit_return_path(rows, steps, host)
        hop = _served_hop(steps, rows, host, archs, measured_hop(args.output))
        store(args.output, SERVED_HOP_KEY, hop)
        if host is not None:
            quiet_gateway, gateway_spread = fit_stretched_latency(gateway_delays(rows), steps, rows, host)
        store(args.output, RETURN_PATH_KEY, back)
        if back is not None:
            print(f"return path per token (last-stage step end -> frontend), fitted from {back.tokens} logged tokens: "
                  f"{1000 * back.latency_s:.2f} ms" + (" x the shared host CPU's stretch" if host else ""))
    arrival0 = min(float(r["arrival_s"]) for r in rows)
    ttft = [t for t, _ in _simulated(*_profiled(config, args), rows, [float(r["arrival_s"]) - arrival0 for r in rows])]
    term = GatewayTerm.from_log(rows, args.gateway_log, ttft, quiet_gateway, gateway_spread)
    store(args.output, GATEWAY_KEY, term)
    quiet = "" if quiet_gateway is None else f" ({1000 * quiet_gateway:.2f} ms on a quiet host x the shared host CPU's stretch)"
    print(f"per-request delays (medians of {term.requests} requests in {args.gateway_log}): gateway "
          f"{1000 * term.delay_s:.2f} ms{quiet}, frontend <-> engines {1000 * term.engine_path_s:.2f} ms; stored in "
          f"{os.path.join(args.output, 'profile.json')}; the simulator delays every request by both, adds the "
          f"engine loop term to every stage step and the return path to every token")
    return 0


def _served_hop(steps, rows, host, archs, probed):
    """The served hop fitted from `steps` (paraflex/costs/served_hop.py), each forward hop less its
    hidden state's bytes at the probed hop's bandwidth; printed, None where the log has none."""
    from paraflex.costs.costmodel import CostModel
    from paraflex.costs.served_hop import fit_served_hop

    bandwidth = probed.bandwidth_Bps if probed is not None and probed.bandwidth_Bps else None

    def transfer_s(step: dict) -> float:
        if bandwidth is None:
            return 0.0
        tokens = int(step["prefill_tokens"]) if step["kind"] != "decode" else int(step["batch_size"])
        return CostModel.hidden_bytes(archs[step["model"]], tokens) / bandwidth

    hop = fit_served_hop(steps, rows, host, transfer_s)
    if hop is not None:
        stretched = " x the shared host CPU's stretch" if host else ""
        print(f"served hop to an idle engine, fitted from {hop.hops} logged hops and {hop.tokens} token messages: "
              f"{1000 * hop.latency_s:.2f} ms (+ bytes), token message back {1000 * hop.token_latency_s:.2f} ms"
              f"{stretched}" + (f" (probed hop: {1000 * probed.latency_s:.2f} ms)" if probed else ""))
    return hop


def _describe(e: dict) -> str:
    if "decode_s" not in e:
        return f"{e['model']} {1000 * e['step_s']:.2f} ms"
    return (f"{e['model']} decode {1000 * e['decode_s']:.2f} ms {1e6 * e['decode_per_seq_s']:+.0f} us/request, prefill "
            f"{1000 * e['prefill_s']:.2f} ms {1e6 * e['prefill_per_token_s']:+.1f} us/token")


def _profiled(config, args) -> tuple:
    """(the config with OUTPUT's profile, its system layout on the served placement)."""
    from dataclasses import replace

    from paraflex.config.schema import Config
    from paraflex.placement import Placement
    from paraflex.simulator.runner import SimSettings
    from paraflex.simulator.systems.layouts import build_system

    d = config.to_dict()
    d["cluster"] = {**d["cluster"], "profile_dir": os.path.abspath(args.output)}
    d.pop("workload", None)
    profiled = Config.from_dict(d, source=f"{config.source} with {args.output}")
    layout = build_system(profiled, SimSettings(rate=1.0))
    if args.placement:
        layout = replace(layout, placement=Placement.load_for(args.placement, profiled))
    return profiled, layout


def _loop_lines(profiled, layout, step_log: str, output: str, requests: list[dict]) -> tuple[dict, object, dict]:
    """(the engine loop's lines per model, the shared host CPU or None, how the steps spread
    around them) from the step log against the profiled cost model's stage time of each logged
    step (no engine loop term: OUTPUT's was dropped). On a `device: cpu` cluster the lines are
    fitted on the steps de-stretched by the host CPU fitted with them (paraflex/costs/host_cpu.py)
    over OUTPUT's `host_cores` (this machine's where the profile has none) and the served
    `requests` in flight (none: engines only)."""
    from paraflex.costs.host_cpu import fit_host_cpu, step_stretches
    from paraflex.costs.loop_fit import fit_loop_lines, read_step_log, stage_time_fn, step_spreads

    models = layout.placement.models
    rows = [r for r in read_step_log(step_log) if r["model"] in models]
    archs = {m.name: m.arch for m in profiled.models}
    stage_time = stage_time_fn(profiled.cluster.cost_model(), layout.placement, archs)
    host = None
    if profiled.cluster.device != "cpu" or not rows:
        lines = fit_loop_lines(rows, stage_time)
    else:
        with open(os.path.join(output, "profile.json"), encoding="utf-8") as fh:
            cores = json.load(fh).get(HOST_CORES_KEY) or os.cpu_count() or 1
        host, lines = fit_host_cpu(rows, stage_time, cores, requests)
    return lines, host, step_spreads(rows, stage_time, lines, step_stretches(rows, host, requests))


def _simulated(profiled, layout, rows: list[dict], arrivals: list[float] | None = None) -> list[tuple[float, float]]:
    """The simulated (TTFT without the per-request delays, mean TBT) of each logged request at
    `arrivals` (seconds from the first; None: each alone, a minute apart), with `profiled`'s
    profile on `layout`."""
    from paraflex.simulator.runner import SimSettings, simulate
    from paraflex.simulator.workload import SimRequest

    arrivals = arrivals if arrivals is not None else [60.0 * i for i in range(len(rows))]
    requests = sorted((SimRequest(i, r["model"], t, int(r["prompt_tokens"]), int(r["output_tokens"]))
                       for i, (r, t) in enumerate(zip(rows, arrivals))), key=lambda q: q.arrival)
    metrics = simulate(profiled, SimSettings(rate=1.0), layout=layout, requests=requests).metrics
    done = [metrics.requests[i] for i in range(len(rows))]
    return [(r.first_token - r.arrival - metrics.request_delay,
             (r.last_token - r.first_token) / (r.tokens - 1) if r.tokens > 1 else 0.0) for r in done]
