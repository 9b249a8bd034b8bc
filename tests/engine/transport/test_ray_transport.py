"""The two-phase Ray transport: phase-1 wire format, the slot table's pairing logic, gloo
phase 2 between endpoints in one process (fake actor handles, so ordering can be forced; both
the pre-posted slot way and the rendezvous way), and a round trip between real Ray actors."""

from __future__ import annotations

import math
import sys
import threading
import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.engine.transport.base import Envelope
from paraflex.engine.transport.ray import GroupSpec, RayTransport, start_store
from paraflex.engine.transport.ray_wire import arrival_key, decode_phase1, encode_phase1
from paraflex.engine.transport.ray_slots import SlotTable, pack, slot_views

# ----------------------------------------------------------------------------- phase-1 wire

msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**62, 2**62) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=60, deadline=None)
@given(meta=st.dictionaries(st.text(max_size=8), msgpack_values, max_size=5),
       shapes=st.lists(st.lists(st.integers(0, 5), min_size=1, max_size=3), max_size=3),
       seq=st.integers(0, 2**40), kind=st.sampled_from(["batch", "token", "free"]))
def test_phase1_round_trip(meta, shapes, seq, kind):
    tensors = {f"t{i}": torch.zeros(s, dtype=torch.float16) for i, s in enumerate(shapes)} or None
    env = Envelope(src=3, dst=5, model="m", kind=kind, meta=meta, tensors=tensors)
    back, specs, seq2, replica, slots = decode_phase1(encode_phase1(env, seq, 2))
    assert (back.src, back.dst, back.model, back.kind, back.meta) == (3, 5, "m", kind, meta)
    assert back.tensors is None and seq2 == seq and replica == 2 and slots is None
    if tensors:
        assert specs == [[n, "torch.float16", list(t.shape)] for n, t in tensors.items()]
    else:
        assert specs is None


def test_phase1_rejects_other_wire_version():
    import msgpack

    with pytest.raises(ValueError, match="version"):
        decode_phase1(msgpack.packb({"v": 99}))


def test_group_spec_rejects_engine_twice():
    with pytest.raises(ValueError, match="engine listed twice"):
        GroupSpec("m", 0, (1, 2, 1))


def test_arrival_key_uses_batch_id_and_stage():
    b = Envelope(0, 1, "m", "batch", {"batch": 7, "stage": 2})
    assert arrival_key(b, 123) == ("m", 7, 2)
    t1, t2 = Envelope(0, 1, "m", "token", {}), Envelope(0, 1, "m", "token", {})
    assert arrival_key(t1, 1) != arrival_key(t2, 2)


# ----------------------------------------------------------------------------- slot table

class _Job:
    def __init__(self, n: int) -> None:
        self.bufs = [None] * n
        self.missing = 0


@settings(max_examples=80, deadline=None)
@given(plan=st.lists(st.tuples(st.sampled_from(["h0", "h1"]), st.integers(1, 3)), min_size=1,
                     max_size=8),
       order=st.randoms(use_true_random=False))
def test_slot_table_pairs_claims_and_landings_in_any_order(plan, order):
    """Every job gets exactly its own slots' buffers, whichever comes first, and is reported
    complete exactly once."""
    table = SlotTable()
    for hop in ("h0", "h1"):
        table.open(hop)
    jobs, events, next_k = [], [], {"h0": 0, "h1": 0}
    for hop, n in plan:
        job, first = _Job(n), next_k[hop]
        next_k[hop] += n
        jobs.append((job, hop, first))
        events.append(("claim", job, hop, first))
        events += [("land", None, hop, first + i) for i in range(n)]
    order.shuffle(events)
    completed = []
    for what, job, hop, k in events:
        if what == "claim":
            if table.claim(hop, k, job):
                completed.append(job)
        else:
            done = table.land(hop, k, torch.tensor([k], dtype=torch.uint8) + (hop == "h1") * 100)
            if done is not None:
                completed.append(done)
    assert sorted(map(id, completed)) == sorted(id(j) for j, _, _ in jobs)
    for job, hop, first in jobs:
        assert [int(b[0]) for b in job.bufs] == [first + i + (hop == "h1") * 100
                                                 for i in range(len(job.bufs))]
    assert table.pending() == (0, 0)


