"""Block tables kept on the device between steps (engine/worker/block_tables.py): the
incremental metadata equals `AttentionMetadata.build` from scratch, tensor for tensor, over
random growth / swap / free sequences of the real block pool; slots are reused and grown; a
table rewritten in place is caught; the runtime with the tables on stays token-exact on CPU."""

import random
from types import SimpleNamespace

import pytest
import torch
from oracle_models import build_llama, hf_greedy, make_config, make_placement

from paraflex.engine.core.block_pool import BlockPool
from paraflex.engine.core.sampling_params import SamplingParams
from paraflex.engine.worker import block_tables
from paraflex.engine.worker.attention import AttentionMetadata
from paraflex.engine.worker.block_tables import IncrementalMetadata, TableSlots
from paraflex.serving.in_process import LLMCluster

TENSORS = ("positions", "write_block", "write_offset", "query_index", "last_token_index", "block_table",
           "context_lens", "query_lens", "query_start")
SCALARS = ("num_seqs", "max_query", "tokens_per_block", "fresh", "max_context")


def _request(q: int, c: int, table) -> SimpleNamespace:
    return SimpleNamespace(num_tokens=q, context_len=c, block_table=table)


def _assert_same(reqs, layers, tpb, got: AttentionMetadata) -> None:
    ref = AttentionMetadata.build([r.num_tokens for r in reqs], [r.context_len for r in reqs],
                                  [[r.block_table[n] for r in reqs] for n in range(layers)], tpb)
    for name in TENSORS:
        a, b = getattr(got, name), getattr(ref, name)
        assert (a is None) == (b is None), name
        if a is not None:
            assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), name
    for name in SCALARS:
        assert getattr(got, name) == getattr(ref, name), name


@pytest.mark.parametrize("seed,layers,tpb", [(0, 3, 2), (1, 1, 1), (2, 4, 8), (3, 2, 3)])
def test_random_growth_swaps_and_frees_match_the_rebuild(seed, layers, tpb):
    rng = random.Random(seed)
    pool = BlockPool(600, 64, 600)
    meta = IncrementalMetadata(layers, tpb, "cpu")
    tokens: dict[str, int] = {}
    swaps = steps = 0
    for step in range(400):
        if rng.random() < 0.5 and len(tokens) < 24:
            owner = f"r{step}"
            pool.open(owner, "stage", layers, tpb)
            tokens[owner] = 0
        for owner in list(tokens):
            alloc, x = pool.get(owner), rng.random()
            if x < 0.02:
                pool.release(owner)
                del tokens[owner]
            elif x < 0.1 and not alloc.on_host and alloc.num_blocks and pool.host_num_free >= alloc.num_blocks:
                pool.swap_out(owner)
                swaps += 1
            elif x < 0.3 and alloc.on_host and pool.num_free >= alloc.num_blocks:
                pool.swap_in(owner)
        reqs = []
        for owner in tokens:
            alloc = pool.get(owner)
            if alloc.on_host or rng.random() < 0.3:
                continue
            new = rng.randint(1, 7) if tokens[owner] == 0 or rng.random() < 0.15 else 1
            if pool.extra_blocks(alloc, tokens[owner] + new) > pool.num_free:
                continue
            tokens[owner] += new
            pool.grow(alloc, tokens[owner])
            reqs.append(_request(new, tokens[owner], alloc.table))
        if reqs:
            rng.shuffle(reqs)
            _assert_same(reqs, layers, tpb, meta.build(reqs))
            steps += 1
        pool.check()
    assert swaps and steps > 300
    assert meta.slots.num_slots > 8  # more live tables than the first slots: they doubled


def test_slots_of_tables_that_left_are_reused():
    """Tables never emptied (a benchmark's own lists) give their slots back after STALE_STEPS."""
    layers, tpb = 2, 2
    meta = IncrementalMetadata(layers, tpb, "cpu")
    for job in range(6):
        tables = [[[job * 1000 + 10 * i + n] for n in range(layers)] for i in range(8)]
        reqs = [_request(1, 1, t) for t in tables]
        for _ in range(block_tables.STALE_STEPS + 1):
            _assert_same(reqs, layers, tpb, meta.build(reqs))
    assert meta.slots.num_slots <= 16


