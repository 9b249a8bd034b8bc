"""One request's state inside a seed cluster: its metrics record, progress and KV footprint."""

from __future__ import annotations


class SeedRequest:
    __slots__ = ("rid", "model", "arch", "prompt_len", "output_len", "rec", "generated", "prefilled", "kv_ready",
                 "admitted", "deadline", "held")

    def __init__(self, req, arch, rec, ttft_slo: float):
        self.rid = req.id
        self.model = req.model
        self.arch = arch
        self.prompt_len = req.prompt_len
        self.output_len = req.output_len
        self.rec = rec
        self.generated = 0  # tokens emitted so far
        self.prefilled = 0  # prompt (or recompute) tokens whose KV exists
        self.kv_ready = 0.0  # when its KV can be used where it waits (Aegaeon: in host memory)
        self.admitted = -1.0
        self.deadline = req.arrival + ttft_slo  # Prism's TTFT deadline
        self.held = 0  # KV bytes it holds on a shared GPU (colocated_cluster.py)

    @property
    def context(self) -> int:
        """Tokens whose KV this request holds once prefilled: prompt + generated so far."""
        return self.prompt_len + self.generated

    def kv_bytes(self, tokens: int | None = None) -> int:
        return (self.context if tokens is None else tokens) * self.arch.kv_bytes_per_token()

    @property
    def done(self) -> bool:
        return self.generated >= self.output_len
