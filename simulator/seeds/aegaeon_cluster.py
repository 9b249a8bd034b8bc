"""Aegaeon (SOSP'25) as a simulated cluster: prefill and decode pools with token-level model switches.

Engines 0..P-1 are prefill instances, the rest decode instances (P from the layout: the paper's
6:10 split by default). Nothing is resident at start: every model's weights live in host memory
(the Model Cache) and are loaded on demand, so more models than GPU memory can be served.

Request flow: arrival -> grouped FCFS (grouped_fcfs.py) picks a prefill instance -> that instance
runs its front group one request at a time, switching model when the group's model is not the
running one (switching.py's Eq. 4, or what is left of a prefetch started when the previous
request began) -> the prefill emits the first token; the KV goes to host memory over the host
link (the request is ready for decode when it lands) -> a decode work list (decode_worklist.py)
takes it; each decode instance runs rounds of turns, a turn = switch to the batch's model, swap
the batch's KV in (the previous batch's KV goes out in the background), decode steps until the
quota (wrr_quota.py) is spent; the next turn's model is prefetched when it fits.
"""

from __future__ import annotations

from paraflex.errors import UserError
from paraflex.simulator.seeds.decode_worklist import WorkList, dispatch_decode, split_overflow
from paraflex.simulator.seeds.grouped_fcfs import GroupedFCFS
from paraflex.simulator.seeds.instance import Instance
from paraflex.simulator.seeds.seed_cluster import SeedCluster
from paraflex.simulator.seeds.switching import aegaeon_switch_time

INF = float("inf")


