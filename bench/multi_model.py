"""Several models on one machine: `paraflex serve` (Ray backend, planned) against one `vllm serve`
per model, under one open-loop workload, in the same run.

Place in the data flow: a client outside both systems. It builds the models' checkpoints
(SmolLM2-135M from its GGUF, bench/vllm_peer.py's `export_smollm2`; the others random-weight
Hugging Face Llama checkpoints of real shapes, made here with `transformers`, with SmolLM2's
tokenizer), then

* ParaFlex: one config with every model (`hf:` folders, the GGUF for SmolLM2), the workload's
  per-model rates, one CPU engine by default (`--engines`): `paraflex serve --ray` plans it and
  runs the engines as Ray actors, each with its share of the machine's CPUs as threads
  (docs/ray.md), the way ParaFlex's docs run a CPU box (bench/serve_process.py);
* vLLM: one `vllm serve` per model (bench/vllm_peer.py), the way an operator runs several models
  with it today; vLLM's CPU guide gives each instance its own cores through
  `VLLM_CPU_OMP_THREADS_BIND`, so with fewer cores than models each instance gets one OpenMP
  thread bound to core i mod cores (two instances share a core on a 2-core box);

and for each popularity (Zipf `--zipf` over the models in the order given, and balanced) sends
the same open-loop Poisson plan (token-id prompts of --input-len, exactly --output-len new
tokens, streaming /v1/completions; bench/serve_client.py) to each system in turn, --rounds times.
Per system and model it reports throughput (requests/s and output tokens/s), goodput (requests
meeting the model's TTFT and TPOT SLOs, per s), TTFT / TPOT median and P99, and the peak memory
of the system (sum of the resident set sizes of its process trees, sampled every 0.5 s), and
the ratios ParaFlex / vLLM. The CPU flags and the load average are printed: the machine's
cores are shared with other jobs, so only ratios of the same run mean anything.

`--rate` takes a comma list of total rates (each runs the same way; a rate above both systems'
capacity measures throughput at saturation), `--dispatch` a comma list of ParaFlex dispatch
rules (home-first, least-outstanding), each its own `paraflex serve` against the same requests.

Usage: python bench/multi_model.py --vllm-python ~/vllm-cpu/bin/python [--rate 1,4]
       [--duration 40] [--popularity zipf,balanced] [--models smollm2-135m,smollm2-360m-shape,
       smollm2-135m-ft] [--dispatch home-first,least-outstanding] [--out results.json]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import threading

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/ is no package
from serve_client import arrivals, open_loop, prompts_for, summarize, wait_quiet, write_report  # noqa: E402
from serve_process import ServeProcess  # noqa: E402
from ttft_split import cpu_flags  # noqa: E402
import vllm_peer  # noqa: E402

SMOLLM2 = dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
               num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, rms_norm_eps=1e-5,
               max_position_embeddings=8192, tie_word_embeddings=True)
# name -> (shape of a random-weight checkpoint, None for the real GGUF; TTFT SLO ms; TPOT SLO ms)
MODELS = {
    "smollm2-135m": (None, 1500, 250),
    "smollm2-360m-shape": ({**SMOLLM2, "hidden_size": 960, "intermediate_size": 2560, "num_hidden_layers": 32,
                            "num_attention_heads": 15, "num_key_value_heads": 5}, 3000, 500),
    "smollm2-135m-ft": (SMOLLM2, 1500, 250),  # a fine-tune of the same shape: another set of weights
    "llama-1b-shape": ({**SMOLLM2, "hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
                        "num_attention_heads": 32, "num_key_value_heads": 4, "tie_word_embeddings": False},
                       6000, 1200),  # TinyLlama-1.1B's shape with SmolLM2's vocabulary
}


def random_checkpoint(shape: dict, tokenizer_dir: str, seed: int) -> str:
    """A temporary HF Llama checkpoint of `shape`, float32, weights drawn from `seed`, with the
    tokenizer files of `tokenizer_dir`; the caller removes it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**shape, torch_dtype="float32")).eval()
    out = tempfile.mkdtemp(prefix="multi-model-")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tokenizer_dir, name), out)
    return out


