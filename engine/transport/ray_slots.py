"""Pre-posted receive slots: phase 2 of a hop starts before phase 1 lands (CPU, gloo).

Where it sits: inside the two-phase Ray transport (paraflex.engine.transport.ray). Without
slots, the receiver learns a transfer's sizes and tag from the phase-1 Ray call, posts its gloo
receives, and only then does gloo (which writes data only after the receiver's recv-ready
notice reaches the sender) move the bytes: phase 1, then a notification round trip, then the
data, one after the other.

Gloo accepts a message into any posted receive at least as large (a larger one is fatal), and
matches by tag on each pair. So every engine keeps `window` receives posted for its
predecessor in each replica group's stage order, each into a fresh buffer of `slot_bytes`,
with tag `slot_tag(k)` for the k-th slot transfer on that hop. The sender numbers its tensors
to its successor the same way and sends each tensor of at most `slot_bytes` into the next slot
(a transfer of at most PACK_BYTES goes packed into one slot) right after it submits phase 1;
the receive is already posted, so the bytes travel while the Ray call does. Phase 1 names the first slot; `SlotTable` pairs phase-1 claims and landed buffers in
whichever order they come. A landed buffer becomes the envelope's tensor (a view, no copy),
and a fresh buffer takes its place in the window.

NCCL needs the exact element count on both sides and a posted receive would occupy the
receive stream, so the CUDA path keeps posting its receives on phase 1 (ray_lanes).
"""

from __future__ import annotations

import datetime
import math
import threading
from collections import deque
from typing import Any, Callable

import torch

SLOT_TAG_BASE = 2**30  # rendezvous tags (ray_wire) stay below; slot tags above
SLOT_TAG_SPACE = 2**30
DEFAULT_SLOT_BYTES = 8 << 20  # per tensor; larger tensors go the rendezvous way
DEFAULT_WINDOW = 4  # receives posted ahead per predecessor
# Transfers up to this size (decode batches) are packed into ONE slot: one gloo operation and
# one wake-up of the receiving thread instead of one per tensor, for a copy of a few µs.
# Larger ones (prefill) take one slot per tensor and are not copied.
PACK_BYTES = 256 << 10
ALIGN = 64
# A posted slot may wait for data indefinitely (an idle model); gloo closes the pair when a
# wait times out, so slot waits use a timeout no idle period reaches. A dead peer still ends
# the wait at once (its connection closes).
IDLE_WAIT = datetime.timedelta(days=365)


def slot_tag(k: int) -> int:
    """The gloo tag of the k-th slot transfer on one hop."""
    return SLOT_TAG_BASE + k % SLOT_TAG_SPACE


