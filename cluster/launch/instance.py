"""One instance of the fleet as the router and the simulator see it: a name, a role, a handle.

`Instance` is what the placement orders (`disagg.cluster.routing.requests.Picker`), what a request
records as its prefill, decode or colocated instance, and what the request flow
(`disagg.cluster.routing.flow`) tells its driver to call. Its ``actor`` is a Ray actor handle in the
router (`disagg.cluster.launch.bootstrap` starts it) and a `SimInstance` in the simulator; this module
imports neither, so the placement and the simulator import no ray.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class Rank:
    """One rank of a tensor-parallel instance: its actor, its PE, its device."""

    rank: int
    actor: Any
    pe: int | None = None
    device: str | None = None


@dataclass
class Instance:
    """One actor of the fleet, as the router sees it.

    Attributes:
        name: "prefill-0", "decode-1", "colocated-0", ...
        role: "prefill", "decode" or "colocated".
        actor: the Ray actor handle (the simulator's: its `SimInstance`); a tensor-parallel
            instance's rank 0, the only rank the router calls.
        pe: its PE in the symmetric heap (rank 0's; None for colocated instances).
        info: what it reported at load (`engines.describe`).
        alive: False once it died or its engine failed; never routed to again.
        error: why it is not alive.
        ranks: a tensor-parallel instance's ranks, rank 0 first (empty: one rank, ``actor``).
        bundles: each rank's placement-group bundle index, rank 0 first (a replacement starts
            in its dead instance's bundles: the same GPU or share of one).
        replaced_by: the name of the instance started in its place once it died (`cluster.restart`).
    """

    name: str
    role: str
    actor: Any
    pe: int | None = None
    info: dict = field(default_factory=dict)
    alive: bool = True
    error: str | None = None
    ranks: list[Rank] = field(default_factory=list)
    bundles: list[int] = field(default_factory=list)
    replaced_by: str | None = None

    @property
    def tensor_parallel(self) -> int:
        """Ranks (GPUs, or shares of one) this instance runs on."""
        return max(1, len(self.ranks))

    @property
    def actors(self) -> list[Any]:
        """Every rank's actor, rank 0 first."""
        return [rank.actor for rank in self.ranks] if self.ranks else [self.actor]

    def rank_entries(self) -> list[dict]:
        """``Cluster.stats()``'s ``ranks``: each rank's number, PE and device."""
        if not self.ranks:
            return [{"rank": 0, "pe": self.pe, "device": self.info.get("device")}]
        return [{"rank": r.rank, "pe": r.pe, "device": r.device} for r in self.ranks]

    def label(self) -> str:
        """How logs and errors name it: its role, name and PE (``decode instance decode-0 (PE 1)``)."""
        return f"{self.role} instance {self.name}" + (f" (PE {self.pe})" if self.pe is not None else "")