KV_GB_PER_MODEL = 1  # each vllm serve's KV cache (VLLM_CPU_KVCACHE_SPACE), and ParaFlex's total per model


def weights_gb(checkpoints: dict[str, str]) -> float:
    """GiB of the checkpoints' safetensors (float32: the bytes either system holds)."""
    return sum(os.path.getsize(os.path.join(d, f)) for d in checkpoints.values() for f in os.listdir(d)
               if f.endswith(".safetensors")) / 2 ** 30


def stage_time_arg(text: str) -> str | float:
    """A `--target-stage-time` value: milliseconds as a number, else as given (auto, xK, /K:
    the config loader checks them)."""
    try:
        return float(text)
    except ValueError:
        return text


def config_dict(sources: dict[str, dict], rates: dict[str, float], engines: int, memory_gb: float = 8.0,
                dispatch: str | None = None, replica_shares: str | None = None,
                target_stage_time: str | float = "auto") -> dict:
    """The bench's ParaFlex config: every model of `sources` (name -> its weight source, e.g.
    {"hf": path}) on `engines` CPU engines of `memory_gb` each (weights + KV), cut into stages by
    the planner's `target_stage_time` (`auto`, the default: about the smallest model's time, so
    the 360M shape gets two stages over both engines; a large number keeps every model whole),
    at `rates`, with the `dispatch` rule (None: the config default)."""
    models = [{"name": name, **source, "dtype": "float32", "rate": rates[name],
               "slo_ttft_ms": MODELS[name][1], "slo_tbt_ms": MODELS[name][2]} for name, source in sources.items()]
    cfg = {"name": "multi-model",
           "cluster": {"num_engines": engines, "device": "cpu", "tp": 1, "memory_gb": round(memory_gb, 2),
                       "host_memory_gb": 1,
                       "interconnect_gbps": 10, "interconnect_latency_us": 50},
           "models": models,
           "planner": {"target_stage_time": target_stage_time, "kappa_gb": 0.05, "ring": False},
           "scheduler": {"max_batch_size": 32, "block_bytes": 32768, "policy": "full-batch-first",
                         "prefill_token_budget": 2048}}
    if dispatch:
        cfg["scheduler"]["dispatch"] = dispatch
    if replica_shares:
        cfg["planner"]["replica_shares"] = replica_shares
    return cfg


def paraflex_config(names: list[str], checkpoints: dict[str, str], rates: dict[str, float], engines: int,
                    memory_gb: float = 8.0, dispatch: str | None = None, replica_shares: str | None = None,
                    target_stage_time: str | float = "auto") -> str:
    """`config_dict` for `names` with their `checkpoints` (SmolLM2-135M: the shipped GGUF), as a
    temporary YAML file."""
    import yaml

    sources = {n: {"gguf": "smollm2-135m"} if MODELS[n][0] is None else {"hf": checkpoints[n]} for n in names}
    cfg = config_dict(sources, rates, engines, memory_gb, dispatch, replica_shares, target_stage_time)
    fd, path = tempfile.mkstemp(suffix=".yaml", prefix="multi-model-")
    with os.fdopen(fd, "w") as fh:
        yaml.safe_dump(cfg, fh)
    return path


