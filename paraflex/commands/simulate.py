"""`paraflex simulate CONFIG`: the cluster simulator from the command line.

One run: `--system NAME --rate R` -> results directory (requests.csv, summary.json,
config.json, placement.json, PNGs; paraflex.simulator.metrics.output). `--sweep` runs a list of rates
(`--rates`) for a list of systems (`--systems`) across processes and draws Fig. 8/9-style
curves (paraflex.simulator.sweep). Workload knobs override the config's `workload:` section.
Bad input (unknown system, rate <= 0, missing trace, malformed trace rows) is a one-line
error with exit status 2.
"""

from __future__ import annotations

import dataclasses
import math
import os

from paraflex.errors import UserError

NAME = "simulate"
HELP = "simulate serving a config on a cluster (cost model, no GPU): latency, throughput, SLOs"


def add_arguments(p) -> None:
    p.add_argument("config", help="cluster + models (+ workload) YAML/JSON config")
    p.add_argument("--system", help="paraflex | ray-serve | sarathi | alpaserve | vllm-tp | aegaeon | prism | muxserve "
                   "(default paraflex)")
    p.add_argument("--rate", type=float, help="total request rate over all models, req/s (default: workload.rate)")
    p.add_argument("-o", "--output", help="results directory (default sim-results/<system>-r<rate> or sim-results/sweep)")
    p.add_argument("--seed", type=int, help="random seed of the workload and random placement (default: workload.seed)")
    p.add_argument("--sweep", action="store_true", help="run --rates x --systems and plot latency versus throughput")
    p.add_argument("--rates", help="comma-separated rates for --sweep, e.g. 1,2,4,8")
    p.add_argument("--systems", help="comma-separated systems for --sweep (default: all five); "
                   "add ablations with +, e.g. paraflex+prefill-first,paraflex+no-sharding")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="worker processes for --sweep")
    p.add_argument("--seeds", type=int, default=1, help="--sweep: independent draws per rate (default 1); curves show their mean")
    p.add_argument("--requests", metavar="FILE",
                   help="replay exactly these requests: a CSV of model,arrived_at,num_prefill_tokens,num_decode_tokens "
                        "[,request_id] (docs/simulate.md); replaces the workload, so no --rate or workload overrides")
    w = p.add_argument_group("workload overrides")
    w.add_argument("--trace", help="replay a shipped trace (splitwise-conv, splitwise-code) or this "
                   "arrived_at,num_prefill_tokens,num_decode_tokens CSV")
    w.add_argument("--arrival", choices=("poisson", "lognormal", "trace"))
    w.add_argument("--cv", type=float, help="log-normal inter-arrival coefficient of variation")
    w.add_argument("--zipf-alpha", type=float, help="Zipf popularity exponent over the listed models")
    w.add_argument("--num-requests", type=int, help="expected number of requests (sets the arrival window)")
    w.add_argument("--duration", type=float, help="arrival window in seconds (instead of --num-requests)")
    w.add_argument("--prompt-scale", type=float, help="multiply prompt lengths (§8.3)")
    w.add_argument("--output-scale", type=float, help="multiply output lengths (§8.3)")
    a = p.add_argument_group("ablations (§8.5) and knobs")
    a.add_argument("--no-sharding", action="store_true", help="paraflex with one shared sharding plan on every engine")
    a.add_argument("--random-placement", action="store_true", help="paraflex sharding/replication, stages placed at random")
    a.add_argument("--prefill-first", action="store_true", help="prefill-first scheduling instead of the system's policy")
    a.add_argument("--pipeline-first", action="store_true",
                   help="paraflex: a multi-stage model's decode batches ahead of prefills and other decode batches "
                        "(scheduler.policy: pipeline-first)")
    a.add_argument("--unbounded-decode-batches", action="store_true",
                   help="the paper's full-batch-first: no bound on a pipeline's decode batches in flight "
                        "(scheduler.decode_batches_in_flight: unbounded)")
    a.add_argument("--paper-replication", action="store_true",
                   help="paraflex: the paper's Alg. 1 stop, no replicas for the other models once the chosen one is full "
                        "(planner.fill_engines: false)")
    a.add_argument("--work-shares", action="store_true",
                   help="paraflex: Alg. 1's shares by rate x weight bytes instead of the paper's rate x stage count "
                        "(planner.replica_shares: work)")
    a.add_argument("--memory-only-placement", action="store_true",
                   help="paraflex: the paper's Alg. 2 placement, without the swaps that even the engines' compute load "
                        "(planner.balance_compute: false)")
    a.add_argument("--one-prompt-prefills", action="store_true",
                   help="paraflex: the paper's one prompt per prefill batch instead of packing waiting prompts "
                        "(scheduler.pack_prompts: false)")
    a.add_argument("--no-head-start", action="store_true",
                   help="paraflex: ignore the config's scheduler.head_start_s (queues in arrival order, the paper's)")
    a.add_argument("--prefill-engines", type=int, help="aegaeon: engines in the prefill pool (default: the paper's 6:10 split)")
    g = p.add_argument_group("GPUs-needed search (Prism Table 1)")
    g.add_argument("--find-min-engines", type=float, metavar="TARGET",
                   help="find the fewest engines at which --system reaches this attainment (e.g. 0.99)")
    g.add_argument("--attainment", default="slo", choices=("slo", "ttft", "tpot"),
                   help="what --find-min-engines measures: token SLO (default), per-request TTFT or TPOT attainment")
    g.add_argument("--max-engines", type=int, help="--find-min-engines: largest cluster tried (default cluster.num_engines)")
    a.add_argument("--host-link-gbps", type=float, default=256.0, help="host<->GPU bandwidth per GPU for KV swaps")
    a.add_argument("--check-invariants", action="store_true", help="check KV accounting after every stage (slow)")
    a.add_argument("--no-fast-forward", action="store_true",
                   help="simulate every decode step as events (same results, slower; for checking)")
    r = p.add_argument_group("live re-planning (docs/simulate.md)")
    r.add_argument("--replan-interval", type=float, metavar="S",
                   help="re-plan the placement every S simulated seconds from measured rates (off by default)")
    r.add_argument("--replan-threshold", type=float, default=0.5,
                   help="also re-plan when a model's rate moves by more than this share (default 0.5)")
    r.add_argument("--replan-hysteresis", type=float, default=0.1,
                   help="keep the placement unless the objective improves by more than this share (default 0.1)")
    r.add_argument("--rate-schedule", metavar="FILE",
                   help="YAML/JSON: per-model rate multipliers over time (steps, ramp, diurnal)")


