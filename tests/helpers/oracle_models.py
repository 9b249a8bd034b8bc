"""Tiny random-weight checkpoints built with `transformers`, the oracle of the engine tests.

Each builder saves a checkpoint with `save_pretrained` (safetensors) into a directory and
returns the in-memory `transformers` model, whose `generate` is the reference output;
`run_stages` runs the engine's `Stage`s of such a model in order, for comparison.
"""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from hand_placement import hand_placement
from paraflex.engine.worker.attention import AttentionMetadata

VOCAB = 320

# The test machine has 2 shared cores: one intra-op thread avoids OpenMP spin contention that
# makes tiny matmuls 100x slower under load.
torch.set_num_threads(1)


def build_llama(directory, num_layers=3, seed=0, llama3_rope=True, max_shard_size=None, tie_word_embeddings=False,
                vocab_size=VOCAB):
    torch.manual_seed(seed)
    kw = {}
    if llama3_rope:
        kw["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                              "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=96,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=256, rope_theta=50000.0, tie_word_embeddings=tie_word_embeddings,
                      bos_token_id=1, eos_token_id=2, **kw)
    return _save(LlamaForCausalLM(cfg), directory, max_shard_size)


def build_qwen2(directory, num_layers=5, seed=1, max_shard_size=None):
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=48, intermediate_size=80,
                      num_hidden_layers=num_layers, num_attention_heads=6, num_key_value_heads=2,
                      max_position_embeddings=256, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    return _save(Qwen2ForCausalLM(cfg), directory, max_shard_size)


CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def save_tokenizer(directory):
    """A byte-level BPE tokenizer (vocab 300) trained on a few sentences, as tokenizer.json."""
    import json

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["The capital of France is Paris.", "What is the capital of France?",
            "Paged attention reads the shared pool.", "hello world, hello engines"] * 20
    tok.train_from_iterator(text, trainer)
    tok.save(f"{directory}/tokenizer.json")
    with open(f"{directory}/tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True,
                   "chat_template": CHAT_TEMPLATE}, f)


def _save(model, directory, max_shard_size):
    model.eval()
    with torch.no_grad():  # larger-than-default weights so greedy paths are not near-ties
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(str(directory), **kw)
    save_tokenizer(directory)
    return model


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """The tokens `transformers` generate picks greedily (EOS ignored)."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False,
            min_new_tokens=max_new_tokens, pad_token_id=0,
        )
    return out[0, len(prompt_ids):].tolist()


def make_placement(models: dict, num_engines: int, kv_bytes: int = 1 << 20):
    """A hand-made placement: models[name] = (num_layers, [(a, b), ...], [[engine per stage], ...])."""
    return hand_placement(models, num_engines, kv_bytes)


def make_config(models: dict, num_engines: int, block_bytes: int = 4096, host_memory_gb: float = 0.0,
                max_batch_size: int = 32):
    """A Config over HF directories: models[name] = directory."""
    from paraflex.config.schema import Config

    return Config.from_dict({
        "cluster": {"num_engines": num_engines, "device": "cpu", "memory_gb": 1.0,
                    "host_memory_gb": host_memory_gb},
        "models": [{"name": n, "hf": str(d)} for n, d in models.items()],
        "scheduler": {"block_bytes": block_bytes, "max_batch_size": max_batch_size},
    })


def run_stages(stages, inputs, query_lens, context_lens, kv, tables, tpb):
    """One forward through consecutive `Stage`s (the layer-wise block `tables` of the whole
    model, cut per stage): the last stage's output."""
    x, offset = inputs, 0
    for st in stages:
        meta = AttentionMetadata.build(query_lens, context_lens, tables[offset:offset + st.num_layers], tpb)
        x = st.forward(x, meta, kv)
        offset += st.num_layers
    return x
