"""MuxServe and Prism as a simulated cluster: models co-located on GPUs, sharing compute by time
slicing and KV memory on demand.

Interference model (neither paper gives one for the simulator to copy): a GPU runs one model's
engine step at a time, round-robin over its resident models that have admitted requests, so a
model's step waits for its neighbours' steps (pure time slicing: MPS's spatial overlap of
memory-bound decode steps is not credited). Each model's step is chunked prefill (SGLang /
Sarathi style: up to `chunk_tokens` prompt tokens plus every decode of its running requests).

Per GPU: one request queue; admission (`fcfs` for MuxServe, `moore-hodgson` for Prism: deadline
= arrival + TTFT SLO, job = prompt / chunked-prefill speed, moore_hodgson.py) dispatches while the
request's KV fits the shared pool now, up to `max_batch` running requests per model. A decode
step that would outgrow the pool preempts the newest request of the GPU (it is recomputed later,
its emitted tokens stand). Prism only (`evict`): a request for an evicted model activates it on
the ready GPU of lowest KVPR that has room after evicting idle models (idle_eviction.py),
costing the Fig. 9 activation time (switching.py); if no GPU has room it waits for one.
"""

from __future__ import annotations

from paraflex.simulator.seeds.idle_eviction import models_to_evict
from paraflex.simulator.seeds.kvpr import kvpr
from paraflex.simulator.seeds.moore_hodgson import moore_hodgson
from paraflex.simulator.seeds.seed_cluster import SeedCluster
from paraflex.simulator.seeds.shared_gpu import SharedGPU
from paraflex.simulator.seeds.switching import prism_activation_time