class AegaeonCluster(SeedCluster):
    def __init__(self, config, layout, settings, loop, metrics, cost=None):
        super().__init__(config, layout, settings, loop, metrics, cost)
        n, p = layout.placement.num_engines, self.params["prefill_engines"]
        for name, w in self.weight_bytes.items():
            if w >= self.memory:
                raise UserError(f"aegaeon: model {name!r} needs {w / 2**30:.1f} GiB of weights, more than one engine's "
                                f"{self.memory / 2**30:.1f} GiB; raise cluster.memory_gb or cluster.tp")
        self.beta = self.params["beta"]
        self.q_max = self.params["q_max_s"]
        self.prefill = [Instance(i, "prefill", self.memory) for i in range(p)]
        self.decode = [Instance(i, "decode", self.memory) for i in range(p, n)]
        self.engines = self.prefill + self.decode
        self.fcfs = GroupedFCFS(p, lambda r: self.timer.prefill(r.arch, r.prompt_len), self.switch_time,
                                self.params["max_group"])
        self.worklists = [WorkList() for _ in self.decode]
        self._switch: dict[str, float] = {}

    def switch_time(self, model: str) -> float:
        t = self._switch.get(model)
        if t is None:
            t = self._switch[model] = aegaeon_switch_time(self.weights(model), self.link_Bps, self.beta)
        return t

    # --- prefill --------------------------------------------------------------------------
    def admit(self, req, t: float) -> None:
        r = self.new_request(req)
        i, _ = self.fcfs.dispatch(r, r.model, [inst.active for inst in self.prefill])
        self.run_prefill(self.prefill[i], t)

    def run_prefill(self, inst: Instance, t: float) -> None:
        if inst.busy:
            return
        nxt = self.fcfs.next_request(inst.id)
        if nxt is None:
            return
        model, r = nxt
        ready = inst.switch_to(model, t, self.switch_time, self.metrics)
        inst.prefetch(self.fcfs.next_model_after(inst.id, model), ready, r.kv_bytes(), self.weights, self.switch_time)
        end = ready + self.timer.prefill(r.arch, r.prompt_len)
        inst.busy = True
        self.metrics.batch(inst.id, ready, end, True, 1, 1)
        self.at(end, self.prefill_done, inst, r)

    def prefill_done(self, inst: Instance, r, t: float) -> None:
        inst.busy = False
        r.prefilled = r.prompt_len
        if not self.emit([r], t):
            nbytes = r.kv_bytes()
            self.metrics.swap(nbytes, 0)
            r.kv_ready = t + nbytes / self.link_Bps  # to host memory; D2H overlaps the next prefill
            j = dispatch_decode(self.worklists, r, r.arch, self.fits)
            self.at(r.kv_ready, self.wake_decode, j)
        self.run_prefill(inst, t)

    def fits(self, j: int, batch, r) -> bool:
        return batch.kv_bytes() + r.kv_bytes() <= self.decode[j].room_for_kv(batch.model, self.weights)

    # --- decode ---------------------------------------------------------------------------
    def wake_decode(self, j: int, t: float) -> None:
        self.run_decode(j, t)

    def start_round(self, wl: WorkList) -> None:
        slos = self.metrics.slos
        wl.start_round(lambda b: self.timer.decode(b.arch, len(b.requests), sum(r.context for r in b.requests)),
                       lambda m: slos[m].tbt_s, self.switch_time, self.q_max)

    def run_decode(self, j: int, t: float) -> None:
        inst, wl = self.decode[j], self.worklists[j]
        if inst.busy:
            return
        skipped = 0
        while True:
            if wl.turn >= len(wl.round):
                self.start_round(wl)
                if not wl.round:
                    return
            batch, quota = wl.round[wl.turn]
            if inst.turn_batch is not batch:
                if not any(r.kv_ready <= t for r in batch.requests):
                    wl.turn += 1
                    skipped += 1
                    if skipped > len(wl.round):
                        return  # nothing can run: a KV arrival wakes the instance
                    continue
                self.begin_turn(inst, wl, batch, t)
            elif inst.used >= quota or not batch.requests:
                inst.turn_batch = None
                wl.turn += 1
                continue
            if self.step(j, inst, wl, batch, t):
                return
            inst.turn_batch = None  # no request of this batch can run: end the turn
            wl.turn += 1

    def begin_turn(self, inst: Instance, wl: WorkList, batch, t: float) -> None:
        ready = inst.switch_to(batch.model, t, self.switch_time, self.metrics)
        if inst.kv_batch is not batch:  # the previous batch's KV goes out in the background
            inst.on_gpu = {}
            inst.kv_batch = batch
        inst.decode_from = max(ready, self.load_kv(inst, batch, max(t, ready)))
        following = wl.round[(wl.turn + 1) % len(wl.round)][0].model
        inst.prefetch(following, inst.decode_from, batch.kv_bytes(), self.weights, self.switch_time)
        inst.turn_batch = batch
        inst.used = 0.0

    def load_kv(self, inst: Instance, batch, t: float) -> float:
        """Swap in the KV of the batch's requests that sit in host memory; return when the
        first can decode (decoding starts as soon as one request's KV is in, §5.3)."""
        first = INF
        for r in batch.requests:
            if r.rid not in inst.on_gpu and r.kv_ready <= t:
                nbytes = r.kv_bytes()
                self.metrics.swap(0, nbytes)
                inst.link_free = max(t, inst.link_free) + nbytes / self.link_Bps
                inst.on_gpu[r.rid] = inst.link_free
            first = min(first, inst.on_gpu.get(r.rid, INF))
        return first

    def step(self, j: int, inst: Instance, wl: WorkList, batch, t: float) -> bool:
        """Start one decode step of `batch` (or wait for its KV); False if nothing can run."""
        first = self.load_kv(inst, batch, t)
        if first == INF:
            return False
        start = max(first, inst.decode_from)
        if start > t:
            self.at(start, self.wake_decode, j)
            return True
        room = inst.room_for_kv(batch.model, self.weights)
        runnable = [r for r in batch.requests if inst.on_gpu.get(r.rid, INF) <= t]
        if sum(r.kv_bytes(r.context + 1) for r in runnable) > room:
            split_overflow(wl, batch, room)
            runnable = [r for r in runnable if r in batch.requests]
        dt = self.timer.decode(batch.arch, len(runnable), sum(r.context for r in runnable))
        end = t + dt
        inst.busy = True
        self.metrics.batch(inst.id, t, end, False, len(runnable), len(runnable))
        self.at(end, self.decode_done, j, batch, runnable, dt)
        return True

    def decode_done(self, j: int, batch, runnable, dt: float, t: float) -> None:
        inst = self.decode[j]
        inst.busy = False
        inst.used += dt
        for r in self.emit(runnable, t):
            batch.requests.remove(r)
            inst.on_gpu.pop(r.rid, None)
        self.run_decode(j, t)
