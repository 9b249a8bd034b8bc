"""Batches over a shared KV pool for the attention-kernel tests: random block tables, ragged
cached/new lengths, a pool whose blocks end in slack bytes and whose unused slots hold noise,
and the reference output computed from the contiguous keys/values of every request; and a
compiled CPU kernel's output beside the torch path's on the same batch."""

from __future__ import annotations

from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F

from paraflex.engine.kernels import native_attention
from paraflex.engine.worker.attention import AttentionMetadata, paged_attention
from paraflex.engine.worker.kv_cache import KVCache

NUM_LAYERS = 2
LAYER = 1  # the layer the tests attend in (its block table differs from layer 0's)

TOLERANCE = {torch.float32: 2e-5, torch.float16: 3e-3, torch.bfloat16: 2e-2}


@dataclass
class Case:
    kv: torch.Tensor  # the model's pool view
    meta: AttentionMetadata
    q: torch.Tensor  # [T, Hq, D]
    k: torch.Tensor  # [T, Hkv, D] new keys
    v: torch.Tensor
    expected: torch.Tensor  # [T, Hq * D] float32
    scale: float


def make_case(lens, tpb, num_heads, kv_heads, head_dim, dtype=torch.float32, device="cpu", seed=0) -> Case:
    """lens: (cached, new) tokens per request; the cached ones are already in the pool."""
    g = torch.Generator().manual_seed(seed)
    elem = torch.empty((), dtype=dtype).element_size()
    need = sum(-(-(c + n) // tpb) for c, n in lens) * NUM_LAYERS
    num_blocks = need + 5
    cache = KVCache(num_blocks, tpb * 2 * kv_heads * head_dim * elem + 4 * elem, device=device)
    cache.blocks.copy_(torch.randint(0, 256, cache.blocks.shape, generator=g, dtype=torch.uint8))
    kv = cache.model_view(kv_heads, head_dim, dtype)
    kv.copy_(torch.randn(kv.shape, generator=g).to(dtype))  # finite noise in every slot
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[[free.pop() for _ in range(-(-(c + n) // tpb))] for c, n in lens] for _ in range(NUM_LAYERS)]
    keys = [torch.randn(c + n, kv_heads, head_dim, generator=g).to(dtype) for c, n in lens]
    values = [torch.randn(c + n, kv_heads, head_dim, generator=g).to(dtype) for c, n in lens]
    for i, (cached, _) in enumerate(lens):
        for pos in range(cached):
            block = tables[LAYER][i][pos // tpb]
            kv[block, 0, pos % tpb] = keys[i][pos].to(device)
            kv[block, 1, pos % tpb] = values[i][pos].to(device)
    qs = [torch.randn(n, num_heads, head_dim, generator=g).to(dtype) for _, n in lens]
    scale = head_dim ** -0.5
    expected = torch.cat([_reference(q, k, v, scale) for q, k, v in zip(qs, keys, values)])
    meta = AttentionMetadata.build([n for _, n in lens], [c + n for c, n in lens], tables, tpb, device)
    return Case(kv, meta, torch.cat(qs).to(device),
                torch.cat([k[c:] for k, (c, _) in zip(keys, lens)]).to(device),
                torch.cat([v[c:] for v, (c, _) in zip(values, lens)]).to(device), expected, scale)


def _reference(q, k, v, scale):
    """Causal attention (float32) of the last len(q) positions over one request's k/v."""
    n, t = k.shape[0], q.shape[0]
    mask = torch.arange(n)[None, :] <= torch.arange(n - t, n)[:, None]
    out = F.scaled_dot_product_attention(
        q.float().transpose(0, 1)[None], k.float().transpose(0, 1)[None], v.float().transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )
    return out[0].transpose(0, 1).reshape(t, -1)


def written_slots(case: Case) -> tuple[torch.Tensor, torch.Tensor]:
    """The (keys, values) the pool holds in the new tokens' slots of LAYER."""
    blocks, offsets = case.meta.write_block[LAYER], case.meta.write_offset
    return case.kv[blocks, 0, offsets], case.kv[blocks, 1, offsets]


def kernel_and_torch_path(switch: str, q, k, v, kv, layer: int, meta, scale: float, threads: int | None = None):
    """`paged_attention` on the batch twice: as routed (a compiled CPU kernel, on `threads`
    threads if given) and on the torch path (`native_attention.<switch>`, the kernel's routing
    test, patched to refuse), each writing the new keys/values into its own copy of the pool.
    Returns (out, ref, kv, kv_torch)."""
    kv_torch = kv.clone()
    previous = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        out = paged_attention(q, k, v, kv, layer, meta, scale)
    finally:
        torch.set_num_threads(previous)
    with mock.patch.object(native_attention, switch, lambda *_: False):
        ref = paged_attention(q, k, v, kv_torch, layer, meta, scale)
    return out, ref, kv, kv_torch
