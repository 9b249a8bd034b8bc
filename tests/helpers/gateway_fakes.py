"""Test doubles for the gateway's HTTP tests: a byte tokenizer and a scripted Backend.

`EchoBackend` streams the prompt's bytes back (cycled), one token every `delay` seconds,
ending with "length" at max_tokens; it keeps a `live` set of request ids standing in for
KV held on the engines, so tests can check that every path frees it.
"""

from __future__ import annotations

import asyncio
import os
import time

from paraflex.serving.backend import BackendMetrics, ModelCard, Output, Unavailable

BOS, EOS = 256, 257


class ByteTokenizer:
    vocab_size = 258
    eos_token_ids = [EOS]

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([BOS] if add_special_tokens else []) + list(text.encode())

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        out = bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        if not skip_special_tokens:
            out = "".join("<s>" if i == BOS else "</s>" if i == EOS else "" for i in ids if i >= 256) + out
        return out

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


class GatedTokenizer(ByteTokenizer):
    """A ByteTokenizer whose `encode` writes its process id to the file `started` and then waits
    (up to a minute, a hang guard) until the file `gate` exists: a test holds a request in the
    middle of its preparation, in whatever process runs it (it pickles by its two paths)."""

    def __init__(self, started: str, gate: str):
        self.started, self.gate = started, gate

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with open(self.started, "w") as f:
            f.write(str(os.getpid()))
        deadline = time.monotonic() + 60
        while not os.path.exists(self.gate) and time.monotonic() < deadline:
            time.sleep(0.01)
        return super().encode(text, add_special_tokens)


class EchoBackend:
    def __init__(self, names=("echo-a", "echo-b"), max_context: int = 64, delay: float = 0.0,
                 fail_after: int | None = None, unavailable: str | None = None, tokenizer=None):
        self.tokenizer = tokenizer or ByteTokenizer()
        self.cards = [ModelCard(n, max_context, self.tokenizer) for n in names]
        self.delay = delay
        self.fail_after = fail_after
        self.unavailable = unavailable  # stream raises Unavailable with this message
        self.live: set[str] = set()
        self.aborted: list[str] = []
        self.abort_errors: dict[str, str] = {}
        self.submitted: list[tuple[str, list[int], object]] = []

    def models(self):
        return self.cards

    async def stream(self, model, prompt_token_ids, params, request_id):
        if self.unavailable:
            raise Unavailable(self.unavailable)
        self.submitted.append((model, list(prompt_token_ids), params))
        self.live.add(request_id)
        body = [t for t in prompt_token_ids if t < 256] or [ord("x")]
        for i in range(params.max_tokens):
            await asyncio.sleep(self.delay)
            if request_id not in self.live:
                error = self.abort_errors.get(request_id)
                yield Output([], error=error) if error else Output([], finish_reason="abort")
                return
            if self.fail_after is not None and i == self.fail_after:
                self.live.discard(request_id)
                yield Output([], error="engine 1 died")
                return
            last = i == params.max_tokens - 1
            if last:
                self.live.discard(request_id)
            yield Output([body[i % len(body)]], finish_reason="length" if last else None)

    async def abort(self, request_id, error=None):
        self.aborted.append(request_id)
        self.live.discard(request_id)
        if error:
            self.abort_errors[request_id] = error

    def health(self):
        return {"ok": True, "engines": {"0": "alive"}}

    def metrics(self):
        return BackendMetrics(running={c.name: 0 for c in self.cards}, waiting={},
                              kv_cache_usage={0: len(self.live) / 100})

    async def close(self):
        self.live.clear()
