"""Decode CUDA graphs: bucket choice and the padding of static inputs on CPU (a padded batch
through the Triton kernels, interpreted, gives the real rows' results and leaves the pool as the
unpadded batch does), and the reserve estimate; the capture itself is covered by the gpu twins in
tests/engine/worker/test_gpu_runtime.py."""

import os

import pytest
import torch
from kernel_cases import LAYER, NUM_LAYERS, make_case

cuda_graphs = pytest.importorskip("paraflex.engine.kernels.cuda_graphs")
from paraflex.models.catalog import get_arch  # noqa: E402
from paraflex.engine.kernels import triton_paged_attention as tpa  # noqa: E402


@pytest.mark.parametrize("max_batch,expected", [
    (1, [1]), (3, [1, 2, 4]), (8, [1, 2, 4, 8]), (30, [1, 2, 4, 8, 16, 24, 32]), (32, [1, 2, 4, 8, 16, 24, 32]),
    (33, [1, 2, 4, 8, 16, 24, 32, 40]),
])
def test_batch_buckets(max_batch, expected):
    assert cuda_graphs.batch_buckets(max_batch) == expected


def test_bucket_for_picks_the_smallest_that_holds_the_batch():
    buckets = cuda_graphs.batch_buckets(32)
    assert [cuda_graphs.bucket_for(n, buckets) for n in (1, 3, 5, 9, 17, 25, 32)] == [1, 4, 8, 16, 24, 32, 32]
    assert cuda_graphs.bucket_for(33, buckets) is None


def test_fill_copies_the_batch_and_pads_the_rest():
    case = make_case([(5, 1), (17, 1), (2, 1)], 4, 4, 2, 16, seed=2)
    static = cuda_graphs.DecodeInputs(NUM_LAYERS, 8, 10, 4, 40, None, "cpu")
    static.write_offset.fill_(3)  # leftovers of an earlier, larger batch
    static.context_lens.fill_(9)
    tokens = torch.tensor([11, 12, 13])
    static.fill(tokens, case.meta)
    meta = static.metadata(4)
    assert torch.equal(meta.context_lens, torch.tensor([6, 18, 3, 0]))
    assert torch.equal(meta.write_offset[:3], case.meta.write_offset) and meta.write_offset[3] == -1
    assert torch.equal(static.write_offset[3:], torch.full((5,), -1))
    assert torch.equal(meta.block_table[:, :3, :5], case.meta.block_table)
    assert torch.equal(static.inputs[:3], tokens) and torch.equal(meta.positions[:3], case.meta.positions)
    assert meta.block_table.data_ptr() == static.block_table.data_ptr()  # views the graph reads in place
    assert (meta.num_seqs, meta.max_context, meta.query_index) == (4, 40, None)


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tensors need the Triton interpreter")
def test_padded_batch_gives_the_real_rows_and_touches_no_other_slot():
    case = make_case([(5, 1), (30, 1), (12, 1)], 3, 4, 2, 16, seed=4)
    kv_eager = case.kv.clone()
    eager = tpa.paged_attention(case.q, case.k, case.v, kv_eager, LAYER, case.meta, case.scale)
    static = cuda_graphs.DecodeInputs(NUM_LAYERS, 8, 20, 3, 60, None, "cpu")
    static.fill(torch.zeros(3, dtype=torch.long), case.meta)
    meta = static.metadata(8)
    pad = lambda x: torch.cat([x, torch.randn(5, *x.shape[1:])])  # noqa: E731
    padded = tpa.paged_attention(pad(case.q), pad(case.k), pad(case.v), case.kv, LAYER, meta, case.scale)
    torch.testing.assert_close(padded[:3], eager, atol=2e-5, rtol=2e-5)
    assert torch.equal(padded[3:], torch.zeros_like(padded[3:]))
    assert torch.equal(case.kv, kv_eager)


def test_reserve_grows_with_batch_and_stays_a_small_part_of_an_h100():
    arch = get_arch("llama-2-7b")
    one = cuda_graphs.reserve_bytes([(arch, 32, torch.bfloat16, True, True)], 1, 32768)
    many = cuda_graphs.reserve_bytes([(arch, 32, torch.bfloat16, True, True)], 128, 32768)
    assert 0 < one < many < 4 * 2**30