def pack_offsets(sizes: list[int]) -> tuple[list[int], int]:
    """Byte offsets of tensors of these sizes packed into one slot (each 64-byte aligned),
    and the packed size."""
    offsets, end = [], 0
    for n in sizes:
        offsets.append(end)
        end += -(-n // ALIGN) * ALIGN
    return offsets, end


def pack(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One uint8 buffer holding `tensors` at their `pack_offsets`."""
    offsets, total = pack_offsets([t.nbytes for t in tensors])
    out = torch.empty(total, dtype=torch.uint8)
    for t, off in zip(tensors, offsets):
        out[off:off + t.nbytes].copy_(t.reshape(-1).view(torch.uint8))
    return out


def slot_views(specs: list, bufs: list[torch.Tensor], packed: bool) -> dict[str, torch.Tensor]:
    """The envelope's tensors as views of their landed slot buffers (no copy).

    `specs` are phase-1 descriptors [name, dtype, shape] (dtype as a torch.dtype); `bufs` the
    uint8 slot buffers: one per tensor, or one holding all of them at `pack_offsets`."""
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]
    if packed:
        offsets, total = pack_offsets(sizes)
        places = [(bufs[0], off) for off in offsets]
        need = [(bufs[0], total)]
    else:
        places = [(buf, 0) for buf in bufs]
        need = list(zip(bufs, sizes))
    for buf, nbytes in need:
        if nbytes > buf.numel():
            raise ValueError(f"slot transfer of {nbytes} bytes does not fit a {buf.numel()}-byte "
                             "slot (engines disagree on slot_bytes)")
    return {name: buf[off:off + n].view(dtype).view(shape)
            for (name, dtype, shape), (buf, off), n in zip(specs, places, sizes)}


class SlotTable:
    """Pairs landed slot buffers with the phase-1 arrivals that claim them, in either order.

    A hop is named by a key (model, replica, generation, source engine); its slots by index.
    A job is any object with `bufs` (a list, one place per tensor) and `missing` (set here).
    Not thread-safe: the transport calls it under its lock."""

    def __init__(self) -> None:
        self._landed: dict[tuple, torch.Tensor] = {}
        self._waiting: dict[tuple, tuple[Any, int]] = {}
        self._open: set = set()

    def open(self, hop: tuple) -> None:
        """Slots of `hop` are posted from now on (its inbox started)."""
        self._open.add(hop)

    def land(self, hop: tuple, k: int, buf: torch.Tensor):
        """Slot k of `hop` received `buf`; returns the job it completed, if any."""
        claim = self._waiting.pop((hop, k), None)
        if claim is None:
            self._landed[(hop, k)] = buf
            return None
        job, i = claim
        job.bufs[i] = buf
        job.missing -= 1
        return job if job.missing == 0 else None

    def claim(self, hop: tuple, first: int, job) -> bool:
        """`job` takes slots first, first+1, ... (one per entry of job.bufs); True if all have
        landed already. Raises RuntimeError if `hop` has no posted slots (never opened, failed
        or closed), so that the job fails instead of waiting forever."""
        if hop not in self._open:
            raise RuntimeError(f"no slot receives are posted for hop {hop} "
                               "(its process group failed or was rebuilt)")
        job.missing = len(job.bufs)
        for i in range(len(job.bufs)):
            buf = self._landed.pop((hop, first + i), None)
            if buf is None:
                self._waiting[(hop, first + i)] = (job, i)
            else:
                job.bufs[i] = buf
                job.missing -= 1
        return job.missing == 0

    def close(self, hop: tuple) -> list:
        """No more slots of `hop` will land: drop its landed buffers and return the jobs that
        were waiting for it (each once)."""
        self._open.discard(hop)
        for key in [key for key in self._landed if key[0] == hop]:
            del self._landed[key]
        jobs: dict[int, Any] = {}
        for key in [key for key in self._waiting if key[0] == hop]:
            job, _ = self._waiting.pop(key)
            jobs[id(job)] = job
        return list(jobs.values())

    def pending(self) -> tuple[int, int]:
        """(landed buffers nobody claimed yet, claimed slots not landed yet)."""
        return len(self._landed), len(self._waiting)


class SlotInbox:
    """The posted slot receives of one hop (one predecessor in one replica group).

    A thread keeps `window` receives posted, each into a fresh `slot_bytes` buffer, waits for
    them in slot order, hands each landed buffer to `on_landed(k, buf)` and re-posts. If the
    pair breaks it calls `on_failed(exc)` and ends, unless `retire()` was called first (the
    group was rebuilt or the transport closed; then it ends quietly)."""

    def __init__(self, pg, src_rank: int, slot_bytes: int, window: int,
                 on_landed: Callable[[int, torch.Tensor], None],
                 on_failed: Callable[[BaseException], None], name: str) -> None:
        self.pg = pg
        self.src_rank = src_rank
        self.slot_bytes = slot_bytes
        self.window = window
        self.on_landed = on_landed
        self.on_failed = on_failed
        self.retired = False
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def retire(self) -> None:
        self.retired = True

    def _post(self, k: int) -> tuple[torch.Tensor, Any]:
        buf = torch.empty(self.slot_bytes, dtype=torch.uint8)
        return buf, self.pg.recv([buf], self.src_rank, slot_tag(k))

    def _run(self) -> None:
        try:
            posted = deque(self._post(k) for k in range(self.window))
            k = 0
            while not self.retired:
                buf, work = posted.popleft()
                work.wait(IDLE_WAIT)
                if self.retired:
                    return
                self.on_landed(k, buf)  # first: the arrival may complete a waiting envelope
                posted.append(self._post(k + self.window))
                k += 1
        except BaseException as exc:  # noqa: BLE001 - reported to the transport
            if not self.retired:
                self.on_failed(exc)
