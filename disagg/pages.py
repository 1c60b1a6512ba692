"""The free pages of the paged KV cache: free extents handed out so that runs stay long.

Owned by `disagg.cache.PagedKVCache`. Free pages are kept as maximal extents (runs of consecutive
page ids), merged with their neighbours as pages come back. `take(n)` hands out, in ascending
order within each extent:

1. the pages right after the caller's last page (``after``), when they are free: a growing
   sequence (decode, chunked prefill) continues its run;
2. then the smallest free extent that holds the whole rest (best fit; the lowest one among equal
   sizes), so one request is one run whenever some free extent fits it and large extents stay
   whole for large requests;
3. else the largest extents first, until the rest fits one (fewest runs); the pages of 2.-3.
   are handed out in ascending order.

So a fresh cache hands out 0, 1, 2, ... like TVM; after frees, TVM's stack would hand out the most
recently freed page first (one run per page across a freed region: compressed maps and
segment puts pay per page), this keeps freed space in long runs. Which page ids a request gets is
not a semantic (TVM's order is an accident of its vector); everything else about the pool is.

Cost: `give` and `take` are O(r log n) for r runs given or taken (dict lookups for merging, a
heap of starts per distinct extent size, and a sorted list of the distinct sizes, of which there
are at most sqrt(2 * num_pages)). Stale heap entries (extents merged away) are skipped when met
and compacted once they outnumber the live extents.

Deferred release: the cache reports slot copies (fork copies, page-to-page sends) in the NEXT
plan, so a page such a copy reads or writes must keep its contents until that plan has run. A page
freed while a pending copy touches it is parked in `deferred` instead of the free extents; it is
freed once no pending copy touches it and no forward is open (so a copy drained into the open
plan still finds it intact).
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections.abc import Iterable

import numpy as np


def ceil_div(a: int, b: int) -> int:
    """``ceil(a / b)`` for ints, b > 0 (pages needed for `a` slots of pages of `b`)."""
    return -(-a // b)


def _runs_small(pages: list[int]) -> tuple[list[int], list[int]]:
    """Maximal runs of consecutive ids in a short list: (starts, ends exclusive), ascending."""
    ids = sorted(pages)
    starts, ends = [ids[0]], []
    for prev, page in zip(ids, ids[1:]):
        if page != prev + 1:
            ends.append(prev + 1)
            starts.append(page)
    ends.append(ids[-1] + 1)
    return starts, ends


class PagePool:
    """Free extents plus deferred pages.

    Attributes:
        num_pages: pages in the cache.
        deferred: freed page ids still touched by a copy (insertion-ordered).
        touched: page ids that a pending copy reads or writes; set by the cache.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.deferred: dict[int, None] = {}
        self.touched: set[int] = set()
        self._length: dict[int, int] = {}  # extent start -> length
        self._start_of_end: dict[int, int] = {}  # extent end (exclusive) -> start
        self._sizes: list[int] = []  # sorted distinct lengths of live extents
        self._count: dict[int, int] = {}  # length -> live extents of that length
        self._starts: dict[int, list[int]] = {}  # length -> heap of starts (may hold stale ones)
        self._heap_entries = 0
        self._num_free = 0
        if num_pages:
            self._add(0, num_pages)

    # ----------------------------------------------------------------- queries

    @property
    def num_free(self) -> int:
        return self._num_free

    def extents(self) -> list[tuple[int, int]]:
        """Free extents ``(start, length)`` in ascending order of start."""
        return sorted(self._length.items())

    def free_pages(self) -> list[int]:
        """Every free page id, ascending."""
        return [p for start, length in self.extents() for p in range(start, start + length)]

    def num_untouched(self, pages: Iterable[int]) -> int:
        """How many of `pages` would be freed (not parked) if given back now."""
        touched = self.touched
        return sum(1 for page in pages if page not in touched)

    def state(self) -> tuple:
        """Everything that decides future hand-outs, for snapshots and equality in tests."""
        return (tuple(self.extents()), tuple(self.deferred), tuple(sorted(self.touched)))

    def index_problems(self) -> list[str]:
        """Inconsistencies between the extents and their indexes (for `disagg.integrity`)."""
        problems = []
        extents = self.extents()
        for (s0, n0), (s1, _) in zip(extents, extents[1:]):
            if s0 + n0 >= s1:
                problems.append(f"free extents ({s0}, {n0}) and ({s1}, ...) overlap or touch (not merged)")
        if any(n < 1 for _, n in extents):
            problems.append(f"empty free extent in {extents[:8]}")
        if {s + n: s for s, n in extents} != self._start_of_end:
            problems.append("free extents' end index disagrees with their starts")
        counts: dict[int, int] = {}
        for _, n in extents:
            counts[n] = counts.get(n, 0) + 1
        if counts != self._count or sorted(counts) != self._sizes:
            problems.append(f"free extent size index {self._count} != the extents' sizes {counts}")
        if sum(n for _, n in extents) != self._num_free:
            problems.append(f"num_free {self._num_free} != pages in free extents")
        for length, starts in self._starts.items():
            live = {s for s, n in extents if n == length}
            if not live <= set(starts):
                problems.append(f"extents of length {length} missing from its heap: {sorted(live - set(starts))[:8]}")
        return problems

    # ----------------------------------------------------------------- hand-out

    def take(self, n: int, after: int | None = None) -> list[int]:
        """Hand out `n` pages (order: see the module docstring). The caller checked n <= num_free.

        Args:
            n: pages wanted.
            after: the caller's last page, whose successor is taken first when free; or None.
        """
        assert 0 <= n <= self._num_free, f"take({n}) needs n <= free pages ({self._num_free})"
        if not n:
            return []
        pages = self.take_after(after, n) if after is not None else []
        n -= len(pages)
        rest: list[int] = []
        while n:
            i = bisect.bisect_left(self._sizes, n)
            size = self._sizes[i] if i < len(self._sizes) else self._sizes[-1]
            n -= self._take_from(self._lowest_of(size), n, rest)
        if rest and rest[-1] < rest[0]:  # several extents: in ascending order
            rest.sort()
        return pages + rest

    def take_after(self, after: int | None, n: int) -> list[int]:
        """Up to `n` free pages right after page `after` (the start of `take`); [] if none."""
        if after is None or after + 1 not in self._length or not n:
            return []
        pages: list[int] = []
        self._take_from(after + 1, n, pages)
        return pages

    def take_many(self, afters: list[int | None], counts: list[int]) -> list[list[int]]:
        """`take` for several callers at once: each first continues after its own last page where
        that is free; what is still missing is ONE `take`, split in order. The caller checked
        sum(counts) <= num_free."""
        length = self._length
        hits = [j for j, after in enumerate(afters) if after is not None and after + 1 in length]
        head = {j: self.take_after(afters[j], counts[j]) for j in hits}
        rest = [n - len(head[j]) if j in head else n for j, n in enumerate(counts)] if hits else counts
        bulk = self.take(sum(rest))
        out = [bulk[end - n : end] for n, end in zip(rest, itertools.accumulate(rest))]
        for j, pages in head.items():
            out[j] = pages + out[j]
        return out

    def give(self, pages: Iterable[int]) -> None:
        """Free `pages` (distinct, none free already): merged into the extents, or parked when a
        pending copy touches them."""
        touched = self.touched
        freed = []
        for page in pages:
            if page in touched:
                self.deferred[page] = None
            else:
                freed.append(page)
        self._free(freed)

    def release_deferred(self) -> None:
        """Free parked pages that no pending copy touches any more."""
        if not self.deferred:
            return
        ready = [page for page in self.deferred if page not in self.touched]
        for page in ready:
            del self.deferred[page]
        self._free(ready)

    # ----------------------------------------------------------------- internals

    def _free(self, pages: list[int]) -> None:
        if not pages:
            return
        if len(pages) <= 64:  # a slide, a decode page, a short sequence: no numpy overhead
            starts, ends = _runs_small(pages)
        else:
            ids = np.sort(np.asarray(pages, dtype=np.int64))
            breaks = np.flatnonzero(np.diff(ids) != 1) + 1
            starts = ids[np.concatenate(([0], breaks))].tolist()
            ends = (ids[np.concatenate((breaks - 1, [ids.size - 1]))] + 1).tolist()
        for start, end in zip(starts, ends):
            left = self._start_of_end.get(start)
            if left is not None:
                self._remove(left)
                start = left
            right = self._length.get(end)
            if right is not None:
                self._remove(end)
                end += right
            self._add(start, end - start)

    def _take_from(self, start: int, n: int, pages: list[int]) -> int:
        """Take up to `n` pages from the front of the extent at `start`; return how many."""
        length = self._remove(start)
        got = min(n, length)
        pages.extend(range(start, start + got))
        if got < length:
            self._add(start + got, length - got)
        return got

    def _lowest_of(self, size: int) -> int:
        """Start of the lowest live extent of length `size` (one exists)."""
        heap = self._starts[size]
        while self._length.get(heap[0]) != size:
            heapq.heappop(heap)
            self._heap_entries -= 1
        return heap[0]

    def _add(self, start: int, length: int) -> None:
        self._length[start] = length
        self._start_of_end[start + length] = start
        self._num_free += length
        count = self._count.get(length, 0)
        if not count:
            bisect.insort(self._sizes, length)
            self._starts[length] = []
        self._count[length] = count + 1
        heapq.heappush(self._starts[length], start)
        self._heap_entries += 1
        if self._heap_entries > 2 * len(self._length) + 64:
            self._compact()

    def _remove(self, start: int) -> int:
        length = self._length.pop(start)
        del self._start_of_end[start + length]
        self._num_free -= length
        count = self._count[length] - 1
        if count:
            self._count[length] = count
        else:
            del self._count[length]
            del self._sizes[bisect.bisect_left(self._sizes, length)]
            self._heap_entries -= len(self._starts.pop(length))
        return length

    def _compact(self) -> None:
        """Rebuild the per-size heaps from the live extents (drops stale entries)."""
        starts: dict[int, list[int]] = {size: [] for size in self._sizes}
        for start, length in self._length.items():
            starts[length].append(start)
        for heap in starts.values():
            heapq.heapify(heap)
        self._starts = starts
        self._heap_entries = len(self._length)
