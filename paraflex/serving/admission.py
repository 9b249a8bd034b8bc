"""Admission checks for one generation request, before any engine sees it.

Called by the serving frontend (`paraflex.serving.frontend.Frontend.admit`, for the in-process
runtime and the Ray backend alike): the model must be served, the prompt non-empty and inside
the vocabulary, prompt + max_tokens inside the model's context, and the request's KV inside the
pool of every engine holding a stage of the model (`check_kv_fit`: an engine could never run
it), all in `check_request`. Each failure is a `UserError` naming the field and the fix (the
gateway turns it into a 400). The KV limits are what each engine reports
(`EngineScheduler.kv_token_limits`), regrouped per model by `kv_limits_by_model`.
"""

from __future__ import annotations

from paraflex.errors import UserError


def kv_limits_by_model(per_engine: dict[int, dict[str, tuple[int, int]]]) -> dict[str, dict[int, tuple[int, int]]]:
    """{engine: {model: limits}} (each engine's `kv_token_limits`) as {model: {engine: limits}}."""
    out: dict[str, dict[int, tuple[int, int]]] = {}
    for engine, limits in per_engine.items():
        for model, limit in limits.items():
            out.setdefault(model, {})[engine] = limit
    return out


def check_request(config, placement, kv_limits, model: str, prompt_token_ids, max_tokens: int) -> list[int]:
    """Return the prompt as a list of ints, or raise `UserError` naming what is wrong.
    `kv_limits`: `kv_limits_by_model` of the engines."""
    if model not in placement.models:
        raise UserError(f"model: {model!r} is not served here; models: {', '.join(placement.models)}")
    prompt = [int(t) for t in prompt_token_ids]
    if not prompt:
        raise UserError("prompt: empty; give at least one token")
    arch = config.model(model).arch
    bad = [t for t in prompt if not 0 <= t < arch.vocab_size]
    if bad:
        raise UserError(f"prompt: token id {bad[0]} outside the vocabulary of {model} (0..{arch.vocab_size - 1})")
    if len(prompt) + max_tokens > arch.max_context:
        raise UserError(
            f"max_tokens: prompt ({len(prompt)}) + max_tokens ({max_tokens}) exceeds the "
            f"context of {model} ({arch.max_context}); shorten the prompt or lower max_tokens"
        )
    check_kv_fit(model, len(prompt), max_tokens, kv_limits.get(model, {}))
    return prompt


def check_kv_fit(model: str, prompt_len: int, max_tokens: int, limits: dict[int, tuple[int, int]]) -> None:
    """Raise `UserError` unless one request of `prompt_len` + `max_tokens` tokens fits the KV pool
    of each engine in `limits` (engine id -> `EngineScheduler.kv_token_limits()[model]`)."""
    need = prompt_len + max_tokens - 1  # the last token is never fed back
    for engine, (prompt_limit, limit) in sorted(limits.items()):
        if prompt_len > prompt_limit:
            raise UserError(
                f"prompt: {prompt_len} tokens of {model} do not fit the KV pool of engine {engine}, which admits "
                f"prompts of up to {prompt_limit} tokens; shorten the prompt (or give the engines more KV memory: "
                "cluster.memory_gb)"
            )
        if need > limit:
            raise UserError(
                f"max_tokens: prompt ({prompt_len}) + max_tokens ({max_tokens}) of {model} need KV for {need} "
                f"tokens on engine {engine}, whose pool holds {limit} per request; shorten the prompt or lower "
                "max_tokens (or give the engines more KV memory: cluster.memory_gb)"
            )


def max_model_len(config, kv_limits, model: str) -> int:
    """The longest request (prompt + max_tokens) of `model` the engines can hold: its context,
    or less where an engine's pool holds less (what /v1/models reports as max_model_len, and what
    a chat request without max_tokens fills)."""
    return min([config.model(model).arch.max_context]
               + [limit + 1 for _, limit in kv_limits.get(model, {}).values()])