class PeakMemory:
    """Peak of the summed resident set size (bytes) of the process trees under `pids`, sampled
    every 0.5 s on a thread from `start()` to `stop()` (shared pages count in each process)."""

    def __init__(self, pids: list[int]) -> None:
        self.pids, self.peak, self._stop = pids, 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def tree(pid: int) -> list[int]:
        out, todo = [], [pid]
        while todo:
            p = todo.pop()
            out.append(p)
            try:
                for task in os.listdir(f"/proc/{p}/task"):
                    with open(f"/proc/{p}/task/{task}/children") as fh:
                        todo += [int(c) for c in fh.read().split()]
            except OSError:
                pass
        return out

    @staticmethod
    def rss(pid: int) -> int:
        try:
            with open(f"/proc/{pid}/statm") as fh:
                return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            return 0

    def _run(self) -> None:
        while not self._stop.wait(0.5):
            self.peak = max(self.peak, sum(self.rss(p) for root in self.pids for p in self.tree(root)))

    def start(self) -> "PeakMemory":
        self._thread.start()
        return self

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def start_vllm(python: str, names: list[str], checkpoints: dict[str, str]) -> dict:
    """One `vllm serve` per model, started at once (each compiles for minutes), one OpenMP thread
    each bound to core i mod cores; if one fails, the others are stopped."""
    from concurrent.futures import ThreadPoolExecutor

    cores = os.cpu_count() or 1
    with ThreadPoolExecutor(len(names)) as pool:
        # on a loaded machine three vLLM servers compiling at once take over 15 minutes to answer
        futures = {name: pool.submit(vllm_peer.VllmServer, python, checkpoints[name], 1, 32, 1800.0, name=name,
                                     cores=str(i % cores), kv_gb=KV_GB_PER_MODEL) for i, name in enumerate(names)}
    started, failure = {}, None
    for name, future in futures.items():
        try:
            started[name] = future.result()
        except BaseException as exc:  # SystemExit from a failed start names its log
            failure = failure or exc
    if failure is not None:
        for server in started.values():
            server.stop()
        raise failure
    return started


def popularity_rates(names: list[str], kind: str, total: float, alpha: float) -> dict[str, float]:
    weights = np.ones(len(names)) if kind == "balanced" else 1.0 / np.arange(1, len(names) + 1) ** alpha
    return {n: float(total * w / weights.sum()) for n, w in zip(names, weights)}


def plan_for(rates: dict[str, float], duration: float, prompts: list[list[int]], rng) -> list[tuple]:
    """Poisson arrivals of every model over `duration` s, each with a prompt of `prompts`."""
    plan = []
    for model, rate in rates.items():
        times = arrivals(rng, rate, max(1, int(rate * duration * 2)), "poisson", 1.0)
        plan += [(float(t), model, prompts[int(rng.integers(len(prompts)))]) for t in times if t < duration]
    return sorted(plan, key=lambda p: p[0])


def run_system(url, pids: list[int], plan, args, slos) -> dict:
    """One system's run of `plan`, started once the previous system's processes are idle
    (serve_client.wait_quiet: vLLM's keep a core busy about a second after their last request)."""
    wait_quiet()
    memory = PeakMemory(pids).start()
    load0 = os.getloadavg()[0]
    results, duration = asyncio.run(open_loop(url, plan, args.output_len, args.request_timeout))
    peak = memory.stop()
    summary = summarize(results, duration, slos)
    summary["per_model"] = {m: summarize([r for r in results if r.model == m], duration, slos) for m in slos}
    summary["peak_memory_gb"] = peak / 2 ** 30
    summary["load_average"] = (load0, os.getloadavg()[0])
    return summary


