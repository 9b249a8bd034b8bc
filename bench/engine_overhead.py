"""Engine overhead and continuous batching of the torch runtime (paraflex.serving.in_process).

Place in the project: a benchmark (not a test). Two claims, each a ratio against a peer
measured in the same run on the same machine:

1. Overhead: the runtime's tokens/s (scheduler + paged KV bookkeeping + worker + sampler +
   in-process transport) over a BARE LOOP that calls the same model forward directly
   (one `Stage` holding all layers, attention metadata built per step, greedy argmax, no
   scheduler, no messages). Same work: B prompts of P tokens, G new tokens each, batch sizes
   1, 8, 32. Target >= 0.9 for one stage. The 2-stage runtime runs both stages in this one
   process (no overlap between engines here), so its ratio shows the per-hop cost.
2. Batching: the runtime (1 stage, max batch B) vs `transformers` generate in static batches
   of B (left-padded, each batch runs until its longest request ends) on a mixed workload of
   2*B requests with prompt lengths 16..48 and output lengths 8..G*2 (seeded). Target >= 3x
   at B = 32.

The model is a random-weight Llama built with `transformers` (hidden 512, 8 layers, GQA 8/4
heads, vocab 8192) in float32 on CPU (bfloat16 on GPU). tokens/s counts generated tokens per
second of process CPU time on CPU (so other tenants of a shared machine do not skew the
ratios) and per second of wall time on GPU.

Usage: python bench/engine_overhead.py [--batches 1 8 32] [--prompt 32] [--gen 32]
       [--threads N] [--device auto|cpu|cuda] [--repeat 2]
Each figure is the best of --repeat runs, the contenders interleaved.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

import torch

from paraflex.config.schema import Config
from paraflex.engine.worker.attention import AttentionMetadata
from paraflex.engine.engine_builder import choose_device, choose_dtype
from paraflex.engine.worker.model import Stage
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.engine.worker.weights import load_stage_weights
from paraflex.placement import EnginePlacement, ModelPlacement, Placement, StageRef
from paraflex.serving.in_process import LLMCluster
from paraflex.cpu_info import machine_line

LAYERS = 8
# On CPU the figures are tokens per CPU-second of this process (time.process_time): on a shared
# machine, wall time mostly measures the other tenants. On GPU: wall time (synchronised).
CLOCK = time.process_time


def build_checkpoint(directory: str) -> "torch.nn.Module":
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1376, num_hidden_layers=LAYERS,
                      num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=1024,
                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(cfg).eval()
    model.save_pretrained(directory)
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(8192)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(os.path.join(directory, "tokenizer.json"))  # the runtime wants one; the bench sends ids
    return model


def placement(cuts) -> Placement:
    engines = [EnginePlacement(i, [StageRef("bench", 0, i)], 0, {"bench": 64 << 20}) for i in range(len(cuts))]
    return Placement(1, "bench", {}, 0.0, {"bench": ModelPlacement("bench", LAYERS, cuts, [list(range(len(cuts)))])}, engines)


def config(directory: str, num_engines: int, batch: int) -> Config:
    return Config.from_dict({
        "cluster": {"num_engines": num_engines, "device": "cpu", "memory_gb": 1},
        "models": [{"name": "bench", "hf": directory}],
        "scheduler": {"max_batch_size": batch, "block_bytes": 32768, "prefill_token_budget": 4096},
    })


def prompts(n: int, length: int, seed: int = 1) -> list[list[int]]:
    g = random.Random(seed)
    return [[g.randrange(3, 8192) for _ in range(length)] for _ in range(n)]


def run_runtime(cluster: LLMCluster, workload) -> float:
    """workload: [(prompt ids, new tokens)]; returns generated tokens/s."""
    for p, g in workload:
        cluster.submit("bench", p, SamplingParams(max_tokens=g, temperature=0.0, ignore_eos=True))
    t0 = CLOCK()
    cluster.run_until_idle()
    return sum(g for _, g in workload) / (CLOCK() - t0)


def run_bare(stage: Stage, device, dtype, batch: int, prompt_len: int, gen: int) -> float:
    """The model forward alone: prefill every prompt, then `gen - 1` batched decode steps."""
    tpb = 32768 // (2 * 4 * 64 * torch.empty((), dtype=dtype).element_size())
    per_seq = -(-(prompt_len + gen) // tpb)
    kv = torch.zeros(batch * per_seq * LAYERS, 2, tpb, 4, 64, dtype=dtype, device=device)
    tables = [[list(range((layer * batch + i) * per_seq, (layer * batch + i + 1) * per_seq)) for i in range(batch)]
              for layer in range(LAYERS)]
    ps = prompts(batch, prompt_len)
    t0 = CLOCK()
    toks = []
    for i, p in enumerate(ps):  # one prefill per request, like the runtime's default policy
        meta = AttentionMetadata.build([prompt_len], [prompt_len], [[t[i]] for t in tables], tpb, device)
        toks.append(int(stage.forward(torch.tensor(p, device=device), meta, kv).argmax(-1)[0]))
    cur = torch.tensor(toks, device=device)
    for step in range(1, gen):
        ctx = prompt_len + step
        meta = AttentionMetadata.build([1] * batch, [ctx] * batch, tables, tpb, device)
        cur = stage.forward(cur, meta, kv).argmax(-1)
    cur.cpu()
    return batch * gen / (CLOCK() - t0)


def run_hf(model, workload, batch: int, device) -> float:
    t0 = CLOCK()
    for k in range(0, len(workload), batch):
        chunk = workload[k:k + batch]
        width = max(len(p) for p, _ in chunk)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in chunk], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in chunk], device=device)
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=max(g for _, g in chunk), do_sample=False,
                           pad_token_id=0, eos_token_id=None)
    return sum(g for _, g in workload) / (CLOCK() - t0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--prompt", type=int, default=32)
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                    help="torch intra-op threads (default: all cores; use 1 on a loaded machine)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--repeat", type=int, default=2, help="runs per measurement; the best is kept (shared machines are noisy)")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = choose_device(args.device)
    dtype = choose_dtype(device)
    global CLOCK
    if device.type == "cuda":
        def CLOCK():  # noqa: N802 - wall clock after the queued GPU work
            torch.cuda.synchronize(device)
            return time.perf_counter()
    print(f"machine: {machine_line()}, "
          f"torch={torch.__version__} threads={torch.get_num_threads()} device={device}"
          + (f" ({torch.cuda.get_device_name(device)})" if device.type == "cuda" else "") + f" dtype={dtype}")
    print(f"clock: {'wall time' if device.type == 'cuda' else 'process CPU time'}")
    print(f"model: random Llama, {LAYERS} layers, hidden 512, GQA 8/4, vocab 8192; prompt {args.prompt}, "
          f"{args.gen} new tokens")
    with tempfile.TemporaryDirectory() as d:
        hf = build_checkpoint(d).to(device=device, dtype=dtype)
        from paraflex.models.arch_files import arch_from_hf_config

        arch = arch_from_hf_config(d)
        whole = Stage(arch, 0, LAYERS, load_stage_weights(d, arch, 0, LAYERS, dtype, device, "hf"), device)
        run_bare(whole, device, dtype, 1, 8, 4)  # warm-up
        rows = []
        for b in args.batches:
            uniform = [(p, args.gen) for p in prompts(b, args.prompt)]
            one = LLMCluster(config(d, 1, b), placement([(0, LAYERS)]), device=device, dtype=dtype)
            two = LLMCluster(config(d, 2, b), placement([(0, LAYERS // 2), (LAYERS // 2, LAYERS)]), device=device, dtype=dtype)
            run_runtime(one, uniform[:1])  # warm-up
            g = random.Random(b)
            mixed = [(p[: g.randrange(16, 49)], g.randrange(8, 2 * args.gen + 1)) for p in prompts(2 * b, 48, seed=b)]
            best = [0.0] * 5
            for _ in range(args.repeat):  # interleaved, so load changes hit every contender
                runs = (run_bare(whole, device, dtype, b, args.prompt, args.gen), run_runtime(one, uniform),
                        run_runtime(two, uniform), run_hf(hf, mixed, b, device), run_runtime(one, mixed))
                best = [max(x, y) for x, y in zip(best, runs)]
            bare, rt1, rt2, hf_tps, rt_mixed = best
            rows.append((b, bare, rt1, rt2, hf_tps, rt_mixed))
            print(f"batch {b:>3}: bare {bare:8.1f} tok/s | runtime 1 stage {rt1:8.1f} ({rt1 / bare:.2f}x bare) | "
                  f"2 stages {rt2:8.1f} ({rt2 / bare:.2f}x bare) | mixed workload: runtime {rt_mixed:8.1f} vs "
                  f"transformers {hf_tps:8.1f} ({rt_mixed / hf_tps:.2f}x)", flush=True)
    print("\nsummary (targets: runtime/bare >= 0.9 for one stage; runtime/transformers >= 3 at batch 32)")
    print(f"{'batch':>5} {'bare':>9} {'rt-1st':>9} {'rt-2st':>9} {'1st/bare':>9} {'2st/bare':>9} {'hf':>9} {'rt-mixed':>9} {'rt/hf':>7}")
    for b, bare, rt1, rt2, hf_tps, rtm in rows:
        print(f"{b:>5} {bare:9.1f} {rt1:9.1f} {rt2:9.1f} {rt1 / bare:9.2f} {rt2 / bare:9.2f} {hf_tps:9.1f} {rtm:9.1f} {rtm / hf_tps:7.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
