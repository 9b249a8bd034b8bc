"""The batched sampler of the last stage: logits -> one new token per request.

Place in the data flow: the engine loop of a model's last stage hands the logits of a batch
and each request's `SamplingParams` (paraflex.engine.core.sampling_params) to
`Sampler.sample` (greedy, temperature, top-k, top-p, per-request seed, optional logprobs).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from paraflex.engine.kernels import native_ops
from paraflex.engine.core.sampling_params import GREEDY_BELOW, SamplingParams


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
