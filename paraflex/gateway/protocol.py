"""OpenAI request schemas for the gateway and their mapping to `SamplingParams`.

Data flow: app.py parses a JSON body into one of these models (pydantic; a bad field becomes
a 400 naming it), then `sampling_params(...)` builds the engine's SamplingParams. Fields the
OpenAI API defines but ParaFlex does not implement (n > 1, logprobs, penalties, echo, ...)
are accepted only at their neutral value, so a client is told instead of silently ignored.
Unknown fields are rejected (400 naming the field). vLLM's extensions top_k,
stop_token_ids and ignore_eos are accepted.
"""

from __future__ import annotations

import json
from typing import Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator

from paraflex.engine.core.sampling_params import SamplingParams


class _Strict(BaseModel):
    """JSON types as sent: no "3" for 3, no true for 1, no "yes" for true (pydantic's lax mode
    would convert them); unknown fields are errors."""

    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


def _neutral(name: str, value, neutral):
    if value is not None and value != neutral:
        raise ValueError(f"{name}={json.dumps(value)} is not supported by this server; leave it at {json.dumps(neutral)}")
    return value


def _shape_error(field: str, message: str):
    """A validator replacing pydantic's error for a union field (one line per member type,
    none saying what is accepted) by `message`."""
    def explain(cls, v, handler):
        try:
            return handler(v)
        except ValueError:
            raise ValueError(message) from None
    return field_validator(field, mode="wrap")(classmethod(explain))


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    top_k: int = -1
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None  # vLLM's extension; `vllm bench serve` sends 1.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None

    @field_validator("max_tokens", "temperature", "top_p", "top_k", "seed", "n", "presence_penalty", "frequency_penalty",
                     "repetition_penalty", mode="before")
    @classmethod
    def _a_number(cls, v):
        """Numbers only, as OpenAI checks them (pydantic would read "0" or true as 0 and 1)."""
        if isinstance(v, (str, bool)):
            raise ValueError(f"must be a number, got {type(v).__name__} {v!r}")
        return v

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v < -1:
            raise ValueError("must be -1 or 0 (disabled) or a positive integer")
        return v

    @field_validator("n")
    @classmethod
    def _n(cls, v: int) -> int:
        if v != 1:
            raise ValueError("only n=1 is supported; send n separate requests (vary `seed`)")
        return v

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _penalty(cls, v, info):
        return _neutral(info.field_name, v, 0.0)

    @field_validator("repetition_penalty")
    @classmethod
    def _repetition_penalty(cls, v):
        return _neutral("repetition_penalty", v, 1.0)

    @field_validator("logit_bias")
    @classmethod
    def _logit_bias(cls, v):
        if v:
            raise ValueError("logit_bias is not supported by this server; leave it empty")
        return v

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else (v or [])
        if any(s == "" for s in stops):
            raise ValueError("stop strings must be non-empty")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_ids(cls, v):
        if v and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v

    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def check_stream_options(self) -> None:
        """OpenAI rejects stream_options without stream; so do we (raised as a field error)."""
        if self.stream_options is not None and not self.stream:
            raise FieldError("stream_options", "only allowed when stream=true")


class CompletionRequest(_SamplingFields):
    prompt: Union[str, list[int], list[str], list[list[int]]]
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("logprobs", mode="before")
    @classmethod
    def _logprobs(cls, v):
        if isinstance(v, bool):
            raise ValueError("the completions API takes an integer count here (or null); this server supports "
                             "only null")
        return _neutral("logprobs", v, None)

    @field_validator("echo")
    @classmethod
    def _echo(cls, v):
        if v:
            raise ValueError("echo=true is not supported by this server")
        return v

    @field_validator("best_of")
    @classmethod
    def _best_of(cls, v):
        return _neutral("best_of", v, 1)

    @field_validator("suffix")
    @classmethod
    def _suffix(cls, v):
        return _neutral("suffix", v, None)

    _prompt_shape = _shape_error("prompt", "give a string or a list of token ids (integers)")

    @field_validator("prompt")
    @classmethod
    def _prompt(cls, v):
        if isinstance(v, list) and v and isinstance(v[0], (str, list)):
            if len(v) != 1:
                raise ValueError("batched prompts are not supported; send one prompt per request")
            v = v[0]
        if isinstance(v, list) and not v:
            raise ValueError("must not be empty")
        if isinstance(v, list) and any(t < 0 for t in v):
            raise ValueError("token ids must be >= 0")
        return v


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: Union[str, list[TextPart]]
    name: str | None = None

    _content_shape = _shape_error("content", 'give a string or a list of text parts {"type": "text", "text": "..."} '
                                  "(this server takes text only)")

    def text(self) -> str:
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None

    @field_validator("logprobs")
    @classmethod
    def _logprobs(cls, v):
        if v:
            raise ValueError("logprobs=true is not supported by this server")
        return v

    @field_validator("top_logprobs")
    @classmethod
    def _top_logprobs(cls, v):
        return _neutral("top_logprobs", v, None)

    def chat_messages(self) -> list[dict]:
        return [{"role": "system" if m.role == "developer" else m.role, "content": m.text()} for m in self.messages]


class TokenizeRequest(_Strict):
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(default=None, min_length=1)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Strict):
    model: str
    tokens: list[int]


class FieldError(Exception):
    """A request field is invalid in context (not just by its own schema): 400 naming `param`."""

    def __init__(self, param: str, message: str):
        self.param = param
        super().__init__(f"{param}: {message}")


def sampling_params(req: _SamplingFields, max_tokens: int) -> SamplingParams:
    """The engine's SamplingParams for `req` with its output budget already resolved."""
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        top_k=req.top_k,
        seed=req.seed,
        stop=req.stop_list(),
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=req.ignore_eos,
    )
    params.validate()
    return params