def test_a_table_rewritten_in_place_is_written_again():
    meta = IncrementalMetadata(2, 1, "cpu")
    table = [[4, 5, 6], [7, 8, 9]]
    _assert_same([_request(3, 3, table)], 2, 1, meta.build([_request(3, 3, table)]))
    table[0][0], table[1][2] = 11, 12  # not how the block pool works: the guard catches it
    table[0].append(13)
    table[1].append(14)
    reqs = [_request(1, 4, table)]
    _assert_same(reqs, 2, 1, meta.build(reqs))


def test_shorter_context_and_reused_slots_keep_zero_padding():
    meta = IncrementalMetadata(1, 1, "cpu")
    long, short = [[1, 2, 3, 4, 5]], [[6]]
    for reqs in ([_request(5, 5, long)], [_request(1, 2, long), _request(1, 1, short)]):
        _assert_same(reqs, 1, 1, meta.build(reqs))
    long[0].clear()  # released: its slot goes to the next table, whose row is shorter
    slots = meta.slots
    slots.free.clear()
    fresh = [[7, 8]]
    reqs = [_request(2, 2, fresh), _request(1, 1, short)]
    _assert_same(reqs, 1, 1, meta.build(reqs))


def test_too_few_blocks_is_the_rebuild_error():
    table = [[1, 2], [3]]
    with pytest.raises(ValueError, match="request 0 in stage layer 1 has 1 blocks, 2 needed for 3 tokens"):
        IncrementalMetadata(2, 2, "cpu").build([_request(3, 3, table)])
    with pytest.raises(ValueError, match="request 1 in stage layer 0 has 1 blocks, 2 needed for 4 tokens"):
        IncrementalMetadata(2, 2, "cpu").build([_request(1, 1, [[1], [2]]), _request(4, 4, [[3], [4, 5]])])
    with pytest.raises(ValueError, match="1 <= new tokens <= context tokens"):
        IncrementalMetadata(2, 2, "cpu").build([_request(3, 2, [[1], [2]])])


def test_plan_writes_only_new_blocks():
    slots = TableSlots(num_layers=32, tokens_per_block=2)
    tables = [[[1000 * i + n] for n in range(32)] for i in range(4)]
    first = slots.plan(tables, [2, 2, 2, 2])
    assert len(first.index) == 4 * 32
    assert len(slots.plan(tables, [2, 2, 2, 2]).index) == 0  # same context: nothing to send
    for t in tables[:2]:
        for n, blocks in enumerate(t):
            blocks.append(blocks[0] + 1)
    grew = slots.plan(tables, [3, 3, 2, 2])
    assert len(grew.index) == 2 * 32 and grew.slots == first.slots


def test_flag(monkeypatch):
    monkeypatch.delenv("PARAFLEX_PERSISTENT_BLOCK_TABLES", raising=False)
    assert block_tables.enabled(torch.device("cuda")) and not block_tables.enabled(torch.device("cpu"))
    monkeypatch.setenv("PARAFLEX_PERSISTENT_BLOCK_TABLES", "0")
    assert not block_tables.enabled(torch.device("cuda"))
    monkeypatch.setenv("PARAFLEX_PERSISTENT_BLOCK_TABLES", "1")
    assert block_tables.enabled(torch.device("cpu"))


def test_runtime_with_device_tables_swaps_and_stays_exact(tmp_path, monkeypatch):
    """The oracle's swapping run (tests/paraflex/serving/test_runtime_oracle.py) with the tables
    kept across steps on CPU: two stages, a pool that forces swaps, greedy tokens as transformers."""
    monkeypatch.setenv("PARAFLEX_PERSISTENT_BLOCK_TABLES", "1")
    model = build_llama(tmp_path, num_layers=3)
    prompts = [[i + 1, i + 2, i + 3, i + 4] for i in range(8)] + [list(range(20, 47))]
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)
    cfg = make_config({"llama": tmp_path}, 2, block_bytes=2048)
    pl = make_placement({"llama": (3, [(0, 2), (2, 3)], [[0, 1]])}, 2)
    cluster = LLMCluster(cfg, pl, kv_bytes=32 * 2048, host_kv_bytes=200 * 2048)
    assert all(e.worker.metadata for e in cluster.engines)
    results = cluster.generate("llama", prompts, params)
    assert [r.token_ids for r in results] == [hf_greedy(model, p, params.max_tokens) for p in prompts]
    stats = cluster.engines[0].scheduler.stats
    assert stats["swap_outs"] > 0 and stats["swap_ins"] > 0
