"""Paged attention over the shared KV pool: the torch reference path.

Place in the data flow: the worker turns a scheduled batch (per request: how many new tokens,
how many tokens of context, and the layer-wise block tables the engine-core block pool
assigned) into one `AttentionMetadata`; every attention layer of the stage then calls
`paged_attention`, which writes the new keys/values into their slots of the pool and attends
over the whole context gathered back through the block table of that layer.

Pool layout seen here (one model's view, see `paraflex.engine.kv_cache`):
``kv[num_blocks, 2, tokens_per_block, kv_heads, head_dim]`` where ``[:, 0]`` holds keys and
``[:, 1]`` values; a physical block holds one layer of one request. Batched prefill (any
number of new tokens per request, including chunks after cached context) and decode (one new
token per request) are the same code path: a causal mask over absolute positions.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """Index tensors shared by all layers of one stage for one batch (built once per step)."""

    positions: torch.Tensor  # [T] absolute position of every new token (packed batch order)
    write_block: torch.Tensor  # [L, T] physical block of every new token, per stage layer
    write_offset: torch.Tensor  # [T] slot inside the block
    read_block: torch.Tensor  # [L, B, K] physical block of every context slot, per layer
    read_offset: torch.Tensor  # [K] slot inside the block
    mask: torch.Tensor  # [B, 1, Q, K] bool: query may attend key
    query_index: torch.Tensor | None  # [T] index into the padded [B*Q] rows; None if Q == 1
    num_seqs: int
    max_query: int
    last_token_index: torch.Tensor  # [B] packed index of the last new token of every request

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        context_lens: list[int],
        block_tables: list[list[list[int]]],
        tokens_per_block: int,
        device: torch.device | str = "cpu",
    ) -> "AttentionMetadata":
        """query_lens[i]: new tokens of request i; context_lens[i]: its tokens in KV after
        this step (cached + new); block_tables[layer][i]: its physical blocks in that layer
        (layer counted inside the stage)."""
        if len(query_lens) != len(context_lens):
            raise ValueError("query_lens and context_lens differ in length")
        num_seqs = len(query_lens)
        max_q, max_k = max(query_lens), max(context_lens)
        max_blocks = -(-max_k // tokens_per_block)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        c_lens = torch.tensor(context_lens, dtype=torch.long)
        if bool((q_lens <= 0).any()) or bool((q_lens > c_lens).any()):
            raise ValueError("every request needs 1 <= new tokens <= context tokens")
        bt = torch.zeros(len(block_tables), num_seqs, max_blocks, dtype=torch.long)
        for layer, tables in enumerate(block_tables):
            for i, blocks in enumerate(tables):
                need = -(-context_lens[i] // tokens_per_block)
                if len(blocks) < need:
                    raise ValueError(
                        f"block table of request {i} in stage layer {layer} has {len(blocks)} "
                        f"blocks, {need} needed for {context_lens[i]} tokens"
                    )
                bt[layer, i, :need] = torch.tensor(blocks[:need], dtype=torch.long)
        seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens)
        starts = torch.cumsum(q_lens, 0) - q_lens
        within = torch.arange(int(q_lens.sum())) - starts[seq_of_token]
        positions = (c_lens - q_lens)[seq_of_token] + within
        write_block = bt[:, seq_of_token, positions // tokens_per_block]
        key_pos = torch.arange(max_k)
        read_block = bt[:, :, key_pos // tokens_per_block]
        q_pos = (c_lens - q_lens)[:, None] + torch.arange(max_q)[None, :]  # [B, Q]
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
            key_pos[None, None, :] < c_lens[:, None, None]
        )
        mask[:, :, 0] = True  # padded query rows attend something (results are discarded)
        query_index = None if max_q == 1 else seq_of_token * max_q + within
        dev = torch.device(device)
        return cls(
            positions=positions.to(dev),
            write_block=write_block.to(dev),
            write_offset=(positions % tokens_per_block).to(dev),
            read_block=read_block.to(dev),
            read_offset=(key_pos % tokens_per_block).to(dev),
            mask=mask[:, None].to(dev),
            query_index=None if query_index is None else query_index.to(dev),
            num_seqs=num_seqs,
            max_query=max_q,
            last_token_index=(starts + q_lens - 1).to(dev),
        )


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv: torch.Tensor,
    layer: int,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of the new tokens; kv the model's pool view.
    Writes k/v into the pool, returns the attention output [T, Hq * D]."""
    wb, wo = meta.write_block[layer], meta.write_offset
    kv[wb, 0, wo] = k.to(kv.dtype)
    kv[wb, 1, wo] = v.to(kv.dtype)
    rb, ro = meta.read_block[layer], meta.read_offset
    keys = kv[rb, 0, ro].to(q.dtype).transpose(1, 2)  # [B, Hkv, K, D]
    values = kv[rb, 1, ro].to(q.dtype).transpose(1, 2)
    num_tokens, num_heads, head_dim = q.shape
    b, max_q = meta.num_seqs, meta.max_query
    if meta.query_index is None:
        qp = q.view(b, 1, num_heads, head_dim)
    else:
        qp = q.new_zeros(b * max_q, num_heads, head_dim)
        qp[meta.query_index] = q
        qp = qp.view(b, max_q, num_heads, head_dim)
    out = F.scaled_dot_product_attention(
        qp.transpose(1, 2), keys, values, attn_mask=meta.mask, scale=scale,
        enable_gqa=num_heads != keys.shape[1],
    )  # [B, Hq, Q, D]
    out = out.transpose(1, 2).reshape(b * max_q, num_heads * head_dim)
    return out if meta.query_index is None else out[meta.query_index]
