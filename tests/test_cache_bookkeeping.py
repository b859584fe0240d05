"""Host bookkeeping: null page, quarantine, slots, stale-state refusal."""

import pytest

from v41_jax.cache.bookkeeping import (NULL_PAGE, OutOfPages, PageAllocator, SlotAllocator,
                                       StaleStateError, check_cursor)


def test_null_page_never_allocated():
    pa = PageAllocator(5)
    pages = pa.allocate(4)
    assert NULL_PAGE not in pages and sorted(pages) == [1, 2, 3, 4]
    with pytest.raises(OutOfPages):
        pa.allocate(1)
    with pytest.raises(ValueError):
        pa.free([NULL_PAGE], last_step=0)


def test_freed_pages_quarantined_until_their_steps_complete():
    pa = PageAllocator(6)
    a = pa.allocate(3)
    pa.free(a, last_step=10)            # step 10 is in flight and may still write these pages
    assert pa.available == 2 and pa.quarantined == 3
    b = pa.allocate(2)
    assert not set(a) & set(b)
    with pytest.raises(OutOfPages, match="3 quarantined"):
        pa.allocate(1)
    pa.retire(completed_step=9)         # not yet: step 10 still running
    assert pa.available == 0
    pa.retire(completed_step=10)
    assert sorted(pa.allocate(3)) == sorted(a)


def test_quarantine_releases_in_step_order():
    pa = PageAllocator(5)
    a, b = pa.allocate(2), pa.allocate(2)
    pa.free(a, last_step=1)
    pa.free(b, last_step=2)
    pa.retire(1)
    assert sorted(pa.allocate(2)) == sorted(a) and pa.quarantined == 2


def test_slots_unique_and_recycled():
    sa = SlotAllocator(2)
    s0, s1 = sa.acquire("a"), sa.acquire("b")
    assert s0 != s1
    with pytest.raises(RuntimeError):
        sa.acquire("c")
    sa.release(s0)
    assert sa.acquire("c") == s0
    with pytest.raises(ValueError):
        sa.release(7)


def test_stale_cursor_is_a_hard_error():
    check_cursor("r", 0, 818)           # a fresh start may find anything: its slot gets reset
    check_cursor("r", 828, 828)
    with pytest.raises(StaleStateError, match="needs state at 828, found 818"):
        check_cursor("r", 828, 818)
