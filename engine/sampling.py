"""Sampling: per-request parameters, the batched sampler of the last stage, and stop rules.

Place in the data flow: a request carries `SamplingParams` from the client (gateway or
`paraflex generate`) through the first stage to the last stage. There the worker turns the
logits of a batch into one new token per request with `Sampler.sample` (greedy, temperature,
top-k, top-p, per-request seed, optional logprobs) and asks `StopChecker` whether the request
is done (stop token ids, end-of-sequence unless ignore_eos, stop strings, max_tokens).
A request restarted by recompute (paraflex/recompute.py) carries the tokens it produced before
in `resumed`: its stop strings are searched across the restart and its seeded generator skips
the draws already made.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import torch

from paraflex.engine import native_ops
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


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[dict | None]  # per request: {"token": id, "logprob": x, "top": {id: x}}


class Sampler:
    """Batched sampler. Requests with a seed draw from their own generator (same seed, same
    output, whatever the batch); the others share the sampler's generator (seeded too, so a
    whole run is reproducible)."""

    def __init__(self, seed: int = 0) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self._request_gens: dict[str, torch.Generator] = {}

    def forget(self, request_id: str) -> None:
        self._request_gens.pop(request_id, None)

    def _gen(self, request_id: str, params: SamplingParams, vocab: int) -> torch.Generator:
        if params.seed is None:
            return self.generator
        gen = self._request_gens.get(request_id)
        if gen is None:
            gen = self._request_gens[request_id] = torch.Generator().manual_seed(params.seed)
            if params.resumed:  # a restarted request: skip the draws its first run made
                flat = torch.ones(vocab)
                for _ in params.resumed:
                    torch.multinomial(flat, 1, generator=gen)
        return gen

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams]) -> SampleResult:
        """logits: float32 [B, vocab] (CPU or GPU); one new token per row."""
        logits = logits.float()
        if native_ops.applies(logits) and logits.is_contiguous():
            tokens = native_ops.argmax_rows(logits)
        else:
            tokens = logits.argmax(-1).cpu()
        rows = [i for i, p in enumerate(params) if p.temperature >= GREEDY_BELOW]
        if rows:
            sub = logits[rows]
            temps = torch.tensor([params[i].temperature for i in rows], device=sub.device)
            sub = sub / temps[:, None]
            sub = _top_k_top_p(sub, [params[i].top_k for i in rows], [params[i].top_p for i in rows])
            probs = torch.softmax(sub, -1).cpu()
            for j, i in enumerate(rows):
                gen = self._gen(request_ids[i], params[i], probs.shape[-1])
                tokens[i] = torch.multinomial(probs[j], 1, generator=gen)[0]
        token_list = tokens.tolist()
        logprobs: list[dict | None] = [None] * len(params)
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            lp = torch.log_softmax(logits[want], -1).cpu()
            for j, i in enumerate(want):
                top = {}
                if params[i].logprobs:
                    vals, idx = lp[j].topk(params[i].logprobs)
                    top = dict(zip(idx.tolist(), vals.tolist()))
                logprobs[i] = {"token": token_list[i], "logprob": float(lp[j, token_list[i]]), "top": top}
        return SampleResult(token_list, logprobs)


def _top_k_top_p(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    vocab = logits.shape[-1]
    ks = [min(k, vocab) if k > 0 else vocab for k in top_k]
    if all(k >= vocab for k in ks) and all(p >= 1.0 for p in top_p):
        return logits
    sorted_logits, order = logits.sort(-1, descending=True)
    rank = torch.arange(vocab, device=logits.device)[None, :]
    drop = rank >= torch.tensor(ks, device=logits.device)[:, None]
    probs = torch.softmax(sorted_logits.masked_fill(drop, float("-inf")), -1)
    before = probs.cumsum(-1) - probs  # mass of strictly better tokens
    drop |= before >= torch.tensor(top_p, device=logits.device)[:, None]
    drop[:, 0] = False  # always keep the best token
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


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