def _workload(args, config):
    from paraflex.config.schema import WorkloadConfig
    from paraflex.shipped import TRACES, trace_path
    from paraflex.simulator.workload.trace import load_trace

    w = config.workload or WorkloadConfig()
    changes = {}
    if args.trace is not None:
        trace = trace_path(args.trace)
        if not os.path.isfile(trace):
            raise UserError(f"--trace {args.trace}: file not found; pass {' or '.join(TRACES)}, or an "
                            "arrived_at,num_prefill_tokens,num_decode_tokens CSV")
        changes["trace"] = os.path.abspath(trace)
        changes["arrival"] = "trace"
    if args.arrival is not None:  # (argparse checked the choice)
        changes["arrival"] = args.arrival
    for flag, field in (("cv", "cv"), ("zipf_alpha", "zipf_alpha"), ("num_requests", "num_requests"),
                        ("duration", "duration_s"), ("prompt_scale", "prompt_scale"), ("output_scale", "output_scale")):
        v = getattr(args, flag)
        if v is not None:
            if not 0 < v < math.inf:
                raise UserError(f"--{flag.replace('_', '-')} must be a finite number > 0, got {v:g}")
            changes[field] = v
    if "num_requests" in changes:
        changes["duration_s"] = None  # the flag sets the window; the config's duration yields
    elif "duration_s" in changes:
        changes["num_requests"] = None
    w = dataclasses.replace(w, **changes)
    if "zipf_alpha" in changes:  # the planner reads the models' rates: the loader's Zipf shares, redone
        w.write_zipf_rates(config.models)
    if w.arrival == "trace" and not w.trace:
        raise UserError("--arrival trace needs a trace: pass --trace FILE or set workload.trace")
    if w.trace:
        load_trace(w.trace)  # validate rows now: one clear error before any planning
    return w


