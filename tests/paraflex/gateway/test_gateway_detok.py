"""Incremental detokenization: deltas add up to the full text, cut at the first stop string."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from paraflex.gateway.detok import CONTEXT_TOKENS, TextStream


def byte_decode(ids: list[int]) -> str:
    return bytes(ids).decode("utf-8", errors="replace")


def run(ids: list[int], chunk_sizes: list[int], stop: list[str], decode=byte_decode) -> tuple[str, bool]:
    """`ids` fed in chunks of `chunk_sizes` (the rest at the end, final): the deltas joined, and
    whether a stop string ended the stream; no delta shows U+FFFD before the text decodes to one."""
    ts = TextStream(decode, stop)
    out, i = [], 0
    for size in chunk_sizes:
        if i >= len(ids):
            break
        out.append(ts.feed(ids[i:i + size]))
        i += size
        assert "\ufffd" not in "".join(out) or "\ufffd" in decode(ids[:i])
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


def _metaspace_tokenizer():
    """A sentencepiece-like BPE (Metaspace: a word's leading space is part of its token and the
    decoder drops it at the start of a decode), where a window must keep context."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    text = ["The capital of France is Paris.", "ünïcödé 🙂 words, and more words"] * 20
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=120, special_tokens=["<unk>"]))
    return tok


def _byte_level_tokenizer(tmp_path_factory):
    from oracle_models import save_tokenizer
    from tokenizers import Tokenizer

    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(d)
    return Tokenizer.from_file(str(d / "tokenizer.json"))


@pytest.fixture(scope="module")
def real_tokenizers(tmp_path_factory):
    return {"byte-level BPE": _byte_level_tokenizer(tmp_path_factory), "metaspace BPE": _metaspace_tokenizer()}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.text(alphabet=st.sampled_from(list("The capitl ofFrancsP.ü🙂,\n")), max_size=60),
       st.lists(st.integers(0, 119), max_size=30), st.lists(st.integers(1, 4), min_size=1, max_size=40))
def test_windowed_deltas_equal_the_whole_decode_with_real_tokenizers(real_tokenizers, text, noise, chunks):
    """Each feed decodes only the new tokens and a few before them: the deltas still add up to
    the decode of every token at once, for encoded text and for arbitrary ids (partial bytes of
    a character, unknown words) alike."""
    for tok in real_tokenizers.values():
        ids = tok.encode(text).ids + noise
        decode = lambda x, tok=tok: tok.decode(x, skip_special_tokens=True)  # noqa: E731
        got, _ = run(ids, chunks, [], decode)
        assert got == decode(ids)


def test_a_long_stream_decodes_each_token_a_bounded_number_of_times():
    """The gateway's work per token must not grow with the output: over 3,000 tokens fed one at a
    time, the ids handed to the decoder stay within a constant per token (decoding the whole
    output each time handed it ~4.5 million)."""
    decoded = []

    def counting(ids):
        decoded.append(len(ids))
        return byte_decode(ids)

    text = ("windowed détokenization 🙂 " * 200)[:3000]
    ids = list(text.encode())
    got, _ = run(ids, [1] * len(ids), [], counting)
    assert got == text
    assert sum(decoded) <= 2 * (CONTEXT_TOKENS + 4) * len(ids)
