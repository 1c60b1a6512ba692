"""Property tests: random operation sequences against a simulated KV store.

The state machine drives a `PagedKVCache` with every operation (add, fork, popn, remove, sliding
window, forward, prepare_recv, mark_send) and plays each plan onto a fake KV memory of token tags:
fork copies first (as ONE parallel batch, like the engine's single `copy_slots` launch), then
appends, pushes and page-to-page copies into fake receiver memories. After every step it checks the integrity invariants AND that every sequence reads back exactly the
tokens it should (with pending fork copies applied), so a page handed out too early, a copy
reported wrong or a half-applied error shows up as wrong data. Failing calls must leave the full
internal state unchanged. Receivers' writes are applied right after `disagg_prepare_recv`, before
any pending copy runs, the most hostile order.
"""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from disagg import posmap
from disagg.cache import PagedKVCache
from disagg.copies import fork_copy_slots
from disagg.errors import DisaggError

from .conftest import cache_state

NUM_PES = 3
REMOTE_SLOTS = 1 << 16


def apply_batched(kv: np.ndarray, src: np.ndarray, dst: np.ndarray) -> None:
    """Fork copies as the engine applies them: ONE parallel `copy_slots` batch (numpy reads every
    source before writing), so a chain the cache left unresolved reads stale KV here too."""
    assert np.intersect1d(src, dst).size == 0, "a fork copy reads a slot another copy writes"
    assert np.unique(dst).size == dst.size, "two fork copies write one slot"
    kv[dst] = kv[src]


