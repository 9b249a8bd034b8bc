"""One command that checks the GPU path on a GPU and prints what it measured.

    python bench/gpu_check.py --out DIR          # on one GPU: < 8 minutes on an H100
    python bench/gpu_check.py --device cpu --tiny  # the script itself, on CPU, in seconds

Four parts, each in its own try block with its own time budget; `DIR/gpu_check.json` is
rewritten after every part (a timeout still leaves the parts done), and a table is printed at
the end:

1. `pytest -m gpu -x tests/engine` (the CUDA twins), then the Triton kernels compiled for real
   (interpreted on CPU) against contiguous reference attention: decode and prefill, head_dim
   64/80/96/128, GQA, 2/8/16 tokens per block, fp32/fp16/bf16;
2. greedy tokens of `LLMCluster` vs `transformers` on the device for small random-weight Llama
   and Qwen2 checkpoints through 1, 2 and 3 stages, two models sharing engines, and a KV pool
   small enough to force swapping: float32 must match exactly; bfloat16 reports the first
   divergence and the reference's top-2 logit gap there;
3. speed of one engine's worker on a Llama-2-7B-shaped random-weight bf16 model built in
   memory: decode step time at batch 1/8/32/64/128 and context 512/2048 (with its metadata
   build, and the graph replay alone) as a fraction of the bandwidth floor ((weight bytes + KV
   bytes read) / device copy bandwidth measured here), tokens/s of a whole job (prefill + 32
   decode steps) against `transformers` `generate` on the same model, batch and prompt, and
   prefill tokens/s at 512/2048 against the bf16 matmul peak measured here;
4. a 3-engine in-process pipeline of two models on the one device under a 200-request
   open-loop (Poisson) workload: output tokens/s, P50/P99 TTFT and TBT.

Everything it needs is built in memory or in a temporary directory; nothing is downloaded.
It imports only torch, triton, transformers, tokenizers, safetensors, numpy and pytest.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"


def say(line: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {line}", flush=True)


# ---------------------------------------------------------------------------------- shapes
def sizes(tiny: bool) -> SimpleNamespace:
    if tiny:
        return SimpleNamespace(
            kernel_cases=[(4, 2, 16, 3), (8, 1, 80, 2)], kernel_dtypes=["float32"],
            speed_arch=dict(hidden=64, ffn=128, layers=2, heads=4, kv_heads=4, vocab=256),
            batches=[1, 8], contexts=[32, 64], prefill_lens=[32, 64], peer_batches=[1, 8], new_tokens=4,
            copy_bytes=1 << 24, matmul=256, requests=40, rate=40.0, out_len=(2, 6), prompt_len=(4, 24),
            serve_arch=[dict(hidden=64, ffn=96, layers=3, heads=4, kv_heads=2), dict(hidden=48, ffn=80, layers=3,
                                                                                        heads=6, kv_heads=2)],
        )
    return SimpleNamespace(
        kernel_cases=[(32, 32, 128, 2), (32, 4, 128, 8), (16, 2, 64, 16), (20, 4, 80, 8), (12, 4, 96, 3)],
        kernel_dtypes=["float32", "float16", "bfloat16"],
        speed_arch=dict(hidden=4096, ffn=11008, layers=32, heads=32, kv_heads=32, vocab=32000),
        batches=[1, 8, 32, 64, 128], contexts=[512, 2048], prefill_lens=[512, 2048], peer_batches=[1, 8, 32],
        new_tokens=32, copy_bytes=1 << 30, matmul=8192, requests=200, rate=20.0, out_len=(16, 128),
        prompt_len=(32, 512),
        serve_arch=[dict(hidden=1024, ffn=2816, layers=12, heads=16, kv_heads=8),
                    dict(hidden=896, ffn=2432, layers=8, heads=14, kv_heads=2)],
    )


# ---------------------------------------------------------------------------------- part 1
def part_tests(ctx) -> dict:
    out = {}
    if ctx.device == "cuda":
        # -P: the checkout's paraflex/ folder must not shadow the installed package (its sub-packages
        # live in other folders, mapped at install time)
        cmd = [sys.executable, "-P", "-m", "pytest", "-m", "gpu", "-x", "-q", "-p", "no:cacheprovider", "tests/engine"]
        say("part 1: " + " ".join(cmd[1:]))
        try:
            proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=ctx.left(0.6))
            tail = (proc.stdout + proc.stderr).strip().splitlines()
            out["pytest"] = {"rc": proc.returncode, "summary": tail[-1] if tail else "", "tail": tail[-25:]}
        except subprocess.TimeoutExpired:
            out["pytest"] = {"rc": None, "summary": "timed out"}
        say(f"part 1: pytest -> {out['pytest']['summary']}")
    else:
        out["pytest"] = {"rc": None, "summary": "skipped off CUDA (the CPU suite runs the interpreted twins)"}
    out["kernels"] = kernel_checks(ctx)
    return out


def kernel_checks(ctx) -> list[dict]:
    import torch

    sys.path.insert(0, str(TESTS / "helpers"))
    from kernel_cases import LAYER, TOLERANCE, make_case

    from paraflex.engine.kernels import triton_paged_attention as tpa

    rows = []
    for heads, kv_heads, head_dim, tpb in ctx.sizes.kernel_cases:
        for dtype_name in ctx.sizes.kernel_dtypes:
            dtype = getattr(torch, dtype_name)
            for kind, lens in (("decode", [(0, 1), (37, 1), (300, 1), (1100, 1)]),
                               ("prefill", [(0, 70), (45, 17), (130, 1)])):
                if ctx.tiny:
                    lens = [(c % 40, n % 20 or 1) for c, n in lens]
                if ctx.expired():
                    return rows
                case = make_case(lens, tpb, heads, kv_heads, head_dim, dtype, ctx.device, seed=head_dim + tpb)
                out = tpa.paged_attention(case.q, case.k, case.v, case.kv, LAYER, case.meta, case.scale)
                err = (out.float().cpu() - case.expected).abs().max().item()
                tol = TOLERANCE[dtype] * 2
                rows.append({"kind": kind, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                             "tokens_per_block": tpb, "dtype": dtype_name, "max_abs_err": err, "ok": err <= tol})
    bad = [r for r in rows if not r["ok"]]
    say(f"part 1: {len(rows) - len(bad)}/{len(rows)} kernel cases within tolerance" + (f"; FAILED {bad}" if bad else ""))
    return rows


# ---------------------------------------------------------------------------------- part 2
def part_greedy(ctx) -> dict:
    import torch

    sys.path.insert(0, str(TESTS / "helpers"))
    from oracle_models import build_llama, build_qwen2, make_config, make_placement

    from paraflex.engine.core.sampling_params import SamplingParams
    from paraflex.serving.in_process import LLMCluster

    tmp = Path(ctx.tmp)
    llama = build_llama(tmp / "llama", num_layers=3)
    qwen = build_qwen2(tmp / "qwen", num_layers=5)
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12], list(range(20, 67)), [3]]
    n = 12 if not ctx.tiny else 6
    runs = [
        ("llama 1 stage", {"llama": (3, [(0, 3)], [[0]])}, 1, {}),
        ("llama 2 stages", {"llama": (3, [(0, 2), (2, 3)], [[0, 1]])}, 2, {}),
        ("llama 3 stages", {"llama": (3, [(0, 1), (1, 2), (2, 3)], [[2, 0, 1]])}, 3, {}),
        ("qwen2 3 stages", {"qwen": (5, [(0, 2), (2, 4), (4, 5)], [[0, 1, 2]])}, 3, {}),
        ("two models share engines", {"llama": (3, [(0, 2), (2, 3)], [[0, 1]]),
                                      "qwen": (5, [(0, 2), (2, 4), (4, 5)], [[1, 2, 0]])}, 3, {}),
        ("llama swapping forced", {"llama": (3, [(0, 2), (2, 3)], [[0, 1]])}, 2,
         {"kv_bytes": 24 * 2048, "host_kv_bytes": 400 * 2048, "block_bytes": 2048}),
    ]
    hf = {"llama": llama, "qwen": qwen}
    rows = []
    for dtype_name in ("float32", "bfloat16"):
        dtype = getattr(torch, dtype_name)
        refs = {}
        for name, model in hf.items():
            model = model.to(device=ctx.device, dtype=dtype)
            refs[name] = [_hf_greedy(model, p, n) for p in prompts]
        for label, layout, engines, kw in runs:
            if ctx.expired():
                break
            batch_prompts = prompts if "swapping" not in label else [[i + 1, i + 2, i + 3, i + 4] for i in range(8)]
            if "swapping" in label:
                refs_here = {"llama": [_hf_greedy(hf["llama"], p, n) for p in batch_prompts]}
            else:
                refs_here = refs
            dirs = {m: tmp / m for m in layout}
            cfg = make_config(dirs, engines, block_bytes=kw.get("block_bytes", 4096))
            cluster = LLMCluster(cfg, make_placement(layout, engines), device=ctx.device, dtype=dtype_name,
                                 kv_bytes=kw.get("kv_bytes", 64 << 20), host_kv_bytes=kw.get("host_kv_bytes"))
            graphs = sum(len(e.worker.graphs) for e in cluster.engines)
            params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
            for model in layout:
                results = cluster.generate(model, batch_prompts, params)
                got = [r.token_ids for r in results]
                row = {"run": label, "model": model, "dtype": dtype_name, "graph_stages": graphs,
                       "identical": got == refs_here[model], "errors": [r.error for r in results if r.error]}
                if not row["identical"]:
                    row.update(_divergence(hf[model], batch_prompts, got, refs_here[model]))
                rows.append(row)
                say(f"part 2: {dtype_name} {label} {model}: " + ("identical" if row["identical"] else
                    f"DIVERGES at request {row['request']} token {row['token']} (top-2 gap {row['top2_gap']:.4g})"))
            del cluster
            _free(ctx)
    return {"runs": rows, "fp32_all_identical": all(r["identical"] for r in rows if r["dtype"] == "float32")}


def _hf_greedy(model, prompt, n) -> list[int]:
    import torch

    dev = next(model.parameters()).device
    ids = torch.tensor([prompt], device=dev)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


def _divergence(model, prompts, got, ref) -> dict:
    """First request and token where `got` leaves `ref`, and the reference's top-2 logit gap there."""
    import torch

    for i, (a, b) in enumerate(zip(got, ref)):
        if a != b:
            j = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            dev = next(model.parameters()).device
            with torch.no_grad():
                logits = model(torch.tensor([prompts[i] + b[:j]], device=dev)).logits[0, -1].float()
            top = torch.topk(logits, 2).values
            return {"request": i, "token": j, "top2_gap": float(top[0] - top[1])}
    return {"request": None, "token": None, "top2_gap": float("nan")}


