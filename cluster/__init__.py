"""disagg.cluster: the fleet on Ray -- instance actors, heap bootstrap, router, CLI, demo.

    Cluster.launch(config) -> Cluster       start every instance from a `disagg.config.Config`
    cluster.stream(prompt, params)          async deltas (`StreamDelta`), from any event loop
    cluster.generate(prompts, params)       blocking, -> list[`Completion`]
    cluster.abort(id); cluster.stats(); cluster.shutdown()

Where things happen, by folder: `launch/` starts a fleet (`connect`, `preflight`, `bootstrap`,
`actors` with their engines (`engines`) on a `step_loop` thread, `instance`); `routing/` takes
each request (`router`; its life in `flow`, its state in `requests`, loads in `ledger`; where it
goes: `placement`, its policies, rules and `Placer`, with `affinity`); `cli/` is the `disagg`
command and `make demo` (`cli.demo`); `serve/`, `bench/` and `simulate/` (the simulator, `profile`,
the step-time model, `plan`) have their verbs. Here: `cluster` (the caller's handle), `outputs`
and `messages`. Only this package imports ray, and only where it launches or routes: `Cluster` is
imported on first use, so the placement and the simulator run without it.
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
