"""Paged attention over the shared KV pool, in plain torch.

Place in the data flow: the worker turns a scheduled batch (per request: how many new tokens,
how many tokens of context, and the layer-wise block tables the engine-core block pool
assigned) into one `AttentionMetadata`; every attention layer of the stage then calls
`paged_attention`, which writes the new keys/values into their slots of the pool and attends
over the whole context read back through the block table of that layer.

Pool layout seen here (one model's view, see `paraflex.engine.worker.kv_cache`):
``kv[num_blocks, 2, tokens_per_block, kv_heads, head_dim]`` where ``[:, 0]`` holds keys and
``[:, 1]`` values; a physical block holds one layer of one request, and blocks may end in
unused slack bytes. Batched prefill (any number of new tokens per request, including chunks
after cached context) and decode (one new token per request) are the same code path.

CPU float32 and bfloat16 decode batches (one new token per request) go to the compiled decode kernel of
`paraflex.engine.kernels.native_attention`, CPU float32 batches with prompts (contexts up to
`PROMPT_KERNEL_MAX_CONTEXT` tokens) to its prompt kernel; both write the new keys/values and attend
over each request's blocks where they lie (no copy of the context); batches on CUDA tensors go to the
Triton kernels of `paraflex.engine.kernels.triton_paged_attention` (same idea, decode and
prompts). Where neither applies (no compiler, no Triton, a shape the kernels refuse), the torch
code below runs.

How the torch path reads the context: the pool is seen as a flat table of
*rows* of ``row`` elements, where ``row`` is the largest divisor of head_dim that also divides
the block stride (head_dim itself for power-of-two blocks), so one key or value vector of one
head is ``head_dim // row`` consecutive rows. For every layer, ONE `index_select` over that
table copies the whole context of the batch straight into the ``[2, B, kv_heads, K, head_dim]``
layout the matmuls want: one memcpy per row, no per-element indexing and no second copy. The
row numbers of all layers are computed once per step (`AttentionMetadata.rows`) and shared
by the layers. Decode (one query per request) multiplies by the grouped queries directly
(``[B, kv_heads, group, D] @ K^T``, masked softmax, ``@ V``): the same operations in the same
order as `transformers`' eager attention. Prompts use `scaled_dot_product_attention` (its
tiled kernel keeps long prompts from materialising the full score matrix); whole prompts with
nothing cached (`AttentionMetadata.fresh`) attend their own new keys/values with the causal
flag, without reading the context back or building its mask.
"""

from __future__ import annotations

import array
import math
from dataclasses import dataclass, field
from functools import cached_property

import torch
import torch.nn.functional as F

from paraflex.engine.kernels import native_attention
from paraflex.engine.kernels.optional import triton_module


