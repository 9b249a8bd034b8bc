"""Start-up of the Ray serving path: Ray, one engine actor per placement engine, the process
groups, and the gateway backend (`paraflex serve` without `--in-process`).

Data flow: `start_cluster(config, placement)` starts a local Ray instance in a temp dir (or joins
`ray_address`, or uses the Ray already initialised in this process), reserves the engines'
nodes with placement groups (paraflex.serving.ray_nodes), creates one `EngineActor`
per placement engine (paraflex.engine.ray_engine) and the `OutputRouter`, prints each engine's
start-up progress, then builds one torch.distributed process group per model replica
(paraflex.engine.transport.ray) through `RayEngines` (paraflex.serving.ray_engines) and returns a
`RayBackend` (paraflex.serving.ray_backend), which serves requests and watches for engine faults.
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from typing import Callable

import ray

from paraflex.engine.ray_engine import FAILED, READY, engine_actor_class
from paraflex.engine.ray_output import OutputRouter
from paraflex.engine.transport.ray import start_store
from paraflex.engine.transport.ray_groups import is_loopback
from paraflex.errors import ParaflexError, UserError
from paraflex.planner.validate import require_valid_layout
from paraflex.serving.ray_backend import RayBackend
from paraflex.serving.ray_engines import RayEngines
from paraflex.serving.ray_join import join_ray
from paraflex.serving.ray_nodes import reserve_nodes


def _print(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


LOOPBACK = "127.0.0.1"


def bind_host(gateway_host: str | None, starts_local_ray: bool) -> str | None:
    """The address what `paraflex serve` starts listens on: loopback when it starts its own Ray
    and the gateway is on loopback (nothing else reaches the engines then); None otherwise (the
    node's cluster address, as Ray picks it)."""
    return LOOPBACK if starts_local_ray and gateway_host is not None and is_loopback(gateway_host) else None


def keep_ray_on_loopback() -> None:
    """Make the local Ray instance started next in this process keep its node IP 127.0.0.1.
    `ray.init(_node_ip_address="127.0.0.1")` alone does not: Ray 2.60 replaces a loopback node IP
    by the machine's routable address (`services.resolve_ip_for_localhost`) unless
    RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER is off (`ray_constants.ENABLE_RAY_CLUSTER`, read once at
    import, so it is set here too). With it off, the GCS, raylet, core workers and dashboard
    agent bind 127.0.0.1 instead of the wildcard address (measured: 0 of 9 listeners on the
    wildcard, 7 of 10 without)."""
    from ray._private import ray_constants

    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"  # Ray's processes read it at start-up
    ray_constants.ENABLE_RAY_CLUSTER = False  # this process imported it already


def _init_ray(ray_address: str | None, progress, gateway_host: str | None,
              runtime_env: dict | None = None) -> tuple[str | None, str | None]:
    """Connect to Ray; returns the temp dir when this call started a local instance (else None)
    and the bind host (`bind_host`). `runtime_env` goes to the local instance this call starts."""
    os.environ.setdefault("RAY_DISABLE_IMPORT_WARNING", "1")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():
        return None, None
    if ray_address:
        progress(f"paraflex: joining Ray at {ray_address}")
        join_ray(ray_address)
        return None, None
    host = bind_host(gateway_host, starts_local_ray=True)
    # Ray runs its workers at nice 15 (a background priority for batch tasks); engine actors
    # serve requests, so they run at the gateway's priority. On the 2-core VM shared with other
    # jobs, nice 15 left the engine a fraction of a core beside nice-0 processes (vLLM's worker).
    os.environ.setdefault("RAY_worker_niceness", "0")
    if host == LOOPBACK:
        keep_ray_on_loopback()
    ray_dir = tempfile.mkdtemp(prefix="paraflex-ray-")
    progress(f"paraflex: starting a local Ray instance (temp dir {ray_dir}"
             + (f", on {host} only)" if host else ")"))
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False,
             configure_logging=False, _temp_dir=ray_dir, _node_ip_address=host, runtime_env=runtime_env)
    return ray_dir, host


