"""Sampling parameters and stop rules: what a request asks of its tokens (pure, no torch).

Place in the data flow: a request carries `SamplingParams` from the client (gateway or
`paraflex generate`) through the first stage to the last stage, where the worker's sampler
(paraflex.engine.worker.sampling) draws one token per request and `StopChecker` decides
whether the request is done (stop token ids, end-of-sequence unless ignore_eos, stop strings,
max_tokens). A request restarted by recompute (paraflex/serving/recompute.py) carries the
tokens it produced before in `resumed`: its stop strings are searched across the restart and
its seeded generator skips the draws already made.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from paraflex.errors import UserError

GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (logits / T would overflow float32)
MAX_STOP_STRINGS = 64  # each is searched for after every token
SEED_RANGE = (-(2**63), 2**64 - 1)  # what a torch.Generator takes
TOKEN_ID_LIMIT = 2**63  # stop token ids are below it (and travel as msgpack's 64-bit integers)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_BELOW) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = whole vocabulary
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # also return this many top alternatives per token
    # set by a backend, never by a client: tokens produced before a preemption by recompute
    # (they end the prompt; max_tokens counts those still to come)
    resumed: list[int] = field(default_factory=list)

    def validate(self) -> "SamplingParams":
        """Raise UserError naming the first bad field; returns self."""
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise UserError(f"max_tokens: {self.max_tokens!r} must be an integer >= 1")
        if not (isinstance(self.temperature, (int, float)) and not isinstance(self.temperature, bool)
                and 0 <= self.temperature < 1e300):
            raise UserError(f"temperature: {self.temperature!r} must be a number >= 0 (0 = greedy)")
        self.temperature = float(self.temperature)  # (not an int of any size: msgpack carries floats)
        if not (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1):
            raise UserError(f"top_p: {self.top_p!r} must be in (0, 1]")
        if not isinstance(self.top_k, int) or (self.top_k < 1 and self.top_k not in (-1, 0)):
            raise UserError(f"top_k: {self.top_k!r} must be -1 (off) or an integer >= 1")
        if self.top_k >= TOKEN_ID_LIMIT:  # beyond any vocabulary: the whole of it
            self.top_k = -1
        if self.seed is not None and not (isinstance(self.seed, int) and SEED_RANGE[0] <= self.seed <= SEED_RANGE[1]):
            raise UserError(f"seed: {self.seed!r} must be an integer from -2**63 to 2**64 - 1")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not all(isinstance(s, str) and s for s in self.stop):
            raise UserError(f"stop: {self.stop!r} must be a list of non-empty strings")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise UserError(f"stop: {len(self.stop)} strings; give at most {MAX_STOP_STRINGS}")
        if not all(isinstance(t, int) and 0 <= t < TOKEN_ID_LIMIT for t in self.stop_token_ids):
            raise UserError(f"stop_token_ids: {self.stop_token_ids!r} must be non-negative integers below 2**63")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or not 0 <= self.logprobs <= 20):
            raise UserError(f"logprobs: {self.logprobs!r} must be an integer in 0..20")
        return self

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        return cls(**d)


class StopChecker:
    """Decides when a request is done. `decode` (ids -> text) is needed only for stop strings."""

    def __init__(self, params: SamplingParams, eos_token_ids: list[int], decode=None) -> None:
        self.params = params
        self.stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos:
            self.stop_ids |= set(eos_token_ids)
        self.decode = decode if params.stop else None
        self.longest_stop = max((len(s) for s in params.stop), default=0)

    def check(self, generated: list[int]) -> str | None:
        """finish reason after the latest token of `generated` (this run's tokens; a restarted
        request's earlier ones are `params.resumed`): "stop", "length" or None."""
        if generated[-1] in self.stop_ids:
            return "stop"
        if self.decode is not None:
            # a stop string must end inside the text of the newest token
            window = self.longest_stop + 8
            recent = generated[-window:]
            if len(recent) < window and self.params.resumed:
                recent = self.params.resumed[-(window - len(recent)):] + recent
            tail = self.decode(recent)
            if any(s in tail for s in self.params.stop):
                return "stop"
        if len(generated) >= self.params.max_tokens:
            return "length"
        return None