def test_slot_table_close_fails_waiting_jobs_and_refuses_new_claims():
    table = SlotTable()
    table.open("h")
    job = _Job(2)
    assert not table.claim("h", 0, job)
    table.land("h", 5, torch.zeros(1, dtype=torch.uint8))  # landed, never claimed
    assert table.pending() == (1, 2)
    assert table.close("h") == [job]
    assert table.pending() == (0, 0)
    with pytest.raises(RuntimeError, match="no slot receives are posted"):
        table.claim("h", 2, _Job(1))


def test_slot_views_are_typed_views_and_reject_a_too_small_slot():
    buf = torch.arange(64, dtype=torch.uint8)
    views = slot_views([("h", torch.float32, [2, 3]), ("r", torch.bool, [4])], [buf, buf], False)
    assert views["h"].shape == (2, 3) and views["h"].data_ptr() == buf.data_ptr()
    assert views["r"].tolist() == [False, True, True, True]
    with pytest.raises(ValueError, match="does not fit"):
        slot_views([("h", torch.float32, [20])], [buf], False)


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.sampled_from([torch.float32, torch.bfloat16, torch.bool,
                                                  torch.int64]),
                                 st.lists(st.integers(1, 7), min_size=1, max_size=3)),
                       min_size=1, max_size=4))
def test_packed_slot_round_trips_every_tensor(shapes):
    tensors = [(torch.arange(math.prod(s)) % 5).to(dt).reshape(s) for dt, s in shapes]
    packed = pack(tensors)
    buf = torch.zeros(packed.numel() + 64, dtype=torch.uint8)  # 4 int64 tensors of 7x7x7 pack to 11 KB
    buf[:packed.numel()] = packed
    specs = [(f"t{i}", t.dtype, list(t.shape)) for i, t in enumerate(tensors)]
    views = slot_views(specs, [buf], True)
    for i, t in enumerate(tensors):
        assert views[f"t{i}"].dtype == t.dtype and torch.equal(views[f"t{i}"], t)
        assert views[f"t{i}"].data_ptr() % 64 == 0


# ----------------------------------------------------------------------------- in-process gloo

class _FakeMethod:
    def __init__(self, target: RayTransport, gate: dict) -> None:
        self.target, self.gate = target, gate

    def remote(self, payload: bytes) -> None:
        env = decode_phase1(payload)[0]
        hold = self.gate.get(env.meta.get("batch"))
        if hold is not None:  # deliver this phase-1 call only when the test releases it
            threading.Thread(target=lambda: (hold.wait(10), self.target.deliver(payload)),
                             daemon=True).start()
        else:
            self.target.deliver(payload)


class _FakeHandle:
    def __init__(self, target: RayTransport, gate: dict) -> None:
        self.deliver = _FakeMethod(target, gate)


def _connect_all(transports: dict[int, RayTransport], groups: list[GroupSpec], gate: dict):
    store, port = start_store("127.0.0.1")
    peers = {e: _FakeHandle(t, gate) for e, t in transports.items()}
    threads = [threading.Thread(target=t.connect, args=(peers, groups, "127.0.0.1", port))
               for t in transports.values()]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return store


def _drain(t: RayTransport, n: int, timeout: float = 10.0) -> list[Envelope]:
    got: list[Envelope] = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        t.wait(0.05)
        got.extend(t.recv_ready())
    return got


def _make_pair(**kw):
    gate: dict = {}
    ts = {0: RayTransport(0, **kw), 1: RayTransport(1, **kw)}
    store = _connect_all(ts, [GroupSpec("a", 0, (0, 1)), GroupSpec("b", 0, (0, 1))], gate)
    return ts, gate, store


@pytest.fixture
def pair():
    ts, gate, store = _make_pair()
    yield ts, gate
    for t in ts.values():
        t.close()
    del store


def _batch(model: str, batch_id: int, rows: int, hidden: int = 8) -> Envelope:
    h = torch.full((rows, hidden), float(batch_id)) + torch.arange(hidden)
    return Envelope(0, 1, model, "batch", {"batch": batch_id, "stage": 1, "rows": rows},
                    {"hidden": h, "residual": -h.to(torch.bfloat16)})


def _check(env: Envelope) -> None:
    bid, rows = env.meta["batch"], env.meta["rows"]
    expect = torch.full((rows, 8), float(bid)) + torch.arange(8)
    assert torch.equal(env.tensors["hidden"], expect)
    assert env.tensors["residual"].dtype == torch.bfloat16
    assert torch.equal(env.tensors["residual"], -expect.to(torch.bfloat16))


