"""The router's prefix affinity (cluster/routing/affinity.py) and its use by the least-loaded picker."""

from __future__ import annotations

import pytest

from disagg.cluster.launch.bootstrap import Instance
from disagg.cluster.routing.affinity import PrefixAffinity
from disagg.cluster.routing.requests import Picker
from disagg.prefix_index import page_keys


def test_keys_leave_out_the_page_of_the_last_token():
    affinity = PrefixAffinity(page_size=4, capacity_pages=16)
    assert affinity.keys(list(range(8))) == page_keys(list(range(7)), 4) and len(affinity.keys(list(range(8)))) == 1
    assert len(affinity.keys(list(range(9)))) == 2
    assert affinity.keys([1, 2, 3]) == []


def test_credit_is_the_longest_leading_prefix_believed_held():
    affinity = PrefixAffinity(page_size=4, capacity_pages=16)
    shared = list(range(100, 108))
    a, b = shared + [1, 2, 3, 4, 5], shared + [9, 9, 9, 9, 9]
    affinity.note("decode-0", affinity.keys(a))
    assert affinity.credit(["decode-0", "decode-1"], affinity.keys(b)) == {"decode-0": 8, "decode-1": 0}
    assert affinity.credit(["decode-0"], affinity.keys(a)) == {"decode-0": 12}
    # A page held without its predecessor is no prefix.
    assert affinity.credit(["decode-0"], affinity.keys([7, 7, 7, 7] + a[4:]))["decode-0"] == 0


def test_capacity_forgets_the_least_recently_sent_pages_first():
    affinity = PrefixAffinity(page_size=2, capacity_pages=3)
    old, new = [1, 1, 2, 2, 0], [3, 3, 4, 4, 0]
    affinity.note("p", affinity.keys(old))
    affinity.note("p", affinity.keys(new))
    assert affinity.num_pages("p") == 3
    assert affinity.credit(["p"], affinity.keys(old))["p"] == 0  # its first page was evicted
    assert affinity.credit(["p"], affinity.keys(new))["p"] == 4
    with pytest.raises(ValueError, match="capacity_pages"):
        PrefixAffinity(page_size=2, capacity_pages=0)


def test_the_picker_takes_credit_off_the_load():
    fleet = [Instance(f"prefill-{i}", "prefill", actor=None) for i in range(2)]

    class Loaded(Picker):
        def loads(self, instances, requests):
            return {"prefill-0": 100, "prefill-1": 40}
    picker = Loaded("least_loaded")
    assert picker.order(fleet, [])[0].name == "prefill-1"
    assert picker.order(fleet, [], {"prefill-0": 64})[0].name == "prefill-0"  # 36 < 40: the hit saves more
    assert picker.order(fleet, [], {"prefill-0": 48})[0].name == "prefill-1"  # 52 > 40: still too busy
