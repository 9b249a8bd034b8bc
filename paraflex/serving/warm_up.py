"""Start-up warm-up: a few short requests per model through the backend before the gateway
opens, so that the first user's request does not pay for compiling kernels.

Place in the data flow: `paraflex serve` (paraflex/commands/serve.py) calls `warm_up(backend)`
after the engines start and before the request log, the step log and the HTTP socket take
anything, so no log row and no metric counts these requests. Each runs the whole path a user's
request runs (frontend, every stage and hop, sampling, detokenizing) through `Backend.stream`.

Why: decode steps are captured as CUDA graphs at start-up (engine/kernels/cuda_graphs.py), but
prefills run eagerly and their Triton kernels compile on their first call: on an H100 the first
request per model after start-up waited 1.4 s for its first token against ~20 ms later
(bench/sim_fidelity.py), and the warm-up takes 1.8-2.1 s per model there, almost all of it
compiling. One compiled prefill serves every later batch (its block-table width and metadata
alignment are not specialised: engine/kernels/triton_paged_attention.py, bench/first_prefills.py).
The rounds run prompts of `PROMPT_LENGTHS` alone (a length divisible by 16 and one that is not)
and then together (two prompts packed into one prefill batch), each generating `MAX_TOKENS`
tokens (one decode step).
"""

from __future__ import annotations

import asyncio
import time

from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.errors import ParaflexError

PROMPT_LENGTHS = (16, 17)
ROUNDS = ((16,), (17,), PROMPT_LENGTHS)
MAX_TOKENS = 2
TIMEOUT_S = 600.0  # a model whose warm-up takes longer is stuck: serve would hang, so say so


def warm_up_prompt(tokenizer, length: int) -> list[int]:
    """`length` token ids the model's tokenizer produced (repeated to length)."""
    ids = [t for t in tokenizer.encode("The quick brown fox jumps over the lazy dog.") if t is not None]
    if not ids:
        raise ParaflexError("warm-up: the tokenizer encoded a sentence to no tokens")
    return (ids * (length // len(ids) + 1))[:length]


async def _one(backend, model: str, prompt: list[int], request_id: str) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True).validate()
    async for out in backend.stream(model, prompt, params, request_id):
        if out.error:
            raise ParaflexError(f"warm-up request of {model} failed: {out.error}")


async def warm_up_models(backend, progress=None) -> dict[str, float]:
    """Run the warm-up rounds for every model of `backend`, one model after another; the
    seconds each model took."""
    took = {}
    for card in backend.models():
        start = time.perf_counter()
        longest = card.max_context - MAX_TOKENS  # a short context window: shorter prompts
        if longest < 1:
            continue
        for i, lengths in enumerate(ROUNDS):
            await asyncio.wait_for(asyncio.gather(*(
                _one(backend, card.name, warm_up_prompt(card.tokenizer, min(n, longest)), f"warm-up-{card.name}-{i}-{j}")
                for j, n in enumerate(lengths))), TIMEOUT_S)
        took[card.name] = time.perf_counter() - start
        if progress is not None:
            progress(f"warm-up: {card.name} in {took[card.name]:.2f} s")
    return took


def warm_up(backend, progress=None) -> dict[str, float]:
    """`warm_up_models` from synchronous code (no event loop running in this thread)."""
    try:
        return asyncio.run(warm_up_models(backend, progress))
    except asyncio.TimeoutError:
        raise ParaflexError(f"warm-up: a model's short requests did not finish within {TIMEOUT_S:.0f} s; "
                            "the engines are stuck (serve --no-warm-up starts without this check)") from None