def _send_all_and_check(ts: dict, sent: list[Envelope]) -> None:
    """Engine 0 sends every envelope; engine 1 gets each batch once, with intact tensors."""
    for env in sent:
        ts[0].send(env)
    got = _drain(ts[1], len(sent))
    assert sorted(e.meta["batch"] for e in got) == sorted(e.meta["batch"] for e in sent)
    for env in got:
        _check(env)


def test_tensors_and_metadata_pair_up_in_process(pair):
    ts, _ = pair
    _send_all_and_check(ts, [_batch("a" if i % 3 else "b", i, rows=1 + i % 4) for i in range(24)])


def test_later_batch_of_another_model_is_not_held_behind_a_stalled_one(pair):
    ts, gate = pair
    release = threading.Event()
    gate[1] = release  # model a's batch 1 phase-1 call is delayed
    ts[0].send(_batch("a", 1, rows=3))
    ts[0].send(_batch("b", 2, rows=2))
    first = _drain(ts[1], 1)
    assert [e.meta["batch"] for e in first] == [2]
    release.set()
    second = _drain(ts[1], 1)
    assert [e.meta["batch"] for e in second] == [1]
    for env in first + second:
        _check(env)


def test_metadata_only_message_never_overtakes_same_model_batch(pair):
    ts, _ = pair
    batch = _batch("a", 5, rows=2)
    # Phase 1 of the batch arrives; its tensors have not been sent yet.
    ts[1].deliver(encode_phase1(batch, 0, 0))
    ts[1].deliver(encode_phase1(Envelope(0, 1, "a", "token", {"n": 1}), 1, 0))
    ts[1].deliver(encode_phase1(Envelope(0, 1, "b", "token", {"n": 2}), 0, 0))
    assert [e.meta["n"] for e in _drain(ts[1], 1, timeout=0.3)] == [2]  # model b is not held
    for work in ts[0].groups.get("a", 0).send(list(batch.tensors.values()), 1, 0):
        work.wait()
    got = _drain(ts[1], 2)
    assert [e.kind for e in got] == ["batch", "token"]
    _check(got[0])


def test_send_without_group_fails_fast_and_lane_failures_are_reported(pair):
    ts, _ = pair
    with pytest.raises(RuntimeError, match="no process group of model 'zzz'"):
        ts[0].send(Envelope(0, 1, "zzz", "batch", {"batch": 9}, {"h": torch.zeros(2)}))
    errors = []
    ts[1].on_error = lambda model, peer, exc: errors.append((model, peer))
    # A phase-1 call naming a replica this engine has no group for: the receive fails,
    # is reported, and the lane keeps serving.
    ts[1].deliver(encode_phase1(_batch("a", 3, rows=1), 0, 7))
    ts[0].send(_batch("a", 11, rows=1))
    got = _drain(ts[1], 1)
    assert [e.meta["batch"] for e in got] == [11] and errors == [("a", 0)]


def test_batches_to_the_next_stage_go_into_preposted_slots(pair):
    ts, gate = pair
    release = threading.Event()
    gate[1] = release  # phase 1 of batch 1 is held: its tensors land in the slots first
    ts[0].send(_batch("a", 1, rows=3))
    deadline = time.monotonic() + 10
    while ts[1].slot_table.pending()[0] < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ts[1].slot_table.pending() == (1, 0) and ts[1].recv_ready() == []  # packed: 1 slot
    release.set()
    (env,) = _drain(ts[1], 1)
    _check(env)
    assert ts[0].groups.get("a", 0).next_slot == 1 and ts[1].slot_table.pending() == (0, 0)


def test_phase1_before_slot_data_holds_later_metadata_of_the_model(pair):
    """Abort/free mid-flight: a free that arrives while a batch's tensors are still on the
    way is released after that batch, never before it."""
    ts, _ = pair
    group = ts[0].groups.get("a", 0)
    batch = _batch("a", 4, rows=2)
    first, group.next_slot = group.next_slot, group.next_slot + 2
    ts[1].deliver(encode_phase1(batch, 0, 0, (0, first, False)))
    ts[1].deliver(encode_phase1(Envelope(0, 1, "a", "free", {"request_ids": ["r"]}), 1, 0))
    assert _drain(ts[1], 1, timeout=0.3) == [] and ts[1].slot_table.pending() == (0, 2)
    for work in group.send_slots(list(batch.tensors.values()), 1, first):
        work.wait()
    got = _drain(ts[1], 2)
    assert [e.kind for e in got] == ["batch", "free"]
    _check(got[0])