def start_cluster(config, placement=None, ray_address: str | None = None,
                  progress: Callable[[str], None] = _print, *, device: str = "auto",
                  dtype: str = "auto", kv_bytes: int | None = None, max_restarts: int = 0,
                  seed: int = 0, startup_timeout_s: float = 900.0,
                  gateway_host: str | None = None, runtime_env: dict | None = None) -> RayBackend:
    """Start (or join) Ray, one engine actor per placement engine, the process groups and the
    output router; returns the gateway `Backend`. `placement=None` plans with the paraflex
    planner. `max_restarts`: how often Ray may restart a dead engine actor (0: never).
    `gateway_host`: the gateway's --host; on loopback, a local Ray instance this call starts and
    the process groups' store listen on 127.0.0.1 only (`bind_host`). `runtime_env`: Ray's
    runtime environment of the workers, when this call starts Ray (bench/ttft_split.py's probe)."""
    if max_restarts < 0:
        raise UserError(f"max_restarts: {max_restarts} is negative; use 0 (never) or more")
    if placement is None:
        from paraflex.planner import plan

        progress(f"paraflex: planning {len(config.models)} model(s) on {config.cluster.num_engines} engine(s)")
        placement = plan(config)
    else:
        for problem in require_valid_layout(placement, config, required=[]):  # serves what it places
            progress(f"paraflex: warning: placement: {problem}")
    ray_dir, host = _init_ray(ray_address, progress, gateway_host, runtime_env)
    actors: dict = {}
    router = nodes = None
    try:
        n = placement.num_engines
        res = ray.cluster_resources()
        use_gpu = device != "cpu" and res.get("GPU", 0) >= n
        if device.startswith("cuda") and not use_gpu:
            raise UserError(f"device: {device!r} needs {n} GPU(s) in the Ray cluster; it has "
                            f"{res.get('GPU', 0):g}; use --device cpu")
        cpus = res.get("CPU", 1.0) / n
        planned = placement.params.get("nodes") or config.cluster.nodes  # (a placement made without them)
        nodes = reserve_nodes(n, list(planned) if planned and sum(planned) == n else None, use_gpu)
        actor_cls = engine_actor_class(nodes.cpu_share, 1 if use_gpu else 0, max_restarts)
        router = OutputRouter.remote()
        for e in range(n):
            actors[e] = actor_cls.options(scheduling_strategy=nodes.strategy(e)).remote(
                e, config, placement, router, device="cuda:0" if use_gpu else "cpu", dtype=dtype,
                kv_bytes=kv_bytes, seed=seed, num_threads=max(1, int(cpus)))
        progress(f"paraflex: {n} engine actor(s) on {'one GPU each' if use_gpu else f'{nodes.cpu_share:g} CPU each'}")
        progress(f"paraflex: engines on nodes: {nodes.describe()}")
        statuses = _wait_ready(actors, progress, startup_timeout_s)
        host = host or ray.util.get_node_ip_address()
        store, port = start_store(host)
        engines = RayEngines(placement, actors, router, store, host, port, nodes=nodes)
        backend = RayBackend(config, placement, engines, ray_dir, progress)
        groups = engines.connect(timeout_s=120)
        progress(f"paraflex: {groups} process group(s) built ({'nccl' if use_gpu else 'gloo'})")
    except BaseException:
        for a in list(actors.values()) + ([router] if router is not None else []):
            ray.kill(a, no_restart=True)
        if nodes is not None:
            nodes.release()
        if ray_dir is not None:
            ray.shutdown()
            shutil.rmtree(ray_dir, ignore_errors=True)
        raise
    backend.start(statuses)
    return backend


def _wait_ready(actors: dict, progress, timeout_s: float) -> dict[int, dict]:
    """Poll every actor's status until all are ready, printing new progress lines."""
    shown = {e: 0 for e in actors}
    statuses: dict[int, dict] = {}
    pending: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    while True:
        for e, a in actors.items():
            if e not in pending:
                pending[e] = a.status.remote()
        ready, _ = ray.wait(list(pending.values()), num_returns=len(pending), timeout=1.0)
        for e, ref in list(pending.items()):
            if ref in ready:
                del pending[e]
                st = statuses[e] = ray.get(ref)
                for line in st["progress"][shown[e]:]:
                    progress(line)
                shown[e] = len(st["progress"])
                if st["state"] == FAILED:
                    raise ParaflexError(f"engine {e} failed to start: {st['error']}")
        if len(statuses) == len(actors) and all(st["state"] == READY for st in statuses.values()):
            return statuses
        if time.monotonic() > deadline:
            silent = sorted(set(actors) - set(statuses))
            slow = sorted(e for e, st in statuses.items() if st["state"] != READY)
            raise ParaflexError(
                f"engines not ready after {timeout_s:.0f} s: still loading {slow}, never started "
                f"{silent} (not enough CPU/GPU in the Ray cluster?); see the progress above")
        time.sleep(0.25)