def print_table(popularity: str, rates: dict, runs: dict) -> None:
    """Per system and model the medians over rounds, then each ParaFlex run's ratios to vLLM."""
    print(f"\n===== {popularity}, rates {({m: round(r, 2) for m, r in rates.items()})} req/s; "
          f"median of {len(next(iter(runs.values())))} round(s) =====")
    print(f"{'system':9s} {'model':20s} {'req/s':>6s} {'tok/s':>7s} {'goodput':>7s} {'TTFT p50':>9s} {'p99':>8s} "
          f"{'TPOT p50':>9s} {'p99':>7s} {'failed':>6s}")
    for system, rounds in runs.items():
        for model in ["(all)", *rates]:
            def med(key, sub=None):
                vals = [(r if model == "(all)" else r["per_model"][model])[key] for r in rounds]
                return float(np.median([v[sub] if sub else v for v in vals]))
            print(f"{system:9s} {model:20s} {med('request_throughput'):6.2f} {med('output_token_throughput'):7.1f} "
                  f"{med('goodput'):7.2f} {med('ttft_ms', 'median'):9.0f} {med('ttft_ms', 'p99'):8.0f} "
                  f"{med('tpot_ms', 'median'):9.1f} {med('tpot_ms', 'p99'):7.1f} {med('failed'):6.0f}")
        mem = float(np.median([r["peak_memory_gb"] for r in rounds]))
        loads = [x for r in rounds for x in r["load_average"]]
        print(f"{system:9s} peak memory {mem:.2f} GiB; load average {min(loads):.1f}-{max(loads):.1f}")
    for system in [s for s in runs if s != "vLLM" and runs.get("vLLM")]:
        for key, label in (("goodput", "goodput"), ("output_token_throughput", "throughput")):
            ours = np.median([r[key] for r in runs[system]])
            theirs = np.median([r[key] for r in runs["vLLM"]])
            print(f"{system} / vLLM {label}: {ours / theirs if theirs else float('inf'):.2f}x")


