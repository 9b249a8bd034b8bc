"""Tokenizers: text <-> token ids, and chat templates, for every model source.

Place in the data flow: the gateway (and `paraflex generate`) encodes prompts and renders chat
messages with the model's `Tokenizer` before submitting token ids to the runtime; the last
stage's sampler decodes generated ids to check stop strings; the gateway decodes streamed ids.

`load_tokenizer(source, source_kind)` picks one of:
* `HFTokenizer` over an HF directory's ``tokenizer.json`` (the `tokenizers` library), with the
  chat template and special tokens from ``tokenizer_config.json`` (``generation_config.json``
  may add end-of-sequence ids);
* `HFTokenizer` built from a GGUF file's embedded vocabulary (``tokenizer.ggml.model`` =
  ``gpt2``, byte-level BPE) and its ``tokenizer.chat_template``;
* `ByteTokenizer` for the tiny demo models: ids 0-255 are bytes, 256 = <bos>, 257 = <eos>,
  258 = <pad> (vocab 259), so the demo needs no files.
Chat templates are rendered with jinja2 the way HF does (trim_blocks, lstrip_blocks).
"""

from __future__ import annotations

import json
import os

from paraflex.errors import UserError

_DEFAULT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _render(template: str, messages: list[dict], add_generation_prompt: bool, **special) -> str:
    import jinja2

    def raise_exception(msg):
        raise UserError(f"chat template: {msg}")

    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.ChainableUndefined)
    env.globals["raise_exception"] = raise_exception
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise UserError(f"messages[{i}]: needs 'role' and 'content'")
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt, **special
    )


class Tokenizer:
    """Interface shared by every tokenizer (see module docstring)."""

    eos_token_ids: list[int]
    vocab_size: int
    chat_template: str | None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        raise NotImplementedError

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return _render(
            self.chat_template or _DEFAULT_TEMPLATE, messages, add_generation_prompt,
            **self.special_tokens(),
        )

    def special_tokens(self) -> dict[str, str]:
        return {}


class ByteTokenizer(Tokenizer):
    """Byte-level tokenizer of the tiny demo models."""

    BOS, EOS, PAD = 256, 257, 258

    def __init__(self) -> None:
        self.eos_token_ids = [self.EOS]
        self.vocab_size = 259
        self.chat_template = None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = list(text.encode("utf-8"))
        return [self.BOS] + ids if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        names = {self.BOS: "<bos>", self.EOS: "<eos>", self.PAD: "<pad>"}
        out, buf = [], bytearray()
        for i in ids:
            if i < 256:
                buf.append(i)
                continue
            out.append(buf.decode("utf-8", errors="replace"))
            buf = bytearray()
            if not skip_special_tokens:
                out.append(names.get(i, f"<{i}>"))
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def special_tokens(self) -> dict[str, str]:
        return {"bos_token": "<bos>", "eos_token": "<eos>"}


class HFTokenizer(Tokenizer):
    """A `tokenizers.Tokenizer` plus the chat template and special-token facts."""

    def __init__(self, tok, eos_token_ids, chat_template=None, bos_token_id=None,
                 add_bos: bool = False) -> None:
        self.tok = tok
        self.eos_token_ids = sorted(set(eos_token_ids))
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch releases the GIL (encode holds it: a megabyte prompt froze the gateway's
        # event loop for seconds although it tokenizes on a worker thread)
        ids = self.tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            if not ids or ids[0] != self.bos_token_id:
                ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def special_tokens(self) -> dict[str, str]:
        out = {}
        if self.bos_token_id is not None:
            out["bos_token"] = self.tok.id_to_token(self.bos_token_id) or ""
        if self.eos_token_ids:
            out["eos_token"] = self.tok.id_to_token(self.eos_token_ids[0]) or ""
        return out


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_hf_tokenizer(directory: str) -> HFTokenizer:
    from tokenizers import Tokenizer as RawTokenizer

    path = os.path.join(directory, "tokenizer.json")
    if not os.path.exists(path):
        raise UserError(f"{directory}: no tokenizer.json; save the tokenizer next to the weights")
    tok = RawTokenizer.from_file(path)
    cfg = {}
    cfg_path = os.path.join(directory, "tokenizer_config.json")
    if os.path.exists(cfg_path):
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    template = cfg.get("chat_template")
    tmpl_file = os.path.join(directory, "chat_template.jinja")
    if template is None and os.path.exists(tmpl_file):
        with open(tmpl_file, encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, list):  # named templates: use "default"
        template = next((t["template"] for t in template if t.get("name") == "default"), None)
    eos = []
    eos_text = _token_text(cfg.get("eos_token"))
    if eos_text is not None and tok.token_to_id(eos_text) is not None:
        eos.append(tok.token_to_id(eos_text))
    gen_path = os.path.join(directory, "generation_config.json")
    if os.path.exists(gen_path):
        with open(gen_path, encoding="utf-8") as f:
            gen_eos = json.load(f).get("eos_token_id")
        eos += gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else []
    bos_text = _token_text(cfg.get("bos_token"))
    bos = tok.token_to_id(bos_text) if bos_text else None
    return HFTokenizer(tok, eos, template, bos, add_bos=bool(cfg.get("add_bos_token", False)))


def load_gguf_tokenizer(path: str) -> HFTokenizer:
    from tokenizers import AddedToken, decoders, models, pre_tokenizers
    from tokenizers import Tokenizer as RawTokenizer

    from paraflex.engine.worker.weights.gguf_loader import open_gguf

    reader = open_gguf(path)

    def field(key, default=None):
        f = reader.fields.get(key)
        return default if f is None else f.contents()

    kind = field("tokenizer.ggml.model")
    if kind != "gpt2":
        raise UserError(
            f"{path}: tokenizer type {kind!r} is not supported (byte-level BPE 'gpt2' is); "
            "use the model's HF directory with tokenizer.json instead"
        )
    tokens = field("tokenizer.ggml.tokens")
    types = field("tokenizer.ggml.token_type", [1] * len(tokens))
    merges = [tuple(m.split(" ", 1)) for m in field("tokenizer.ggml.merges", [])]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = RawTokenizer(models.BPE(vocab, merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types) if ty == 3]
    tok.add_special_tokens(control)
    eos = field("tokenizer.ggml.eos_token_id")
    eot = field("tokenizer.ggml.eot_token_id")
    eos_ids = [i for i in (eos, eot) if i is not None]
    return HFTokenizer(
        tok, eos_ids, field("tokenizer.chat_template"), field("tokenizer.ggml.bos_token_id"),
        add_bos=bool(field("tokenizer.ggml.add_bos_token", False)),
    )


def load_tokenizer(source: str | None, source_kind: str | None = None, model_name: str = "") -> Tokenizer:
    """The tokenizer of a model source (same arguments as the weight loaders)."""
    from paraflex.engine.worker.weights import resolve_source

    kind, loc = resolve_source(source, model_name or str(source), source_kind)
    if kind == "random":
        return ByteTokenizer()
    if kind == "hf":
        return load_hf_tokenizer(loc)
    return load_gguf_tokenizer(loc)
