"""Scheduling decisions per second of the engine-local scheduler (engine/core/scheduler.py).

Place in the project: a benchmark (not a test). It checks the claim that the scheduler never
limits a GPU step or the simulator: target >= 20,000 decisions/s with 64 resident stages and
1,000 live requests on one engine.

Set-up: one engine hosting 64 stages of 64 models (32 first stages of 3-stage models, 32 last
stages of 2-stage models), 1,000 live requests spread over them, max batch 32, full-batch-first.
A synthetic driver keeps the population at exactly 1,000: it feeds every completed batch's
requests straight back (a token for first stages, the next decode step from "upstream" for
later stages) and replaces each finished request with a new one. Only `schedule()` +
`complete()` are timed; the synthetic driver is not.

Peer, measured in the same run: BASELINE "naive re-sort" - the same full-batch-first rules and
the same batch builders, but every decision rescans all live requests and sorts the candidates
from scratch (what a straightforward implementation does). Both make identical decisions; the
bench asserts it over the baseline's run.

Usage: python bench/scheduler_speed.py [--decisions 20000] [--baseline-decisions 3000] [--seed 0]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.messages import BatchMessage, DecodeEntry, PrefillEntry, TokenEntry, TokenMessage
from paraflex.engine.core.policies.full_batch_first import FULL_DECODE, PREFILL, SMALL_DECODE, FullBatchFirst
from paraflex.engine.core.request import SWAPPED_DECODE, WAITING_DECODE, WAITING_PREFILL
from paraflex.engine.core.scheduler import EngineScheduler
from paraflex.cpu_info import machine_line

STAGES = 64
LIVE = 1000
BATCH = 32


class NaiveResort(FullBatchFirst):
    """BASELINE for the ratio: full-batch-first by rescanning and re-sorting every decision."""

    name = "naive-resort-baseline"

    def pick(self, sched, now):
        ready_of = {}
        for req in sched.live_requests():  # rescan every live request
            if req.state in (WAITING_PREFILL, WAITING_DECODE, SWAPPED_DECODE):
                ready_of.setdefault((req.model, req.stage), []).append(req)
        cands = []  # (class, head arrival key, queue)
        for st in sched.stages:
            if st.key not in ready_of:
                continue
            if st.is_first:
                dec = sorted((r for r in ready_of[st.key] if r.state != WAITING_PREFILL), key=lambda r: r.key)
                pre = sorted((r for r in ready_of[st.key] if r.state == WAITING_PREFILL), key=lambda r: r.key)
                if dec:
                    cands.append((FULL_DECODE if len(dec) >= sched.max_batch_size else SMALL_DECODE, dec[0].key, st.decode_q))
                if pre:
                    cands.append((PREFILL, pre[0].key, st.prefill_q))
            else:
                for cls, q in ((FULL_DECODE, st.full_q), (PREFILL, st.prefill_q), (SMALL_DECODE, st.decode_q)):
                    if q.items:
                        cands.append((cls, sorted(q.items, key=lambda b: b.key)[0].key, q))
        cands.sort(key=lambda c: (c[0], c[1]))
        for _, _, q in cands:
            batch = self.attempt(sched, q, now)
            if batch is not None:
                return batch
        return None


class Driver:
    """Keeps LIVE requests on one engine and feeds each completed batch straight back."""

    def __init__(self, policy_cls, seed: int):
        self.rng = random.Random(seed)
        pool = BlockPool(400_000, 32768, 100_000)
        self.s = EngineScheduler(pool, max_batch_size=BATCH, prefill_token_budget=4096)
        if policy_cls is not None:
            self.s.policy = policy_cls()  # same classes as full-batch-first; its own pick
        for i in range(STAGES):
            layers = 1 + i % 4
            if i % 2 == 0:
                self.s.add_stage(f"m{i}", 0, layers, 256 * (1 + i % 3), 3)
            else:
                self.s.add_stage(f"m{i}", 1, layers, 256 * (1 + i % 3), 2)
        self.n = 0
        self.now = 0.0
        self.left: dict[str, int] = {}
        for _ in range(LIVE):
            self.new_request()

    def new_request(self) -> None:
        st = self.s.stages[self.rng.randrange(STAGES)]
        rid = f"r{self.n}"
        self.n += 1
        self.now += 1e-3
        prompt = self.rng.randint(16, 512)
        out = self.rng.randint(4, 64)
        self.left[rid] = out
        if st.is_first:
            self.s.add_request(rid, st.model, prompt, out, self.now)
        else:
            self.s.receive_batch(BatchMessage(st.model, 1, f"up{rid}", "prefill", [PrefillEntry(rid, 0, prompt, prompt, out, self.now)]))

    def feed_back(self, batch, done) -> None:
        """What the rest of the cluster would send back, immediately."""
        if batch.is_first:  # tokens come back from the (elsewhere) last stage
            entries = []
            for r in batch.requests:
                self.left[r.req_id] -= 1
                entries.append(TokenEntry(r.req_id, 7, r.context_len, self.left[r.req_id] == 0, None))
            self.s.receive_tokens(TokenMessage(batch.model, batch.batch_id, entries))
            finished = sum(1 for e in entries if e.finished)
        else:  # the last stage sampled; upstream sends the next decode step as one batch
            live = [e for e in done.token_message.entries if not e.finished]
            finished = len(done.finished)
            if live:
                self.s.receive_batch(BatchMessage(batch.model, 1, batch.batch_id + "+", "decode",
                                                  decodes=[DecodeEntry(e.req_id, 7, e.position) for e in live]))
        for _ in range(finished):
            self.new_request()

    def run(self, decisions: int) -> tuple[float, float, list]:
        """Returns (CPU seconds, wall seconds) inside schedule()+complete(), and the decision trace."""
        timed = wall = 0.0
        trace = []
        s = self.s
        cpu, clock = time.process_time, time.perf_counter  # CPU time: robust on a shared machine
        for _ in range(decisions):
            t0, w0 = cpu(), clock()
            batch = s.schedule(self.now)
            done = s.complete(batch)
            wall += clock() - w0
            timed += cpu() - t0
            trace.append((batch.model, batch.kind, tuple(batch.req_ids)))
            self.feed_back(batch, done)
            assert s.num_live == LIVE
        return timed, wall, trace


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--decisions", type=int, default=20000, help="decisions timed for the real scheduler")
    ap.add_argument("--baseline-decisions", type=int, default=3000, help="decisions timed for the naive baseline")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    print(f"machine: {machine_line()}")
    print(f"set-up: {STAGES} resident stages, {LIVE} live requests, max batch {BATCH}, full-batch-first")
    print("warming up ...", flush=True)
    Driver(None, args.seed).run(500)

    print(f"timing engine scheduler over {args.decisions} decisions ...", flush=True)
    fast = Driver(None, args.seed)
    t_fast, w_fast, trace_fast = fast.run(args.decisions)
    print(f"timing BASELINE naive-resort over {args.baseline_decisions} decisions ...", flush=True)
    naive = Driver(NaiveResort, args.seed)
    t_naive, w_naive, trace_naive = naive.run(args.baseline_decisions)
    n = min(len(trace_fast), len(trace_naive))
    same = trace_fast[:n] == trace_naive[:n]

    rate_fast = args.decisions / t_fast
    rate_naive = args.baseline_decisions / t_naive
    kinds = {k: sum(1 for _, kind, _ in trace_fast if kind == k) for k in ("prefill", "decode", "mixed")}
    mean_batch = sum(len(ids) for _, _, ids in trace_fast) / len(trace_fast)
    print()
    print(f"{'scheduler':34s} {'decisions':>10s} {'CPU s':>8s} {'decisions/s':>12s} {'us/decision':>12s} {'wall dec/s':>11s}")
    print(f"{'engine scheduler (paraflex)':34s} {args.decisions:10d} {t_fast:8.3f} {rate_fast:12.0f} {1e6 / rate_fast:12.1f} {args.decisions / w_fast:11.0f}")
    print(f"{'BASELINE naive re-sort (peer)':34s} {args.baseline_decisions:10d} {t_naive:8.3f} {rate_naive:12.0f} {1e6 / rate_naive:12.1f} {args.baseline_decisions / w_naive:11.0f}")
    print(f"ratio engine / baseline: {rate_fast / rate_naive:.1f}x   (same decisions over the first {n}: {'yes' if same else 'NO'})")
    print(f"batches: {kinds}, mean batch size {mean_batch:.1f}; swaps: {fast.s.stats['swap_outs']}")
    print(f"(decisions/s from this process's CPU time; wall-clock figures beside it; load average {os.getloadavg()[0]:.1f})")
    target = 20000
    print(f"target >= {target} decisions/s: {'met' if rate_fast >= target else 'NOT met'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
