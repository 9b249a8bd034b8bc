"""Incremental detokenization: deltas add up to the full text, cut at the first stop string."""

from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.gateway.detok import TextStream


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def run(ids: list[int], chunk_sizes: list[int], stop: list[str]) -> tuple[str, bool]:
    ts = TextStream(byte_decode, stop)
    out, i = [], 0
    for size in chunk_sizes:
        if i >= len(ids):
            break
        out.append(ts.feed(ids[i:i + size]))
        i += size
        assert "\ufffd" not in "".join(out) or "\ufffd" in byte_decode(ids[:i])
    out.append(ts.feed(ids[i:], final=True))
    return "".join(out), ts.stopped


texts = st.text(alphabet=st.sampled_from(list("ab c\né€😀")), max_size=40)


@settings(max_examples=200, deadline=None)
@given(texts, st.lists(st.integers(1, 5), max_size=60), st.lists(st.sampled_from(["a", "bc", "é€", "😀a", " c\n"]),
                                                                   max_size=2))
def test_deltas_concatenate_to_text_cut_at_first_stop(text, chunks, stop):
    ids = list(text.encode())
    got, stopped = run(ids, chunks, stop)
    cuts = [text.find(s) for s in stop if s in text]
    if cuts:
        assert stopped and got == text[:min(cuts)]
    else:
        assert not stopped and got == text


def test_never_emits_half_a_character():
    ts = TextStream(byte_decode, [])
    euro = "€".encode()
    assert ts.feed([euro[0]]) == ""
    assert ts.feed([euro[1]]) == ""
    assert ts.feed([euro[2]]) == "€"


def test_holds_back_a_possible_stop_prefix_then_releases_it():
    ts = TextStream(byte_decode, ["STOP"])
    assert ts.feed(list(b"abST")) == "a"  # the last 3 characters could start "STOP"
    assert ts.feed(list(b"x")) == "b"
    assert ts.feed(list(b"STOPyz")) == "STx"  # cut before the stop string, rest released
    assert ts.stopped and ts.text == "abSTx"
    assert ts.feed(list(b"more"), final=True) == ""
