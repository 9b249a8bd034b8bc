"""Messages: msgpack round trips, compact incremental decode updates, clear decode errors."""

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.engine.core.messages import (
    BatchMessage,
    DecodeEntry,
    FreeMessage,
    MessageError,
    PrefillEntry,
    TokenEntry,
    TokenMessage,
    pack,
    unpack,
)

ids = st.text(min_size=1, max_size=12)
tok = st.one_of(st.none(), st.integers(0, 2**31 - 1))
sampling = st.one_of(st.none(), st.fixed_dictionaries({"temperature": st.floats(0, 2), "top_k": st.integers(-1, 100),
                                                         "stop": st.lists(st.text(max_size=4), max_size=2)}))
prefills = st.builds(PrefillEntry, ids, st.integers(0, 5000), st.integers(1, 512), st.integers(1, 8192),
                     st.integers(1, 4096), st.floats(0, 1e6), st.one_of(st.none(), st.lists(st.integers(0, 300000), max_size=20)),
                     sampling)
decodes = st.builds(DecodeEntry, ids, tok, st.integers(0, 10**6))
batches = st.builds(BatchMessage, st.text(min_size=1, max_size=10), st.integers(1, 16), ids,
                    st.sampled_from(["prefill", "decode", "mixed"]), st.lists(prefills, max_size=4),
                    st.lists(decodes, max_size=40), st.floats(0, 1e6),
                    st.dictionaries(st.sampled_from(["hidden", "residual"]), st.lists(st.integers(1, 8192), min_size=2, max_size=2)))
tokens = st.builds(TokenMessage, st.text(min_size=1, max_size=10), ids,
                   st.lists(st.builds(lambda r, t, p, f: TokenEntry(r, t, p, f is not None, f), ids, tok,
                                      st.integers(0, 10**6), st.sampled_from([None, "stop", "length"])), max_size=40))
frees = st.builds(FreeMessage, st.text(min_size=1, max_size=10), st.lists(ids, max_size=10), st.sampled_from(["finished", "aborted"]))


@settings(max_examples=150, deadline=None)
@given(st.one_of(batches, tokens, frees))
def test_round_trip_through_msgpack(msg):
    assert unpack(pack(msg)) == msg


def test_decode_update_carries_only_new_token_and_position():
    prefill = BatchMessage("m", 1, "b1", "prefill", [PrefillEntry("r1", 0, 900, 900, 64, 1.5, list(range(900)), {"temperature": 0.7})])
    decode = BatchMessage("m", 1, "b2", "decode", decodes=[DecodeEntry("r1", 42, 900)])
    d = decode.to_dict()
    assert d["p"] == [] and d["d"] == [["r1"], [42], [900]]
    assert len(pack(decode)) < len(pack(prefill)) / 10
    # 32 decodes: three flat arrays, well under 20 bytes per request
    big = BatchMessage("m", 1, "b3", "decode", decodes=[DecodeEntry(f"req-{i}", 1000 + i, 500 + i) for i in range(32)])
    assert len(pack(big)) < 32 * 20


def test_row_count_and_ids():
    msg = BatchMessage("m", 2, "b", "mixed", [PrefillEntry("a", 0, 7, 20, 4, 0.0)], [DecodeEntry("b", 1, 9), DecodeEntry("c", 2, 3)])
    assert msg.num_tokens == 9 and msg.req_ids == ["a", "b", "c"]


def test_token_message_lists_finished():
    m = TokenMessage("m", "b", [TokenEntry("a", 1, 5), TokenEntry("b", 2, 6, True, "length")])
    assert m.finished == ["b"]


@pytest.mark.parametrize(
    "raw,match",
    [
        (msgpack.packb({"v": 99, "type": "free", "model": "m", "ids": [], "reason": "finished"}), "wire version 99"),
        (msgpack.packb({"v": 1, "type": "free", "model": "m"}), "missing field"),
        (msgpack.packb({"v": 1, "type": "tensor"}), "unknown message type"),
        (b"\xc1garbage", "undecodable"),
    ],
)
def test_bad_bytes_raise_message_error(raw, match):
    with pytest.raises(MessageError, match=match):
        unpack(raw)
