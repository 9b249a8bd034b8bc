"""Simulator fidelity: the same requests through the real `paraflex serve` (Ray; or with
`--backend in-process` one in-process engine, e.g. on a GPU machine without Ray: fidelity_setup.py)
and through the simulator, compared number by number (issue 20).

One command: profile the models on this machine (or reuse `--profile DIR`; `--no-profile`: the
plain roofline): op tables, per-step residuals and the Ray hop between engines, all read by the
simulator through `cluster.profile_dir`. Plan a config of three models on two engines where
tiny-8l is cut into two stages on different engines and both engines hold stages of several
models, start `paraflex serve` on it (Ray backend, `--request-log`, `--step-log`) and calibrate
on it: a few requests one at a time, the saturation rate (a burst, then open loop at the burst's
rate: the lower of the two), then requests open loop at half of it; from the lone and the
half-load requests and their steps (not the saturation runs') `paraflex profile --gateway-log
--step-log` stores in the profile the Ray engine loop's time per stage step (lines in the step's
size), the shared host CPU (cores' worth per busy engine and per open request), each token's
return path (a latency the host's load stretches) and the per-request
delays (gateway; frontend <-> engines). Then at three loads
(light, ~60% and ~90% of saturation) write a request list (simulator/workload/requests_file.py),
replay it open loop against the server (same arrival times, ignore_eos with fixed output
lengths, token-id prompts of the given lengths) and simulate the same file with the profiled
cost model. Prints per load and model median and P99 of TTFT, TBT (per-request mean) and E2E,
and throughput, real vs simulated with the relative error; writes fidelity.csv and
fidelity_cdfs.png (fidelity_compare.py). Real times start at the HTTP arrival the server logs
(`http_arrival_s`), as the simulator's do with the measured delays. Per load it also prints the
served steps and TTFT parts against the simulator's terms (served_split.py), and warns where
the profile's `noise` says its rounds disagreed. While it serves it samples the server's threads'
CPU and runs a host-speed probe in a process of its own (served_drift.py): it prints the served
steps per time bin beside the threads' cores, and each load window's host speed against the
calibration's. `--warm-in S` serves S seconds at the calibration's load (after the burst) before
calibrating.

    python bench/sim_fidelity.py [--out DIR] [--requests 600] [--runs 1] [--profile DIR | --no-profile]
                                 [--saturation RPS] [--warm-in S] [--tiny] [--resimulate DIR]

`--runs K`: K independent runs (each profiles, calibrates and serves anew) in DIR/run-<k>, then
each all-models error per run and how many runs meet the target (fidelity-runs.csv).
`--resimulate DIR`: serve nothing, simulate an earlier results folder again (its request lists,
server log and windows.json) with `--profile` or its own, e.g. to compare terms on the same
served run. `--tiny` (the CI test): a few requests per load, no profiling (so no served terms).
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import dataclasses
import json
import os
import subprocess
import sys
import time

import httpx
import numpy as np
import yaml

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fidelity_compare import compare, plot_cdfs, print_runs, print_table, write_csv  # noqa: E402
from fidelity_setup import Setup, build_setup  # noqa: E402
from serve_client import one_request  # noqa: E402
from serve_process import ServeProcess  # noqa: E402
from served_drift import HostProbe, ThreadSampler, drift_report, host_speeds  # noqa: E402
from served_split import served_parts, step_split  # noqa: E402

from paraflex.config.schema import Config  # noqa: E402
from paraflex.engine.step_log import FLUSH_EVERY_S, STEP_LOG_COLUMNS  # noqa: E402
from paraflex.costs.serving_terms import measured_hop  # noqa: E402
from paraflex.serving.request_log import LOG_COLUMNS  # noqa: E402
from paraflex.placement import Placement  # noqa: E402
from paraflex.planner import plan  # noqa: E402
from paraflex.simulator.runner import SimSettings, simulate  # noqa: E402
from paraflex.simulator.systems.layouts import build_system  # noqa: E402
from paraflex.simulator.workload import SimRequest  # noqa: E402
from paraflex.simulator.workload.requests_file import load_requests, write_requests  # noqa: E402

LOADS = (("light", 0.2), ("mid", 0.6), ("high", 0.9))  # fractions of the measured saturation rate
CALIBRATION_LOAD = 0.5  # the calibration's open-loop requests, a fraction of the saturation rate
NOISY = 0.5  # a profile whose rounds disagree by more than this share gets a warning


def run(cmd: list[str]) -> str:
    print(f"$ {' '.join(cmd)}", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"sim_fidelity: {cmd[1]} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return done.stdout


def make_requests(setup: Setup, rate: float, n: int, first_id: int, rng) -> list[SimRequest]:
    times = np.cumsum(rng.exponential(1.0 / rate, n))
    times -= times[0]
    models = setup.models
    return [SimRequest(first_id + i, models[int(rng.integers(len(models)))], float(t),
                       int(rng.integers(*setup.prompt_range)), int(rng.integers(*setup.output_range)))
            for i, t in enumerate(times)]


async def replay(setup: Setup, url: str, requests: list[SimRequest], rng) -> tuple[list, float]:
    """Fire every request at its arrival offset (open loop); (client results, start epoch)."""
    prompts = [rng.integers(*setup.token_ids, size=r.prompt_len).tolist() for r in requests]
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=600, limits=limits) as client:
        t0, epoch = time.perf_counter(), time.time()

        async def fire(req, prompt):
            await asyncio.sleep(max(0.0, req.arrival - (time.perf_counter() - t0)))
            return await one_request(client, url, req.model, prompt, req.output_len)

        results = await asyncio.gather(*(fire(r, p) for r, p in zip(requests, prompts)))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise SystemExit(f"sim_fidelity: {len(failed)} request(s) failed against the server, e.g. {failed[0]}")
    return results, epoch


def raw_log(path: str) -> list[dict]:
    with open(path, newline="") as fh:
        return list(csv.DictReader(fh))


def read_log(path: str) -> list[dict]:
    """The server's rows, timed from the HTTP arrival where the gateway stamped one."""
    rows = raw_log(path)
    for r in rows:
        if r.get("http_arrival_s"):
            r["gateway_s"] = float(r["arrival_s"]) - float(r["http_arrival_s"])
            r["arrival_s"] = r["http_arrival_s"]
            r["ttft_s"] = float(r["first_token_s"]) - float(r["arrival_s"])
            r["e2e_s"] = float(r["finish_s"]) - float(r["arrival_s"])
    return rows


