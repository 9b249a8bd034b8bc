"""`paraflex serve`: plan (or load) a placement, start the engines, serve the OpenAI API.

Data flow: CONFIG (default: the shipped demo, paraflex.shipped) -> placement (--placement FILE, or
planned on the fly with the paraflex planner) -> a Backend: one Ray actor per engine
(paraflex.serving.ray_startup.start_cluster; joins --ray-address or starts a local Ray instance) or,
with --in-process, every engine in this process (paraflex.serving.in_process_backend) ->
the HTTP gateway (paraflex.gateway.app) on --host:--port. Prints the base URL once
listening; Ctrl-C stops the gateway, then the engines, leaving no processes behind.
"""

from __future__ import annotations

import asyncio
import os
import sys

from paraflex.errors import UserError

NAME = "serve"
HELP = "Serve the models of a config over an OpenAI-compatible HTTP API."


def add_arguments(parser) -> None:
    parser.add_argument("config", nargs="?", default=None,
                        help="cluster + models config (default: the demo config shipped in the package)")
    parser.add_argument("--placement", metavar="FILE",
                        help="placement file from `paraflex plan` (default: plan the config now)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="interface to listen on (default 127.0.0.1; 0.0.0.0 exposes it to the network)")
    parser.add_argument("--port", type=int, default=8000, help="TCP port (default 8000; 0 = any free port)")
    parser.add_argument("--api-key", default=os.environ.get("PARAFLEX_API_KEY") or None,
                        help="require 'Authorization: Bearer KEY' (default: $PARAFLEX_API_KEY, else no auth)")
    parser.add_argument("--metrics-require-key", action="store_true",
                        help="/metrics too needs the API key (default: open, for Prometheus scrapers; /health always is)")
    parser.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                        help="accept requests whose Host header is NAME (repeatable; '*' for any). Always accepted: "
                             "localhost, IP addresses and the --host name")
    parser.add_argument("--max-outstanding", type=int, default=256, metavar="N",
                        help="admitted requests before new ones get 503 (default 256)")
    parser.add_argument("--read-timeout", type=float, default=30.0, metavar="SECONDS",
                        help="a client must send a request's headers within SECONDS of their first byte, and its "
                             "body may stall at most SECONDS (408) (default 30)")
    parser.add_argument("--drain-seconds", type=float, default=5.0, metavar="SECONDS",
                        help="after SIGTERM, answer /health and new requests with 503 for SECONDS while running "
                             "requests go on, then close (default 5; 0 closes at once)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weights' dtype: auto (each model's `dtype:`, else bfloat16 on GPU and float32 on CPU), "
                             "float32, bfloat16 (CPU: fast with avx512_bf16/AMX), float16 (GPU only)")
    parser.add_argument("--in-process", action="store_true",
                        help="run every engine in this process instead of as Ray actors (debugging)")
    parser.add_argument("--ray-address", default=None,
                        help="join this Ray cluster, HOST:PORT of its head (default: start a local Ray instance; docs/cluster.md)")
    parser.add_argument("--request-log", metavar="FILE",
                        help="write one CSV row per finished request (arrival, first token, finish, E2E, TTFT, TBT, "
                             "tokens) in the columns of `paraflex simulate`'s requests.csv (docs/serve.md)")
    parser.add_argument("--step-log", metavar="DIR",
                        help="every engine writes one CSV row per batch it runs (what it carried, "
                             "how long its loop took) to DIR/engine-<id>.csv, for `paraflex profile --step-log` "
                             "(docs/costmodel.md)")
    parser.add_argument("--no-warm-up", dest="warm_up", action="store_false",
                        help="open the socket without first running a few short requests per model (default: run "
                             "them, so the first user's request does not wait for kernels to compile)")
    parser.add_argument("--max-restarts", type=int, default=0, metavar="N",
                        help="Ray restarts of a dead engine actor before its replicas stay down (default 0)")
    from paraflex.planner.incremental import DEFAULT_HYSTERESIS
    from paraflex.planner.replan_controller import DEFAULT_THRESHOLD

    r = parser.add_argument_group("live re-planning (docs/serve.md, \"Re-planning live\")")
    r.add_argument("--replan-interval", type=float, metavar="S",
                   help="re-plan the placement every S seconds from the measured rates and apply it live "
                        "(off by default)")
    r.add_argument("--replan-threshold", type=float, default=DEFAULT_THRESHOLD,
                   help=f"also re-plan when a model's rate moves by more than this share (default {DEFAULT_THRESHOLD:g})")
    r.add_argument("--replan-hysteresis", type=float, default=DEFAULT_HYSTERESIS,
                   help="keep the placement unless the objective improves by more than this share "
                        f"(default {DEFAULT_HYSTERESIS:g})")