def test_tensors_over_slot_bytes_take_the_rendezvous_way():
    ts, _, store = _make_pair(slot_bytes=64)
    try:
        sent = [_batch("a", i, rows=[1, 40, 2, 9][i % 4]) for i in range(12)]  # 32 B .. 1.3 KB
        _send_all_and_check(ts, sent)
        small = sum(2 for e in sent if e.meta["rows"] * 8 * 4 <= 64)
        assert ts[0].groups.get("a", 0).next_slot == small == 12
    finally:
        for t in ts.values():
            t.close()
        del store


def test_claim_on_a_hop_without_slots_fails_alone_and_the_lane_keeps_serving(pair):
    ts, _ = pair
    errors = []
    ts[1].on_error = lambda model, peer, exc: errors.append((model, peer, str(exc)))
    ts[1].deliver(encode_phase1(_batch("a", 3, rows=1), 0, 0, (7, 0, True)))  # generation 7: none
    ts[0].send(_batch("a", 12, rows=1))
    got = _drain(ts[1], 1)
    assert [e.meta["batch"] for e in got] == [12]
    assert [(m, p) for m, p, _ in errors] == [("a", 0)] and "no slot receives" in errors[0][2]


def test_rebuilt_group_gets_fresh_slots_and_close_ends_the_slot_threads():
    def slot_threads():
        return [t for t in threading.enumerate() if t.name.startswith("pf-slots-")]

    before = len(slot_threads())
    ts, gate, store = _make_pair()
    try:
        ts[0].send(_batch("a", 1, rows=2))
        _check(_drain(ts[1], 1)[0])
        store2 = _connect_all(ts, [GroupSpec("a", 0, (0, 1), generation=1)], gate)
        assert ts[1].group_generations()["a/0"] == 1
        assert ts[0].groups.get("a", 0).next_slot == 0  # the new group numbers slots afresh
        for i in range(3):
            ts[0].send(_batch("a", 10 + i, rows=1 + i))
        got = _drain(ts[1], 3)
        assert sorted(e.meta["batch"] for e in got) == [10, 11, 12]
        for env in got:
            _check(env)
    finally:
        for t in ts.values():
            t.close()
    deadline = time.monotonic() + 10
    while len(slot_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(slot_threads()) == before
    del store, store2


def test_send_after_close_raises():
    t = RayTransport(0)
    t.close()
    with pytest.raises(RuntimeError, match="closed"):
        t.send(Envelope(0, 1, "m", "token", {}))


def test_loopback_delivers_without_a_peer():
    t = RayTransport(4)
    t.send(Envelope(4, 4, "m", "token", {"tok": [1]}))
    assert [e.meta for e in t.recv_ready()] == [{"tok": [1]}]
    t.close()


# ----------------------------------------------------------------------------- real Ray actors

def _probe_class(ray):
    ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])  # workers cannot import tests/

    @ray.remote(num_cpus=0.5)
    class Probe:
        """A bare actor hosting one RayTransport endpoint (no engine loop)."""

        def __init__(self, engine_id: int) -> None:
            torch.set_num_threads(1)
            self.t = RayTransport(engine_id)

        def connect(self, peers, groups, host, port) -> None:
            self.t.connect(peers, [GroupSpec.from_wire(g) for g in groups], host, port)

        def deliver(self, payload: bytes) -> None:
            self.t.deliver(payload)

        def send(self, items) -> None:
            for model, dst, bid, rows in items:
                env = _batch(model, bid, rows)
                env.src, env.dst = self.t.engine_id, dst
                self.t.send(env)

        def send_token(self, model, dst, tokens) -> None:
            self.t.send(Envelope(self.t.engine_id, dst, model, "token", {"tokens": tokens}))

        def poll(self):
            """Never blocks: a sync actor runs `deliver` only between other calls."""
            return [(e.src, e.model, e.kind, e.meta, e.tensors) for e in self.t.recv_ready()]

        def close(self) -> None:
            self.t.close()

    return Probe


def _poll(ray, probe, n: int, timeout: float = 20.0) -> list:
    got: list = []
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        got.extend(ray.get(probe.poll.remote(), timeout=timeout))
        time.sleep(0.01)
    return got


