"""Property test of prefix caching under page pressure: random prompts over a tiny vocabulary (so
prefixes repeat), entering from their longest cached prefix, computing in random chunks, leaving;
a fake KV memory holds at each slot a tag of the whole prefix up to that token (as real K/V
depends on every token before it). After every step: integrity, and every live sequence reads back
exactly its tokens' tags (a cached page evicted while used, or a wrong hit, shows as wrong data).
At the end every page is free (free = in the pool, or evictable: held only by cached sequences)
and a reservation of the whole cache succeeds by evicting all of them."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from disagg import posmap
from disagg.cache import PagedKVCache
from disagg.errors import OutOfPages


def tags(tokens: list[int]) -> list[int]:
    """Tag of each position: a hash of the tokens up to and including it."""
    out, h = [], 17
    for t in tokens:
        h = hash((h, t))
        out.append(h)
    return out


class PrefixMachine(RuleBasedStateMachine):
    @initialize(num_pages=st.integers(3, 16), page_size=st.sampled_from([1, 2, 4]))
    def setup(self, num_pages: int, page_size: int) -> None:
        self.cache = PagedKVCache(num_pages, page_size, prefix_caching=True)
        self.kv = np.zeros(num_pages * page_size, dtype=np.int64)
        self.live: dict[int, tuple[list[int], int]] = {}  # seq id -> (tokens, computed)
        self.next_id = 0
        self.hits = 0

    def forward(self, seq_ids: list[int], counts: list[int]) -> bool:
        try:
            plan = self.cache.begin_forward(seq_ids, counts)
        except OutOfPages:
            return False
        self.kv[plan.fork_dst_slots] = self.kv[plan.fork_src_slots]
        rows = []
        for seq_id, n in zip(seq_ids, counts):
            tokens, done = self.live[seq_id]
            rows += tags(tokens)[done: done + n]
            self.live[seq_id] = (tokens, done + n)
        self.kv[plan.append_slots] = rows
        self.cache.end_forward()
        for seq_id in seq_ids:
            tokens, done = self.live[seq_id]
            self.cache.cache_tokens(seq_id, tokens[:done])
        return True

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14), aligned=st.booleans())
    def enter(self, prompt: list[int], aligned: bool) -> None:
        match = self.cache.match_prefix(prompt, page_aligned=aligned)
        assert match.num_tokens < len(prompt)
        if match.num_pages > self.cache.num_free_pages:
            return
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.cache.add_sequence(seq_id, prefix=match)
        self.hits += match.num_tokens
        self.live[seq_id] = (prompt, match.num_tokens)
        self.forward([], [])  # run the fork's page copy now

    @rule(prompt=st.lists(st.integers(0, 2), min_size=1, max_size=14), lands=st.booleans())
    def receive(self, prompt: list[int], lands: bool) -> None:
        """A decode reservation: whole cached pages, the rest received (written by a 'sender'), or
        dropped before its KV landed (abort, lease expiry): nothing of it may become matchable."""
        match = self.cache.match_prefix(prompt, page_aligned=True)
        assert match.num_tokens % self.cache.page_size == 0
        seq_id, self.next_id = self.next_id, self.next_id + 1
        self.cache.add_sequence(seq_id, prefix=match)
        self.hits += match.num_tokens  # counted when found, whatever happens next
        try:
            cmap = self.cache.disagg_prepare_recv(seq_id, len(prompt) - match.num_tokens)
        except OutOfPages:
            self.cache.remove_sequence(seq_id)  # the forked prefix stays cached
            return
        self.cache.end_forward()
        if not lands:
            self.cache.remove_sequence(seq_id)
            return
        self.kv[posmap.decompress(cmap)] = tags(prompt)[match.num_tokens:]
        self.cache.cache_tokens(seq_id, prompt)  # rung: the KV landed
        self.live[seq_id] = (prompt, len(prompt))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def compute(self, data) -> None:
        ids = [i for i, (t, done) in self.live.items() if done < len(t)]
        if not ids:
            return
        chosen = data.draw(st.lists(st.sampled_from(ids), min_size=1, max_size=3, unique=True))
        counts = [data.draw(st.integers(1, len(self.live[i][0]) - self.live[i][1])) for i in chosen]
        self.forward(chosen, counts)

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def leave(self, data) -> None:
        seq_id = data.draw(st.sampled_from(sorted(self.live)))
        self.cache.remove_sequence(seq_id)
        del self.live[seq_id]

    @invariant()
    def intact(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        for seq_id, (tokens, done) in self.live.items():
            slots = self.cache.slots(seq_id, 0, done)
            assert self.kv[slots].tolist() == tags(tokens)[:done], f"sequence {seq_id} reads wrong KV"
        assert self.cache.prefix_stats()["prefix_hit_tokens"] == self.hits

    def teardown(self) -> None:
        if not hasattr(self, "cache"):
            return
        for seq_id in list(self.live):
            self.cache.remove_sequence(seq_id)
        cache = self.cache
        assert cache.num_free_pages == cache.num_pages
        cache.add_sequence(10**6)
        cache.begin_forward([10**6], [cache.num_pages * cache.page_size])
        cache.end_forward()
        cache.remove_sequence(10**6)
        cache.check_integrity()
        assert cache._pool.num_free == cache.num_pages and cache.num_cached_pages == 0


PrefixMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
TestPrefixCaching = PrefixMachine.TestCase
