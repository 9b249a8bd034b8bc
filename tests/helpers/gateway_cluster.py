"""A small real cluster for the gateway's end-to-end tests: the three tiny demo models
(random weights, byte tokenizer) on two CPU engines with a hand-made placement that has
multi-stage pipelines, an unaligned cut and a replicated model."""

from __future__ import annotations

import asyncio

import openai

from paraflex.config.schema import Config
from paraflex.placement import Placement

from hand_placement import hand_placement

# model -> (layers, stage layer ranges, replicas as engine per stage)
LAYOUT = {
    "tiny-2l": (2, [(0, 2)], [[0], [1]]),
    "tiny-4l": (4, [(0, 1), (1, 4)], [[0, 1]]),
    "tiny-8l": (8, [(0, 4), (4, 8)], [[1, 0]]),
}
MODELS = list(LAYOUT)


def config_dict() -> dict:
    return {
        "name": "gateway-e2e",
        "cluster": {"num_engines": 2, "device": "cpu", "memory_gb": 0.5, "host_memory_gb": 0.1},
        "models": [{"name": m, "arch": m, "rate": 1} for m in MODELS],
        "scheduler": {"max_batch_size": 8, "prefill_token_budget": 2048},
    }


def make_config() -> Config:
    return Config.from_dict(config_dict(), source="gateway-e2e")


def make_placement(kv_bytes: int = 4 << 20) -> Placement:
    return hand_placement(LAYOUT, 2, kv_bytes)


def stream_concurrently(url: str, jobs: list[tuple[str, int]], prompt_prefix: str, timeout: float) -> list[tuple]:
    """Send every (model, max_tokens) job at once as a streaming completion through the official
    client; per job: ("ok", finish_reason, completion_tokens) or ("error", message, None)."""

    async def one(c, model, n):
        try:
            stream = await c.completions.create(model=model, prompt=f"{prompt_prefix} {n}", max_tokens=n,
                                                temperature=0, stream=True,
                                                stream_options={"include_usage": True},
                                                extra_body={"ignore_eos": True})
            finish, usage = None, None
            async for ch in stream:
                if ch.choices and ch.choices[0].finish_reason:
                    finish = ch.choices[0].finish_reason
                usage = ch.usage or usage
            return ("ok", finish, usage.completion_tokens if usage else None)
        except openai.APIError as exc:
            return ("error", str(exc), None)

    async def run_all():
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, m, n) for m, n in jobs)), timeout)

    return asyncio.run(run_all())
