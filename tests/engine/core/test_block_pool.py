"""BlockPool: layer-wise tables, shared pool across models, swap plans, invariants."""

import pytest

from paraflex.engine.core.block_pool import BlockPool, PoolExhausted, tokens_per_block
from paraflex.errors import ConfigError, ParaflexError


def test_tokens_per_block_from_kv_bytes():
    # llama-2-7b: 2 * 32 heads * 128 * 2 bytes = 16 KiB per token per layer -> 2 tokens / 32 KiB
    assert tokens_per_block(32768, 2 * 32 * 128 * 2) == 2
    assert tokens_per_block(32768, 2 * 2 * 32 * 2) == 128  # tiny GQA model
    with pytest.raises(ConfigError, match="scheduler.block_bytes"):
        tokens_per_block(1024, 4096, "big")


def test_grow_is_layer_wise_and_rounds_up_per_layer():
    pool = BlockPool(100, 1024)
    a = pool.open("r1", ("m", 0), num_layers=3, tokens_per_block=4)
    assert pool.grow(a, 10) == 9  # ceil(10/4)=3 blocks in each of 3 layers
    assert [len(layer) for layer in a.table] == [3, 3, 3]
    assert pool.grow(a, 12) == 0  # still fits
    assert pool.grow(a, 13) == 3  # one more block per layer
    assert a.token_capacity == 16
    assert pool.num_used == 12 and pool.num_free == 88
    assert pool.used_by(("m", 0)) == 12
    flat = [b for layer in a.table for b in layer]
    assert len(set(flat)) == 12
    pool.check()


def test_grow_hands_each_layer_its_ids_in_pop_order():
    """Layer i gets the i-th run of `per_layer` ids the free list pops, for one block per layer
    (the common growth by a token) as for several, and after ids came back."""
    pool = BlockPool(100, 1024)
    a = pool.open("r1", ("m", 0), num_layers=3, tokens_per_block=4)
    pool.grow(a, 4)  # one block per layer
    assert a.table == [[0], [1], [2]]
    pool.grow(a, 12)  # two more per layer
    assert a.table == [[0, 3, 4], [1, 5, 6], [2, 7, 8]]
    b = pool.open("r2", ("m", 0), num_layers=3, tokens_per_block=4)
    pool.grow(b, 1)
    pool.release("r2")  # 9, 10, 11 back on the stack, 11 on top
    pool.grow(a, 13)
    assert a.table == [[0, 3, 4, 11], [1, 5, 6, 10], [2, 7, 8, 9]]
    pool.release("r1")  # each layer's ids pushed back in reverse, layer after layer: the last layer's first id on top
    c = pool.open("r3", ("m", 0), num_layers=1, tokens_per_block=1)
    pool.grow(c, 13)
    assert c.table == [[2, 7, 8, 9, 1, 5, 6, 10, 0, 3, 4, 11, 12]]
    pool.check()


def test_models_with_different_tokens_per_block_share_one_pool():
    pool = BlockPool(20, 1024)
    big = pool.open("a", ("big", 1), 2, tokens_per_block=2)
    small = pool.open("b", ("small", 0), 1, tokens_per_block=16)
    pool.grow(big, 8)  # 4 blocks x 2 layers
    pool.grow(small, 40)  # 3 blocks x 1 layer
    assert pool.used_by(("big", 1)) == 8 and pool.used_by(("small", 0)) == 3
    assert pool.num_free == 20 - 11
    pool.check()
    assert pool.release("a") == 8
    assert pool.num_free == 17 and pool.used_by(("big", 1)) == 0
    assert pool.release("a") == 0  # idempotent
    pool.check()


def test_exhaustion_raises_and_leaves_pool_unchanged():
    pool = BlockPool(5, 1024)
    a = pool.open("r", "g", 2, 1)
    with pytest.raises(PoolExhausted):
        pool.grow(a, 3)  # 6 blocks
    assert pool.num_free == 5 and a.num_blocks == 0
    pool.check()


def test_swap_out_then_in_moves_every_block_and_composes():
    pool = BlockPool(10, 1024, host_num_blocks=10)
    a = pool.open("r", "g", 2, 2)
    pool.grow(a, 5)  # 3 per layer
    before = [list(layer) for layer in a.table]
    out = pool.swap_out("r")
    assert [src for src, _ in out] == [b for layer in before for b in layer]
    assert a.on_host and pool.num_free == 10 and pool.host_num_used == 6
    assert [b for layer in a.table for b in layer] == [dst for _, dst in out]
    assert pool.used_by("g") == 0 and pool.host_used_by("g") == 6
    pool.check()
    back = pool.swap_in("r")
    # each host block goes back to a device block, in the same (layer, logical) order
    assert [src for src, _ in back] == [dst for _, dst in out]
    assert not a.on_host and pool.host_num_used == 0 and pool.num_used == 6
    assert [len(layer) for layer in a.table] == [3, 3]
    pool.check()


def test_swap_out_needs_host_room():
    pool = BlockPool(10, 1024, host_num_blocks=3)
    a = pool.open("r", "g", 2, 1)
    pool.grow(a, 2)
    with pytest.raises(PoolExhausted, match="host pool"):
        pool.swap_out("r")
    assert not a.on_host
    pool.check()


def test_extra_blocks_counts_whole_allocation_when_swapped():
    pool = BlockPool(10, 1024, host_num_blocks=10)
    a = pool.open("r", "g", 2, 4)
    pool.grow(a, 4)
    assert pool.extra_blocks(a, 5) == 2
    pool.swap_out("r")
    assert pool.extra_blocks(a, 5) == 4
    with pytest.raises(ParaflexError, match="swapped out"):
        pool.grow(a, 5)


def test_check_detects_a_block_owned_twice():
    pool = BlockPool(10, 1024)
    a = pool.open("a", "g", 1, 1)
    b = pool.open("b", "g", 1, 1)
    pool.grow(a, 1)
    pool.grow(b, 1)
    b.table[0][0] = a.table[0][0]
    with pytest.raises(ParaflexError, match="owned twice"):
        pool.check()


def test_bad_sizes_name_the_field():
    with pytest.raises(ConfigError, match="kv_blocks"):
        BlockPool(0)
    with pytest.raises(ConfigError, match="host"):
        BlockPool(4, 1024, -1)
    assert BlockPool.from_bytes(10 * 32768 + 5, 32768, 3 * 32768).capacity == 10
