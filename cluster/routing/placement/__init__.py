"""Placement: where a request's prompt is computed and where it decodes.

A prefill + decode fleet serves each request on one of three paths:

    remote  a prefill instance P computes the prompt and pushes its KV into pages a decode
            instance D reserved for the prompt and its answer; D decodes it. Costs D's
            reservation round trip, P's queue and the prompt's chunks (stalling the requests P
            keeps), the push, and one more sequence in D's decode steps.
    local   D computes the prompt in chunks beside its running decodes: no transfer, but each
            chunk stalls every decode on D.
    kept    P computes the prompt and decodes it too: no transfer; P's decodes then run beside
            the prompts it computes next.

`router.placement` names the policy (`policy`): `DISAGGREGATED` takes remote, `LOCAL` local,
`ADAPTIVE` chooses per request (`decide`). `predict` prices every candidate path from the
instances' `InstanceView`s: its TTFT (a seat, the step in flight, the queue ahead, the prompt's
chunks past its cached prefix, D's reservation answer, the first token's relay) and its TPOT as
the SLO counts it, a request's mean gap, a stall spread over the tokens it delays. `decide` then
folds the rules:

1. Admit (`admit`: `ADMISSION_RULES` in order, the first refusal is the candidate's ``why``):
   `pages_fit`            D has the pages: the prompt's, and a push's expected answer
   `ttft_within_target`   TTFT within `router.slo_ttft_ms`
   `tpot_within_bound`    TPOT within `router.slo_tpot_ms`; without one, a local or kept
                          prompt stretches no decode step past `TPOT_SLACK` x the remote path's
   `spares_slack`         with a TPOT target, the prompt's chunks leave every request decoding
                          where it is computed, or on its way there, within its TPOT slack (a
                          push also goes through the fastest prefill instance that spares them)
   `spares_expected_pushes`  a local prompt also counts the pushes expected into its stall,
                          where no other decode instance can take them
2. Choose among the admissible by `router.adaptive_prefer` (`choose.CHOOSERS`):
   `prefer_fastest`       the lowest predicted TTFT; near-ties go local, remote, kept (`PREFERENCE`)
   `prefer_remote`        with a TTFT target, the fastest admissible push; else as fastest
   `prefer_balanced`      (the default) as fastest, then `decode_on_prefill`: the decode goes to a
                          kept path while D's predicted TPOT is past `KEEP_SHARE` of the target,
                          P's is lower and the TTFT target has room for P's decode steps
3. None admissible: among the paths whose pages fit, by `router.adaptive_overload`
   (`overload.FALLBACKS`):
   `least_violation`      (the default) the least `violation_cost` (the worst predicted/target
                          ratio, plus one per request whose slack the path breaks) among
                          `avoid_breaking`'s: never a local prompt on a saturated decode
                          instance, nor a path through a prefill instance whose kept requests it
                          breaks, while another path spares them
   `no_push`              the same among the paths that push nothing (`without_pushes`): a push
                          only where nothing else fits
4. No path has the pages: no choice (`Decision.chosen` None); the request waits at the queue head.

A fleet that lost a whole role serves on what is left, whatever the policy (`degraded_path`): no
prefill instance -> every prompt local; no decode instance -> every prompt kept; nothing is
predicted then, there is one path. No instance left of either role: the request fails
(`NoLiveInstance`).

Around the decision: the `Placer` (`placer`) carries the policy out for the router and the
simulator (the picker's order, the prefix affinity, the prefill-queue bound, the routes);
`FleetModel` (`fleet_model`) keeps the router's picture of the instances (step-time models,
loads, `meters`) and builds their views (`view`). docs/placement-notes.md gives the measurement
behind each rule. Pure Python, in the router's (or the simulator's) process.
"""

from disagg.cluster.routing.placement.admission import (ADMISSION_RULES, TPOT_SLACK, Judging, admit, fits, pages_fit,
                                                        slack_breaks, spares_expected_pushes, spares_slack,
                                                        sparing_prefills, stall_past_slack, stalls_past_slack,
                                                        tpot_bound, tpot_within_bound, ttft_within_target)
from disagg.cluster.routing.placement.choose import (CHOOSERS, KEEP_SHARE, PREFERENCE, decode_on_prefill, fastest,
                                                     prefer_balanced, prefer_fastest, prefer_remote,
                                                     remote_within_targets)
from disagg.cluster.routing.placement.decision import Decision, decide
from disagg.cluster.routing.placement.fleet_model import TTFT_MISS_WEIGHT, FleetModel, InstanceWork, tally
from disagg.cluster.routing.placement.meters import (HOP_WINDOW, PUSH_RATE_WINDOW_S, STALL_WINDOW_STEPS, HopMeter,
                                                     RateMeter, StallMeter)
from disagg.cluster.routing.placement.overload import (FALLBACKS, avoid_breaking, least_violation, no_push,
                                                       saturated_decodes, violation, violation_cost, without_pushes)
from disagg.cluster.routing.placement.policy import (ADAPTIVE, DEFAULT_PLACEMENT, DISAGGREGATED, LOCAL, POLICIES,
                                                     PlacementPolicy, degraded_path, policy_of)
from disagg.cluster.routing.placement.prediction import (DEFAULT_OVERLOAD, DEFAULT_PREFER, PATHS, Prediction, Targets,
                                                         cached_tokens, local_tpot, predict, pushed_tpot, running_tpot)
from disagg.cluster.routing.placement.progress import DecodeProgress, ProgressTable
from disagg.cluster.routing.placement.view import HORIZON_SHARE, InstanceView, fleet_tpot_slacks_s

__all__ = [
    "ADAPTIVE", "ADMISSION_RULES", "CHOOSERS", "DEFAULT_OVERLOAD", "DEFAULT_PLACEMENT", "DEFAULT_PREFER",
    "DISAGGREGATED", "FALLBACKS", "HOP_WINDOW", "HORIZON_SHARE", "KEEP_SHARE", "LOCAL", "PATHS", "POLICIES",
    "PREFERENCE", "PUSH_RATE_WINDOW_S", "STALL_WINDOW_STEPS", "TPOT_SLACK", "TTFT_MISS_WEIGHT", "Decision",
    "DecodeProgress", "FleetModel", "HopMeter", "InstanceView", "InstanceWork", "Judging", "PlacementPolicy",
    "Prediction", "ProgressTable", "RateMeter", "StallMeter", "Targets", "admit", "avoid_breaking", "cached_tokens",
    "decide", "decode_on_prefill", "degraded_path", "fastest", "fits", "fleet_tpot_slacks_s", "least_violation",
    "local_tpot", "no_push", "pages_fit", "policy_of", "predict", "prefer_balanced", "prefer_fastest",
    "prefer_remote", "pushed_tpot", "remote_within_targets", "running_tpot", "saturated_decodes", "slack_breaks",
    "spares_expected_pushes", "spares_slack", "sparing_prefills", "stall_past_slack", "stalls_past_slack", "tally",
    "tpot_bound", "tpot_within_bound", "ttft_within_target", "violation", "violation_cost", "without_pushes",
]
