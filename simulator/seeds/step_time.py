"""Whole-model step times for the seed systems' engines, from the simulator's cost model.

A seed engine runs every layer of a model (no pipeline stages): prefill of a prompt, one decode
step of a batch, or a chunked-prefill step (prompt chunks + decodes, Sarathi style, the same
`mixed_time` the ParaFlex simulator uses). Cached per shape, as `SimEngine` caches its own.
"""

from __future__ import annotations

from paraflex.simulator.core.sim_engine import mixed_time


class ModelTimer:
    def __init__(self, cost):
        self.cost = cost
        self._prefill: dict = {}

    def prefill(self, arch, num_tokens: int) -> float:
        key = (arch, num_tokens)
        t = self._prefill.get(key)
        if t is None:
            t = self._prefill[key] = self.cost.prefill_time(arch, arch.num_layers, max(1, num_tokens), first=True, last=True)
        return t

    def decode(self, arch, batch_size: int, total_context: int) -> float:
        return self.cost.decode_time(arch, arch.num_layers, batch_size, max(batch_size, total_context), first=True, last=True)

    def step(self, arch, prefill_tokens: int, num_seqs: int, batch_size: int, total_context: int) -> float:
        if not batch_size:
            return self.cost.prefill_time(arch, arch.num_layers, prefill_tokens, first=True, last=True, num_seqs=num_seqs)
        if not prefill_tokens:
            return self.decode(arch, batch_size, total_context)
        return mixed_time(self.cost, arch, arch.num_layers, True, True, prefill_tokens, num_seqs, batch_size, total_context)
