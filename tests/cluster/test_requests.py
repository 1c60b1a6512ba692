"""`RecentIds` (cluster/routing/requests.py): the router's bounded memory of request ids, on a fake clock."""

from __future__ import annotations

import pytest

from disagg.cluster.routing.requests import RecentIds


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
    from disagg.cluster.launch.bootstrap import Instance
    from disagg.cluster.routing.requests import Picker

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


def test_least_loaded_puts_an_instance_with_every_seat_held_last():
    """colocated-0 holds fewer tokens but all its 2 seats; colocated-1 has one free: with
    ``max_seqs`` it goes first, without it the lighter one does. Seats count what `seat_holders`
    names: a request's colocated or decode instance, and its prefill instance while prefilling."""
    from disagg.cluster.launch.bootstrap import Instance
    from disagg.cluster.outputs import RequestMetrics
    from disagg.cluster.routing.requests import Picker, RoutedRequest, seat_holders
    from disagg.sampling import SamplingParams

    c0, c1 = Instance("colocated-0", "colocated", actor=None), Instance("colocated-1", "colocated", actor=None)

    def req(rid, inst, prompt_len):
        r = RoutedRequest(rid, [0] * prompt_len, SamplingParams(max_tokens=8), lambda *a: None,
                          RequestMetrics(arrival_time=0.0))
        r.colocated, r.stage = inst, "running"
        return r

    live = [req("a", c0, 10), req("b", c0, 10), req("c", c1, 500)]
    assert Picker("least_loaded").order([c0, c1], live)[0] is c0
    assert Picker("least_loaded", max_seqs=2).order([c0, c1], live)[0] is c1
    assert Picker("least_loaded", max_seqs=3).order([c0, c1], live)[0] is c0  # a seat free on both
    assert Picker("least_loaded", max_seqs=2).seats([c0, c1], live) == {"colocated-0": 2, "colocated-1": 1}
    p, d = Instance("prefill-0", "prefill", actor=None), Instance("decode-0", "decode", actor=None)
    pushed = req("d", None, 10)
    pushed.colocated, pushed.prefill, pushed.decode, pushed.stage = None, p, d, "prefilling"
    assert seat_holders(pushed) == (d, p)
    pushed.stage = "decoding"
    assert seat_holders(pushed) == (d,)
    pushed.stage = "done"
    assert seat_holders(pushed) == ()
