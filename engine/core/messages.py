"""Request metadata that travels between engines, as plain msgpack-friendly types (paper §7).

Place in the data flow: the scheduler of a stage builds a `BatchMessage` for the next stage of
the same model when it forms a batch (`ScheduledBatch.message`); the transport sends it as the
`meta` of a "batch" envelope (phase 1), next to the hidden/residual tensors (phase 2), and the
next engine's scheduler takes it in with `receive_batch`. The last stage's `complete` yields a
`TokenMessage` (metadata only) for the first stage, and finished/aborted requests travel as a
`FreeMessage` to every stage. `to_dict()`/`from_dict()` give plain dicts of str/int/float/
bool/None/list; `pack`/`unpack` wrap msgpack.

Incremental decode updates: a prefill entry carries everything a stage must know about a
request (prompt length, token ids on the first chunk, sampling params as a dict, budget); a
decode entry carries only the request id, the new token and its position, as three parallel
lists so that a batch of 32 decodes is three short int arrays on the wire.

Tensor row order of a batch: the prefill entries in order (``num_tokens`` rows each), then the
decode entries in order (one row each). `tensor_shapes` is filled by the torch driver
(``{"hidden": [rows, hidden_size], ...}``); the scheduler leaves it empty.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgpack

from paraflex.errors import ParaflexError

WIRE_VERSION = 1
BATCH, TOKEN, FREE = "batch", "token", "free"
PREFILL, DECODE, MIXED = "prefill", "decode", "mixed"


class MessageError(ParaflexError):
    """A message that does not decode: wrong version, missing field, wrong type."""


@dataclass
class PrefillEntry:
    """One request's prompt chunk: tokens ``[start, start + num_tokens)`` of its prompt."""

    req_id: str
    start: int
    num_tokens: int
    prompt_len: int
    max_new_tokens: int
    arrival: float
    prompt_token_ids: list[int] | None = None  # sent with the first chunk only (None in the simulator)
    sampling: dict | None = None  # sent with the first chunk only

    def to_list(self) -> list:
        return [self.req_id, self.start, self.num_tokens, self.prompt_len, self.max_new_tokens,
                self.arrival, self.prompt_token_ids, self.sampling]

    @classmethod
    def from_list(cls, row: list) -> "PrefillEntry":
        rid, start, n, plen, mnt, arr, toks, samp = row
        return cls(rid, start, n, plen, mnt, arr, list(toks) if toks is not None else None,
                   dict(samp) if samp is not None else None)


@dataclass
class DecodeEntry:
    """One request's decode step: the new token (None in the simulator) at `position`."""

    req_id: str
    token_id: int | None
    position: int


