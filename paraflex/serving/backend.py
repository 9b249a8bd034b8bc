"""The Backend protocol: what the HTTP gateway needs from whatever runs the engines.

Data flow: the gateway (paraflex.gateway.app) turns an OpenAI request into prompt token ids
and a `SamplingParams`, then iterates `Backend.stream(...)`, which yields `Output` deltas as
the last pipeline stage samples tokens. If the client goes away, the gateway calls
`Backend.abort(request_id)`, and the backend must free the request's KV on every engine.

Two implementations, both over the one serving frontend (paraflex.serving.frontend):
`InProcessBackend` (paraflex.serving.in_process_backend; the whole cluster in this process on a
background thread) and the Ray backend (`paraflex.serving.ray_startup.start_cluster`; one actor
per engine).

Contract details an implementation must honour:

- `stream` yields `Output`s whose `token_ids` are the NEW tokens since the previous Output
  (possibly empty on the final one). The last Output has `finish_reason` set ("stop" for
  EOS / stop token, "length" for max_tokens, "abort" after `abort`) or `error` set (a one-line
  message, e.g. "engine 3 died"); nothing is yielded after it. A backend must end a stream
  with an error rather than hang when an engine dies.
- `stream` raises `UserError` for a request it refuses (a 400) and `Unavailable` when it cannot
  take one now, e.g. no live replica of the model (a 503 the client may retry).
- `abort` is idempotent and safe for unknown or finished request ids; with an `error`, the
  stream's last Output carries it.
- `metrics()` returns plain numbers (see `BackendMetrics`); the gateway renders them in
  Prometheus format next to the latency histograms it measures itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Iterable, Protocol, runtime_checkable

from paraflex.errors import ParaflexError


class Unavailable(ParaflexError):
    """The backend cannot take a request now (no live replica of its model): a 503."""


@dataclass(frozen=True)
class ModelCard:
    """A served model: its public name, context window (prompt + output tokens: the model's, or
    less where its engines' KV pools hold less, `admission.max_model_len`) and tokenizer.

    `tokenizer` follows paraflex.engine.worker.tokenizer.Tokenizer: encode, decode,
    apply_chat_template, eos_token_ids, vocab_size.
    """

    name: str
    max_context: int
    tokenizer: Any


@dataclass(frozen=True)
class Output:
    """One step of a request's token stream (see the module docstring for the rules)."""

    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None

    @property
    def final(self) -> bool:
        return self.finish_reason is not None or self.error is not None


@dataclass
class BackendMetrics:
    """Scheduler state for /metrics, in the units vLLM reports.

    running / waiting: model name -> number of requests in that state (vLLM's
    num_requests_running / num_requests_waiting). kv_cache_usage: engine id -> fraction of
    that engine's KV block pool in use, 0..1 (vLLM's kv_cache_usage_perc, per engine).
    preemptions: model name -> requests stopped to free KV and restarted by recompute so far
    (vLLM's num_preemptions; paraflex/serving/recompute.py). swapped: model name -> requests
    whose KV is (on some stage) in host memory now (vLLM v0's num_requests_swapped). swaps:
    engine id -> that engine's swap counters so far (`KVPlanner.swap_totals`,
    paraflex/engine/core/kv_planner.py): "swap_outs" / "swap_ins" count requests moved,
    "swap_out_bytes" / "swap_in_bytes" the bytes copied each way. placement_actions: (op,
    outcome) -> live placement actions so far, placement_moved_bytes: weight bytes they loaded
    (paraflex/serving/live_placement.py's `ChangeCounters`).
    """

    running: dict[str, int] = field(default_factory=dict)
    waiting: dict[str, int] = field(default_factory=dict)
    kv_cache_usage: dict[int, float] = field(default_factory=dict)
    preemptions: dict[str, int] = field(default_factory=dict)
    swapped: dict[str, int] = field(default_factory=dict)
    swaps: dict[int, dict[str, int]] = field(default_factory=dict)
    placement_actions: dict[tuple[str, str], int] = field(default_factory=dict)
    placement_moved_bytes: int = 0


def count_swapped(per_engine: Iterable[dict[str, list[str]]]) -> dict[str, int]:
    """Model -> distinct swapped requests, from each engine's `KVPlanner.swapped_ids` (a request
    swapped on several stages of its pipeline counts once)."""
    ids: dict[str, set[str]] = {}
    for swapped in per_engine:
        for model, rids in swapped.items():
            ids.setdefault(model, set()).update(rids)
    return {model: len(rids) for model, rids in ids.items()}


@runtime_checkable
class Backend(Protocol):
    """What the gateway calls. All methods are called from the gateway's event loop."""

    def models(self) -> list[ModelCard]:
        """Every hosted model (fixed for the backend's lifetime)."""

    def stream(
        self, model: str, prompt_token_ids: list[int], params: Any, request_id: str
    ) -> AsyncIterator[Output]:
        """Submit a request and yield its outputs; `params` is a SamplingParams."""

    async def abort(self, request_id: str, error: str | None = None) -> None:
        """Stop the request and free its KV on every engine; its stream ends with finish_reason
        "abort", or with `error` when one is given (e.g. the server shutting down)."""

    def health(self) -> dict:
        """{"ok": bool, ...details such as per-engine liveness}; ok=False makes /health 503."""

    def metrics(self) -> BackendMetrics:
        """Current scheduler state (cheap; called on every /metrics scrape)."""

    async def close(self) -> None:
        """Stop engines and release resources; no stray processes or threads afterwards."""


@runtime_checkable
class PlacementBackend(Backend, Protocol):
    """A backend whose placement changes live (both engine backends; GET/POST /v1/placement)."""

    def placement(self):
        """The serving `Placement`."""

    def change_placement(self, placement, source: str = "placement") -> dict:
        """Apply `placement` live (blocking; call it off the event loop): `PlacementChanger.apply`
        (paraflex/serving/live_placement.py), which raises `PlacementRejected` with nothing changed."""
