"""One instance of the fleet as the router and the simulator see it: a name, a role, a handle.

`Instance` is what the placement orders (`disagg.cluster.routing.requests.Picker`), what a request
records as its prefill, decode or colocated instance, and what the request flow
(`disagg.cluster.routing.flow`) tells its driver to call. Its ``actor`` is a Ray actor handle in the
router (`disagg.cluster.launch.bootstrap` starts it) and a `SimEngine` in the simulator; this module
imports neither, so the placement and the simulator import no ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Instance:
    """One actor of the fleet, as the router sees it.

    Attributes:
        name: "prefill-0", "decode-1", "colocated-0", ...
        role: "prefill", "decode" or "colocated".
        actor: the Ray actor handle (the simulator's: its `SimEngine`).
        pe: its PE in the symmetric heap (None for colocated instances).
        info: what it reported at load (`engines.describe`).
        alive: False once it died or its engine failed; never routed to again.
        error: why it is not alive.
    """

    name: str
    role: str
    actor: Any
    pe: int | None = None
    info: dict = field(default_factory=dict)
    alive: bool = True
    error: str | None = None

    def label(self) -> str:
        """How logs and errors name it: its role, name and PE (``decode instance decode-0 (PE 1)``)."""
        return f"{self.role} instance {self.name}" + (f" (PE {self.pe})" if self.pe is not None else "")
