"""Automatic prefix caching, the content index: which sequence's pages hold which token ids.

vLLM's design (``vllm/v1/core/kv_cache_utils.py`` hashes, ``block_pool.py``) on TVM's block tree:
a full page is keyed by a hash chained over its token ids and its predecessor's key, so equal keys
mean an equal prefix up to the end of that page. Each *registered* sequence (`register`: the KV of
its first ``len(token_ids)`` positions is written and holds those tokens) is listed under the key
of every full page it holds. `match` walks a prompt's page keys while some sequence holds them,
verifies the tokens (a hash collision never becomes a wrong hit), then extends the match token by
token into the next page of one of those holders (a hit may end mid page: the fork copies that
partial page). Owned by `disagg.cache.PagedKVCache` (which decides what stays cached and what is
evicted, `disagg.prefix_cache`); pure Python, in the process that owns the cache.

    keys:  k0 = hash((ROOT, *t[0:P]))   k1 = hash((k0, *t[P:2P]))   k2 = ...
    holders[k] = {seq ids holding that page at that position, oldest registration first}
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence as SequenceLike
from dataclasses import dataclass

ROOT_KEY = 0x5EED  # the "previous key" of a sequence's first page
MAX_HOLDERS_EXTENDED = 8  # holders tried for the mid-page extension (most recent first)


def page_keys(token_ids: SequenceLike[int], page_size: int, start: int = 0, parent: int = ROOT_KEY) -> list[int]:
    """Chained keys of the full pages ``start, start + 1, ...`` of ``token_ids``.

    Args:
        token_ids: the tokens (a list of ints).
        page_size: tokens per page.
        start: the first page to key; ``parent`` is the key of page ``start - 1`` (ROOT_KEY at 0).

    Returns:
        One int key per full page from ``start`` on.
    """
    keys = []
    for first in range(start * page_size, len(token_ids) - page_size + 1, page_size):
        parent = hash((parent, *token_ids[first: first + page_size]))
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class PrefixMatch:
    """The longest cached prefix of a prompt, as `PagedKVCache.match_prefix` found it.

    Attributes:
        seq_id: the cache sequence to fork from (None: no hit).
        num_tokens: prompt tokens found (0 .. num_query_tokens - 1: one is always computed).
        num_query_tokens: prompt tokens looked up.
        num_pages: pages of ``num_free_pages`` that the fork takes (cached pages it pins, plus the
            page a mid-page hit copies into and the cached page it copies from, which its pending
            copy keeps from being evicted).
        epoch: the cache's state when matched; `add_sequence` refuses a match made stale by any
            change since.
    """

    seq_id: int | None
    num_tokens: int
    num_query_tokens: int
    num_pages: int
    epoch: int


class PrefixIndex:
    """Page keys of registered sequences, and the tokens behind them.

    Args:
        page_size: tokens per page.
    """

    def __init__(self, page_size: int) -> None:
        self.page_size = page_size
        self._tokens: dict[int, list[int]] = {}  # seq id -> tokens whose KV is written
        self._keys: dict[int, list[int]] = {}  # seq id -> key of each full page of those tokens
        self._holders: dict[int, dict[int, None]] = {}  # key -> seq ids holding that page

    def __contains__(self, seq_id: object) -> bool:
        return seq_id in self._tokens

    def __len__(self) -> int:
        return len(self._tokens)

    def length(self, seq_id: int) -> int:
        """Registered tokens of ``seq_id`` (0 when none)."""
        tokens = self._tokens.get(seq_id)
        return 0 if tokens is None else len(tokens)

    def tokens(self, seq_id: int) -> list[int]:
        """The registered tokens of ``seq_id`` (do not mutate)."""
        return self._tokens.get(seq_id, [])

    def register(self, seq_id: int, token_ids: SequenceLike[int]) -> bool:
        """``seq_id`` holds ``token_ids`` in its first positions; key its full pages.

        Returns:
            False (nothing changes) when ``token_ids`` disagrees with what ``seq_id`` registered
            before over their common length; True otherwise.
        """
        tokens = list(token_ids)
        old = self._tokens.get(seq_id, [])
        common = min(len(old), len(tokens))
        if old[:common] != tokens[:common]:
            return False
        keys = self._keys.setdefault(seq_id, [])
        num_full = len(tokens) // self.page_size
        if num_full < len(keys):
            self._unlist(seq_id, keys[num_full:])
            del keys[num_full:]
        new = page_keys(tokens, self.page_size, len(keys), keys[-1] if keys else ROOT_KEY)
        for key in new:
            self._holders.setdefault(key, {})[seq_id] = None
        keys.extend(new)
        self._tokens[seq_id] = tokens
        return True

    def copy_prefix(self, parent_id: int, child_id: int, num_tokens: int) -> None:
        """A fork: ``child_id`` holds ``parent_id``'s first ``num_tokens`` positions (as far as
        they are registered)."""
        tokens = self._tokens.get(parent_id)
        if tokens is None:
            return
        self.drop(child_id)
        num = min(num_tokens, len(tokens))
        keys = self._keys[parent_id][: num // self.page_size]
        self._tokens[child_id] = tokens[:num]
        self._keys[child_id] = list(keys)
        for key in keys:
            self._holders[key][child_id] = None

    def truncate(self, seq_id: int, num_tokens: int) -> None:
        """``seq_id`` now holds at most ``num_tokens`` positions (after a pop)."""
        tokens = self._tokens.get(seq_id)
        if tokens is not None and len(tokens) > num_tokens:
            keys = self._keys[seq_id]
            num_full = num_tokens // self.page_size
            self._unlist(seq_id, keys[num_full:])
            del keys[num_full:]
            del tokens[num_tokens:]

    def drop(self, seq_id: int) -> None:
        """Forget ``seq_id`` (removed, or its contents are no longer known)."""
        if seq_id in self._tokens:
            self._unlist(seq_id, self._keys.pop(seq_id))
            del self._tokens[seq_id]

    def rename(self, old_id: int, new_id: int) -> None:
        """The sequence ``old_id`` is now called ``new_id``."""
        if old_id not in self._tokens:
            return
        keys = self._keys.pop(old_id)
        self._tokens[new_id] = self._tokens.pop(old_id)
        self._keys[new_id] = keys
        for key in keys:
            holders = self._holders[key]
            del holders[old_id]
            holders[new_id] = None

    def match(self, token_ids: SequenceLike[int], max_tokens: int) -> tuple[int | None, int]:
        """The longest registered prefix of ``token_ids[:max_tokens]`` that starts with a full page.

        Returns:
            ``(seq_id, num_tokens)`` of a holder of it, or ``(None, 0)``.
        """
        size = self.page_size
        parent, num_pages, holders = ROOT_KEY, 0, None
        while (num_pages + 1) * size <= max_tokens:
            key = hash((parent, *token_ids[num_pages * size: (num_pages + 1) * size]))
            found = self._holders.get(key)
            if not found:
                break
            parent, num_pages, holders = key, num_pages + 1, found
        if holders is None:
            return None, 0
        full = num_pages * size
        query = list(token_ids[:max_tokens])
        best, best_len = None, 0
        for seq_id in itertools.islice(reversed(holders), MAX_HOLDERS_EXTENDED):
            tokens = self._tokens[seq_id]
            if tokens[:full] != query[:full]:
                continue  # a hash collision: not this prefix
            extra = 0
            for a, b in zip(tokens[full:], query[full:]):
                if a != b:
                    break
                extra += 1
            if full + extra > best_len:
                best, best_len = seq_id, full + extra
        return best, best_len

    def problems(self, seq_lengths: dict[int, int]) -> list[str]:
        """Inconsistencies (for `disagg.integrity`): unknown or too short sequences, keys that
        are not the chain of the tokens, holder lists that disagree with the keys."""
        out = []
        expected: dict[int, set[int]] = {}
        for seq_id, tokens in self._tokens.items():
            if seq_id not in seq_lengths:
                out.append(f"prefix index lists sequence {seq_id}, which is not in the cache")
            elif len(tokens) > seq_lengths[seq_id]:
                out.append(f"sequence {seq_id} registered {len(tokens)} tokens but holds {seq_lengths[seq_id]}")
            if self._keys[seq_id] != page_keys(tokens, self.page_size):
                out.append(f"sequence {seq_id}: page keys are not the chain of its tokens")
            for key in self._keys[seq_id]:
                expected.setdefault(key, set()).add(seq_id)
        actual = {key: set(holders) for key, holders in self._holders.items() if holders}
        if actual != expected:
            out.append("prefix index holders disagree with the sequences' page keys")
        if any(not holders for holders in self._holders.values()):
            out.append("prefix index keeps a key with no holder")
        return out

    def _unlist(self, seq_id: int, keys: list[int]) -> None:
        for key in keys:
            holders = self._holders[key]
            holders.pop(seq_id, None)
            if not holders:
                del self._holders[key]
