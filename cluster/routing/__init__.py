"""Where each request goes and how its life is kept: the router and what it decides with.

router.py: `Router`, the FIFO queue, page reservation, streaming, leases, failures, turning the
request flow's actions into Ray calls; flow.py: `RequestFlow`, a request's life as a sans-IO state
machine, driven by the router and the simulator alike; migration.py: a dead instance's requests
routed again with what they streamed; call_errors.py: what a failed actor call means; requests.py:
the request records, their `Stage` and loads; ledger.py: the incremental per-instance load;
affinity.py: prefix affinity; restart.py: replacing dead instances; rebuild.py: the whole fleet
restarted into one new heap after a death (full strength); placement/: the placement
policy and its named rules (the package docstring is the policy). Imports no ray but in router.py
and call_errors.py. The design: docs/ARCHITECTURE.md §7.
"""
