"""Host bookkeeping of the cache: pages, slots and the stale-state refusal.

* `PageAllocator`: page ids 1..P-1 (page 0 is the null page every padding row names). A freed
  page is quarantined until every step that was dispatched while the request still held it has
  completed (docs/CACHE.md §1.10, INV-7): in a pipelined loop the step in flight may still read or
  write it, and handing it to a new request at once would let that step's writes land in the new
  owner's rows.
* `SlotAllocator`: one STATE entry per in-flight request; unique by construction (docs/CACHE.md INV-9).
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

    def allocate(self, n: int) -> list[int]:
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

    def acquire(self, request_id) -> int:
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


def check_cursor(request_id, position: int, found: int) -> None:
    """Refuse a continuation whose slot is not at its first position (hard error, never a warning)."""
    if position != 0 and found != position:
        raise StaleStateError(f"request {request_id!r} needs state at {position}, found {found}; "
                              "replay from a recoverable boundary")