class ColocatedCluster(SeedCluster):
    def __init__(self, config, layout, settings, loop, metrics, cost=None):
        super().__init__(config, layout, settings, loop, metrics, cost)
        p = self.params
        self.chunk = p["chunk_tokens"]
        self.max_batch = config.scheduler.max_batch_size
        self.evict = p["evict"]
        self.gpus = self.engines = [SharedGPU(i, self.memory) for i in range(layout.placement.num_engines)]
        self.home: dict[str, SharedGPU | None] = {}
        for name, mp in layout.placement.models.items():
            self.home[name] = self.gpus[mp.replicas[0][0]] if mp.replicas else None
            if self.home[name] is not None:
                self.home[name].load(name, self.weights(name), 0.0)
        self.ttft_slo = {m: metrics.slos[m].ttft_s for m in self.archs}
        self.w_rate = {m: p["rates"][m] / self.ttft_slo[m] for m in self.archs}
        self.awaiting: dict[str, list] = {}  # evicted model -> its requests, until a GPU has room for it
        self.retry_at = -1.0
        self._speed: dict[str, float] = {}

    # --- arrivals and activation ---------------------------------------------------------
    def admit(self, req, t: float) -> None:
        r = self.new_request(req)
        gpu = self.home[r.model]
        if gpu is None:
            self.awaiting.setdefault(r.model, []).append(r)
            if not self.activate(r.model, t):
                self.retry_later(t)
            return
        gpu.queue.append(r)
        gpu.last_used[r.model] = t
        self.run(gpu, t)

    def activate(self, model: str, t: float) -> bool:
        """Load an evicted model on the lowest-KVPR GPU with room (evicting idle models there)."""
        need = self.weights(model) + self.archs[model].max_context * self.archs[model].kv_bytes_per_token()
        slos = self.ttft_slo
        order = sorted(self.gpus, key=lambda g: (kvpr(sum(self.w_rate[m] for m in g.ready_at), g.memory - g.weights), g.id))
        for gpu in order:
            victims = models_to_evict(gpu, need, t, self.params["idle_s"], slos, self.weights)
            if victims is None:
                continue
            for m in victims:
                gpu.unload(m, self.weights(m))
                self.home[m] = None
            ready = t + prism_activation_time(self.archs[model].num_params())
            self.metrics.switch(ready - t)
            gpu.load(model, self.weights(model), ready)
            self.home[model] = gpu
            gpu.queue.extend(self.awaiting.pop(model))
            gpu.last_used[model] = t
            self.at(ready, self.run, gpu)
            return True
        return False

    def retry_later(self, t: float) -> None:
        """No GPU had room: models become evictable once idle long enough, so try again then."""
        at = t + self.params["idle_s"]
        if self.retry_at <= t:  # no retry pending
            self.retry_at = at
            self.at(at, self.retry_activations)

    def retry_activations(self, t: float) -> None:
        for m in list(self.awaiting):
            self.activate(m, t)
        if self.awaiting:
            self.retry_later(t)

    # --- admission and steps --------------------------------------------------------------
    def speed(self, model: str) -> float:
        """Chunked-prefill speed c_r (tokens/s) of a model alone on a GPU."""
        c = self._speed.get(model)
        if c is None:
            c = self._speed[model] = self.chunk / self.timer.step(self.archs[model], self.chunk, 1, 0, 0)
        return c

    def admit_from_queue(self, gpu: SharedGPU, t: float) -> None:
        ready = [r for r in gpu.queue if gpu.is_ready(r.model, t)]
        if not ready:
            return
        if self.params["admission"] == "moore-hodgson":
            schedule, late = moore_hodgson(ready, t, lambda r: r.deadline, lambda r: r.prompt_len / self.speed(r.model))
            ready = schedule + late
        for r in ready:
            if len(gpu.running[r.model]) >= self.max_batch:
                continue
            need = r.kv_bytes()
            if need > gpu.free_bytes() and not self.make_room(gpu, need, t):
                break
            gpu.queue.remove(r)
            gpu.hold(r, need)
            r.prefilled = 0
            r.admitted = t
            gpu.running[r.model].append(r)

    def make_room(self, gpu: SharedGPU, need: int, t: float) -> bool:
        if not self.evict:
            return False
        victims = models_to_evict(gpu, need, t, self.params["idle_s"], self.ttft_slo, self.weights)
        if not victims:
            return False
        for m in victims:
            gpu.unload(m, self.weights(m))
            self.home[m] = None
        return gpu.free_bytes() >= need

    def run(self, gpu: SharedGPU, t: float) -> None:
        if gpu.busy:
            return
        self.admit_from_queue(gpu, t)
        model = gpu.next_model(t)
        if model is None:
            if gpu.queue and self.evict and not any(gpu.running.values()):
                self.at(t + self.params["idle_s"], self.run, gpu)  # room comes when a neighbour turns evictable
            return
        running = gpu.running[model]
        decodes = [r for r in running if r.prefilled >= r.context]
        grow = len(decodes) * self.archs[model].kv_bytes_per_token()
        while grow > gpu.free_bytes() and decodes:
            self.preempt(gpu, decodes)
            grow = len(decodes) * self.archs[model].kv_bytes_per_token()
        chunks, budget = [], self.chunk
        for r in running:
            if r.prefilled < r.context and budget > 0:
                n = min(budget, r.context - r.prefilled)
                chunks.append((r, n))
                budget -= n
        if not decodes and not chunks:
            return
        for r in decodes:
            gpu.hold(r, r.arch.kv_bytes_per_token())
        dt = self.timer.step(self.archs[model], self.chunk - budget, len(chunks), len(decodes), sum(r.context for r in decodes))
        gpu.busy = True
        self.metrics.batch(gpu.id, t, t + dt, not decodes, len(decodes) + len(chunks), len(decodes) + len(chunks))
        self.at(t + dt, self.step_done, gpu, model, decodes, chunks)

    def preempt(self, gpu: SharedGPU, decodes: list) -> None:
        """Free the newest admitted request's KV on this GPU; it goes back to the queue's front."""
        victim = max((r for rs in gpu.running.values() for r in rs), key=lambda r: r.admitted)
        gpu.running[victim.model].remove(victim)
        if victim in decodes:
            decodes.remove(victim)
        gpu.release(victim)
        self.metrics.swap(victim.kv_bytes(), 0)  # recompute: counted as KV dropped
        gpu.queue.insert(0, victim)

    def step_done(self, gpu: SharedGPU, model: str, decodes: list, chunks: list, t: float) -> None:
        gpu.busy = False
        firsts = []
        for r, n in chunks:
            r.prefilled += n
            if r.prefilled >= r.context and r.generated == 0:
                firsts.append(r)
        emitted = decodes + firsts
        finished = self.emit(emitted, t)
        for r in finished:
            gpu.running[r.model].remove(r)
            gpu.release(r)
        for r in emitted:
            r.prefilled = r.context  # in decode: the next step writes the new token's KV
        gpu.last_used[model] = t
        if finished and self.awaiting:  # KV freed: a waiting model may fit now
            self.retry_activations(t)
        self.run(gpu, t)
