"""FreeList (engine/core/free_list.py) hands out exactly the ids, in exactly the order, of the plain
stack ``list(range(capacity - 1, -1, -1))`` it replaces, under any mix of takes and gives."""

from hypothesis import given, settings
from hypothesis import strategies as st

from paraflex.engine.core.free_list import FreeList


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(0, 60), ops=st.lists(st.tuples(st.booleans(), st.integers(0, 12)), max_size=40),
       order=st.randoms(use_true_random=False))
def test_free_list_matches_plain_stack(capacity, ops, order):
    lazy, plain = FreeList(capacity), list(range(capacity - 1, -1, -1))
    held: list[int] = []
    for take, k in ops:
        if take:
            k = min(k, len(plain))
            expected = [plain.pop() for _ in range(k)]
            assert lazy.take(k) == expected
            held.extend(expected)
        else:
            order.shuffle(held)
            back, held = held[:k], held[k:]
            plain.extend(back)
            lazy.give(back)
        assert len(lazy) == len(plain)
        assert sorted(lazy.ids()) == sorted(plain)


def test_start_up_lists_nothing():
    fl = FreeList(10**9)
    assert len(fl) == 10**9 and fl.returned == [] and fl.take(3) == [0, 1, 2]
