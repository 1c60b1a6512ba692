"""disagg.cluster: the fleet on Ray -- instance actors, heap bootstrap, router, CLI, demo.

    Cluster.launch(config) -> Cluster       start every instance from a `disagg.config.Config`
    cluster.stream(prompt, params)          async deltas (`StreamDelta`), from any event loop
    cluster.generate(prompts, params)       blocking, -> list[`Completion`]
    cluster.abort(id); cluster.stats(); cluster.shutdown()

Where things happen: `bootstrap` (placement, weights, heap, preflight: `preflight`), `actors`
(one per instance; its engine runs on a `step_loop` thread; engines built by `engines`),
`router` (request entry, page reservation, streaming, leases, failures; state in `requests`;
where each request goes: `placer`, over `placement`'s step-time model and `affinity`),
`cluster` (the caller's handle), `cli` (the `disagg` command), `demo` (`make demo`). Only this
package imports ray.
"""

from disagg.cluster.cluster import Cluster
from disagg.cluster.outputs import Completion, RequestMetrics, StreamDelta

__all__ = ["Cluster", "Completion", "RequestMetrics", "StreamDelta"]
