"""Phase-1 wire format of the Ray transport: the msgpack bytes of one hop's metadata.

Where it sits: a model's send lane (paraflex.engine.transport.ray_lanes) encodes an envelope's
metadata and tensor descriptors (name, dtype, shape; never tensor data, never pickled) with
`encode_phase1` and ships them in a Ray actor call; the receiving engine's
`RayTransport.deliver` (paraflex.engine.transport.ray) decodes them with `decode_phase1`, and
`arrival_key` names the slot of the arrival buffer the envelope is parked in until the engine
loop drains it. Phase-2 tensor tags (paraflex.engine.transport.ray_groups) are derived from the
per-model sequence number carried here.
"""

from __future__ import annotations

import msgpack
import torch

from paraflex.engine.transport.base import Envelope

WIRE_VERSION = 2
# Rendezvous gloo/NCCL tags: each tensor of a transfer gets seq * MAX_TENSORS + index (gloo
# matches on it; NCCL ignores tags and matches in order, which the per-model FIFO threads
# preserve). Slot transfers use the tags above TAG_SPACE (ray_slots.slot_tag).
MAX_TENSORS = 16
TAG_SPACE = 2**30

# The tensor dtypes phase 1 can name, by the name it carries (`str(dtype)`).
WIRE_DTYPES = {
    str(dt): dt
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
               torch.int32, torch.int8, torch.uint8, torch.bool)
}


def encode_phase1(env: Envelope, seq: int, replica: int | None,
                  slots: tuple[int, int, bool] | None = None) -> bytes:
    """msgpack bytes of one envelope's metadata and tensor descriptors (no tensor data).

    `slots` = (group generation, first slot index, packed) when the tensors went into the
    receiver's pre-posted slots: all in one slot if packed, else one slot per tensor in order;
    None for the rendezvous way."""
    specs = None
    if env.tensors:
        if len(env.tensors) > MAX_TENSORS:
            raise ValueError(f"Envelope.tensors: {len(env.tensors)} tensors; at most {MAX_TENSORS}")
        specs = [[name, str(t.dtype), list(t.shape)] for name, t in env.tensors.items()]
    return msgpack.packb(
        {"v": WIRE_VERSION, "src": env.src, "dst": env.dst, "model": env.model, "kind": env.kind,
         "meta": env.meta, "seq": seq, "replica": replica, "tensors": specs,
         "slots": list(slots) if slots is not None else None},
        use_bin_type=True)


def decode_phase1(payload: bytes) -> tuple[Envelope, list | None, int, int | None, tuple | None]:
    """(envelope without tensors, tensor descriptors, seq, replica, slots) from
    `encode_phase1` bytes."""
    d = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    if d.get("v") != WIRE_VERSION:
        raise ValueError(f"phase-1 payload version {d.get('v')!r}; this engine speaks {WIRE_VERSION} "
                         "(all engines must run the same paraflex version)")
    env = Envelope(src=d["src"], dst=d["dst"], model=d["model"], kind=d["kind"], meta=d["meta"])
    slots = tuple(d["slots"]) if d["slots"] is not None else None
    return env, d["tensors"], d["seq"], d["replica"], slots


def arrival_key(env: Envelope, seq: int) -> tuple:
    """Key of the arrival buffer: (model, batch id, stage) for batches, else unique per message."""
    meta = env.meta if isinstance(env.meta, dict) else {}
    if env.kind == "batch" and "batch" in meta:  # engine-core BatchMessage.to_dict()
        return (env.model, meta["batch"], meta.get("stage"))
    return (env.model, env.kind, env.src, seq)

