"""A decoded request -> what its route runs, checked against the served model: a `Generation`
(the prompt's token ids, the resolved output budget's `SamplingParams`) for the generation
routes, or the finished JSON body of /tokenize and /detokenize; or an ApiError naming the
field (404 for an unknown model, 400 for a token id out of range, a prompt that does not fit
the context, a bad sampling field).

Place in the data flow: request_body.py decodes a body into a protocol model; body_workers.py
runs `prepare` on a worker thread (small bodies) or, together with the decoding, in a worker
process (large bodies), so that tokenizing a long prompt, rendering a long chat or checking
millions of token ids never holds up the event loop; app.py admits and runs the Generation.
Everything here is plain CPU work on picklable inputs and outputs: no awaits, no I/O.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi.responses import JSONResponse

from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.errors import UserError
from paraflex.gateway.api_error import ApiError
from paraflex.gateway.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    FieldError,
    StreamOptions,
    TokenizeRequest,
    sampling_params,
)
from paraflex.serving.backend import ModelCard

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default max_tokens for /v1/completions


@dataclass
class Generation:
    """A generation request ready for admission. `ids` fits the model's context (with
    `params.max_tokens`), so it is at most one context long when it crosses processes."""

    model: str
    ids: list[int]
    params: SamplingParams
    stream: bool
    stream_options: StreamOptions | None


@dataclass
class RenderedJson:
    """A finished 200 response body (/tokenize, /detokenize), rendered where it was computed:
    bytes cross processes as one copy, a list of a million token ids would not."""

    body: bytes


def param_of(message: str) -> str | None:
    """The field a `UserError` message starts with ("max_tokens: ..."), if it names one."""
    m = re.match(r"([A-Za-z_][\w.\[\]]*):", message)
    return m.group(1) if m else None


def card_of(cards: dict[str, ModelCard], name: str) -> ModelCard:
    if name not in cards:
        raise ApiError(404, f"model: {name!r} is not served here; GET /v1/models lists "
                       f"{sorted(cards)}", param="model", code="model_not_found")
    return cards[name]


def prompt_ids(card: ModelCard, prompt) -> list[int]:
    """A completion prompt (text, or token ids checked against the vocabulary) as token ids."""
    if isinstance(prompt, str):
        ids = card.tokenizer.encode(prompt, add_special_tokens=True)
    else:
        ids = list(prompt)
        vocab = card.tokenizer.vocab_size
        if ids and max(ids) >= vocab:  # max() runs in C: millions of ids take milliseconds
            bad = next(t for t in ids if t >= vocab)
            raise ApiError(400, f"prompt: token id {bad} is out of range for {card.name} "
                           f"(vocab size {vocab})", param="prompt")
    if not ids:
        raise ApiError(400, "prompt: encodes to zero tokens; send some text", param="prompt")
    return ids


def chat_ids(card: ModelCard, messages: list[dict], add_generation_prompt: bool) -> list[int]:
    text = card.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    return card.tokenizer.encode(text, add_special_tokens=False)


def budget(card: ModelCard, n_prompt: int, requested: int | None, default: int | None,
           field: str = "max_tokens") -> int:
    """The output tokens a request gets: `requested`, or `default` capped by the room left in
    the context, or all of that room; 400 when the prompt or the request does not fit."""
    room = card.max_context - n_prompt
    if room < 1:
        raise ApiError(400, f"prompt: {n_prompt} tokens leave no room in {card.name}'s context of "
                       f"{card.max_context} tokens; shorten the prompt", param="prompt")
    if requested is None:
        return min(default, room) if default is not None else room
    if requested > room:
        raise ApiError(400, f"{field}: prompt ({n_prompt} tokens) + {field} ({requested}) exceeds "
                       f"{card.name}'s context of {card.max_context} tokens; ask for at most {room}",
                       param=field)
    return requested


def checked_params(req, max_tokens: int) -> SamplingParams:
    try:
        req.check_stream_options()
        return sampling_params(req, max_tokens)
    except FieldError as exc:
        raise ApiError(400, str(exc), param=exc.param)
    except UserError as exc:
        raise ApiError(400, str(exc), param=param_of(str(exc)))


def prepare_completion(req: CompletionRequest, cards: dict[str, ModelCard]) -> Generation:
    card = card_of(cards, req.model)
    ids = prompt_ids(card, req.prompt)
    params = checked_params(req, budget(card, len(ids), req.max_tokens, DEFAULT_COMPLETION_TOKENS))
    return Generation(card.name, ids, params, req.stream, req.stream_options)


def prepare_chat(req: ChatCompletionRequest, cards: dict[str, ModelCard]) -> Generation:
    card = card_of(cards, req.model)
    ids = chat_ids(card, req.chat_messages(), True)
    field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
    params = checked_params(req, budget(card, len(ids), getattr(req, field), None, field))
    return Generation(card.name, ids, params, req.stream, req.stream_options)


def prepare_tokenize(req: TokenizeRequest, cards: dict[str, ModelCard]) -> RenderedJson:
    card = card_of(cards, req.model)
    if (req.prompt is None) == (req.messages is None):
        raise ApiError(400, "prompt: send exactly one of `prompt` or `messages`", param="prompt")
    if req.messages is not None:
        msgs = [{"role": m.role, "content": m.text()} for m in req.messages]
        ids = chat_ids(card, msgs, req.add_generation_prompt)
    else:
        ids = card.tokenizer.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return RenderedJson(JSONResponse({"count": len(ids), "max_model_len": card.max_context, "tokens": ids}).body)


def prepare_detokenize(req: DetokenizeRequest, cards: dict[str, ModelCard]) -> RenderedJson:
    card = card_of(cards, req.model)
    vocab = card.tokenizer.vocab_size
    if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= vocab):  # in C, as prompt_ids
        bad = next(t for t in req.tokens if not 0 <= t < vocab)
        raise ApiError(400, f"tokens: token id {bad} is out of range (vocab size {vocab})", param="tokens")
    text = card.tokenizer.decode(req.tokens, skip_special_tokens=False)
    return RenderedJson(JSONResponse({"prompt": text}).body)


PREPARE = {CompletionRequest: prepare_completion, ChatCompletionRequest: prepare_chat,
           TokenizeRequest: prepare_tokenize, DetokenizeRequest: prepare_detokenize}


def prepare(req, cards: dict[str, ModelCard]) -> Generation | RenderedJson:
    """What the route of `req` (a decoded protocol model) runs; an ApiError if it cannot run."""
    return PREPARE[type(req)](req, cards)
