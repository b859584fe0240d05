"""Host bookkeeping: null page, quarantine, slots, stale-state refusal."""

import pytest

from v41_jax.cache.bookkeeping import (NULL_PAGE, OutOfPages, PageAllocator, RankedPages, RankedSlots,
                                       SlotAllocator, StaleStateError, check_cursor)


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


def test_ranked_pages_and_slots_stay_in_their_rank():
    """A mesh's ranks (docs/PARALLEL.md §3): rank r owns pages [4r, 4r + 4) and slots [2r, 2r + 2);
    page 4r is its null page, never handed out or freed; quarantine holds per rank."""
    pa, sa = RankedPages(12, 3), RankedSlots(6, 3)
    assert pa.available == 9 and [pa.available_on(r) for r in range(3)] == [3, 3, 3]
    got = pa.allocate(3, rank=1)
    assert sorted(got) == [5, 6, 7]
    with pytest.raises(OutOfPages):
        pa.allocate(1, rank=1)
    with pytest.raises(ValueError, match="null page"):
        pa.free([8], last_step=0)               # rank 2's null page
    pa.free(got, last_step=4)
    assert pa.available_on(1) == 0 and pa.quarantined == 3
    pa.retire(completed_step=4)
    assert sorted(pa.allocate(3, rank=1)) == [5, 6, 7]
    assert [sa.acquire(i, rank=2) for i in "ab"] == [4, 5] and sa.available_on(2) == 0
    sa.release(5)
    assert sa.acquire("c", rank=2) == 5
    with pytest.raises(ValueError, match="split"):
        RankedPages(10, 3)
    with pytest.raises(ValueError, match="one rank"):
        PageAllocator(4).allocate(1, rank=1)


def test_scheduler_places_a_request_on_the_rank_with_most_free_pages():
    from v41_jax.runtime.request import Request
    from v41_jax.runtime.scheduler import Scheduler
    sch = Scheduler(num_pages=12, slots=4, max_requests=4, max_tokens=64, prefill_chunk=64, page_tokens=4,
                    max_context=64, check=lambda r: None, eos_id=None, ranks=2)
    for n in (9, 1, 1):                         # 3 pages, then 1, then 1 (prompt + 1 new token)
        sch.add(Request(list(range(2, 2 + n)), max_new_tokens=2))
    sch.schedule()
    ranks = [(s.slot // 2, min(s.pages) // 6, max(s.pages) // 6) for s in sch.running]
    # the first goes to rank 0 (a tie, the lower rank), the next two to rank 1 (5 - 3 free < 5)
    assert ranks == [(0, 0, 0), (1, 1, 1), (1, 1, 1)]


def test_scheduler_budgets_are_per_rank():
    """One request per step and rank, 4 tokens a step: two ranks run two requests' prefill chunks
    side by side; a third request waits for a rank's request to finish."""
    from v41_jax.runtime.request import Request
    from v41_jax.runtime.scheduler import Scheduler
    sch = Scheduler(num_pages=12, slots=4, max_requests=1, max_tokens=4, prefill_chunk=4, page_tokens=4,
                    max_context=64, check=lambda r: None, eos_id=None, ranks=2)
    for _ in range(3):
        sch.add(Request(list(range(2, 8)), max_new_tokens=1))
    plan = sch.schedule()
    assert [(sch.rank_of(sp.seq), sp.length) for sp in plan.spans] == [(0, 4), (1, 4)]
    assert len(sch.running) == 2 and len(sch.waiting) == 1
