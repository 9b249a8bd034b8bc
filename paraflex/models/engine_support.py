"""Which HF checkpoints the engine runs: the `config.json` settings it does not implement, each
as one line naming the field and what is supported.

Place in the data flow: arch_files reads a config.json into a `ModelArch` and records here why
the engine cannot run it (`ModelArch.unsupported`); the sizes are still read, so `paraflex
simulate` and the cost model keep using such a model. The entry points that run a model
(`paraflex plan`, `serve`, `generate`, `profile` and `LLMCluster`) call `require_runnable`
before planning or loading anything, instead of loading a checkpoint the engine would
compute wrong tokens for (a Mistral sliding window, Gemma, a Llama o_proj bias) or fail on
halfway ("tensor ... missing"). No torch import.
"""

from __future__ import annotations

import os

from paraflex.errors import UserError

RUNNABLE_MODEL_TYPES = ("llama", "mistral", "qwen2")  # one decoder layer: RMSNorm, RoPE, GQA, SwiGLU


def _active_window(cfg: dict, context: int) -> int | None:
    """The sliding-window width `cfg` asks for when it is narrower than the context, else None."""
    window = cfg.get("sliding_window")
    if isinstance(window, bool) or not isinstance(window, (int, float)) or window >= context:
        return None
    return int(window)


def unsupported_setting(cfg: dict, model_type: str, context: int) -> str | None:
    """Why the engine cannot run the checkpoint of HF config `cfg` (None when it can), as
    "`field` is VALUE ...; the engine implements ...". `context`: the model's context length."""
    if model_type not in RUNNABLE_MODEL_TYPES:
        return (f"model_type is {model_type!r}, an architecture the engine does not implement; "
                f"supported: {', '.join(RUNNABLE_MODEL_TYPES)}")
    if model_type == "qwen2" and cfg.get("use_sliding_window") and _active_window(cfg, context):
        return ("use_sliding_window is true (sliding-window attention); the engine implements full "
                "attention only: use_sliding_window false")
    if model_type == "mistral" and _active_window(cfg, context):
        return (f"sliding_window is {_active_window(cfg, context)}, narrower than the context of {context} "
                "tokens (sliding-window attention); the engine implements full attention only: sliding_window "
                "null or at least max_position_embeddings")
    if model_type != "qwen2" and cfg.get("attention_bias"):
        return ("attention_bias is true (biases on the q/k/v/o projections); the engine implements "
                "attention_bias false")
    if cfg.get("mlp_bias"):
        return "mlp_bias is true (biases on the MLP projections); the engine implements mlp_bias false"
    act = cfg.get("hidden_act", "silu")
    if act not in ("silu", "swish"):
        return f"hidden_act is {act!r}; the engine implements silu"
    return None


def _config_json(source: str | None) -> str:
    if not source:
        return "config.json"
    return source if source.endswith(".json") else os.path.join(source, "config.json")


def require_runnable(config, models: list[str] | None = None) -> None:
    """Refuse (one-line UserError) a model of `config` (or of `models`) whose checkpoint the
    engine does not implement, naming the config.json field and what is supported."""
    for m in config.models:
        if (models is None or m.name in models) and m.arch.unsupported:
            raise UserError(f"model {m.name!r}: {_config_json(m.source)}: {m.arch.unsupported} "
                            "(only `paraflex simulate`, which uses the sizes alone, accepts it)")
