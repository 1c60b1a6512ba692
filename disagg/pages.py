"""The free-page stack of the paged KV cache, with deferred release of pages a pending copy touches.

Owned by `disagg.cache.PagedKVCache`. Pages are handed out and taken back in TVM's order
(`free_page_ids_` is a stack: page 0 is handed out first, the most recently freed page next).

Deferred release: the cache reports slot copies (fork copies, page-to-page sends) in the NEXT
plan, so a page such a copy reads or writes must keep its contents until that plan has run. A page
freed while a pending copy touches it is parked in `deferred` instead of the free stack; it goes
back on the stack once no pending copy touches it and no forward is open (so a copy drained into
the open plan still finds it intact), in the order it was parked.
"""

from __future__ import annotations

from collections.abc import Iterable


class PagePool:
    """Free stack plus deferred pages.

    Attributes:
        num_pages: pages in the cache.
        free: page ids ready to hand out; the last one goes first.
        deferred: freed page ids still touched by a copy (insertion-ordered).
        touched: page ids that a pending copy reads or writes; set by the cache.
    """

    def __init__(self, num_pages: int) -> None:
        self.num_pages = num_pages
        self.free: list[int] = list(range(num_pages - 1, -1, -1))
        self.deferred: dict[int, None] = {}
        self.touched: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self.free)

    def take(self, n: int) -> list[int]:
        """Pop `n` pages in TVM's order (each from the top of the stack). The caller checked n <= num_free."""
        assert 0 <= n <= len(self.free), f"take({n}) needs n <= free pages ({len(self.free)})"
        if n == 0:
            return []
        pages = self.free[-n:][::-1]
        del self.free[-n:]
        return pages

    def give(self, pages: Iterable[int]) -> None:
        """Free `pages` in order: onto the stack, or parked when a pending copy touches them."""
        touched = self.touched
        for page in pages:
            if page in touched:
                self.deferred[page] = None
            else:
                self.free.append(page)

    def num_untouched(self, pages: Iterable[int]) -> int:
        """How many of `pages` would land on the free stack if given back now."""
        touched = self.touched
        return sum(1 for page in pages if page not in touched)

    def release_deferred(self) -> None:
        """Move parked pages that no pending copy touches any more back onto the stack."""
        if not self.deferred:
            return
        ready = [page for page in self.deferred if page not in self.touched]
        for page in ready:
            del self.deferred[page]
        self.free.extend(ready)

    def state(self) -> tuple:
        """Everything, for snapshots and equality in tests."""
        return (tuple(self.free), tuple(self.deferred), tuple(sorted(self.touched)))
