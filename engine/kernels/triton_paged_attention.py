"""Triton paged attention over the shared KV byte pool: the CUDA path of `paged_attention`.

Place in the data flow: `paged_attention` (engine/worker/attention.py) hands a batch on CUDA tensors
to `paged_attention` here. It stores the new keys/values into their pool slots
(`_write_kv_kernel`), then attends over each request's context where its blocks lie, through
the layer's block table (no copy of the context):

* a decode batch (one query per request): `_decode_kernel`, one program per (request, KV head,
  split) that handles all query heads of the group and walks `BLOCK_N` tokens at a time across
  as many pool blocks as that covers; long contexts are cut into splits whose partial results
  `_reduce_splits_kernel` merges (split-K, so that a small batch still fills the GPU);
* anything else (prompts, prompt chunks after cached context, mixed batches): `_prefill_kernel`,
  one program per (request, block of `BLOCK_M` queries, query head), causal over cached context
  plus the new tokens.

Pool layout (one model's view, engine/worker/kv_cache.py): ``kv[num_blocks, 2, tokens_per_block,
kv_heads, head_dim]`` with any strides the byte pool gives (blocks may end in slack bytes) and
any tokens_per_block. head_dim is padded inside the kernels to the next power of two with
masks. Scores and softmax run in float32; float32 models multiply in IEEE float32 (not TF32),
so that their greedy tokens can match a float32 reference exactly.

The kernels read no host value during a step: splits and tile sizes come from the host-side
metadata (`AttentionMetadata.max_context`, `max_query`), so a decode step can be captured in a
CUDA graph (engine/kernels/cuda_graphs.py) and replayed with other context lengths. A negative
write offset skips the write (the padded rows of such a graph).

On a machine without a GPU the same kernels run on CPU tensors under the Triton interpreter
(`TRITON_INTERPRET=1` before Triton is imported); the interpreter's dot product mishandles
bfloat16, so there the operands of `tl.dot` are widened to float32 first (`WIDEN_DOT`).
"""

from __future__ import annotations

import functools
import logging

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
LOG2E = 1.4426950408889634
MIN_TOKENS_PER_SPLIT = 256  # a split shorter than this costs more in its merge than it saves
SPLIT_TARGET_PROGRAMS = 4  # aim for this many decode programs per streaming multiprocessor
MAX_SPLITS = 64

_logged: set[str] = set()

# Triton compiles a kernel once per specialisation of its arguments: an integer equal to 1 or
# divisible by 16, a pointer aligned to 16 bytes. The prefill's block-table width (`stride_table`:
# the batch's longest context in blocks) and the alignment of its per-layer metadata views change
# from batch to batch, so each new combination compiled the prefill kernel again: on an H100, five
# compiles of 0.5-1.7 s per model within its first prompts of 83-1,024 tokens, each stalling the
# whole engine (bench/first_prefills.py). These arguments are not specialised: one variant serves
# every batch, at the same step time (the eager prefill is launch-bound).
PREFILL_UNSPECIALIZED = {"do_not_specialize": ["stride_table", "tokens_per_block"],
                         "do_not_specialize_on_alignment": ["BLOCK_TABLE", "CONTEXT_LENS", "QUERY_START"]}
WRITE_KV_UNSPECIALIZED = {"do_not_specialize_on_alignment": ["BLOCK", "OFFSET"]}
# the same for a decode run eagerly (beyond the CUDA graphs' sizes; captured graphs fix them)
DECODE_UNSPECIALIZED = {"do_not_specialize": ["stride_table", "tokens_per_block"],
                        "do_not_specialize_on_alignment": ["BLOCK_TABLE", "CONTEXT_LENS"]}


def unsupported_reason(q: torch.Tensor, kv: torch.Tensor) -> str | None:
    """Why these kernels cannot serve this layer (None when they can)."""
    head_dim = q.shape[-1]
    if kv.dtype not in DTYPES or q.dtype != kv.dtype:
        return f"dtype {q.dtype} over a {kv.dtype} pool (kernels: matching float16, bfloat16 or float32)"
    if head_dim > MAX_HEAD_DIM:
        return f"head_dim {head_dim} > {MAX_HEAD_DIM}"
    if kv.stride(-1) != 1:
        return "a pool view whose head_dim is not contiguous"
    return None


