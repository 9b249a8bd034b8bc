"""Request validation: every bad parameter is a 400 naming its field; good ones reach
SamplingParams unchanged."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from paraflex.gateway.api_error import ApiError
from paraflex.gateway.request_body import validation_error
from paraflex.gateway.protocol import ChatCompletionRequest, CompletionRequest, sampling_params


def error_of(schema, body: dict) -> ApiError:
    with pytest.raises(ValidationError) as info:
        schema.model_validate(body)
    return validation_error(info.value)


@settings(max_examples=60, deadline=None)
@given(temperature=st.floats(0, 2), top_p=st.floats(0.01, 1), top_k=st.integers(-1, 500),
       seed=st.none() | st.integers(0, 2**31), stop=st.lists(st.text(min_size=1, max_size=4), max_size=3),
       max_tokens=st.integers(1, 100))
def test_valid_parameters_reach_sampling_params(temperature, top_p, top_k, seed, stop, max_tokens):
    req = CompletionRequest.model_validate({"model": "m", "prompt": "p", "temperature": temperature, "top_p": top_p,
                                            "top_k": top_k, "seed": seed, "stop": stop})
    sp = sampling_params(req, max_tokens)
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.stop, sp.max_tokens) == (
        temperature, top_p, top_k, seed, stop, max_tokens)


@settings(max_examples=60, deadline=None)
@given(field=st.sampled_from(["temperature", "top_p", "max_tokens", "top_k", "n"]),
       value=st.one_of(st.floats(allow_nan=False), st.integers(-10**6, 10**6), st.text(max_size=3)))
def test_out_of_range_values_name_their_field(field, value):
    ok = {"temperature": lambda v: 0 <= v <= 2, "top_p": lambda v: 0 < v <= 1,
          "max_tokens": lambda v: v >= 1 and float(v).is_integer(), "top_k": lambda v: v >= -1 and float(v).is_integer(),
          "n": lambda v: v == 1}[field]
    if not isinstance(value, str) and ok(value):
        return
    err = error_of(CompletionRequest, {"model": "m", "prompt": "p", field: value})
    assert err.status == 400 and err.param == field and err.message.startswith(f"{field}:")


@pytest.mark.parametrize("field, value", [("temperature", "0"), ("max_tokens", "16"), ("top_p", True), ("n", "1")])
def test_numbers_given_as_strings_or_booleans_are_rejected(field, value):
    """(hypothesis found "0" read as temperature 0.0: pydantic's lax mode; OpenAI rejects it)"""
    err = error_of(CompletionRequest, {"model": "m", "prompt": "p", field: value})
    assert err.status == 400 and err.param == field and "must be a number" in err.message


def test_nested_fields_are_named_like_openai():
    err = error_of(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user", "content": "a"},
                                                                      {"role": "robot", "content": "b"}]})
    assert err.param == "messages[1].role"
    err = error_of(ChatCompletionRequest, {"model": "m", "messages": [{"role": "user"}]})
    assert err.param == "messages[0].content" and "missing" in err.message
    err = error_of(CompletionRequest, {"model": "m", "prompt": "p", "stop": 5})
    assert err.param == "stop"
    err = error_of(CompletionRequest, {"model": "m", "prompt": "p", "stream_options": {"include_usage": "x"}})
    assert err.param == "stream_options.include_usage"
    err = error_of(CompletionRequest, {"model": "m", "prompt": "p", "min_tokens": 3})
    assert err.param == "min_tokens" and "unknown field" in err.message
    # vLLM's repetition_penalty: its neutral 1.0 (what `vllm bench serve` sends) passes, others are refused
    err = error_of(CompletionRequest, {"model": "m", "prompt": "p", "repetition_penalty": 1.1})
    assert err.param == "repetition_penalty" and "leave it at 1.0" in err.message
    assert CompletionRequest.model_validate({"model": "m", "prompt": "p", "repetition_penalty": 1.0})
    assert ChatCompletionRequest.model_validate({"model": "m", "messages": [{"role": "user", "content": "a"}],
                                                 "repetition_penalty": 1.0})
    err = error_of(CompletionRequest, {"prompt": "p"})
    assert err.param == "model"


def test_chat_content_parts_join_and_developer_is_system():
    req = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]})
    assert req.chat_messages() == [{"role": "system", "content": "rules"}, {"role": "user", "content": "ab"}]
