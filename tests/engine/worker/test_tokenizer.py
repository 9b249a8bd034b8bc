"""Tokenizers: demo bytes, HF tokenizer.json (against transformers), GGUF-embedded vocabularies."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from oracle_models import CHAT_TEMPLATE, save_tokenizer

from paraflex.engine.worker.tokenizer import ByteTokenizer, load_tokenizer
from paraflex.errors import UserError


@given(st.text(max_size=60))
@settings(max_examples=60, deadline=None)
def test_byte_tokenizer_round_trips_any_text(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids[0] == ByteTokenizer.BOS and all(0 <= i < tok.vocab_size for i in ids)
    assert tok.decode(ids) == text
    assert tok.encode(text, add_special_tokens=False) == ids[1:]


def test_byte_tokenizer_is_what_demo_models_load():
    tok = load_tokenizer("tiny-2l", "builtin", "tiny-2l")
    assert isinstance(tok, ByteTokenizer) and tok.eos_token_ids == [257]
    assert tok.decode([104, 105, 257], skip_special_tokens=False) == "hi<eos>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hey"}])
    assert chat.endswith("<|assistant|>\n") and "hey" in chat


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    save_tokenizer(d)
    return d


def test_hf_tokenizer_matches_transformers(hf_dir):
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), bos_token="<s>", eos_token="</s>")
    tok = load_tokenizer(str(hf_dir), "hf", "m")
    for text in ["The capital of France is Paris.", "hello   world\n\tengines!", "ünïcödé 🙂"]:
        ids = tok.encode(text, add_special_tokens=False)
        assert ids == ref.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
    assert tok.encode("hello")[0] == tok.bos_token_id  # add_bos_token from tokenizer_config.json
    assert tok.eos_token_ids == [ref.eos_token_id]


def test_hf_chat_template_renders_like_transformers(hf_dir):
    from transformers import PreTrainedTokenizerFast

    ref = PreTrainedTokenizerFast(tokenizer_file=str(hf_dir / "tokenizer.json"), bos_token="<s>",
                                  eos_token="</s>", chat_template=CHAT_TEMPLATE)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    tok = load_tokenizer(str(hf_dir), "hf", "m")
    assert tok.apply_chat_template(msgs) == ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert not tok.apply_chat_template(msgs, add_generation_prompt=False).endswith("<|assistant|>")


def test_bad_messages_and_missing_files_are_user_errors(tmp_path, hf_dir):
    tok = load_tokenizer(str(hf_dir), "hf", "m")
    with pytest.raises(UserError, match="messages\\[0\\]"):
        tok.apply_chat_template([{"content": "no role"}])
    with pytest.raises(UserError, match="tokenizer.json"):
        load_tokenizer(str(tmp_path), "hf", "m")
    with pytest.raises(UserError, match="does not exist"):
        load_tokenizer(str(tmp_path / "nope"), "hf", "m")


@pytest.mark.slow
def test_gguf_tokenizer_of_smollm2():
    tok = load_tokenizer("smollm2-135m", "builtin", "smollm2")
    # ids from transformers' own GGUF tokenizer conversion of the same file
    assert tok.encode("What is the capital of France?") == [1780, 314, 260, 3575, 282, 4649, 47]
    assert tok.eos_token_ids == [2]
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat.startswith("<|im_start|>system") and chat.endswith("<|im_start|>assistant\n")
    ids = tok.encode(chat)
    assert ids.count(1) == 3  # <|im_start|> is one special token, three times
    assert tok.decode(ids) == chat.replace("<|im_start|>", "").replace("<|im_end|>", "")


def test_a_long_encode_lets_other_threads_run():
    """The gateway tokenizes prompts on a worker thread; that only keeps its event loop (and
    /health) responsive if the encode releases the GIL (tokenizers' `encode` holds it for the
    whole call: about 2 of ~1,800 1-ms ticks got through for a 2.4 MB prompt)."""
    import threading
    import time

    tok = load_tokenizer("smollm2-135m", "builtin", "smollm2")
    text = "hello world " * 100_000
    ticks, done = [0], threading.Event()

    def tick():
        while not done.is_set():
            ticks[0] += 1
            time.sleep(0.001)

    ticker = threading.Thread(target=tick)
    ticker.start()
    started = time.perf_counter()
    ids = tok.encode(text, add_special_tokens=False)
    elapsed = time.perf_counter() - started
    done.set()
    ticker.join()
    assert len(ids) > 100_000
    assert ticks[0] > 0.1 * elapsed * 1000  # a free thread gets ~1 tick per ms of the encode
