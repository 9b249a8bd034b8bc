"""The start-up warm-up (paraflex/serving/warm_up.py): it runs every model's short requests to
the end through a real in-process backend and leaves nothing behind, and a failing request
stops start-up with a one-line error."""

from __future__ import annotations

import asyncio

import pytest

import polling
from gateway_cluster import MODELS, make_config, make_placement
from paraflex.errors import ParaflexError
from paraflex.serving.backend import ModelCard, Output
from paraflex.serving.in_process_backend import InProcessBackend
from paraflex.serving.warm_up import PROMPT_LENGTHS, ROUNDS, warm_up, warm_up_prompt


def test_warm_up_runs_every_model_and_leaves_the_engines_idle():
    backend = InProcessBackend.start(make_config(), make_placement(), progress=None)
    try:
        idle = [e.scheduler.pool.num_used for e in backend.cluster.engines]
        lines = []
        took = warm_up(backend, progress=lines.append)
        assert sorted(took) == sorted(MODELS) and all(t > 0 for t in took.values())
        assert [line.split()[1] for line in lines] == [c.name for c in backend.models()]
        # every KV block freed (a later stage frees on its engine's next step)
        assert polling.wait_for(lambda: [e.scheduler.pool.num_used for e in backend.cluster.engines] == idle, timeout=10.0)
        assert backend.cluster.frontend.running_by_model() == {}  # every request ended
    finally:
        asyncio.run(backend.close())


class _Tokenizer:
    def encode(self, text):
        return [5, 6, 7]


def test_warm_up_prompt_has_the_length_asked_from_the_tokenizers_ids():
    for n in (*PROMPT_LENGTHS, 1, 40):
        prompt = warm_up_prompt(_Tokenizer(), n)
        assert len(prompt) == n and set(prompt) <= {5, 6, 7}
    assert any(n % 16 == 0 for n in PROMPT_LENGTHS) and any(n % 16 for n in PROMPT_LENGTHS)
    assert any(len(r) > 1 for r in ROUNDS)  # prompts packed into one prefill


class _RecordingBackend:
    """A backend of one model whose context window is `context` tokens; records what it is sent."""

    def __init__(self, context: int):
        self.context, self.asked = context, []

    def models(self):
        return [ModelCard("m", self.context, _Tokenizer())]

    async def stream(self, model, prompt, params, request_id):
        self.asked.append(len(prompt) + params.max_tokens)
        yield Output([5] * params.max_tokens, finish_reason="length")


def test_warm_up_prompts_fit_a_short_context_window_and_a_tiny_one_is_skipped():
    short = _RecordingBackend(context=10)
    warm_up(short)
    assert short.asked and max(short.asked) <= 10
    tiny = _RecordingBackend(context=2)  # no prompt fits beside the generated tokens
    assert warm_up(tiny) == {} and tiny.asked == []


class _FailingBackend:
    """A backend whose model's stream ends with an engine error."""

    def __init__(self):
        self.asked = []

    def models(self):
        return [ModelCard("m", 64, _Tokenizer())]

    async def stream(self, model, prompt, params, request_id):
        self.asked.append((request_id, len(prompt), params.max_tokens))
        yield Output(error="engine 3 died")


def test_a_failed_warm_up_request_is_a_one_line_error_naming_the_model():
    backend = _FailingBackend()
    with pytest.raises(ParaflexError, match="warm-up request of m failed: engine 3 died"):
        warm_up(backend)
    assert backend.asked and backend.asked[0][1] in PROMPT_LENGTHS