class CacheMachine(RuleBasedStateMachine):
    """A cache, a fake KV memory holding token tags, and the tags each sequence should read."""

    @initialize(num_pages=st.integers(1, 32), page_size=st.sampled_from([1, 2, 3, 4, 8]))
    def setup(self, num_pages: int, page_size: int) -> None:
        self.cache = PagedKVCache(num_pages, page_size)
        self.kv = np.full(num_pages * page_size, -1, dtype=np.int64)
        self.remote = np.full((NUM_PES, REMOTE_SLOTS), -1, dtype=np.int64)
        self.expected: dict[int, list[int]] = {}
        self.next_tag = 1000
        self.next_id = 0
        self.next_remote = 0

    # ------------------------------------------------------------- helpers

    def attempt(self, call):
        """Run `call`; on a project error, require the state to be exactly as before."""
        before = cache_state(self.cache)
        try:
            return call(), True
        except DisaggError:
            assert cache_state(self.cache) == before, "a failed call changed the cache"
            return None, False

    def tags(self, n: int) -> np.ndarray:
        out = np.arange(self.next_tag, self.next_tag + n)
        self.next_tag += n
        return out

    def appended(self, seq_id: int, tags: np.ndarray) -> None:
        """Extend the expected tokens, then apply the sequence's window as TVM keeps it."""
        expected = self.expected[seq_id] + tags.tolist()
        seq = self.cache._seqs[seq_id]
        if seq.windowed and len(expected) > seq.sliding_window_size:
            sinks = self.cache._prefix_length(seq) + seq.last_block_attn_sink_size
            tail = seq.sliding_window_size - sinks
            expected = expected[:sinks] + expected[len(expected) - tail :]
        self.expected[seq_id] = expected

    def pick(self, data, ids=None) -> int:
        return data.draw(st.sampled_from(sorted(self.expected if ids is None else ids)))

    def play(self, plan) -> None:
        """Play a plan on the fake memories in the order consumers must follow."""
        apply_batched(self.kv, plan.fork_src_slots, plan.fork_dst_slots)
        copied = self.kv[plan.copy_local_slots]
        tags = self.tags(plan.num_tokens)
        written = plan.append_slots >= 0
        self.kv[plan.append_slots[written]] = tags[written]
        assert np.array_equal(self.kv[plan.copy_local_slots], copied), "a forward overwrote a copy source"
        self.remote[plan.copy_pes, plan.copy_remote_slots] = copied
        pushed = plan.push_slots >= 0
        self.remote[plan.push_pes[pushed], plan.push_slots[pushed]] = tags[pushed]
        for i, seq_id in enumerate(plan.seq_ids):
            self.appended(seq_id, tags[plan.qo_indptr[i] : plan.qo_indptr[i + 1]])
        for i, seq_id in enumerate(plan.seq_ids):
            self.check_page_table(plan, i, seq_id)
        for seq_id, pe, complete in zip(plan.send_seq_ids.tolist(), plan.send_pes, plan.send_complete):
            if complete:
                self.check_delivered(seq_id, int(pe))

    def check_page_table(self, plan, i: int, seq_id: int) -> None:
        page_size = self.cache.page_size
        pages = plan.page_indices[plan.page_indptr[i] : plan.page_indptr[i + 1]].astype(np.int64)
        slots = (pages[:, None] * page_size + np.arange(page_size)).reshape(-1)
        slots = slots[: (len(pages) - 1) * page_size + int(plan.last_page_len[i])]
        keep = np.ones(slots.size, dtype=bool)
        keep[int(plan.sink_size[i]) : int(plan.sliding_window_offset[i])] = False
        assert slots[keep].tolist() == self.cache.slots(seq_id).tolist()

    def check_delivered(self, seq_id: int, pe: int) -> None:
        send = self.cache._seqs[seq_id].send
        remote = send.remote_slots
        sent = remote >= 0
        want = np.asarray(self.expected[seq_id][send.begin : send.begin + len(remote)])
        assert np.array_equal(
            self.remote[pe, remote[sent]], want[sent]
        ), f"sequence {seq_id} delivered wrong KV"

    # --------------------------------------------------------------- rules

    @precondition(lambda self: len(self.expected) < 6)
    @rule()
    def add(self) -> None:
        seq_id = self.next_id
        self.next_id += 1
        if self.attempt(lambda: self.cache.add_sequence(seq_id))[1]:
            self.expected[seq_id] = []

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def forward(self, data) -> None:
        batch = data.draw(st.lists(st.sampled_from(sorted(self.expected)), unique=True, max_size=4))
        lens = [data.draw(st.integers(1, 16)) for _ in batch]
        plan, ok = self.attempt(lambda: self.cache.begin_forward(batch, lens))
        if ok:
            self.play(plan)
            self.cache.end_forward()

    @precondition(lambda self: self.expected)
    @rule()
    def decode(self) -> None:
        batch = sorted(self.expected)
        plan, ok = self.attempt(lambda: self.cache.begin_forward(batch, [1] * len(batch)))
        if ok:
            self.play(plan)
            self.cache.end_forward()

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def fork(self, data) -> None:
        parent = self.pick(data)
        length = len(self.expected[parent])
        pos = data.draw(st.one_of(st.just(-1), st.integers(0, length + 1)))
        child = self.next_id
        self.next_id += 1
        if self.attempt(lambda: self.cache.fork_sequence(parent, child, pos))[1]:
            self.expected[child] = self.expected[parent][: length if pos == -1 else pos]

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def popn(self, data) -> None:
        seq_id = self.pick(data)
        n = data.draw(st.integers(0, len(self.expected[seq_id]) + 1))
        if self.attempt(lambda: self.cache.popn(seq_id, n))[1] and n:
            del self.expected[seq_id][-n:]

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def remove(self, data) -> None:
        seq_id = self.pick(data)
        self.cache.remove_sequence(seq_id)
        del self.expected[seq_id]

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def window(self, data) -> None:
        seq_id = self.pick(data)
        window = data.draw(st.integers(1, 16))
        sink = data.draw(st.integers(0, window))
        self.attempt(lambda: self.cache.enable_sliding_window(seq_id, window, sink))

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def prepare_recv(self, data) -> None:
        seq_id = self.pick(data)
        n = data.draw(st.integers(0, 9))
        cmap, ok = self.attempt(lambda: self.cache.disagg_prepare_recv(seq_id, n))
        if ok:
            slots = posmap.decompress(cmap)
            tags = self.tags(n)
            self.kv[slots[slots >= 0]] = tags[slots >= 0]  # the sender writes right away
            self.appended(seq_id, tags)
            self.cache.end_forward()

    @precondition(lambda self: self.expected)
    @rule(data=st.data())
    def mark_send(self, data) -> None:
        seq_id = self.pick(data)
        length = len(self.expected[seq_id])
        begin = data.draw(st.integers(0, length + 2))
        size = max(length - begin, 0) + data.draw(st.sampled_from([-1, 0, 1, 3, 8, 30]))
        remote = self.next_remote + np.arange(max(size, 0))
        self.next_remote += max(size, 0)
        skipped = data.draw(st.lists(st.integers(0, max(size - 1, 0)), max_size=3))
        remote[[s for s in skipped if s < size]] = -1
        pe = data.draw(st.integers(0, NUM_PES - 1))
        self.attempt(lambda: self.cache.disagg_mark_send(seq_id, begin, posmap.compress(remote), pe))

    @precondition(lambda self: len(self.expected) > 3)
    @rule()
    def remove_all(self) -> None:
        for seq_id in list(self.expected):
            self.cache.remove_sequence(seq_id)
        self.expected.clear()
        self.cache.check_integrity()
        assert (
            self.cache.num_free_pages == self.cache.num_pages
        ), "removing every sequence must free every page"

    # ---------------------------------------------------------- invariants

    @invariant()
    def consistent(self) -> None:
        if not hasattr(self, "cache"):
            return
        self.cache.check_integrity()
        kv = self.kv.copy()
        # What the next plan's copies will produce, applied like a plan's (one batch).
        apply_batched(kv, *fork_copy_slots(self.cache._copies.fork, self.cache.page_size))
        for seq_id, want in self.expected.items():
            assert self.cache.seq_length(seq_id) == len(want)
            assert kv[self.cache.slots(seq_id)].tolist() == want, f"sequence {seq_id} reads wrong tokens"

    def teardown(self) -> None:
        if hasattr(self, "cache"):
            self.remove_all()


CacheMachine.TestCase.settings = settings(
    max_examples=400,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,  # the same operation sequences on every run and machine
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCache = CacheMachine.TestCase
