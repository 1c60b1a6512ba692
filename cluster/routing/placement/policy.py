"""`router.placement`'s three policies as objects: the paths each takes and what it needs.

    DISAGGREGATED  every prompt on a prefill instance, its KV pushed to a decode instance (remote)
    LOCAL          every prompt on the decode instance that decodes it (local)
    ADAPTIVE       per request remote, local or kept, by `decide` over the predicted step times

Asked, instead of comparing `router.placement`'s string, by the `Placer` (which path a request
takes), the engine builder (which phases each instance warms up for), the simulator (what it
feeds the step-time model) and the planner (which candidates predict against the SLOs).

Whatever the policy, a fleet that lost a whole role serves on the survivors' path
(`degraded_path`): local with no prefill instance left, kept with no decode instance left.
"""

from __future__ import annotations

from dataclasses import dataclass

from disagg.cluster.routing.placement.prediction import PATHS
from disagg.config import RouterSection

DEFAULT_PLACEMENT = RouterSection.model_fields["placement"].default  # one default: the config's


@dataclass(frozen=True)
class PlacementPolicy:
    """One `router.placement` value of a prefill + decode fleet.

    Attributes:
        name: its `router.placement` value.
        paths: the paths its requests may take (`PATHS`' names).
        predicts: it chooses each request's path by the predicted TTFT and TPOT (`decide`): the
            instances' step samples and loads must feed the `FleetModel`, and `router.slo_*` are
            the targets it predicts against.
    """

    name: str
    paths: tuple[str, ...]
    predicts: bool = False

    @property
    def always_local(self) -> bool:
        """Every prompt is computed by the decode instance that decodes it."""
        return self.paths == ("local",)

    @property
    def keeps(self) -> bool:
        """A prefill instance may decode a request it computed (kept): it needs decode graphs."""
        return "kept" in self.paths

    @property
    def mixes_phases(self) -> bool:
        """Some instance runs both phases (local prompts on decode instances, kept decodes on
        prefill instances): every instance warms up for both."""
        return self.paths != ("remote",)


DISAGGREGATED = PlacementPolicy("disaggregated", ("remote",))
LOCAL = PlacementPolicy("local", ("local",))
ADAPTIVE = PlacementPolicy("adaptive", PATHS, predicts=True)
POLICIES = {policy.name: policy for policy in (DISAGGREGATED, LOCAL, ADAPTIVE)}


def degraded_path(prefill_alive: bool, decode_alive: bool) -> str | None:
    """The path every request takes, under every policy, while a prefill + decode fleet has lost
    a whole role: "local" when no prefill instance lives (the decode instances compute their own
    prompts), "kept" when no decode instance lives (the prefill instances decode what they
    compute); a fleet down to one instance so serves as a colocated one. None while both roles
    live (the policy's own paths) or neither does (nothing can serve)."""
    if prefill_alive == decode_alive:
        return None
    return "kept" if prefill_alive else "local"


def policy_of(name: str) -> PlacementPolicy:
    """The policy of `router.placement` ``name``.

    Raises:
        ValueError: ``name`` is not a `router.placement` value.
    """
    try:
        return POLICIES[name]
    except KeyError:
        raise ValueError(f"router.placement: expected one of {', '.join(POLICIES)}, got {name!r}") from None