def _floats(text: str, flag: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UserError(f"{flag} {text!r}: expected comma-separated numbers, e.g. 1,2,4") from None
    if not vals:
        raise UserError(f"{flag}: give at least one value")
    bad = [v for v in vals if not 0 < v < math.inf]
    if bad:
        raise UserError(f"{flag}: rates must be finite numbers > 0 requests/s, got {bad[0]:g}")
    return vals


def run(args) -> int:
    from paraflex.config.schema import load_config
    from paraflex.simulator.systems.layouts import SYSTEMS
    from paraflex.simulator.workload.generator import check_request_count

    config = load_config(args.config)
    if args.requests is not None:
        return _run_requests(config, args)
    config.workload = _workload(args, config)
    seed = args.seed if args.seed is not None else config.workload.seed
    base = _settings(args, 1.0, seed)
    if args.sweep:
        from paraflex.simulator.sweep import run_sweep

        one_run = [f for f, given in (("--system", args.system is not None), ("--rate", args.rate is not None)) if given]
        if one_run:
            plural = {"--system": "--systems", "--rate": "--rates"}[one_run[0]]
            raise UserError(f"{one_run[0]} applies to one run only; with --sweep give {plural} (comma-separated)")
        if not args.rates:
            raise UserError("--sweep needs --rates, e.g. --rates 1,2,4,8")
        rates = _floats(args.rates, "--rates")
        systems = [s.strip() for s in args.systems.split(",") if s.strip()] if args.systems is not None else list(SYSTEMS_ORDER)
        if not systems:
            raise UserError("--systems: give at least one system, e.g. --systems paraflex,ray-serve (or leave it out: all five)")
        for s in systems:
            SYSTEMS.get(s.split("+")[0], "--systems")
        for rate in rates:
            check_request_count(config.workload, rate)
        out = _output_dir(args.output or os.path.join("sim-results", "sweep"))
        results = run_sweep(config, systems, rates, base, out, jobs=max(1, args.jobs), replicates=args.seeds)
        print(f"{'system':<10} {'rate':>6} {'seed':>6} {'tput req/s':>10} {'E2E med s':>10} {'E2E P99 s':>10} {'SLO att.':>8}")
        for r in results:
            print(f"{r['system']:<10} {r['rate']:>6g} {r['seed']:>6} {_num(r['throughput_rps'], 10)} {_num(r['e2e_median_s'], 10)} "
                  f"{_num(r['e2e_p99_s'], 10)} {_num(r['slo_attainment'], 8)}")
        print(f"results: {out}/ (sweep.csv, sweep.json, latency_vs_throughput.png, per_model.png)")
        return 0
    sweep_only = [f for f, given in (("--rates", args.rates is not None), ("--systems", args.systems is not None),
                                     ("--seeds", args.seeds != 1)) if given]
    if sweep_only:
        raise UserError(f"{sweep_only[0]} applies to --sweep only; add --sweep (one run takes --system and --rate)")
    rate = args.rate if args.rate is not None else config.workload.rate
    if rate is None:
        raise UserError("give --rate R (total requests/s) or set workload.rate in the config")
    SYSTEMS.get(base.system, "--system")
    if args.find_min_engines is not None:
        return _find_min_engines(config, dataclasses.replace(base, rate=rate), args)
    return _run_one(config, dataclasses.replace(base, rate=rate), args.output, _schedules(args.rate_schedule, config))


def _schedules(path, config):
    """The --rate-schedule file's per-model schedules (None without the flag)."""
    if path is None:
        return None
    from paraflex.config.file import read_config_file
    from paraflex.simulator.workload.schedule import parse_schedules

    raw = read_config_file(path)
    return parse_schedules(raw, [m.name for m in config.models])


def _settings(args, rate: float, seed: int):
    from paraflex.simulator.runner import SimSettings

    return SimSettings(system=args.system or "paraflex", rate=rate, seed=seed, no_sharding=args.no_sharding,
                       random_placement=args.random_placement, prefill_first=args.prefill_first,
                       pipeline_first=args.pipeline_first,
                       unbounded_decode_batches=args.unbounded_decode_batches, paper_replication=args.paper_replication,
                       work_shares=args.work_shares, memory_only_placement=args.memory_only_placement,
                       one_prompt_prefills=args.one_prompt_prefills, no_head_start=args.no_head_start,
                       host_link_gbps=args.host_link_gbps, check_invariants=args.check_invariants,
                       prefill_engines=args.prefill_engines,
                       fast_forward=not args.no_fast_forward, replan_interval=args.replan_interval,
                       replan_threshold=args.replan_threshold, replan_hysteresis=args.replan_hysteresis)


def _find_min_engines(config, settings, args) -> int:
    from paraflex.simulator.min_engines import find_min_engines

    settings.validate()
    best, tries = find_min_engines(config, settings, args.find_min_engines, args.attainment, args.max_engines)
    print(f"{'engines':>7} {args.attainment + ' att.':>10}  note")
    for n in sorted(tries):
        print(f"{n:>7} {tries[n][0]:>10.3f}  {tries[n][1][:90]}")
    if best is None:
        print(f"{settings.system}: {args.attainment} attainment {args.find_min_engines:g} not met with "
              f"{max(tries)} engines; raise --max-engines")
    else:
        print(f"{settings.system}: {best} engines x {config.cluster.tp} GPUs reach {args.attainment} attainment "
              f">= {args.find_min_engines:g} at {settings.rate:g} req/s")
    return 0


SYSTEMS_ORDER = ("paraflex", "ray-serve", "sarathi", "alpaserve", "vllm-tp")


def _output_dir(path: str) -> str:
    """The results directory, made now."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        _cannot_make(path, exc.strerror or str(exc))
    return path


def _check_output_dir(path: str) -> None:
    """Fail now, making nothing, when `path` cannot become the results directory: it, or the
    nearest folder above it that exists, is not a directory one can write into."""
    existing = path
    while existing and not os.path.exists(existing):
        existing = os.path.dirname(existing)
    existing = existing or "."
    if not os.path.isdir(existing):
        _cannot_make(path, "File exists" if existing == path else f"{existing} is not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        _cannot_make(path, "Permission denied")


def _cannot_make(path: str, reason: str):
    raise UserError(f"-o {path}: cannot make the results directory ({reason}); pass a directory path you can write")


def _num(v, width: int) -> str:
    """A sweep table cell: n/a where a point finished no request."""
    return f"{v:>{width}.3f}" if v is not None else f"{'n/a':>{width}}"


REQUESTS_EXCLUDE = ("sweep", "rate", "rates", "systems", "trace", "arrival", "cv", "zipf_alpha", "num_requests",
                    "duration", "prompt_scale", "output_scale", "rate_schedule")


def _run_requests(config, args) -> int:
    """`--requests FILE`: one run replaying the file's requests exactly."""
    from paraflex.simulator.workload.requests_file import load_requests

    given = [f for f in REQUESTS_EXCLUDE if getattr(args, f) not in (None, False)]
    if given:
        raise UserError(f"--{given[0].replace('_', '-')} does not apply with --requests: the file sets every arrival "
                        "and length; leave it out")
    listed = load_requests(args.requests, {m.name: m.arch.max_context for m in config.models})
    if listed.reordered:
        print(f"note: {listed.reordered} row(s) of {args.requests} were out of arrival order; replaying them sorted "
              "by arrived_at")
    reqs = listed.requests
    span = reqs[-1].arrival - reqs[0].arrival
    rate = len(reqs) / span if span > 0 else float(len(reqs))  # the file's mean rate, for the summary
    seed = args.seed if args.seed is not None else (config.workload.seed if config.workload else 0)
    settings = _settings(args, rate, seed)
    from paraflex.simulator.systems.layouts import SYSTEMS

    SYSTEMS.get(settings.system, "--system")
    return _run_one(config, settings, args.output, requests=reqs)


def _run_one(config, settings, output, requests=None, schedules=None) -> int:
    from paraflex.simulator.metrics.output import write_run
    from paraflex.simulator.progress import RunProgress
    from paraflex.simulator.runner import simulate

    settings.validate()
    out = output or os.path.join("sim-results", f"{settings.system}-r{settings.rate:g}")
    _check_output_dir(out)
    progress = RunProgress(settings.system)
    try:
        result = simulate(config, settings, requests=requests, progress=progress, schedules=schedules)
    finally:
        progress.close()
    write_run(_output_dir(out), result)  # made only now: a run that fails leaves no empty folder
    s = result.summary
    if not s["finished"]:
        print(f"{s['system']}: the workload drew {s['requests']} requests (rate x window too small, or a very bursty CV): "
              f"nothing to measure; raise --num-requests / --duration")
        print(f"results: {out}/")
        return 0
    print(f"{s['system']}: {s['finished']}/{s['requests']} requests, {s['engines']} engines x {result.layout.gpus_per_engine} GPUs, "
          f"simulated {s['simulated_s']:.1f} s in {s['wall_s']:.1f} s wall ({s['events']} events)")
    print(f"  throughput {s['throughput_rps']:.3f} req/s, {s['throughput_tok_s']:.1f} tok/s; goodput {s['goodput_rps']:.3f} req/s; "
          f"SLO attainment {s['slo_attainment']:.3f}")
    print(f"  E2E median {s['e2e_median_s']:.3f} s, P99 {s['e2e_p99_s']:.3f} s; TTFT median {s['ttft_median_s']:.3f} s, "
          f"P99 {s['ttft_p99_s']:.3f} s; TBT median {1000 * (s['tbt_median_s'] or 0):.1f} ms, P99 {1000 * (s['tbt_p99_s'] or 0):.1f} ms")
    print(f"  active GPUs {100 * s['active_gpu_share_mean']:.1f}% mean; decode batch {s['decode_batch_size_mean']:.1f} mean; "
          f"swaps out/in {s['swap_outs']}/{s['swap_ins']}")
    for m, pm in s["per_model"].items():
        if pm["finished"]:
            print(f"  {m:<28} {pm['finished']:>6} req  E2E median {pm['e2e_median_s']:.3f} s  P99 {pm['e2e_p99_s']:.3f} s")
    live = s.get("live_replanning")
    if live is not None:
        print(f"  live re-planning: {live['replans']} changes, {live['replica_adds']} replicas added, "
              f"{live['replica_removes']} removed, {live['moved_weight_bytes'] / 2**30:.1f} GiB of weights loaded")
    print(f"results: {out}/ (requests.csv, summary.json, config.json, placement.json, *.png)")
    return 0