@dataclass
class BatchMessage:
    """A batch formed by the model's first stage, addressed to stage `stage` of `model`."""

    model: str
    stage: int
    batch_id: str
    kind: str
    prefills: list[PrefillEntry] = field(default_factory=list)
    decodes: list[DecodeEntry] = field(default_factory=list)
    formed_at: float = 0.0
    tensor_shapes: dict[str, list[int]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(p.num_tokens for p in self.prefills) + len(self.decodes)

    @property
    def req_ids(self) -> list[str]:
        return [p.req_id for p in self.prefills] + [d.req_id for d in self.decodes]

    def to_dict(self) -> dict:
        return {
            "v": WIRE_VERSION,
            "type": BATCH,
            "model": self.model,
            "stage": self.stage,
            "batch": self.batch_id,
            "kind": self.kind,
            "at": self.formed_at,
            "shapes": {k: list(v) for k, v in self.tensor_shapes.items()},
            "p": [p.to_list() for p in self.prefills],
            "d": [
                [d.req_id for d in self.decodes],
                [d.token_id for d in self.decodes],
                [d.position for d in self.decodes],
            ],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "BatchMessage":
        _check(d, BATCH, ("model", "stage", "batch", "kind", "at", "shapes", "p", "d"))
        ids, toks, pos = d["d"]
        if not len(ids) == len(toks) == len(pos):
            raise MessageError("batch message: decode id/token/position lists differ in length")
        return cls(
            model=d["model"],
            stage=d["stage"],
            batch_id=d["batch"],
            kind=d["kind"],
            prefills=[PrefillEntry.from_list(r) for r in d["p"]],
            decodes=[DecodeEntry(i, t, p) for i, t, p in zip(ids, toks, pos)],
            formed_at=d["at"],
            tensor_shapes={k: list(v) for k, v in d["shapes"].items()},
        )


@dataclass
class TokenEntry:
    """A token sampled by the last stage for one request (token_id None in the simulator)."""

    req_id: str
    token_id: int | None
    position: int
    finished: bool = False
    reason: str | None = None  # "length" | "stop" | None


@dataclass
class TokenMessage:
    """Last stage -> first stage after each batch: the sampled tokens (metadata only)."""

    model: str
    batch_id: str
    entries: list[TokenEntry] = field(default_factory=list)

    @property
    def finished(self) -> list[str]:
        return [e.req_id for e in self.entries if e.finished]

    def to_dict(self) -> dict:
        e = self.entries
        return {
            "v": WIRE_VERSION,
            "type": TOKEN,
            "model": self.model,
            "batch": self.batch_id,
            "ids": [x.req_id for x in e],
            "tok": [x.token_id for x in e],
            "pos": [x.position for x in e],
            "fin": [x.reason if x.finished else None for x in e],
        }

    @classmethod
    def from_dict(cls, d: dict) -> "TokenMessage":
        _check(d, TOKEN, ("model", "batch", "ids", "tok", "pos", "fin"))
        return cls(
            d["model"],
            d["batch"],
            [TokenEntry(i, t, p, f is not None, f) for i, t, p, f in zip(d["ids"], d["tok"], d["pos"], d["fin"])],
        )


@dataclass
class FreeMessage:
    """Free the KV of finished or aborted requests on every stage of `model`."""

    model: str
    req_ids: list[str]
    reason: str = "finished"  # "finished" | "aborted"

    def to_dict(self) -> dict:
        return {"v": WIRE_VERSION, "type": FREE, "model": self.model, "ids": list(self.req_ids), "reason": self.reason}

    @classmethod
    def from_dict(cls, d: dict) -> "FreeMessage":
        _check(d, FREE, ("model", "ids", "reason"))
        return cls(d["model"], list(d["ids"]), d["reason"])


Message = BatchMessage | TokenMessage | FreeMessage
_TYPES = {BATCH: BatchMessage, TOKEN: TokenMessage, FREE: FreeMessage}


def _check(d: dict, kind: str, fields: tuple[str, ...]) -> None:
    if not isinstance(d, dict):
        raise MessageError(f"{kind} message: expected a dict, got {type(d).__name__}")
    if d.get("v") != WIRE_VERSION:
        raise MessageError(f"{kind} message: wire version {d.get('v')!r}, this engine speaks {WIRE_VERSION}; run the same paraflex version everywhere")
    missing = [f for f in fields if f not in d]
    if missing:
        raise MessageError(f"{kind} message: missing field(s) {', '.join(missing)}")


def from_dict(d: dict) -> Message:
    """Rebuild any message from its `to_dict()` form (dispatching on its "type")."""
    cls = _TYPES.get(d.get("type")) if isinstance(d, dict) else None
    if cls is None:
        raise MessageError(f"unknown message type {d.get('type') if isinstance(d, dict) else d!r}; expected one of {sorted(_TYPES)}")
    return cls.from_dict(d)


def pack(msg: Message) -> bytes:
    """msgpack bytes of a message."""
    return msgpack.packb(msg.to_dict(), use_bin_type=True)


def unpack(data: bytes) -> Message:
    """The message packed by `pack`."""
    try:
        d = msgpack.unpackb(data, raw=False, strict_map_key=False)
    except (ValueError, msgpack.exceptions.ExtraData, msgpack.exceptions.UnpackException) as exc:
        raise MessageError(f"undecodable message bytes: {exc}") from exc
    return from_dict(d)
