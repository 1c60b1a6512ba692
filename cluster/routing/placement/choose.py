"""Which admissible path is taken: the choosers of `router.adaptive_prefer`.

`CHOOSERS` maps each `router.adaptive_prefer` value to a function of the admissible candidates
and the decision's `Judging` that returns the one taken: `prefer_fastest` (the lowest predicted
TTFT, near-ties by `PREFERENCE`), `prefer_remote` (a push that holds the TTFT target) and
`prefer_balanced` (the fastest, whose decode a loaded decode instance hands to a prefill
instance: `decode_on_prefill`). Pure functions, no I/O.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from disagg.cluster.routing.placement.admission import Judging
from disagg.cluster.routing.placement.prediction import Prediction, Targets
from disagg.cluster.routing.placement.view import InstanceView

# Near-equal TTFTs (within the model's error margin) go to the path that disturbs least: local
# (admissible only when it slows no running decode step beyond the bound, it uses a decode
# instance's spare compute and needs no transfer), then remote, then kept.
PREFERENCE = ("local", "remote", "kept")
# `router.adaptive_prefer: balanced`: the fastest path decoding on a decode instance gives way to
# keeping the decode on the prefill instance while the decode instance's predicted TPOT is past
# this share of the TPOT target and the kept prompt's TTFT plus one of the prefill instance's
# decode steps is within this share of the TTFT target (`decode_on_prefill`). Measured:
# benchmarks/records/headline-h200x2-2026-11-28b/.
KEEP_SHARE = 0.5


def fastest(ok: list[Prediction]) -> Prediction:
    """The admissible path of the lowest predicted TTFT, near-ties by `PREFERENCE`: the paths
    within their model's margin of the best (and whatever is faster than one that is: a path
    predicted sooner and surer must not lose to a slower one for its wider margin) give the
    path, and the fastest candidate of that path is taken (even one whose own smaller margin left
    it out: an uncertain instance's prediction must not win over a surer, faster one)."""
    best = min(c.ttft_s for c in ok)
    cutoff = max(c.ttft_s for c in ok if c.ttft_s <= best * (1.0 + c.margin))
    near = [c for c in ok if c.ttft_s <= cutoff]
    path = min(near, key=lambda c: (PREFERENCE.index(c.path), c.ttft_s)).path
    return min((c for c in ok if c.path == path), key=lambda c: c.ttft_s)


def remote_within_targets(ok: list[Prediction], targets: Targets) -> Prediction | None:
    """The fastest admissible push when there is a TTFT target, else None. A TTFT under its
    target earns nothing: the split's own path while it holds the targets; local and kept
    borrow the other phase's instance for the requests it cannot serve."""
    remote = [c for c in ok if c.path == "remote"]
    if remote and targets.ttft_s is not None:
        return min(remote, key=lambda c: c.ttft_s)
    return None


def decode_on_prefill(prompt_len: int, chosen: Prediction, ok: list[Prediction], views: Mapping[str, InstanceView],
                      targets: Targets) -> Prediction | None:
    """The admissible kept candidate that ``chosen`` (the fastest path, remote or local: decoding
    on a decode instance) gives way to under `router.adaptive_prefer: balanced`, or None.

    With a TPOT target, when the decode instance's predicted TPOT is past `KEEP_SHARE` of it, a
    prefill instance's is lower, and the TTFT target (if any) has room for one of that prefill
    instance's decode steps ahead of a prompt (its decodes delay every prompt after them, so a
    strict TTFT keeps it a pure prefill instance). Kept need not tie ``chosen`` for TTFT: a TTFT
    under its target earns nothing, and near-ties alone would leave the prefill instance idle."""
    if targets.tpot_s is None or chosen.path == "kept":
        return None
    decode_side = chosen.tpot_s - chosen.seat_tpot_s  # D's decode speed, not its seat wait
    kept = [c for c in ok if c.path == "kept"]
    if not kept or decode_side <= KEEP_SHARE * targets.tpot_s:
        return None
    best = min(kept, key=lambda c: c.tpot_s)
    if best.tpot_s >= decode_side:
        return None
    if targets.ttft_s is None:
        return best
    room = KEEP_SHARE * targets.ttft_s
    if decode_side * (1.0 + chosen.margin) > targets.tpot_s:
        # Within its model's error of the TPOT target the decode instance's requests may miss
        # it; one kept here will not, and the TTFT target itself bounds the prompts its steps
        # delay.
        room = targets.ttft_s
    step = views[best.prefill].decode_step_s(1, prompt_len)
    return best if best.ttft_s + step <= room else None


def prefer_fastest(ok: list[Prediction], judging: Judging) -> Prediction:
    """`router.adaptive_prefer: fastest`: `fastest`."""
    return fastest(ok)


def prefer_remote(ok: list[Prediction], judging: Judging) -> Prediction:
    """`router.adaptive_prefer: remote`: `remote_within_targets`, else `fastest`. Wins where the
    decode side is the bottleneck, loses where the prefill side is."""
    return remote_within_targets(ok, judging.targets) or fastest(ok)


def prefer_balanced(ok: list[Prediction], judging: Judging) -> Prediction:
    """`router.adaptive_prefer: balanced` (the default): `fastest`, unless it gives way to a kept
    path (`decode_on_prefill`)."""
    chosen = fastest(ok)
    return decode_on_prefill(judging.prompt_len, chosen, ok, judging.views, judging.targets) or chosen


CHOOSERS: dict[str, Callable[[list[Prediction], Judging], Prediction]] = {
    "fastest": prefer_fastest, "remote": prefer_remote, "balanced": prefer_balanced}