def calibrate(setup: Setup, server, log_path: str, out: str, profile: str, rng, n: int, lone: int = 8,
              warm_in: float = 0.0) -> float:
    """Send `lone` requests one at a time, measure the saturation rate (`burst`, which it
    returns), then send 2`n` open loop at CALIBRATION_LOAD of it; store in the profile what the lone and
    the moderate requests measured (`paraflex profile --gateway-log --step-log`, their log rows
    in gateway.csv, their steps in calib-steps/): the engine loop's term, the tokens' return
    path and the per-request delays. The saturation runs' steps are kept apart (burst-steps/): lines
    fitted from them predicted the loads' steps worse (docs/simulate.md, fifth pass). With
    `warm_in` seconds the burst comes first, then that long open loop at CALIBRATION_LOAD, then the
    lone and the moderate requests: a server whose steps change over its first minutes is
    calibrated as the loads will find it (docs/simulate.md, "Fidelity on a GPU")."""
    def alone() -> tuple[float, float]:
        start = time.time()
        for req in make_requests(setup, 1.0, lone, 2 * 10**6, rng):
            asyncio.run(replay(setup, server.url, [dataclasses.replace(req, arrival=0.0)], rng))
        return start, time.time()

    if warm_in > 0:
        start = time.time()
        sat = burst(setup, server, n, rng)
        rate = CALIBRATION_LOAD * sat
        asyncio.run(replay(setup, server.url, make_requests(setup, rate, max(1, round(warm_in * rate)),
                                                            5 * 10**6, rng), rng))
        print(f"warm-in: {time.time() - start:.0f} s (the burst, then {warm_in:.0f} s at {rate:.2f} req/s)",
              flush=True)
        windows = [alone(), (start, time.time())]
    else:
        windows = [alone()]
        sat = burst(setup, server, n, rng)
        windows.append((windows[0][1], time.time()))
    start = time.time()
    asyncio.run(replay(setup, server.url, make_requests(setup, CALIBRATION_LOAD * sat, 2 * n, 3 * 10**6, rng), rng))
    windows.append((start, time.time()))
    calib = (windows[0], windows[2])
    with open(os.path.join(out, "calibration.json"), "w") as fh:
        json.dump({"windows": calib}, fh)  # the host probe's reference (served_drift.host_speeds)
    rows = [r for r in raw_log(log_path) if any(a <= float(r["arrival_s"]) <= b for a, b in calib)]
    path = os.path.join(out, "gateway.csv")
    with open(path, "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=LOG_COLUMNS)
        w.writeheader()
        w.writerows(rows)
    steps = copy_steps(os.path.join(out, "steps"), os.path.join(out, "calib-steps"), calib)
    copy_steps(os.path.join(out, "steps"), os.path.join(out, "burst-steps"), windows[1:2])
    print(f"calibration: {lone} requests alone and {2 * n} at {CALIBRATION_LOAD * sat:.2f} req/s "
          f"({CALIBRATION_LOAD:.0%} of saturation); load average {os.getloadavg()[0]:.2f}", flush=True)
    print(run([sys.executable, "-m", "paraflex", "profile", os.path.join(out, "config.yaml"), "--gateway-log", path,
               "--step-log", steps, "--placement", os.path.join(out, "placement.json"), "-o", profile]).strip(),
          flush=True)
    return sat


def burst(setup: Setup, server, n: int, rng) -> float:
    """The saturation rate (req/s): `n` requests at once give the server's best rate, then 2`n`
    open loop at that rate what it sustains (lower where the engines, gateway and client cannot
    keep up with requests spread out); the lower of the two."""
    requests = [dataclasses.replace(r, arrival=0.0) for r in make_requests(setup, 1.0, max(4, n), 10**6, rng)]
    results, _ = asyncio.run(replay(setup, server.url, requests, rng))
    best = len(results) / max(r.e2e for r in results)
    requests = make_requests(setup, best, 2 * max(4, n), 4 * 10**6, rng)
    results, _ = asyncio.run(replay(setup, server.url, requests, rng))
    sustained = len(results) / max(q.arrival + r.e2e for q, r in zip(requests, results))
    print(f"saturation: {best:.2f} req/s for a burst of {max(4, n)}, {sustained:.2f} req/s sustained at that rate",
          flush=True)
    return min(best, sustained)


def copy_steps(src: str, dst: str, windows) -> str:
    """The engine step rows logged in any of `windows` ((start, end), Unix s), from src/ to dst/."""
    time.sleep(2 * FLUSH_EVERY_S)  # the engines' last rows reach the files
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        rows = [r for r in raw_log(os.path.join(src, name)) if any(a <= float(r["start_s"]) <= b for a, b in windows)]
        with open(os.path.join(dst, name), "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=STEP_LOG_COLUMNS)
            w.writeheader()
            w.writerows(rows)
    return dst


def warn_noise(profile: str) -> None:
    """Say where the profile's rounds disagreed or points had to be pooled (profile.json `noise`)."""
    with open(os.path.join(profile, "profile.json")) as fh:
        noise = json.load(fh).get("noise", {})
    for model, n in noise.get("steps", {}).items():
        worst = max(n["prefill_spread"], n["decode_spread"])
        if worst > NOISY or n["adjusted"]:
            print(f"warning: profile of {model}: step timings' blocks disagree by up to {worst:.0%}"
                  + (f"; pooled to stay monotone: {', '.join(n['adjusted'])}" if n["adjusted"] else "")
                  + " (a busy machine: profile again in a quieter minute)", flush=True)
    for model, n in noise.get("ops", {}).items():
        if n["spread"] > NOISY or n["adjusted"]:
            print(f"warning: op table of {model}: typical spread {n['spread']:.0%}, {len(n['adjusted'])} point(s) "
                  f"pooled to stay monotone in tokens", flush=True)


def simulated_rows(config, placement, requests: list[SimRequest]) -> list[dict]:
    settings = SimSettings(rate=1.0)
    layout = dataclasses.replace(build_system(config, settings), placement=placement)
    result = simulate(config, settings, layout=layout, requests=requests)
    rows = result.metrics.request_rows()
    header = next(rows)
    return [dict(zip(header, row)) for row in rows]


def serve_loads(setup: Setup, args, out: str, config_path: str, placement_path: str, profile: str | None,
                n: int) -> list[dict]:
    """Start the server, calibrate (with a profile), replay the three loads' request lists open
    loop and stop it; the windows ({load, start, end, client_ttft_s}), also in windows.json."""
    base = yaml.safe_load(open(config_path))
    max_context = {m.name: m.arch.max_context for m in Config.from_dict(base, source=config_path, base_dir=out).models}
    log_path = os.path.join(out, "served_requests.csv")
    server = ServeProcess(config_path, backend=setup.backend, who="sim_fidelity", echo=True,
                          log_path=os.path.join(out, "serve.log"),
                          extra_args=("--placement", placement_path, "--request-log", log_path,
                                      "--step-log", os.path.join(out, "steps")))
    sampler = ThreadSampler(server.proc.pid, os.path.join(out, "threads.csv"))
    probe = HostProbe(os.path.join(out, "host.csv"))
    rng = np.random.default_rng(args.seed)
    windows = []
    try:
        measured = calibrate(setup, server, log_path, out, profile, rng, n, warm_in=args.warm_in) if profile else None
        sat = args.saturation or measured or burst(setup, server, n, rng)
        for i, (load, frac) in enumerate(LOADS):
            path = os.path.join(out, f"requests-{load}.csv")
            write_requests(path, make_requests(setup, frac * sat, n, i * n, rng))
            requests = load_requests(path, max_context).requests  # replay what the file says
            print(f"{load}: {n} requests at {frac * sat:.2f} req/s ({frac:.0%} of saturation); "
                  f"load average {os.getloadavg()[0]:.2f}", flush=True)
            results, epoch = asyncio.run(replay(setup, server.url, requests, rng))
            windows.append({"load": load, "start": epoch, "end": time.time(),
                            "client_ttft_s": float(np.median([r.ttft for r in results]))})
    finally:
        probe.stop()
        sampler.stop()
        server.stop()
    print_pauses(os.path.join(out, "serve.log"))
    print(drift_report(out), flush=True)
    with open(os.path.join(out, "windows.json"), "w") as fh:
        json.dump(windows, fh, indent=1)
    return windows


def print_pauses(serve_log: str) -> None:
    """The server's garbage-collection pauses (engine/gc_heap.py): how many were long, and its totals."""
    with open(serve_log) as fh:
        lines = [line.strip() for line in fh if "garbage collection" in line]
    long = [line for line in lines if line.startswith("warning:")]
    print(f"server: {len(long)} long garbage-collection pause(s)" + (f", e.g. {long[0]}" if long else "")
          + "".join(f"; {line}" for line in lines if not line.startswith("warning:")), flush=True)


def report(out: str, profile: str | None, windows: list[dict]) -> list[dict]:
    """Simulate each window's request list (with `profile`) and compare it with the server log;
    prints the per-window split and the table, writes fidelity.csv and fidelity_cdfs.png in
    `out`; the comparison rows."""
    base = yaml.safe_load(open(os.path.join(out, "config.yaml")))
    config = Config.from_dict(base, source=os.path.join(out, "config.yaml"), base_dir=out)
    placement = Placement.load_for(os.path.join(out, "placement.json"), config)
    log_path, steps = os.path.join(out, "served_requests.csv"), os.path.join(out, "steps")
    served = read_log(log_path)
    # the simulator reads the whole profile (tables, residuals, hop, gateway) through profile_dir
    sim_config = Config.from_dict({**base, "cluster": {**base["cluster"], "profile_dir": profile}} if profile else base,
                                  source="sim-fidelity" + (" (profiled)" if profile else ""), base_dir=out)
    max_context = {m.name: m.arch.max_context for m in config.models}
    rows, runs = [], []
    print()
    for w in windows:
        load, start, end = w["load"], w["start"], w["end"]
        requests = load_requests(os.path.join(out, f"requests-{load}.csv"), max_context).requests
        real = [r for r in served if start <= float(r["arrival_s"]) <= end]
        sim = simulated_rows(sim_config, placement, requests)
        rows += compare(load, real, sim)
        runs.append((load, real, sim))
        log_ttft = float(np.median([float(r["ttft_s"]) for r in real]))
        gateway = [r["gateway_s"] for r in real if "gateway_s" in r]
        split = f"gateway (HTTP arrival -> frontend) {1000 * float(np.median(gateway)):.1f} ms; " if gateway else ""
        if profile and os.path.isdir(steps):
            print(f"{load}: {step_split(sim_config, placement, steps, start, end, log_path)}")
            print(f"{load}: {served_parts(log_path, steps, {r['id'] for r in real}, start, end, profile)}")
        print(f"{load}: {len(real)}/{len(requests)} logged; {split}median TTFT at the client "
              f"{1000 * w['client_ttft_s']:.1f} ms vs {1000 * log_ttft:.1f} ms in the server log: client + HTTP "
              f"transport + response path {1000 * (w['client_ttft_s'] - log_ttft):.1f} ms")
    print_host_speeds(out, windows)
    print()
    print_table(rows)
    write_csv(os.path.join(out, "fidelity.csv"), rows)
    png = plot_cdfs(os.path.join(out, "fidelity_cdfs.png"), runs)
    print(f"results: {out}/fidelity.csv, " + (png or "no PNG (matplotlib is not installed)"))
    return rows


def print_host_speeds(out: str, windows: list[dict]) -> None:
    """Each load window's host CPU speed against the calibration's (bench/served_drift.py's probe),
    where the run has both."""
    calibration = os.path.join(out, "calibration.json")
    if not os.path.isfile(calibration):
        return
    with open(calibration) as fh:
        reference = [tuple(w) for w in json.load(fh)["windows"]]
    speeds = host_speeds(os.path.join(out, "host.csv"), reference, {w["load"]: (w["start"], w["end"]) for w in windows})
    if speeds:
        print("host speed against the calibration's (a pure-Python probe in its own process; below 1: slower; "
              "where the server keeps every core busy it includes the wait for one): "
              + ", ".join(f"{load} {v:.2f}" for load, v in speeds.items()))


def one_run(args, out: str, n: int) -> list[dict]:
    """Profile (unless reused or off), serve, calibrate, replay and compare into `out`."""
    os.makedirs(out, exist_ok=True)
    setup = build_setup(args.backend, args.shapes, out)
    config_path = os.path.join(out, "config.yaml")
    with open(config_path, "w") as fh:
        yaml.safe_dump(setup.config, fh)
    placement = plan(Config.from_dict(setup.config, source=config_path, base_dir=out))
    placement_path = os.path.join(out, "placement.json")
    placement.save(placement_path)
    print(f"{setup.backend} backend, cluster device {setup.config['cluster']['device']}, "
          f"{setup.config['cluster']['num_engines']} engine(s):")
    for name, mp in placement.models.items():
        print(f"  {name}: {mp.num_stages} stage(s), replicas on engines {mp.replicas}")
    profile = None
    if not (args.no_profile or args.tiny):
        profile = os.path.abspath(args.profile or os.path.join(out, "profile"))
        if not args.profile:
            hop = ["--no-hop"] if setup.backend == "in-process" else []  # one engine: no hop, and maybe no Ray
            run([sys.executable, "-m", "paraflex", "profile", config_path, "-o", profile, "--tokens",
                 setup.profile_tokens, "--repeats", "10", "-q", *hop])
        warn_noise(profile)
        hop = measured_hop(profile)
        if hop is not None:
            print(f"hop between engines (profiled): {1e6 * hop.latency_s:.0f} µs", flush=True)
    windows = serve_loads(setup, args, out, config_path, placement_path, profile, n)
    return report(out, profile, windows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default="sim-fidelity-results", help="results folder")
    ap.add_argument("--requests", type=int, default=600,
                    help="requests per load (default 600: the saturation burst is 600 and the 2-vCPU machine's "
                         "load windows last 16-90 s; with 200 the burst overstated the sustainable rate 2x and the "
                         "windows lasted 3-18 s, one host-speed regime each: docs/simulate.md)")
    ap.add_argument("--runs", type=int, default=1, help="independent runs, each profiling anew (default 1)")
    ap.add_argument("--profile", help="reuse this `paraflex profile` folder instead of profiling now")
    ap.add_argument("--no-profile", action="store_true", help="simulate with the plain roofline")
    ap.add_argument("--saturation", type=float, help="saturation rate in req/s (default: measure it, `burst`)")
    ap.add_argument("--resimulate", metavar="DIR", help="serve nothing: simulate the results folder DIR of an earlier "
                    "run again (with --profile, or DIR/profile) and compare it with its server log")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warm-in", type=float, default=0.0, metavar="S",
                    help="serve S seconds at the calibration's load before calibrating (after the burst), so "
                         "that a server whose steps change over its first minutes is calibrated as the loads "
                         "find it (default 0)")
    ap.add_argument("--backend", choices=("ray", "in-process"), default="ray",
                    help="ray: two engine actors, a model cut over both (default); in-process: one engine holding "
                         "every model (`serve --in-process`, e.g. on a GPU machine without Ray)")
    ap.add_argument("--shapes", choices=("builtin", "random-real", "random-small"), default="builtin",
                    help="builtin: tiny-2l/4l/8l (default); random-real: random-weight Llama checkpoints of real "
                         "shapes (0.4-1.1B, for a GPU); random-small: the same at toy sizes (a CPU dry run)")
    ap.add_argument("--tiny", action="store_true", help="CI size: 3 requests per load, no profiling")
    args = ap.parse_args(argv)
    n = 3 if args.tiny else args.requests
    wall0 = time.perf_counter()
    print(f"machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    if args.resimulate:
        out = os.path.abspath(args.resimulate)
        profile = os.path.abspath(args.profile or os.path.join(out, "profile"))
        with open(os.path.join(out, "windows.json")) as fh:
            report(out, profile if os.path.isdir(profile) and not args.no_profile else None, json.load(fh))
        return 0
    out = os.path.abspath(args.out)
    if args.runs == 1:
        one_run(args, out, n)
    else:
        per_run = []
        for k in range(args.runs):
            print(f"\n=== run {k + 1} of {args.runs}; load average {os.getloadavg()[0]:.2f}", flush=True)
            run_args = argparse.Namespace(**{**vars(args), "seed": args.seed + k})
            per_run.append(one_run(run_args, os.path.join(out, f"run-{k + 1}"), n))
        print_runs(per_run)
        write_csv(os.path.join(out, "fidelity-runs.csv"), [{**r, "run": k + 1} for k, rows in enumerate(per_run)
                                                           for r in rows])
    print(f"wall {time.perf_counter() - wall0:.0f} s; load average {os.getloadavg()[0]:.2f} at the end")
    return 0


if __name__ == "__main__":
    sys.exit(main())
