"""Measured per-step residuals: what a served engine spends on one stage execution beyond the
cost model's op times (scheduling, attention metadata and the attention kernel itself, sampling,
Python between ops), read from a profile directory's ``profile.json``.

Place in the data flow: `paraflex profile` measures whole engine steps of each model on this
machine (paraflex/serving/step_profiler.py) and subtracts the cost model's prediction from its
tables; `CostModel(profile_dir=...)` adds the residual to every prefill and decode stage time,
pro rata to the stage's share of the model's layers, so the planner and the simulator predict a
served engine rather than its bare ops. Each residual is a line in the step's size, fitted over
the sizes the profiler ran: `prefill_s + prefill_per_token_s * tokens` for a prefill and
`decode_s + decode_per_seq_s * batch` for a decode step (`fit_line`; a profile.json written
before the slopes were measured reads as flat lines), on a GPU plus `prefill_per_extra_seq_s` per
prompt packed beyond the first and `decode_per_context_s` per token of the batch's context (the
attention kernel beyond the roofline's; both 0 in a CPU profile). Entries are matched to a model by its shape, vocabulary
and depth (tables match by shape alone: the residual also holds per-step costs that do not scale
with layers). A negative residual (the tables over-predict a whole step) is written as measured
and used as zero where the line is negative: a residual adds time, never removes it.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass

from paraflex.costs.profile_tables import shape_of

PROFILE_FILE = "profile.json"
KEY = "step_overheads"
NOISE_KEY = "noise"  # how noisy the op tables and step timings were (written by `paraflex profile`)


@dataclass(frozen=True)
class StepOverhead:
    """One model's measured residual per whole-model engine step (seconds)."""

    model: str
    n_head: int
    n_kv_head: int
    n_embd: int
    n_expanded_embd: int
    use_gated_mlp: bool
    vocab_size: int
    num_layers: int
    prefill_s: float  # intercept of the prefill residual
    decode_s: float  # intercept of the decode residual
    prefill_per_token_s: float = 0.0
    decode_per_seq_s: float = 0.0
    prefill_per_extra_seq_s: float = 0.0  # each prompt packed into a prefill beyond the first
    decode_per_context_s: float = 0.0  # each token of the decode batch's summed context

    @classmethod
    def of(cls, model: str, arch, prefill_s: float, decode_s: float, prefill_per_token_s: float = 0.0,
           decode_per_seq_s: float = 0.0, prefill_per_extra_seq_s: float = 0.0,
           decode_per_context_s: float = 0.0) -> "StepOverhead":
        s = shape_of(arch)
        return cls(model, s.n_head, s.n_kv_head, s.n_embd, s.n_expanded_embd, s.use_gated_mlp, arch.vocab_size,
                   arch.num_layers, prefill_s, decode_s, prefill_per_token_s, decode_per_seq_s,
                   prefill_per_extra_seq_s, decode_per_context_s)

    def whole_model(self, prefill: bool, size: int, num_seqs: int = 1, context: int = 0) -> float:
        """Residual of one whole-model step of `size` tokens in `num_seqs` prompts (prefill) or
        `size` requests of `context` tokens of context in all (decode), >= 0."""
        line = (self.prefill_s + self.prefill_per_token_s * size + self.prefill_per_extra_seq_s * (num_seqs - 1)
                if prefill else self.decode_s + self.decode_per_seq_s * size + self.decode_per_context_s * context)
        return max(0.0, line)

    def key(self) -> tuple:
        return (self.n_head, self.n_kv_head, self.n_embd, self.n_expanded_embd, self.use_gated_mlp,
                self.vocab_size, self.num_layers)

    def to_dict(self) -> dict:
        return asdict(self)


def arch_key(arch) -> tuple:
    s = shape_of(arch)
    return (s.n_head, s.n_kv_head, s.n_embd, s.n_expanded_embd, s.use_gated_mlp, arch.vocab_size, arch.num_layers)


class StepOverheads:
    """The residuals of a profile directory, by model key (empty when it measured none)."""

    def __init__(self, entries: list[StepOverhead]):
        self.by_key = {e.key(): e for e in entries}

    def __bool__(self) -> bool:
        return bool(self.by_key)

    @classmethod
    def load(cls, profile_dir: str) -> "StepOverheads":
        path = os.path.join(profile_dir, PROFILE_FILE)
        if not os.path.isfile(path):
            return cls([])
        with open(path, encoding="utf-8") as fh:
            data = json.load(fh)
        return cls([StepOverhead(**e) for e in data.get(KEY, [])])

    def stage_residual(self, arch, num_layers: int, prefill: bool, size: int, num_seqs: int = 1,
                       context: int = 0) -> float:
        """Residual of one stage execution of `num_layers` of `arch`'s layers over `size` tokens
        in `num_seqs` prompts (prefill) or `size` requests of `context` tokens in all (decode); 0
        when unmeasured."""
        e = self.by_key.get(arch_key(arch))
        if e is None:
            return 0.0
        return e.whole_model(prefill, size, num_seqs, context) * num_layers / e.num_layers

