"""Host bookkeeping of the cache: pages, slots and the stale-state refusal.

* `PageAllocator`: page ids 1..P-1 (page 0 is the null page every padding row names). A freed
  page is quarantined until every step that was dispatched while the request still held it has
  completed (docs/CACHE.md §1.10, INV-7): in a pipelined loop the step in flight may still read or
  write it, and handing it to a new request at once would let that step's writes land in the new
  owner's rows.
* `SlotAllocator`: one STATE entry per in-flight request; unique by construction (docs/CACHE.md INV-9).
* `RankedPages` / `RankedSlots`: the same split in equal ranges, one per data-parallel rank of a
  mesh (docs/PARALLEL.md §3): a request's slot and pages all come from its rank's range, the
  first page of each range is that rank's null page. Both allocators take the rank as an
  argument (the single-rank ones only rank 0), so the scheduler places requests one way.
* `check_cursor`: a span that does not start at 0 must find its slot's committed position equal to
  its own first position, else `StaleStateError` (docs/CACHE.md INV-1: the seed's "needs state at 828, found 818"
  can never pass silently).
"""

from __future__ import annotations

from collections import deque

NULL_PAGE = 0


class OutOfPages(RuntimeError):
    pass


class StaleStateError(RuntimeError):
    pass


class PageAllocator:
    def __init__(self, num_pages: int):
        if num_pages < 2:
            raise ValueError("num_pages: need the null page and at least one more")
        self._free: deque[int] = deque(range(1, num_pages))
        self._quarantine: deque[tuple[int, list[int]]] = deque()  # (last step that may touch, pages)

    @property
    def available(self) -> int:
        """Pages allocatable now (quarantined ones excluded)."""
        return len(self._free)

    @property
    def quarantined(self) -> int:
        return sum(len(p) for _, p in self._quarantine)

    def available_on(self, rank: int) -> int:
        return self.available if rank == 0 else 0

    def allocate(self, n: int, rank: int = 0) -> list[int]:
        if rank != 0:
            raise ValueError(f"rank {rank}: this pool has one rank")
        if n > len(self._free):
            raise OutOfPages(f"need {n} pages, {len(self._free)} free ({self.quarantined} quarantined)")
        return [self._free.popleft() for _ in range(n)]

    def free(self, pages: list[int], last_step: int) -> None:
        """Return pages that steps up to `last_step` (the newest dispatched one) may still touch."""
        if NULL_PAGE in pages:
            raise ValueError("the null page is never allocated, so never freed")
        if pages:
            self._quarantine.append((last_step, list(pages)))

    def retire(self, completed_step: int) -> None:
        """Every step <= completed_step has finished: release what only they could touch."""
        while self._quarantine and self._quarantine[0][0] <= completed_step:
            self._free.extend(self._quarantine.popleft()[1])


class SlotAllocator:
    def __init__(self, slots: int):
        self._free: deque[int] = deque(range(slots))
        self._owner: dict[int, object] = {}

    @property
    def available(self) -> int:
        return len(self._free)

    def available_on(self, rank: int) -> int:
        return self.available if rank == 0 else 0

    def acquire(self, request_id, rank: int = 0) -> int:
        if rank != 0:
            raise ValueError(f"rank {rank}: this pool has one rank")
        if not self._free:
            raise RuntimeError("no free STATE slot")
        slot = self._free.popleft()
        self._owner[slot] = request_id
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._owner:
            raise ValueError(f"slot {slot} is not held")
        del self._owner[slot]
        self._free.append(slot)


class _Ranked:
    """`ranks` allocators of one kind over equal ranges of the ids: rank r owns [r * per, (r + 1) * per)."""

    def __init__(self, n: int, ranks: int, what: str, make):
        if n % ranks:
            raise ValueError(f"{what}: {n} does not split over {ranks} ranks")
        self.per = n // ranks
        self.pools = [make(self.per) for _ in range(ranks)]

    @property
    def available(self) -> int:
        return sum(p.available for p in self.pools)

    def available_on(self, rank: int) -> int:
        return self.pools[rank].available


class RankedPages(_Ranked):
    """PageAllocators per rank; each rank's first page is its null page (the page 0 of its
    device's share of the cache)."""

    def __init__(self, num_pages: int, ranks: int):
        super().__init__(num_pages, ranks, "num_pages", PageAllocator)

    @property
    def quarantined(self) -> int:
        return sum(p.quarantined for p in self.pools)

    def allocate(self, n: int, rank: int = 0) -> list[int]:
        return [rank * self.per + p for p in self.pools[rank].allocate(n)]

    def free(self, pages: list[int], last_step: int) -> None:
        for r, pool in enumerate(self.pools):
            pool.free([p - r * self.per for p in pages if p // self.per == r], last_step)

    def retire(self, completed_step: int) -> None:
        for pool in self.pools:
            pool.retire(completed_step)


class RankedSlots(_Ranked):
    """SlotAllocators per rank."""

    def __init__(self, slots: int, ranks: int):
        super().__init__(slots, ranks, "slots", SlotAllocator)

    def acquire(self, request_id, rank: int = 0) -> int:
        return rank * self.per + self.pools[rank].acquire(request_id)

    def release(self, slot: int) -> None:
        self.pools[slot // self.per].release(slot % self.per)


def check_cursor(request_id, position: int, found: int) -> None:
    """Refuse a continuation whose slot is not at its first position (hard error, never a warning)."""
    if position != 0 and found != position:
        raise StaleStateError(f"request {request_id!r} needs state at {position}, found {found}; "
                              "replay from a recoverable boundary")