# ---------------------------------------------------------------------------------- part 3
def part_speed(ctx) -> dict:
    import torch

    from paraflex.engine.worker.kv_cache import KVCache
    from paraflex.engine.worker.model import Stage
    from paraflex.engine.worker.stage_worker import Worker

    s = ctx.sizes
    dev = ctx.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    out = {"copy_GBps": _copy_bandwidth(dev, s.copy_bytes) / 1e9, "matmul_TFLOPs": _matmul_peak(dev, s.matmul, dtype) / 1e12}
    say(f"part 3: device copy {out['copy_GBps']:.0f} GB/s, {dtype} matmul {out['matmul_TFLOPs']:.1f} TFLOP/s")
    hf_model, arch = _llama_in_memory(s.speed_arch, dev, dtype, Path(ctx.tmp) / "speed-config.json")
    prompt_len = s.contexts[0]
    peer = {}
    for b in s.peer_batches:
        if ctx.expired():
            break
        peer[b] = _hf_tok_s(hf_model, b, prompt_len, s.new_tokens, arch.vocab_size)
        say(f"part 3: transformers generate batch {b}: {peer[b]:.1f} tok/s")
    weights = {k: v for k, v in hf_model.state_dict().items()}
    del hf_model
    stage = Stage(arch, 0, arch.num_layers, weights, dev)
    del weights
    _free(ctx)
    weight_bytes = stage.weight_bytes()
    elem = torch.empty((), dtype=dtype).element_size()
    kv_token = 2 * arch.num_kv_heads * arch.head_dim * elem * arch.num_layers
    block_bytes = 32768
    free = torch.cuda.mem_get_info()[0] if dev == "cuda" else 1 << 31
    graph_reserve = 0
    if dev == "cuda":
        from paraflex.engine.kernels import cuda_graphs

        graph_reserve = cuda_graphs.reserve_bytes([(arch, arch.num_layers, dtype, True, True)], max(s.batches),
                                                  block_bytes)
    headroom = 12 << 30 if dev == "cuda" else 0  # activations of the largest prefill (128 x 511 tokens)
    pool_bytes = min(int(free * 0.95) - graph_reserve - headroom,
                     max(b * c for b in s.batches for c in s.contexts) * kv_token * 2)
    kv = KVCache(pool_bytes // block_bytes, block_bytes, 0, dev)
    worker = Worker(kv)
    worker.add_stage("m", stage)
    if dev == "cuda":
        worker.capture_decode_graphs(max(s.batches), graph_reserve, "speed engine", say)
    tpb = kv.model_view(arch.num_kv_heads, arch.head_dim, dtype).shape[2]  # tokens per block, as the worker sees it
    fits = lambda b, c: b * (-(-(c + s.new_tokens) // tpb)) * arch.num_layers <= kv.num_blocks  # noqa: E731
    decode = []
    for c in s.contexts:
        for b in s.batches:
            if ctx.expired():
                break
            row = {"batch": b, "context": c}
            if not fits(b, c):
                row["skipped"] = "KV does not fit next to the weights"
            else:
                job = _Job(worker, arch, tpb, b, c)
                step, replay = job.time_decode(steps=10 if not ctx.tiny else 3)
                floor = (weight_bytes + b * c * kv_token) / (out["copy_GBps"] * 1e9)
                row.update(step_ms=step * 1e3, replay_ms=replay * 1e3 if replay else None, floor_ms=floor * 1e3,
                           floor_fraction=floor / step, replay_floor_fraction=floor / replay if replay else None)
            decode.append(row)
            say(f"part 3: decode {row}")
    out["decode"] = decode
    jobs = []
    for b in s.peer_batches:
        if ctx.expired() or b not in peer:
            break
        tok_s = _Job(worker, arch, tpb, b, prompt_len).tokens_per_s(s.new_tokens)
        jobs.append({"batch": b, "prompt": prompt_len, "new_tokens": s.new_tokens, "paraflex_tok_s": tok_s,
                     "transformers_tok_s": peer[b], "ratio": tok_s / peer[b]})
        say(f"part 3: job {jobs[-1]}")
    out["generate_vs_transformers"] = jobs
    prefill = []
    flops_token = 2 * (weight_bytes / elem - 2 * arch.vocab_size * arch.hidden_size)  # embedding, head: not per token
    for n in s.prefill_lens:
        if ctx.expired():
            break
        t = _Job(worker, arch, tpb, 1, n).time_prefill()
        attn = 2 * arch.num_layers * arch.num_heads * arch.head_dim * n  # per token, on average (causal)
        prefill.append({"tokens": n, "tok_s": n / t, "mfu": n * (flops_token + attn) / t / (out["matmul_TFLOPs"] * 1e12)})
        say(f"part 3: prefill {prefill[-1]}")
    out["prefill"] = prefill
    out["weight_GB"] = weight_bytes / 1e9
    del worker, stage, kv
    _free(ctx)
    return out


class _Job:
    """Batches of `batch` requests driven through `Worker.run` like the engine loop does
    (layer-wise block tables, metadata built every step, graphs where they serve), minus the
    scheduler: blocks are handed out in order."""

    def __init__(self, worker, arch, tpb, batch, context) -> None:
        self.worker, self.arch, self.tpb, self.batch, self.context = worker, arch, tpb, batch, context
        self.next_block = 0
        self.tables = [[[] for _ in range(arch.num_layers)] for _ in range(batch)]

    def _grow(self, req: int, tokens: int) -> None:
        need = -(-tokens // self.tpb)
        for layer in self.tables[req]:
            while len(layer) < need:
                layer.append(self.next_block)
                self.next_block += 1

    def _run(self, new: list[list[int]], contexts: list[int]):
        reqs = []
        for i, (toks, c) in enumerate(zip(new, contexts)):
            self._grow(i, c)
            reqs.append(SimpleNamespace(token_ids=toks, num_tokens=len(toks), context_len=c,
                                        block_table=self.tables[i], samples=True))
        batch = SimpleNamespace(model="m", requests=reqs, swap_out=[], swap_in=[], batch_id="b", src_rows=None,
                                num_tokens=sum(len(t) for t in new))
        return self.worker.run(batch)

    def _prefill(self, n: int):
        rng = random.Random(self.batch * 7 + n)
        prompts = [[rng.randrange(self.arch.vocab_size) for _ in range(n)] for _ in range(self.batch)]
        return self._run(prompts, [n] * self.batch)

    def time_prefill(self) -> float:
        self._prefill(self.context)  # warm-up (kernels compile for this shape)
        _sync()
        start = time.perf_counter()
        self._prefill(self.context)
        _sync()
        return time.perf_counter() - start

    def time_decode(self, steps: int) -> tuple[float, float | None]:
        """(seconds per decode step including its metadata build, seconds per graph replay alone)."""
        logits = self._prefill(self.context - 1)
        tokens = logits.argmax(-1).tolist()
        for _ in range(2):  # warm-up
            logits = self._run([[t] for t in tokens], [self.context] * self.batch)
        _sync()
        start = time.perf_counter()
        for _ in range(steps):
            logits = self._run([[t] for t in tokens], [self.context] * self.batch)
        _sync()
        step = (time.perf_counter() - start) / steps
        graphs = self.worker.graphs.get("m")
        if graphs is None or self.batch > graphs.buckets[-1] or self.context > graphs.max_context:
            return step, None
        graph, _ = graphs.graphs[next(b for b in graphs.buckets if b >= self.batch)]
        _sync()
        start = time.perf_counter()
        for _ in range(steps):
            graph.replay()
        _sync()
        return step, (time.perf_counter() - start) / steps

    def tokens_per_s(self, new_tokens: int) -> float:
        """Output tokens/s of a whole greedy job: prefill of `context` tokens, then decode."""
        _sync()
        start = time.perf_counter()
        tokens = self._prefill(self.context).argmax(-1).tolist()
        for step in range(1, new_tokens):
            tokens = self._run([[t] for t in tokens], [self.context + step] * self.batch).argmax(-1).tolist()
        _sync()
        return self.batch * new_tokens / (time.perf_counter() - start)


def _llama_in_memory(shape: dict, dev: str, dtype, config_path: Path):
    """A random-weight `LlamaForCausalLM` of this shape on the device, and its arch (read back
    from the config written to `config_path`, as ParaFlex reads a checkpoint's)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from paraflex.models.arch_files import arch_from_hf_config

    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], max_position_embeddings=4096)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg).eval()
    finally:
        torch.set_default_dtype(previous)
    model.to(dtype)
    cfg.to_json_file(str(config_path))
    return model, arch_from_hf_config(str(config_path), "llama-7b-shape")


def _hf_tok_s(model, batch, prompt_len, new_tokens, vocab) -> float:
    import torch

    dev = next(model.parameters()).device
    ids = torch.randint(3, vocab, (batch, prompt_len), device=dev)
    kw = dict(attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
              do_sample=False, pad_token_id=0)
    with torch.no_grad():
        model.generate(ids[:, :16], **{**kw, "attention_mask": torch.ones_like(ids[:, :16]), "max_new_tokens": 2,
                                       "min_new_tokens": 2})  # warm-up
        _sync()
        start = time.perf_counter()
        model.generate(ids, **kw)
        _sync()
    return batch * new_tokens / (time.perf_counter() - start)


def _copy_bandwidth(dev: str, nbytes: int) -> float:
    """Bytes moved (read + written) per second by a device-to-device copy."""
    import torch

    src = torch.empty(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    _sync()
    return 2 * nbytes * 10 / (time.perf_counter() - start)


def _matmul_peak(dev: str, n: int, dtype) -> float:
    import torch

    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    a @ b
    _sync()
    start = time.perf_counter()
    for _ in range(10):
        a @ b
    _sync()
    return 2 * n ** 3 * 10 / (time.perf_counter() - start)


# ---------------------------------------------------------------------------------- part 4
def part_serve(ctx) -> dict:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    sys.path.insert(0, str(TESTS / "helpers"))
    from oracle_models import make_config, make_placement, save_tokenizer

    from paraflex.engine.core.sampling_params import SamplingParams
    from paraflex.serving.in_process import LLMCluster

    s = ctx.sizes
    dirs = {}
    for name, cls, cfg_cls, shape in (("llama", LlamaForCausalLM, LlamaConfig, s.serve_arch[0]),
                                      ("qwen", Qwen2ForCausalLM, Qwen2Config, s.serve_arch[1])):
        torch.manual_seed(len(name))
        cfg = cfg_cls(vocab_size=320, hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], max_position_embeddings=2048, bos_token_id=1,
                      eos_token_id=2)
        dirs[name] = Path(ctx.tmp) / f"serve-{name}"
        cls(cfg).save_pretrained(str(dirs[name]))
        save_tokenizer(dirs[name])
    layers = {m: s.serve_arch[i]["layers"] for i, m in enumerate(("llama", "qwen"))}
    third = layers["llama"] // 3
    layout = {"llama": (layers["llama"], [(0, third), (third, 2 * third), (2 * third, layers["llama"])], [[0, 1, 2]]),
              "qwen": (layers["qwen"], [(0, layers["qwen"] // 2), (layers["qwen"] // 2, layers["qwen"])], [[2, 0]])}
    kv_bytes = (4 << 30) if ctx.device == "cuda" else (64 << 20)
    cfg = make_config(dirs, 3, block_bytes=32768, max_batch_size=64)
    cluster = LLMCluster(cfg, make_placement(layout, 3), device=ctx.device, kv_bytes=kv_bytes)
    rng = random.Random(0)
    records, lock = [], threading.Lock()

    class Sink:
        def __init__(self):
            self.times, self.done = [], threading.Event()

        def on_output(self, rid, token_ids, finish_reason, error, **extra):
            now = time.perf_counter()
            self.times.extend([now] * len(token_ids))
            if finish_reason is not None:
                self.error = error
                self.done.set()

    cluster.start()
    start = time.perf_counter()
    at = 0.0
    try:
        for i in range(s.requests):
            at += rng.expovariate(s.rate)
            wait = start + at - time.perf_counter()
            if wait > 0:
                time.sleep(wait)
            model = "llama" if rng.random() < 0.6 else "qwen"
            prompt = [rng.randrange(3, 300) for _ in range(rng.randint(*s.prompt_len))]
            sink = Sink()
            sent = time.perf_counter()
            cluster.submit(model, prompt, SamplingParams(max_tokens=rng.randint(*s.out_len), temperature=0.0,
                                                         ignore_eos=True), sink=sink)
            with lock:
                records.append((sent, sink))
        for _, sink in records:
            if not sink.done.wait(max(1.0, ctx.left(1.0))):
                break
    finally:
        cluster.shutdown()
    end = max((sk.times[-1] for _, sk in records if sk.times), default=time.perf_counter())
    ttft = sorted(sk.times[0] - sent for sent, sk in records if sk.times)
    tbt = sorted(b - a for _, sk in records for a, b in zip(sk.times, sk.times[1:]))
    tokens = sum(len(sk.times) for _, sk in records)
    done = sum(sk.done.is_set() for _, sk in records)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3 if xs else float("nan")  # noqa: E731
    return {"requests": s.requests, "finished": done, "errors": sum(1 for _, sk in records if getattr(sk, "error", None)),
            "rate_req_s": s.rate, "output_tokens": tokens, "tok_s": tokens / (end - start),
            "ttft_p50_ms": q(ttft, 0.5), "ttft_p99_ms": q(ttft, 0.99), "tbt_p50_ms": q(tbt, 0.5),
            "tbt_p99_ms": q(tbt, 0.99)}


# ---------------------------------------------------------------------------------- driver
def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _free(ctx) -> None:
    gc.collect()
    if ctx.device == "cuda":
        import torch

        torch.cuda.empty_cache()


PARTS = (("1_kernels_and_twins", part_tests, 170), ("2_greedy_vs_transformers", part_greedy, 90),
         ("3_speed_7b_shape", part_speed, 150), ("4_pipeline_workload", part_serve, 60))


def table(results: dict) -> str:
    lines = [f"device: {results['device_name']}  torch {results['torch']}  triton {results.get('triton')}  "
             f"transformers {results.get('transformers')}"]
    for name, part in results["parts"].items():
        head = f"{name}: {part.get('status')} in {part.get('seconds', 0):.0f} s"
        if part.get("error"):
            head += f"  ERROR {part['error'].splitlines()[-1]}"
        lines.append(head)
        r = part.get("result") or {}
        if "pytest" in r:
            ok = sum(k["ok"] for k in r.get("kernels", []))
            lines.append(f"  pytest -m gpu: {r['pytest']['summary']}; kernels {ok}/{len(r.get('kernels', []))} ok")
        for run in r.get("runs", []):
            extra = "" if run["identical"] else f" first divergence req {run['request']} tok {run['token']} gap {run['top2_gap']:.3g}"
            lines.append(f"  {run['dtype']:9s} {run['run']:26s} {run['model']:6s} {'identical' if run['identical'] else 'DIFFERS'}{extra}")
        if "copy_GBps" in r:
            lines.append(f"  copy {r['copy_GBps']:.0f} GB/s, matmul {r['matmul_TFLOPs']:.1f} TFLOP/s, weights {r.get('weight_GB', 0):.2f} GB")
            lines.append("  batch context  step_ms  floor_ms  floor%  replay_ms  replay_floor%")
            for d in r.get("decode", []):
                if "skipped" in d:
                    lines.append(f"  {d['batch']:5d} {d['context']:7d}  {d['skipped']}")
                    continue
                replay = "" if d["replay_ms"] is None else f"{d['replay_ms']:9.2f}  {100 * d['replay_floor_fraction']:6.1f}%"
                lines.append(f"  {d['batch']:5d} {d['context']:7d} {d['step_ms']:8.2f} {d['floor_ms']:9.2f} "
                             f"{100 * d['floor_fraction']:6.1f}%  {replay}")
            for j in r.get("generate_vs_transformers", []):
                lines.append(f"  job batch {j['batch']}: paraflex {j['paraflex_tok_s']:.1f} tok/s vs transformers "
                             f"{j['transformers_tok_s']:.1f} = {j['ratio']:.2f}x")
            for p in r.get("prefill", []):
                lines.append(f"  prefill {p['tokens']} tokens: {p['tok_s']:.0f} tok/s, {100 * p['mfu']:.1f}% of matmul peak")
        if "tok_s" in r and "ttft_p50_ms" in r:
            lines.append(f"  {r['finished']}/{r['requests']} finished, {r['errors']} errors, {r['tok_s']:.1f} tok/s, "
                         f"TTFT p50 {r['ttft_p50_ms']:.1f} ms p99 {r['ttft_p99_ms']:.1f} ms, "
                         f"TBT p50 {r['tbt_p50_ms']:.1f} ms p99 {r['tbt_p99_ms']:.1f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="gpu-check", help="folder for gpu_check.json (default ./gpu-check)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (seconds; for CPU dry runs and CI)")
    ap.add_argument("--parts", default="1,2,3,4", help="which parts to run (default 1,2,3,4)")
    ap.add_argument("--budget-scale", type=float, default=1.0, help="multiply every part's time budget")
    args = ap.parse_args(argv)
    if args.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: --device cuda but no CUDA device is visible; use --device cpu --tiny", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "gpu_check.json"
    results = {"device_name": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "argv": sys.argv[1:], "parts": {}}
    for mod in ("triton", "transformers"):
        try:
            results[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001
            results[mod] = f"unavailable: {exc}"
    wanted = {p.strip() for p in args.parts.split(",")}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        for name, fn, budget in PARTS:
            if name[0] not in wanted:
                continue
            budget *= args.budget_scale
            begin = time.perf_counter()
            ctx = SimpleNamespace(device=args.device, tiny=args.tiny, sizes=sizes(args.tiny), tmp=tmp,
                                  expired=lambda b=begin, t=budget: time.perf_counter() - b > t,
                                  left=lambda share, b=begin, t=budget: max(5.0, share * t - (time.perf_counter() - b)))
            say(f"{name}: start (budget {budget:.0f} s)")
            entry = results["parts"][name] = {"status": "running"}
            try:
                entry["result"] = fn(ctx)
                entry["status"] = "over budget (cut short)" if ctx.expired() else "done"
            except Exception:  # noqa: BLE001  (every part runs; its error goes into the JSON)
                entry["status"] = "error"
                entry["error"] = traceback.format_exc()
                say(f"{name}: ERROR\n{entry['error']}")
            entry["seconds"] = time.perf_counter() - begin
            _free(ctx)
            path.write_text(json.dumps(results, indent=2, default=str))
            say(f"{name}: {entry['status']} in {entry['seconds']:.0f} s; wrote {path}")
    print(table(results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
