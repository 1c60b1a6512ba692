"""`decide`: the adaptive placement's choice for one prompt, a fold over the named rules.

Predict every path (`predict`), judge each by the admission rules (`admission.admit`), take one of the
admissible by `router.adaptive_prefer` (`choose.CHOOSERS`), or, none admissible, fall back by
`router.adaptive_overload` (`overload.FALLBACKS`). Called by the `Placer` for each request of an
adaptive fleet; pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from disagg.cluster.routing.placement.admission import (Judging, admit, fits, sparing_prefills, spares_expected_pushes,
                                                        tpot_bound)
from disagg.cluster.routing.placement.choose import CHOOSERS
from disagg.cluster.routing.placement.overload import FALLBACKS
from disagg.cluster.routing.placement.prediction import Prediction, Targets, predict
from disagg.cluster.routing.placement.view import InstanceView


@dataclass(frozen=True)
class Decision:
    """The chosen path (None: no instance has the pages; wait) and every prediction behind it."""

    chosen: Prediction | None
    predictions: tuple[Prediction, ...]

    @property
    def path(self) -> str | None:
        return None if self.chosen is None else self.chosen.path

    def as_row(self) -> dict:
        """The decision as plain data (the router's stats): the chosen path and each candidate's
        predictions (ms)."""
        return {"path": self.path,
                "candidates": [{"path": p.path, "prefill": p.prefill, "decode": p.decode,
                                "ttft_ms": round(p.ttft_s * 1e3, 3), "tpot_ms": round(p.tpot_s * 1e3, 3),
                                "margin": round(p.margin, 3), "admissible": p.admissible, "why": p.why}
                               for p in self.predictions]}


def decide(prompt_len: int, prefills: list[InstanceView], decodes: list[InstanceView],
           targets: Targets = Targets(), cached: Mapping[str, int] | None = None) -> Decision:
    """Choose a path for a prompt of ``prompt_len`` tokens by the rules of the package docstring.

    Args:
        prompt_len: the prompt's tokens (>= 1).
        prefills, decodes: the live instances of each role.
        targets: the SLOs and preferences; without a TPOT target the bound is `TPOT_SLACK` x the
            remote step.
        cached: instance name -> the prompt's tokens believed cached there (`predict`).

    Returns:
        The `Decision`; ``chosen`` is None when no instance has the pages for it.
    """
    judging = Judging.of(prompt_len, prefills, decodes, targets, cached)
    candidates = predict(prompt_len, prefills, decodes, cached, sparing_prefills(prefills, judging))
    judging = replace(judging, bound=tpot_bound(candidates, judging))
    judged, judging = spares_expected_pushes([admit(c, judging) for c in candidates], decodes, judging)
    ok = [c for c in judged if c.admissible]
    if ok:
        return Decision(CHOOSERS[targets.prefer](ok, judging), tuple(judged))
    fitting = [c for c in judged if fits(c, judging.views, prompt_len)]
    if not fitting:
        return Decision(None, tuple(judged))
    return Decision(FALLBACKS[targets.overload](fitting, judged, judging), tuple(judged))