def run_popularity(popularity: str, names, checkpoints, vllm, slos, rng, args) -> list[tuple[str, dict, dict]]:
    """(label, rates, runs) per total rate of `args.rates`: one `paraflex serve` per dispatch
    rule (the plan depends on the rates' ratios only), each rule and vLLM in turn per round."""
    systems = {rule: "ParaFlex" if rule is None else f"ParaFlex {rule}" for rule in args.rules}
    results = {rate: {**{s: [] for s in systems.values()}, "vLLM": []} for rate in args.rates}
    shares = popularity_rates(names, popularity, args.rates[0], args.zipf)
    plans, warm = {}, []
    for rule, system in systems.items():
        # the same memory as the vLLM servers hold: every weight once, and their KV space in all
        memory = (weights_gb({n: checkpoints[n] for n in names}) + KV_GB_PER_MODEL * len(names)) / args.engines
        cfg = paraflex_config(names, checkpoints, shares, args.engines, memory, rule, args.replica_shares,
                              args.target_stage_time)
        server = None
        try:
            server = ServeProcess(cfg, backend="ray", echo=True, who="multi_model")
            if not plans:  # the same requests for every system
                prompts = prompts_for(server.url, names[0], 64, args.input_len, rng)
                plans = {rate: plan_for(popularity_rates(names, popularity, rate, args.zipf), args.duration, prompts, rng)
                         for rate in args.rates}
                warm = [(0.0, n, prompts[0]) for n in names]
                if vllm:
                    asyncio.run(open_loop({n: v.url for n, v in vllm.items()}, warm, 4, args.request_timeout))
            asyncio.run(open_loop(server.url, warm, 4, args.request_timeout))
            for rate, plan in plans.items():
                print(f"{popularity} at {rate:g} req/s: {len(plan)} requests over {args.duration:.0f} s", flush=True)
                for rnd in range(args.rounds):
                    results[rate][system].append(run_system(server.url, [server.proc.pid], plan, args, slos))
                    if vllm and len(results[rate]["vLLM"]) < args.rounds:
                        results[rate]["vLLM"].append(run_system({n: v.url for n, v in vllm.items()},
                                                                [v.proc.pid for v in vllm.values()], plan, args, slos))
                    print(f"  {system} round {rnd + 1}/{args.rounds} done; load average {os.getloadavg()[0]:.1f}",
                          flush=True)
        finally:
            if server is not None:
                server.stop()
            os.unlink(cfg)
    return [(f"{popularity} at {rate:g} req/s", popularity_rates(names, popularity, rate, args.zipf), results[rate])
            for rate in args.rates]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="smollm2-135m,smollm2-360m-shape,smollm2-135m-ft",
                   help=f"models in popularity order, of {', '.join(MODELS)}")
    p.add_argument("--vllm-python", default=os.environ.get("PARAFLEX_VLLM_PYTHON"),
                   help="a Python with vllm-cpu (bench/vllm_peer.py); without it only ParaFlex runs")
    p.add_argument("--popularity", default="zipf,balanced")
    p.add_argument("--zipf", type=float, default=1.01)
    p.add_argument("--rate", default="1.5",
                   help="total requests/s over all models; a comma list runs each (e.g. 1,4: 4 saturates both systems)")
    p.add_argument("--replica-shares", choices=("work", "stages"),
                   help="Alg. 1's target shares for ParaFlex's plan (default: the config default, stages)")
    p.add_argument("--dispatch", default="",
                   help="ParaFlex dispatch rules to run, comma list (home-first, least-outstanding, least-load; default: the config's)")
    p.add_argument("--target-stage-time", default="auto",
                   help="ParaFlex planner.target_stage_time: auto (the default: the 360M shape in two stages over "
                        "two engines), milliseconds, xK or /K; 100000 keeps every model whole (one stage)")
    p.add_argument("--duration", type=float, default=40.0, help="seconds of arrivals per run")
    p.add_argument("--input-len", type=int, default=64)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--rounds", type=int, default=1, help="ParaFlex / vLLM alternations per popularity")
    p.add_argument("--engines", type=int, default=1, help="ParaFlex CPU engines (Ray actors) sharing the cores")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out")
    args = p.parse_args(argv)
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        p.error(f"--models: unknown {unknown[0]!r}; known: {', '.join(MODELS)}")
    try:
        args.rates = [float(r) for r in args.rate.split(",")]
    except ValueError:
        p.error(f"--rate {args.rate!r}: give requests/s, e.g. 1.5 or 1,4")
    args.rules = [r for r in args.dispatch.split(",") if r] or [None]
    args.target_stage_time = stage_time_arg(args.target_stage_time)
    if args.vllm_python and not os.access(args.vllm_python, os.X_OK):
        p.error(f"--vllm-python {args.vllm_python}: not an executable; give the python of a venv with vllm-cpu")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    names = args.models.split(",")
    slos = {n: (MODELS[n][1], MODELS[n][2]) for n in names}
    print(f"machine: {cpu_flags()}; load average {os.getloadavg()[0]:.1f}", flush=True)
    from transformers_peer import transformers_model

    checkpoints, vllm, report = {}, {}, {"machine": cpu_flags(), "args": vars(args), "runs": {}}
    try:
        checkpoints["smollm2-135m"] = vllm_peer.export_smollm2(transformers_model())
        for i, name in enumerate(names):
            if MODELS[name][0] is not None:
                checkpoints[name] = random_checkpoint(MODELS[name][0], checkpoints["smollm2-135m"], args.seed + i)
        print(f"checkpoints: {checkpoints}", flush=True)
        if args.vllm_python:
            vllm.update(start_vllm(args.vllm_python, names, checkpoints))
        rng = np.random.default_rng(args.seed)
        for popularity in args.popularity.split(","):
            for key, rates, runs in run_popularity(popularity, names, checkpoints, vllm, slos, rng, args):
                print_table(key, rates, {k: v for k, v in runs.items() if v})
                report["runs"][key] = {"rates": rates, **runs}
    finally:
        for server in vllm.values():
            server.stop()
        for path in checkpoints.values():
            vllm_peer.remove(path)
    print("ParaFlex: one `paraflex serve --ray` (every model, planned); vLLM: one `vllm serve` per model, one "
          "OpenMP thread each bound to core i mod cores. SLOs (TTFT, TPOT ms): "
          + ", ".join(f"{n} {s[0]}/{s[1]}" for n, s in slos.items()))
    write_report(args.out, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