@dataclass
class AttentionMetadata:
    """Index tensors shared by all layers of one stage for one batch (built once per step)."""

    positions: torch.Tensor  # [T] absolute position of every new token (packed batch order)
    write_block: torch.Tensor  # [L, T] physical block of every new token, per stage layer
    write_offset: torch.Tensor  # [T] slot inside the block
    query_index: torch.Tensor | None  # [T] index into the padded [B*Q] rows; None if Q == 1
    num_seqs: int
    max_query: int
    last_token_index: torch.Tensor  # [B] packed index of the last new token of every request
    block_table: torch.Tensor  # [L, B, max blocks] int64, physical blocks of every request per layer
    context_lens: torch.Tensor  # [B] int64, tokens in KV after this step
    query_lens: torch.Tensor  # [B] int64 (on the CPU), new tokens of every request
    tokens_per_block: int
    fresh: bool = False  # every request's context is its new tokens (whole prompts, nothing cached)
    max_context: int = 0  # the longest context of the batch (host-side: kernels size their work by it)
    query_start: torch.Tensor | None = None  # [B+1] int64: request i owns packed rows [i]:[i+1]
    _rows: dict = field(default_factory=dict, repr=False)  # pool geometry -> (read rows, write rows)

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
        check_lengths(query_lens, context_lens)
        num_seqs = len(query_lens)
        max_q, max_k = max(query_lens), max(context_lens)
        max_blocks = -(-max_k // tokens_per_block)
        needs = [-(-c // tokens_per_block) for c in context_lens]
        pads = [[0] * (max_blocks - need) for need in needs]
        flat = array.array("q")  # one flat int64 buffer: ~10x faster to fill and wrap than torch.tensor(list)
        for layer, tables in enumerate(block_tables):
            for i, blocks in enumerate(tables):
                need = needs[i]
                if len(blocks) < need:
                    raise ValueError(
                        f"block table of request {i} in stage layer {layer} has {len(blocks)} "
                        f"blocks, {need} needed for {context_lens[i]} tokens"
                    )
                flat.extend(blocks[:need])
                flat.extend(pads[i])
        bt = torch.frombuffer(flat, dtype=torch.long).view(len(block_tables), num_seqs, max_blocks)
        q_lens = torch.tensor(query_lens, dtype=torch.long)
        c_lens = torch.tensor(context_lens, dtype=torch.long)
        # (not torch.repeat_interleave: it goes parallel even for 32 elements, ~4 ms on two threads
        # when the other core is busy, against ~20 us on one)
        seq_of_token = (torch.arange(num_seqs) if max_q == 1 else
                        torch.tensor([i for i, n in enumerate(query_lens) for _ in range(n)], dtype=torch.long))
        starts = torch.cumsum(q_lens, 0) - q_lens
        within = torch.arange(int(q_lens.sum())) - starts[seq_of_token]
        positions = (c_lens - q_lens)[seq_of_token] + within
        write_block = bt[:, seq_of_token, positions // tokens_per_block]
        query_index = None if max_q == 1 else seq_of_token * max_q + within
        dev = torch.device(device)
        return cls(
            positions=positions.to(dev),
            write_block=write_block.to(dev),
            write_offset=(positions % tokens_per_block).to(dev),
            query_index=None if query_index is None else query_index.to(dev),
            num_seqs=num_seqs,
            max_query=max_q,
            last_token_index=(starts + q_lens - 1).to(dev),
            block_table=bt.to(dev),
            context_lens=c_lens.to(dev),
            query_lens=q_lens,
            tokens_per_block=tokens_per_block,
            fresh=query_lens == context_lens,
            max_context=max_k,
            query_start=torch.cat((starts, starts[-1:] + q_lens[-1:])).to(dev),
        )

    @cached_property
    def context(self) -> "ContextIndex":
        """Where every context slot of the batch lies and who may attend it: built on first use
        (the torch path needs it; the compiled CPU decode kernel walks the block table itself)."""
        return ContextIndex.build(self)

    def rows(self, kv: torch.Tensor, read: bool = True) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, int]:
        """(row table of the pool view `kv`, read rows [L, 2*B*H*K*r] (None unless `read`),
        write rows [L, 2*T*H*r], row size) where r = head_dim // row size; computed once per
        pool geometry (the read rows on first use)."""
        num_blocks, _, tpb, heads, head_dim = kv.shape
        stride = kv.stride(0)
        row = math.gcd(stride, head_dim)
        table = torch.as_strided(kv, (num_blocks * stride // row, row), (row, 1), kv.storage_offset())
        key = (stride, tpb, heads, head_dim)
        cached = self._rows.get(key)
        if cached is None or (read and cached[0] is None):
            per_vec = head_dim // row
            dev = kv.device
            # row of element 0 of (block, k/v, slot, head): block*stride/row + ((kv*tpb + slot)*H + head)*per_vec
            kvh = (torch.arange(2, device=dev)[:, None] * tpb * heads + torch.arange(heads, device=dev)[None, :])
            sub = torch.arange(per_vec, device=dev)
        if cached is None:
            wbase = self.write_block * (stride // row) + self.write_offset * heads * per_vec  # [L, T]
            write = (wbase[:, None, :, None, None] + (kvh * per_vec)[None, :, None, :, None]
                     + sub).reshape(wbase.shape[0], -1)  # [L, 2, T, H, per_vec]
            cached = self._rows[key] = [None, write]
        if read and cached[0] is None:
            ctx = self.context
            layers = ctx.read_block.shape[0]
            base = ctx.read_block * (stride // row) + (ctx.read_offset * heads * per_vec)  # [L, B, K]
            cached[0] = (base[:, None, :, None, :, None] + (kvh * per_vec)[None, :, None, :, None, None]
                         + sub).reshape(layers, -1)  # [L, 2, B, H, K, per_vec]
        return table, cached[0], cached[1], row


def check_lengths(query_lens: list[int], context_lens: list[int]) -> None:
    """Raise ValueError unless every request has 1 <= new tokens <= context tokens."""
    if len(query_lens) != len(context_lens):
        raise ValueError("query_lens and context_lens differ in length")
    if any(q <= 0 or q > c for q, c in zip(query_lens, context_lens)):
        raise ValueError("every request needs 1 <= new tokens <= context tokens")


@dataclass
class ContextIndex:
    """The context side of `AttentionMetadata` (torch path only)."""

    read_block: torch.Tensor  # [L, B, K] physical block of every context slot, per layer
    read_offset: torch.Tensor  # [K] slot inside the block
    mask: torch.Tensor  # [B, 1, Q, K] bool: query may attend key
    bias: torch.Tensor | None  # [B, 1, 1, K] float 0/-inf of a decode batch; None if nothing is masked

    @classmethod
    def build(cls, meta: AttentionMetadata) -> "ContextIndex":
        bt, tpb, dev = meta.block_table.cpu(), meta.tokens_per_block, meta.block_table.device
        c_lens, q_lens = meta.context_lens.cpu(), meta.query_lens
        max_q, max_k = meta.max_query, int(c_lens.max())
        key_pos = torch.arange(max_k)
        read_block = bt[:, :, key_pos // tpb]
        q_pos = (c_lens - q_lens)[:, None] + torch.arange(max_q)[None, :]  # [B, Q]
        mask = (key_pos[None, None, :] <= q_pos[:, :, None]) & (
            key_pos[None, None, :] < c_lens[:, None, None]
        )
        mask[:, :, 0] = True  # padded query rows attend something (results are discarded)
        bias = None
        if max_q == 1 and int(c_lens.min()) < max_k:
            bias = torch.zeros(meta.num_seqs, 1, 1, max_k).masked_fill_(~mask[:, None], float("-inf"))
        return cls(
            read_block=read_block.to(dev),
            read_offset=(key_pos % tpb).to(dev),
            mask=mask[:, None].to(dev),
            bias=None if bias is None else bias.to(dev),
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
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = k.shape[1]
    if q.is_cuda:
        kernels = triton_module("triton_paged_attention", "CUDA attention runs on the torch path")
        if kernels is not None and kernels.serves(q, kv):
            return kernels.paged_attention(q, k, v, kv, layer, meta, scale)
    if meta.query_index is None and native_attention.usable(q, kv):
        return native_attention.decode_attention(q, k, v, kv, meta.block_table[layer], meta.context_lens, scale)
    if meta.query_index is not None and native_attention.prompts_usable(q, kv, meta.max_context):
        return native_attention.prompt_attention(q, k, v, kv, meta.block_table[layer], meta.context_lens,
                                                 meta.query_start, scale)
    fresh = meta.fresh and meta.query_index is not None
    table, read, write, row = meta.rows(kv, read=not fresh)
    new = torch.stack((k, v)).to(kv.dtype)  # [2, T, Hkv, D]
    table.index_copy_(0, write[layer], new.view(-1, row))
    if fresh:
        return _fresh_prompts(q, k, v, meta, scale)
    context = meta.context
    b, max_q, max_k = meta.num_seqs, meta.max_query, context.read_block.shape[2]
    ctx = table.index_select(0, read[layer]).view(2, b, kv_heads, max_k, head_dim).to(q.dtype)
    keys, values = ctx[0], ctx[1]  # [B, Hkv, K, D]
    if meta.query_index is None:  # decode: one query per request, grouped by kv head
        qg = q.view(b, kv_heads, num_heads // kv_heads, head_dim)
        scores = torch.matmul(qg, keys.transpose(-1, -2)) * scale  # [B, Hkv, G, K]
        if context.bias is not None:
            scores += context.bias  # (in place: keeps a bfloat16 batch in bfloat16)
        out = torch.matmul(torch.softmax(scores, dim=-1), values)  # [B, Hkv, G, D]
        return out.reshape(b, num_heads * head_dim)
    qp = q.new_zeros(b * max_q, num_heads, head_dim)
    qp[meta.query_index] = q
    out = F.scaled_dot_product_attention(
        qp.view(b, max_q, num_heads, head_dim).transpose(1, 2), keys, values, attn_mask=context.mask,
        scale=scale, enable_gqa=num_heads != kv_heads,
    )  # [B, Hq, Q, D]
    return out.transpose(1, 2).reshape(b * max_q, num_heads * head_dim)[meta.query_index]


def _fresh_prompts(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
                   scale: float) -> torch.Tensor:
    """Whole prompts (no cached context): each attends its own new keys/values causally, so
    the pool is not read back and the kernel skips the blocks above the diagonal. Prompts of
    one length need no padding; shorter ones are padded to the longest (a padded key lies
    after every real query of its prompt, so causality hides it; padded query rows are
    dropped)."""
    num_tokens, num_heads, head_dim = q.shape
    b, max_q = meta.num_seqs, meta.max_query

    def padded(x: torch.Tensor) -> torch.Tensor:  # [T, H, D] -> [B, H, Q, D]
        if num_tokens != b * max_q:
            full = x.new_zeros(b * max_q, *x.shape[1:])
            full[meta.query_index] = x
            x = full
        return x.view(b, max_q, *x.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(padded(q), padded(k), padded(v), is_causal=True, scale=scale,
                                         enable_gqa=num_heads != k.shape[1])  # [B, Hq, Q, D]
    out = out.transpose(1, 2).reshape(b * max_q, num_heads * head_dim)
    return out if num_tokens == b * max_q else out[meta.query_index]