def serves(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the kernels take this layer; logs once per reason when they do not."""
    reason = unsupported_reason(q, kv)
    if reason is not None and reason not in _logged:
        _logged.add(reason)
        log.warning("Triton paged attention: %s; this shape runs on the torch path", reason)
    return reason is None


def paged_attention(q, k, v, kv, layer: int, meta, scale: float) -> torch.Tensor:
    """q [T, Hq, D], k/v [T, Hkv, D] of the new tokens; kv the model's pool view; `meta` an
    `AttentionMetadata` on q's device. Writes k/v into the pool, returns [T, Hq * D]."""
    write_kv(k, v, kv, meta.write_block[layer], meta.write_offset)
    if meta.query_index is None:
        return decode(q, kv, meta.block_table[layer], meta.context_lens, meta.max_context, scale)
    return prefill(q, kv, meta.block_table[layer], meta.context_lens, meta.query_start, meta.max_query, scale)


def write_kv(k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, block: torch.Tensor, offset: torch.Tensor) -> None:
    """Store k/v [T, Hkv, D] at slot `offset[t]` of physical block `block[t]` (int64 [T]);
    rows whose offset is negative are skipped."""
    num_tokens, kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _write_kv_kernel[(num_tokens, kv_heads)](
        k, v, kv, block, offset,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        HEAD_DIM=head_dim, DIM_PAD=_dim_pad(head_dim),
    )


def decode(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
           max_context: int, scale: float, num_splits: int | None = None) -> torch.Tensor:
    """One query per request: q [B, Hq, D], block_table int64 [B, max blocks] of this layer,
    context_lens int64 [B] (a request with 0 gets zeros), `max_context` >= every context length
    (sets the split count unless `num_splits` is given). Returns [B, Hq * D]."""
    batch, num_heads, head_dim = q.shape
    kv_heads = kv.shape[3]
    group = num_heads // kv_heads
    q = _last_dim_contiguous(q)
    out = torch.empty(batch, num_heads * head_dim, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    splits = num_splits or choose_splits(batch * kv_heads, max_context, q.device)
    use_dot = group > 1
    group_pad = max(16, triton.next_power_of_2(group)) if use_dot else 1
    dim_pad = _dim_pad(head_dim)
    block_n = 64 if dim_pad <= 128 else 32
    if splits > 1:
        part_out = torch.empty(batch, num_heads, splits, head_dim, dtype=torch.float32, device=q.device)
        part_lse = torch.empty(batch, num_heads, splits, dtype=torch.float32, device=q.device)
    else:
        part_out = part_lse = out  # unused: the kernel stores the final output
    _decode_kernel[(batch, kv_heads, splits)](
        q, kv, block_table, context_lens, out, part_out, part_lse,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        block_table.stride(0), out.stride(0), scale * LOG2E, kv.shape[2],
        GROUP=group, HEAD_DIM=head_dim, GROUP_PAD=group_pad, DIM_PAD=dim_pad, BLOCK_N=block_n,
        NUM_SPLITS=splits, USE_DOT=use_dot, **_dot_flags(q),
        num_warps=4, num_stages=2,
    )
    if splits > 1:
        _reduce_splits_kernel[(batch, num_heads)](
            part_out, part_lse, out, out.stride(0),
            HEAD_DIM=head_dim, DIM_PAD=dim_pad, NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits),
        )
    return out


def prefill(q: torch.Tensor, kv: torch.Tensor, block_table: torch.Tensor, context_lens: torch.Tensor,
            query_start: torch.Tensor, max_query: int, scale: float) -> torch.Tensor:
    """Packed queries q [T, Hq, D] of every request (request i owns rows
    query_start[i]:query_start[i+1], int64 [B+1]), each the last tokens of its context_lens[i]
    tokens; causal over the context. Returns [T, Hq * D]."""
    num_tokens, num_heads, head_dim = q.shape
    kv_heads = kv.shape[3]
    q = _last_dim_contiguous(q)
    out = torch.empty(num_tokens, num_heads * head_dim, dtype=q.dtype, device=q.device)
    batch = context_lens.shape[0]
    if num_tokens == 0:
        return out
    dim_pad = _dim_pad(head_dim)
    block_m = 16 if max_query <= 16 else 64
    block_n = 64 if dim_pad <= 128 else 32
    _prefill_kernel[(batch, triton.cdiv(max_query, block_m), num_heads)](
        q, kv, block_table, context_lens, query_start, out,
        q.stride(0), q.stride(1), kv.stride(0), kv.stride(1), kv.stride(2), kv.stride(3),
        block_table.stride(0), out.stride(0), scale * LOG2E, kv.shape[2],
        GROUP=num_heads // kv_heads, HEAD_DIM=head_dim, DIM_PAD=dim_pad, BLOCK_M=block_m, BLOCK_N=block_n,
        **_dot_flags(q), num_warps=4, num_stages=2,
    )
    return out


def choose_splits(programs: int, max_context: int, device: torch.device) -> int:
    """Splits per (request, KV head) of a decode batch: enough programs to fill the GPU, no
    split shorter than MIN_TOKENS_PER_SPLIT, rounded down to a power of two. The count is a
    compile-time constant of the kernels, so each distinct value compiles them (0.5-1.7 s on an
    H100, the whole engine waiting: bench/first_prefills.py): a decode run eagerly (a context
    beyond the CUDA graphs' `MAX_CONTEXT`, engine/kernels/cuda_graphs.py) would otherwise meet
    a new count every MIN_TOKENS_PER_SPLIT tokens its context grows; powers of two make at most
    seven variants, each compiled once."""
    longest = max(1, max_context // MIN_TOKENS_PER_SPLIT)
    if device.type != "cuda":
        return min(longest, 4)
    wanted = -(-SPLIT_TARGET_PROGRAMS * _multiprocessors(device.index) // programs)
    splits = max(1, min(longest, wanted, MAX_SPLITS))
    return 1 << (splits.bit_length() - 1)


@functools.lru_cache(maxsize=None)
def _multiprocessors(index: int | None) -> int:
    return torch.cuda.get_device_properties(index if index is not None else torch.cuda.current_device()).multi_processor_count


def _dim_pad(head_dim: int) -> int:
    return max(16, triton.next_power_of_2(head_dim))


def _dot_flags(q: torch.Tensor) -> dict:
    return {"WIDEN_DOT": q.device.type == "cpu", "IEEE": q.dtype == torch.float32 or q.device.type == "cpu"}


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


@triton.jit(**WRITE_KV_UNSPECIALIZED)
def _write_kv_kernel(K, V, KV, BLOCK, OFFSET, stride_k_tok, stride_k_head, stride_v_tok, stride_v_head,
                     stride_block, stride_kind, stride_slot, stride_head,
                     HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr):
    tok = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(OFFSET + tok).to(tl.int64)
    block = tl.load(BLOCK + tok).to(tl.int64)
    d = tl.arange(0, DIM_PAD)
    ok = (d < HEAD_DIM) & (d * 0 + slot >= 0)  # (a vector mask: the interpreter refuses a scalar in it)
    dst = KV + block * stride_block + slot * stride_slot + head * stride_head + d
    key = tl.load(K + tok * stride_k_tok + head * stride_k_head + d, mask=ok)
    value = tl.load(V + tok * stride_v_tok + head * stride_v_head + d, mask=ok)
    tl.store(dst, key.to(KV.dtype.element_ty), mask=ok)
    tl.store(dst + stride_kind, value.to(KV.dtype.element_ty), mask=ok)


@triton.jit(**DECODE_UNSPECIALIZED)
def _decode_kernel(Q, KV, BLOCK_TABLE, CONTEXT_LENS, OUT, PART_OUT, PART_LSE,
                   stride_q_tok, stride_q_head, stride_block, stride_kind, stride_slot, stride_head,
                   stride_table, stride_out, scale_log2, tokens_per_block,
                   GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_PAD: tl.constexpr, DIM_PAD: tl.constexpr,
                   BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr, USE_DOT: tl.constexpr,
                   WIDEN_DOT: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    context = tl.load(CONTEXT_LENS + seq).to(tl.int32)
    chunk = tl.cdiv(tl.cdiv(context, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * chunk
    end = tl.minimum(start + chunk, context)

    g = tl.arange(0, GROUP_PAD)
    d = tl.arange(0, DIM_PAD)
    heads = kv_head * GROUP + g
    q_mask = (g[:, None] < GROUP) & (d[None, :] < HEAD_DIM)
    q = tl.load(Q + seq * stride_q_tok + heads[:, None] * stride_q_head + d[None, :], mask=q_mask, other=0.0)
    if WIDEN_DOT:
        q = q.to(tl.float32)

    m = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, DIM_PAD], tl.float32)
    head_base = KV + kv_head * stride_head
    table = BLOCK_TABLE + seq * stride_table
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < end
        block = tl.load(table + n // tokens_per_block, mask=n_ok, other=0).to(tl.int64)
        rows = block * stride_block + (n % tokens_per_block).to(tl.int64) * stride_slot
        kv_mask = n_ok[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(head_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(head_base + stride_kind + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if USE_DOT:
            if WIDEN_DOT:
                k = k.to(tl.float32)
            if IEEE:
                s = tl.dot(q, tl.trans(k), input_precision="ieee")
            else:
                s = tl.dot(q, tl.trans(k))
        else:  # one query head per KV head: a dot product per key
            s = tl.sum(q.to(tl.float32) * k.to(tl.float32), axis=1)[None, :]
        s = tl.where(n_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            p = p.to(v.dtype)
            if WIDEN_DOT:
                p = p.to(tl.float32)
                v = v.to(tl.float32)
            if IEEE:
                pv = tl.dot(p, v, input_precision="ieee")
            else:
                pv = tl.dot(p, v)
        else:
            pv = tl.sum(tl.trans(p) * v.to(tl.float32), axis=0)[None, :]
        acc = acc * alpha[:, None] + pv
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    if NUM_SPLITS == 1:
        tl.store(OUT + seq * stride_out + heads[:, None] * HEAD_DIM + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=q_mask)
    else:
        part = (seq * (tl.num_programs(1) * GROUP) + heads) * NUM_SPLITS + split
        tl.store(PART_OUT + part[:, None] * HEAD_DIM + d[None, :], out, mask=q_mask)
        lse = tl.where(l > 0, m + tl.log2(tl.where(l > 0, l, 1.0)), float("-inf"))
        tl.store(PART_LSE + part, lse, mask=g < GROUP)


@triton.jit
def _reduce_splits_kernel(PART_OUT, PART_LSE, OUT, stride_out, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                          NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    d = tl.arange(0, DIM_PAD)
    part = (seq * tl.num_programs(1) + head) * NUM_SPLITS + s
    lse = tl.load(PART_LSE + part, mask=s < NUM_SPLITS, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)  # an empty context: every weight is 0
    w = tl.exp2(lse - top)
    mask = (s[:, None] < NUM_SPLITS) & (d[None, :] < HEAD_DIM)
    parts = tl.load(PART_OUT + part[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
    total = tl.sum(w, axis=0)
    out = tl.sum(w[:, None] * parts, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(OUT + seq * stride_out + head * HEAD_DIM + d, out.to(OUT.dtype.element_ty), mask=d < HEAD_DIM)


@triton.jit(**PREFILL_UNSPECIALIZED)
def _prefill_kernel(Q, KV, BLOCK_TABLE, CONTEXT_LENS, QUERY_START, OUT,
                    stride_q_tok, stride_q_head, stride_block, stride_kind, stride_slot, stride_head,
                    stride_table, stride_out, scale_log2, tokens_per_block,
                    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_PAD: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WIDEN_DOT: tl.constexpr, IEEE: tl.constexpr):
    seq = tl.program_id(0)
    m_block = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP
    q_start = tl.load(QUERY_START + seq)
    q_len = tl.load(QUERY_START + seq + 1) - q_start
    context = tl.load(CONTEXT_LENS + seq)
    cached = context - q_len

    i = m_block * BLOCK_M + tl.arange(0, BLOCK_M)
    d = tl.arange(0, DIM_PAD)
    q_mask = (i[:, None] < q_len) & (d[None, :] < HEAD_DIM)
    q = tl.load(Q + (q_start + i)[:, None] * stride_q_tok + head * stride_q_head + d[None, :], mask=q_mask, other=0.0)
    if WIDEN_DOT:
        q = q.to(tl.float32)
    q_pos = cached + i
    # keys up to the last query of this block (causal); none for a block past the request's queries
    hi = tl.minimum(context, cached + (m_block + 1) * BLOCK_M)
    hi = tl.where(m_block * BLOCK_M < q_len, hi, 0)

    m = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DIM_PAD], tl.float32)
    head_base = KV + kv_head * stride_head
    table = BLOCK_TABLE + seq * stride_table
    for n0 in range(0, hi, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        block = tl.load(table + n // tokens_per_block, mask=n_ok, other=0).to(tl.int64)
        rows = block * stride_block + (n % tokens_per_block).to(tl.int64) * stride_slot
        kv_mask = n_ok[:, None] & (d[None, :] < HEAD_DIM)
        k = tl.load(head_base + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(head_base + stride_kind + rows[:, None] + d[None, :], mask=kv_mask, other=0.0)
        if WIDEN_DOT:
            k = k.to(tl.float32)
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = tl.where((n[None, :] <= q_pos[:, None]) & n_ok[None, :], s * scale_log2, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        p = p.to(v.dtype)
        if WIDEN_DOT:
            p = p.to(tl.float32)
            v = v.to(tl.float32)
        if IEEE:
            pv = tl.dot(p, v, input_precision="ieee")
        else:
            pv = tl.dot(p, v)
        acc = acc * alpha[:, None] + pv
        m = m_new

    out = acc / tl.where(l > 0, l, 1.0)[:, None]
    tl.store(OUT + (q_start + i)[:, None] * stride_out + head * HEAD_DIM + d[None, :],
             out.to(OUT.dtype.element_ty), mask=q_mask)