def require_device_at_hand(device: str) -> None:
    """A UserError when the config's `cluster.device` is a GPU and this machine shows none (the
    engines would size their KV pools for it in host memory)."""
    import torch

    if device != "cpu" and not torch.cuda.is_available():
        raise UserError(f"cluster.device is {device!r} but no CUDA device is present here (CPU only): serve a "
                        "config with device: cpu (e.g. the shipped demo), or run on a machine with that GPU "
                        "(or join its Ray cluster with --ray-address)")


def load_placement(config, path: str | None):
    from paraflex.placement import Placement
    from paraflex.planner.validate import require_valid_layout

    if path is not None:
        if not os.path.exists(path):
            raise UserError(f"--placement: {path} does not exist; create it with `paraflex plan CONFIG -o {path}`")
        placement = Placement.load_for(path, config)
        require_valid_layout(placement, config, source=path)
        return placement
    from paraflex.planner import plan

    print(f"planning {len(config.models)} models on {config.cluster.num_engines} engines ...", flush=True)
    return plan(config)


def _require_writable_dir(path: str) -> None:
    """--step-log's folder exists (made if need be) and can be written, before any engine starts."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise UserError(f"--step-log {path}: cannot make it ({exc.strerror}); pass a folder you can write") from None
    if not os.access(path, os.W_OK):
        raise UserError(f"--step-log {path}: cannot write in it; pass a folder you can write")


def start_backend(config, placement, args):
    if args.in_process:
        from paraflex.serving.in_process_backend import InProcessBackend

        return InProcessBackend.start(config, placement, dtype=args.dtype)
    try:
        from paraflex.serving.ray_startup import start_cluster
    except ImportError as exc:
        raise UserError(f"the Ray backend is not available in this installation ({exc}); "
                        "serve with --in-process") from None
    return start_cluster(config, placement, args.ray_address, max_restarts=args.max_restarts,
                         gateway_host=args.host, dtype=args.dtype)


def run(args) -> int:
    from paraflex.engine.kernels import omp_policy

    omp_policy.apply_here()  # before torch loads: the in-process engines' OpenMP threads sleep between regions
    from paraflex.config.schema import load_config
    from paraflex.shipped import demo_config_path

    try:
        from paraflex.gateway.app import build_app
        from paraflex.gateway.server import base_url, bind, serve
    except ImportError as exc:
        raise UserError(f"serve needs the HTTP stack: the {exc.name!r} package is not installed (pip install "
                        "fastapi uvicorn); `paraflex generate` runs without it") from None
    from paraflex.engine.gc_heap import PauseWatch, freeze_start_up_heap
    from paraflex.models.engine_support import require_runnable

    if args.in_process and (args.ray_address or args.max_restarts):
        raise UserError("--in-process: cannot be combined with --ray-address or --max-restarts (Ray only)")
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts: {args.max_restarts} is negative; use 0 (never) or more")
    if args.api_key is not None and not args.api_key.strip():
        raise UserError("--api-key: empty; give a key, or leave the flag out to serve without one")
    if args.api_key is not None and any(ch.isspace() for ch in args.api_key):
        raise UserError("--api-key: contains whitespace, which an HTTP header cannot carry intact "
                        "(check $PARAFLEX_API_KEY for a trailing newline); give a key without spaces")
    if args.metrics_require_key and args.api_key is None:
        raise UserError("--metrics-require-key: there is no key to require; give --api-key (or $PARAFLEX_API_KEY)")
    if args.max_outstanding < 1:
        raise UserError("--max-outstanding: must be at least 1")
    if not 0 < args.read_timeout < float("inf"):
        raise UserError(f"--read-timeout: must be a finite number of seconds > 0, got {args.read_timeout:g}")
    if not 0 <= args.drain_seconds < float("inf"):
        raise UserError(f"--drain-seconds: must be a finite number of seconds >= 0, got {args.drain_seconds:g}")
    if args.replan_interval is not None and not 0 < args.replan_interval < float("inf"):
        raise UserError(f"--replan-interval: must be a finite number of seconds > 0, got {args.replan_interval:g}")
    if not 0 < args.replan_threshold < float("inf"):
        raise UserError(f"--replan-threshold: must be a relative rate change > 0 (e.g. 0.5), got {args.replan_threshold:g}")
    if not 0 <= args.replan_hysteresis < float("inf"):
        raise UserError(f"--replan-hysteresis: must be a share >= 0 (e.g. 0.1), got {args.replan_hysteresis:g}")
    if not 0 <= args.port <= 65535:
        raise UserError(f"--port: {args.port} is not a TCP port (0-65535)")
    sock = bind(args.host, args.port)  # a bad --host or a taken --port fails before any planning or engine
    try:
        config_path = args.config or demo_config_path()
        config = load_config(config_path)
        if args.ray_address is None:  # engines on this machine; a cluster's GPUs are the cluster's to check
            require_device_at_hand(config.cluster.device)
        require_runnable(config)
        placement = load_placement(config, args.placement)
        request_log = None
        if args.request_log is not None:
            from paraflex.serving.request_log import RequestLog

            request_log = RequestLog(args.request_log, config.models)
        if args.step_log:
            _require_writable_dir(args.step_log)
        print(f"starting {len(placement.engines)} engines ({'in-process' if args.in_process else 'Ray'}) ...",
              flush=True)
        backend = start_backend(config, placement, args)
        replanner = pauses = None
        try:
            if args.warm_up:  # before the logs: their rows are the users' requests only
                from paraflex.serving.warm_up import warm_up

                warm_up(backend, progress=lambda line: print(line, flush=True))
            frozen = freeze_start_up_heap()
            if frozen is not None:
                print(frozen.describe(), flush=True)
            pauses = PauseWatch(report=lambda line: print(line, file=sys.stderr, flush=True))
            if request_log is not None:
                backend.frontend.request_log = request_log
            if args.step_log:
                paths = backend.start_step_logs(args.step_log)
                print(f"engine step log: {', '.join(paths)}", flush=True)
            if args.replan_interval is not None:
                from paraflex.serving.live_replanner import LiveReplanner

                replanner = LiveReplanner(backend, config, args.replan_interval, args.replan_threshold,
                                          args.replan_hysteresis, report=lambda line: print(line, flush=True))
                replanner.start()
            app = build_app(backend, api_key=args.api_key, max_outstanding=args.max_outstanding,
                            allowed_hosts=(args.host, *args.allowed_host), metrics_require_key=args.metrics_require_key,
                            arrival_rates=replanner)
            names = ", ".join(c.name for c in backend.models())
            serve(app, sock, announce=lambda: print(
                f"serving {names}\n{base_url(sock)}/v1  (OpenAI-compatible; Ctrl-C to stop)", flush=True),
                read_timeout=args.read_timeout, drain_s=args.drain_seconds)
        finally:
            if replanner is not None:
                replanner.stop()
            if pauses is not None:
                pauses.stop()
                print(pauses.summary(), file=sys.stderr, flush=True)
            print("stopping engines ...", file=sys.stderr, flush=True)
            asyncio.run(backend.close())
            if request_log is not None:
                request_log.close()
                print(f"request log: {request_log.written} finished request(s) in {request_log.path}",
                      file=sys.stderr, flush=True)
    finally:
        sock.close()
    return 0