@pytest.mark.slow
def test_round_trip_between_ray_actors(ray_session):
    ray = ray_session
    Probe = _probe_class(ray)
    probes = {e: Probe.remote(e) for e in range(3)}
    groups = [GroupSpec("a", 0, (0, 1)), GroupSpec("b", 0, (0, 2)), GroupSpec("c", 0, (1, 2))]
    store, port = start_store("127.0.0.1")
    try:
        ray.get([p.connect.remote(probes, [g.to_wire() for g in groups], "127.0.0.1", port)
                 for p in probes.values()], timeout=60)
        # Engine 2 hears from two predecessors (models b and c) interleaved.
        s0 = probes[0].send.remote([("a", 1, i, 1 + i % 3) if i % 2 else ("b", 2, i, 2)
                                    for i in range(20)])
        s1 = probes[1].send.remote([("c", 2, 100 + i, 1 + i % 5) for i in range(10)])
        ray.get([s0, s1], timeout=30)
        at1 = _poll(ray, probes[1], 10)
        at2 = _poll(ray, probes[2], 20)
        assert sorted(m["batch"] for _, _, _, m, _ in at1) == list(range(1, 20, 2))
        assert sorted(m["batch"] for _, _, _, m, _ in at2) == (
            list(range(0, 20, 2)) + list(range(100, 110)))
        for src, model, kind, meta, tensors in at1 + at2:
            env = Envelope(src, 0, model, kind, meta, tensors)
            _check(env)
            assert src == {"a": 0, "b": 0, "c": 1}[model]
        # Last stage -> first stage: metadata only.
        ray.get(probes[2].send_token.remote("b", 0, [42]), timeout=10)
        (tok,) = _poll(ray, probes[0], 1)
        assert tok[2] == "token" and tok[3] == {"tokens": [42]} and tok[4] is None
    finally:
        ray.get([p.close.remote() for p in probes.values()], timeout=30)
        for p in probes.values():
            ray.kill(p)
        del store


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                    reason="needs two CUDA devices (NCCL ranks cannot share one)")
def test_nccl_streams_pair_up_tensors_and_metadata():
    """The GPU path of test_tensors_and_metadata_pair_up_in_process: NCCL groups and the
    per-model CUDA stream pair, two endpoints on two devices in one process."""
    ts = {0: RayTransport(0, "cuda:0"), 1: RayTransport(1, "cuda:1")}
    store = _connect_all(ts, [GroupSpec("a", 0, (0, 1)), GroupSpec("b", 0, (0, 1))], {})
    try:
        with torch.cuda.device(0):
            sent = []
            for i in range(12):
                env = _batch("a" if i % 3 else "b", i, rows=1 + i % 4)
                env.tensors = {k: v.to("cuda:0") for k, v in env.tensors.items()}
                sent.append(env)
                ts[0].send(env)
        got = _drain(ts[1], len(sent), timeout=60)
        assert sorted(e.meta["batch"] for e in got) == list(range(12))
        for env in got:
            assert env.tensors["hidden"].device == torch.device("cuda:1")
            env.tensors = {k: v.cpu() for k, v in env.tensors.items()}
            _check(env)
    finally:
        for t in ts.values():
            t.close()
        del store


def _tcp_listeners() -> set:
    """(address, port) of this process's listening IPv4 TCP sockets, from /proc (Linux)."""
    own = {os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
           if os.path.exists(f"/proc/self/fd/{fd}")}
    out = set()
    with open("/proc/net/tcp") as fh:
        for line in fh.readlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f"socket:[{f[9]}]" in own:  # 0A: LISTEN
                ip, port = f[1].split(":")
                out.add((".".join(str(int(ip[i:i + 2], 16)) for i in (6, 4, 2, 0)), int(port, 16)))
    return out


def test_gloo_pairs_of_a_loopback_store_listen_on_loopback_only(monkeypatch):
    import torch.distributed as dist

    made, create = [], dist.ProcessGroupGloo.create_device
    monkeypatch.setattr(dist.ProcessGroupGloo, "create_device",
                        lambda **kw: made.append(kw) or create(**kw))
    before = _tcp_listeners()
    ts, _, store = _make_pair()
    try:
        # each group's device is bound to the store's loopback address (a host name resolving
        # elsewhere would otherwise put gloo's listeners there)
        assert made == [{"hostname": "127.0.0.1"}] * 4
        _send_all_and_check(ts, [_batch("a", i, rows=2) for i in range(3)])
        new = _tcp_listeners() - before
        assert new and {ip for ip, _ in new} == {"127.0.0.1"}  # the store and gloo's devices
    finally:
        for t in ts.values():
            t.close()
        del store
