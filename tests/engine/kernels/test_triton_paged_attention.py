"""The Triton paged-attention kernels against contiguous reference attention and the torch path.

On CPU they run under the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1 where
no GPU is visible); the `gpu` twins run the same cases compiled on CUDA."""

import pytest
import torch
from kernel_cases import LAYER, TOLERANCE, make_case, written_slots
from kernel_devices import DEVICES, needs_cuda

tpa = pytest.importorskip("paraflex.engine.kernels.triton_paged_attention")


def _check(case, out):
    tol = TOLERANCE[case.q.dtype]
    assert out.dtype == case.q.dtype
    torch.testing.assert_close(out.float().cpu(), case.expected, atol=tol, rtol=tol)
    keys, values = written_slots(case)
    assert torch.equal(keys, case.k) and torch.equal(values, case.v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("heads,kv_heads,head_dim,tpb,splits", [
    (2, 2, 16, 3, 1),  # one query head per KV head, non-power-of-two block
    (4, 2, 24, 2, 3),  # GQA 2, head_dim padded to 32, three splits
    (6, 2, 16, 8, 2),  # GQA 3
    (8, 1, 80, 16, 4),  # GQA 8, head_dim 80, more splits than some requests have tokens
])
def test_decode_matches_reference_with_ragged_contexts(device, heads, kv_heads, head_dim, tpb, splits):
    lens = [(0, 1), (5, 1), (37, 1), (130, 1)]  # partial last blocks, one request of one token
    case = make_case(lens, tpb, heads, kv_heads, head_dim, device=device, seed=heads * tpb)
    tpa.write_kv(case.k, case.v, case.kv, case.meta.write_block[LAYER], case.meta.write_offset)
    out = tpa.decode(case.q, case.kv, case.meta.block_table[LAYER], case.meta.context_lens,
                     case.meta.max_context, case.scale, num_splits=splits)
    _check(case, out)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_decode_dtypes_through_the_hook(device, dtype):
    case = make_case([(9, 1), (20, 1), (3, 1)], 4, 4, 2, 32, dtype=dtype, device=device, seed=7)
    _check(case, tpa.paged_attention(case.q, case.k, case.v, case.kv, LAYER, case.meta, case.scale))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("lens,tpb,heads,kv_heads,head_dim", [
    ([(0, 7), (0, 20)], 4, 4, 2, 16),  # whole prompts, ragged
    ([(11, 5), (0, 3), (40, 17), (6, 1)], 3, 6, 2, 24),  # chunks after cached context, a decode row
    ([(33, 18)], 16, 2, 2, 80),  # one chunk spanning several query blocks, head_dim 80
])
def test_prefill_and_chunks_match_reference(device, lens, tpb, heads, kv_heads, head_dim):
    case = make_case(lens, tpb, heads, kv_heads, head_dim, device=device, seed=len(lens) + tpb)
    _check(case, tpa.paged_attention(case.q, case.k, case.v, case.kv, LAYER, case.meta, case.scale))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_prefill_half_precision(device, dtype):
    case = make_case([(10, 6), (0, 9)], 2, 4, 1, 64, dtype=dtype, device=device, seed=3)
    _check(case, tpa.paged_attention(case.q, case.k, case.v, case.kv, LAYER, case.meta, case.scale))


@pytest.mark.parametrize("device", DEVICES)
def test_same_result_and_pool_as_the_torch_path(device):
    """A mixed batch (prompt chunk + decodes): the kernels leave the pool exactly as the torch
    reference path does and give its output."""
    from paraflex.engine.worker import attention

    case = make_case([(12, 4), (3, 1), (0, 5)], 4, 4, 2, 16, device=device, seed=11)
    torch_kv = case.kv.cpu().clone()
    meta_cpu = type(case.meta).build(case.meta.query_lens.tolist(), case.meta.context_lens.tolist(),
                                     case.meta.block_table.cpu().tolist(), case.meta.tokens_per_block)
    ref = attention.paged_attention(case.q.cpu(), case.k.cpu(), case.v.cpu(), torch_kv, LAYER, meta_cpu, case.scale)
    out = tpa.paged_attention(case.q, case.k, case.v, case.kv, LAYER, case.meta, case.scale)
    torch.testing.assert_close(out.cpu(), ref, atol=2e-5, rtol=2e-5)
    assert torch.equal(case.kv.cpu(), torch_kv)


@pytest.mark.parametrize("device", DEVICES)
def test_negative_offsets_skip_the_write_and_empty_contexts_give_zeros(device):
    """The padded rows of a CUDA graph: offset -1 writes nothing, context 0 attends nothing."""
    case = make_case([(6, 1), (0, 1)], 4, 4, 2, 16, device=device, seed=5)
    before = case.kv.clone()
    offsets = case.meta.write_offset.clone()
    offsets[1] = -1
    tpa.write_kv(case.k, case.v, case.kv, case.meta.write_block[LAYER], offsets)
    blocks = case.meta.write_block[LAYER]
    assert torch.equal(case.kv[blocks[1]], before[blocks[1]])
    assert torch.equal(case.kv[blocks[0], 0, offsets[0]], case.k[0])
    lens = case.meta.context_lens.clone()
    lens[1] = 0
    for splits in (1, 2):
        out = tpa.decode(case.q, case.kv, case.meta.block_table[LAYER], lens, 7, case.scale, num_splits=splits)
        assert torch.equal(out[1], torch.zeros_like(out[1]))
        torch.testing.assert_close(out[0].cpu(), case.expected[0], atol=2e-5, rtol=2e-5)


def test_unsupported_shapes_are_named():
    q = torch.zeros(1, 2, 320)
    kv = torch.zeros(3, 2, 4, 2, 320)
    assert "head_dim 320" in tpa.unsupported_reason(q, kv)
    assert "dtype" in tpa.unsupported_reason(q.double(), kv.double())
    assert tpa.unsupported_reason(q[..., :128], kv[..., :128].contiguous()) is None


def test_the_unspecialised_arguments_are_the_kernels_parameters():
    """A misspelt name would leave the argument specialised (and the recompiles back)."""
    for kernel, unspecialised in ((tpa._prefill_kernel, tpa.PREFILL_UNSPECIALIZED),
                                  (tpa._write_kv_kernel, tpa.WRITE_KV_UNSPECIALIZED),
                                  (tpa._decode_kernel, tpa.DECODE_UNSPECIALIZED)):
        names = [n for names in unspecialised.values() for n in names]
        assert names and set(names) <= set(kernel.arg_names)


@pytest.mark.gpu
@needs_cuda
def test_one_compiled_prefill_serves_every_block_table_width_and_alignment():
    """After one batch of each query tile (`BLOCK_M` 16 up to 16 queries, 64 beyond: a real
    compile-time choice), prompts spanning 2, 3, 4, 16 and 17 blocks, alone and packed by two and
    three (block-table widths divisible by 16 or not; metadata views at odd and even offsets)
    compile no new variant of the prefill or KV-write kernel (bench/first_prefills.py measured
    0.5-1.7 s per variant on an H100)."""
    def variants():
        return {k: sum(len(c[0]) for c in k.device_caches.values())
                for k in (tpa._prefill_kernel, tpa._write_kv_kernel)}

    def run(i, lens):
        case = make_case(lens, 4, 4, 2, 64, dtype=torch.bfloat16, device="cuda", seed=i)
        _check(case, tpa.paged_attention(case.q, case.k, case.v, case.kv, LAYER, case.meta, case.scale))

    run(0, [(0, 4)])  # BLOCK_M 16, one block
    run(1, [(0, 17)])  # BLOCK_M 64
    seen = variants()
    later = [[(0, 5)], [(0, 11)], [(0, 16)], [(0, 64)], [(0, 65)], [(0, 12), (0, 13)], [(0, 5), (0, 64)],
             [(0, 3), (0, 65), (0, 9)]]
    for i, lens in enumerate(later, start=2):
        run(i, lens)
        assert variants() == seen, f"batch {lens} compiled a new variant"


def test_split_counts_are_powers_of_two_so_few_variants_compile(monkeypatch):
    """The split count is a compile-time constant: over every batch and context a GPU meets,
    at most seven values, each a power of two, none splitting below MIN_TOKENS_PER_SPLIT."""
    monkeypatch.setattr(tpa, "_multiprocessors", lambda index: 132)  # an H100's
    cuda = torch.device("cuda")  # (a device name: nothing runs on it)
    seen = set()
    for programs in range(1, 513):
        for context in range(1, 65536, 97):
            s = tpa.choose_splits(programs, context, cuda)
            assert s & (s - 1) == 0 and 1 <= s <= tpa.MAX_SPLITS
            assert s == 1 or context // s >= tpa.MIN_TOKENS_PER_SPLIT
            seen.add(s)
    assert len(seen) <= 7 and max(seen) == tpa.MAX_SPLITS
