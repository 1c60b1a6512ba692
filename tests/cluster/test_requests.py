"""`RecentIds` (cluster/requests.py): the router's bounded memory of request ids, on a fake clock."""

from __future__ import annotations

import pytest

from disagg.cluster.requests import RecentIds


def test_recent_ids_are_bounded_by_count_and_age():
    now = [0.0]
    ids = RecentIds(3, ttl_s=10.0, clock=lambda: now[0])
    for name in "abcd":
        ids.add(name)
    assert "a" not in ids and len(ids) == 3  # pushed out by count, oldest first
    now[0] = 5.0
    ids.add("b")  # renewed: now the newest
    now[0] = 12.0
    assert [n for n in "abcd" if n in ids] == ["b"]  # c and d, noted at 0 s, are older than 10 s
    assert ids.pop("b") and not ids.pop("b")
    assert len(ids) == 0


def test_recent_ids_without_ttl_keep_ids_until_pushed_out():
    now = [0.0]
    ids = RecentIds(2, clock=lambda: now[0])
    ids.add("a")
    now[0] = 1e9
    ids.add("b")
    assert "a" in ids and "b" in ids
    ids.add("c")
    assert "a" not in ids and len(ids) == 2


def test_recent_ids_need_room_for_one():
    with pytest.raises(ValueError, match="max_ids: expected at least 1, got 0"):
        RecentIds(0)


def test_least_loaded_takes_turns_among_equal_loads_and_still_prefers_the_least_loaded():
    from disagg.cluster.bootstrap import Instance
    from disagg.cluster.requests import Picker

    fleet = [Instance(f"prefill-{i}", "prefill", actor=None) for i in range(3)]
    picker = Picker("least_loaded")
    firsts = [picker.order(fleet, [])[0].name for _ in range(6)]  # an idle fleet, one request at a time
    assert firsts == ["prefill-0", "prefill-1", "prefill-2"] * 2

    class Loaded(Picker):
        def loads(self, instances, requests):
            return {"prefill-0": 5, "prefill-1": 0, "prefill-2": 9}
    loaded = Loaded("least_loaded")
    assert [[i.name for i in loaded.order(fleet, [])] for _ in range(3)] == [["prefill-1", "prefill-0", "prefill-2"]] * 3
    fleet[1].alive = False
    assert picker.order(fleet, [])[0].name in {"prefill-0", "prefill-2"}
