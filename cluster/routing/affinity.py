"""Prefix affinity: which prompt pages the router believes each instance holds in its prefix cache.

The router's `Placer` (`disagg.cluster.routing.placement.placer`, in the launching process) keeps, per
instance, the chained page keys of the prompts it sent there (`disagg.prefix_index.page_keys`, the keys
the instances' caches use), least recently used first and bounded by the instance's pages:
SGLang's cache-aware router does the same rather than asking the workers. It is a belief, not the cache: an instance
may have evicted a page the router still counts, which costs only a less useful choice (the
instance computes what it misses). The credit of an instance for a prompt is the tokens of its
longest believed prefix; `Picker.order` subtracts it from the instance's load, so a request goes
where its prefix is unless that instance is busier by more than the work the hit saves
(docs/ARCHITECTURE.md §7).
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from disagg.prefix_index import page_keys

if TYPE_CHECKING:
    from disagg.cluster.launch.bootstrap import Fleet
    from disagg.config import Config


def smallest_cache_pages(fleet: Fleet) -> int:
    """Pages of the smallest instance cache of ``fleet`` (what the affinity remembers per
    instance): each instance's KV budget over its page's bytes."""
    sizes = [inst.info["kv_budget_bytes"] // inst.info["page_bytes"] for inst in fleet.instances
             if inst.info.get("page_bytes")]
    return max(1, min(sizes)) if sizes else (fleet.config.cache.num_pages or 4096)


def prefix_affinity(config: Config, capacity_pages: int) -> PrefixAffinity | None:
    """The prefix affinity of ``config``'s router: kept where the instances cache prefixes
    (``cache.prefix_caching``) and the picker weighs loads (``router.policy`` least_loaded; round
    robin ignores credit); None otherwise. The router and the simulator
    (`disagg.cluster.simulate.fleet`) both take it from here.

    Args:
        config: the deployment.
        capacity_pages: pages remembered per instance (the smallest instance cache's).
    """
    if not (config.cache.prefix_caching and config.router.policy == "least_loaded"):
        return None
    return PrefixAffinity(config.cache.page_size, capacity_pages)


class PrefixAffinity:
    """Per-instance LRU sets of page keys.

    Args:
        page_size: tokens per page (the instances' `cache.page_size`).
        capacity_pages: pages remembered per instance (its cache's pages).
    """

    def __init__(self, page_size: int, capacity_pages: int) -> None:
        if page_size < 1 or capacity_pages < 1:
            raise ValueError(f"PrefixAffinity: expected page_size and capacity_pages >= 1, got "
                             f"{page_size} and {capacity_pages}")
        self.page_size = page_size
        self.capacity_pages = capacity_pages
        self._pages: dict[str, collections.OrderedDict[int, None]] = {}

    def keys(self, prompt_token_ids: Sequence[int]) -> list[int]:
        """The keys of the prompt's full pages but the one holding its last token (an instance
        always computes that token, so a page it ends is never a hit)."""
        return page_keys(prompt_token_ids[:len(prompt_token_ids) - 1], self.page_size)

    def credit(self, names: Iterable[str], keys: list[int]) -> dict[str, int]:
        """Tokens of the longest prefix of ``keys`` each instance is believed to hold."""
        out = {}
        for name in names:
            pages = self._pages.get(name)
            matched = 0
            if pages:
                for key in keys:
                    if key not in pages:
                        break
                    matched += 1
            out[name] = matched * self.page_size
        return out

    def note(self, name: str, keys: list[int]) -> None:
        """``name`` was sent a prompt with these page keys: they are now its most recent."""
        pages = self._pages.setdefault(name, collections.OrderedDict())
        for key in keys:
            pages[key] = None
            pages.move_to_end(key)
        while len(pages) > self.capacity_pages:
            pages.popitem(last=False)

    def forget(self, name: str) -> None:
        """``name`` died (or restarted): it holds nothing."""
        self._pages.pop(name, None)

    def num_pages(self, name: str) -> int:
        """Pages believed held by ``name``."""
        return len(self._pages.get(name, ()))
