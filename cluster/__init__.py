"""disagg.cluster: the fleet on Ray -- instance actors, heap bootstrap, router, CLI, demo.

    Cluster.launch(config) -> Cluster       start every instance from a `disagg.config.Config`
    cluster.stream(prompt, params)          async deltas (`StreamDelta`), from any event loop
    cluster.generate(prompts, params)       blocking, -> list[`Completion`]
    cluster.abort(id); cluster.stats(); cluster.shutdown()

Where things happen: `bootstrap` (placement, weights, heap, preflight: `preflight`), `actors` (one
per instance; its engine runs on a `step_loop` thread; engines built by `engines`), `router`
(request entry, page reservation, streaming, leases, failures; each request's life in `flow`, its
state in `requests`; where each request goes: `placement`, its policies, rules and `Placer`, with
`affinity`), `cluster` (the caller's handle), `cli` (the `disagg` command), `demo` (`make demo`).
Only this package imports ray, and only where it launches or routes: `Cluster` is imported on first
use, so the placement and the simulator (`simulate`) run without it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from disagg.cluster.outputs import Completion, RequestMetrics, StreamDelta

if TYPE_CHECKING:
    from disagg.cluster.cluster import Cluster

__all__ = ["Cluster", "Completion", "RequestMetrics", "StreamDelta"]


def __getattr__(name: str) -> Any:
    if name == "Cluster":  # it imports ray: only for a caller that launches a fleet
        from disagg.cluster.cluster import Cluster

        return Cluster
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
