"""Migration: a request held by an instance that died goes on, on the survivors.

`RequestFlow.instance_died` (`disagg.cluster.routing.flow`) migrates each request the dead
instance held (`RoutedRequest.holders`) while some instance can still serve it, the way vLLM,
Dynamo and SGLang continue a stream whose worker died: what it held on a surviving instance is
released (a decode reservation a dead prefill instance may still have been pushing into is
quarantined until its lease; a prompt pushing into a dead decode instance is aborted), then
`resume` makes its prompt the prompt and every token already streamed to the caller, its
``max_tokens`` those tokens fewer, and it goes back to the queue head, routed again like a new
request (to the survivors, `degraded_path`, or to a replacement, `cluster.restart`). The
caller's stream goes on from the next token: none repeated, none lost. A prompt the dead
instance had not finished (nothing streamed yet) is simply routed again.

Greedy requests continue with the tokens of an uninterrupted run (the resumed prompt's KV is the
KV those tokens had). So do seeded sampled ones: the engines number a request's draws
(`disagg.engine.sampler`, noise of ``(seed, step)``) from its prompt's end plus
``SamplingParams.draw_offset``, and `resume` raises that offset by the tokens it moves into the
prompt, so the resumed request's next draw is the one the uninterrupted request would have made.
A sampled request without ``SamplingParams.seed`` goes on with a seed its new engines draw.

Each placement of a request has its own id on the engines (`RoutedRequest.engine_id`): the dead
placement's leftovers on a survivor (a quarantined reservation, an aborted push still quiescing)
keep the old id until they are gone, so the next placement is no duplicate there, and their late
outputs are told apart from the new placement's (`request_of`).

A request migrates at most `MAX_MIGRATIONS` times; a death that holds it after that fails it with
`InstanceDied` naming the instance, as does a death that leaves no instance to serve it and no
replacement on its way. Pure Python, no I/O: the request flow's, on the router's event loop.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Hashable, Mapping
from typing import Any

from disagg.cluster.routing.requests import RoutedRequest, Stage
from disagg.sampling import SamplingParams

MAX_MIGRATIONS = 3  # migrations of one request at most: the next death that holds it fails it


def request_of(live: Mapping[Any, RoutedRequest], engine_request_id: Hashable) -> RoutedRequest | None:
    """The live request whose current placement ``engine_request_id`` names (an engine's output
    row); None for an ended request or a placement it migrated away from."""
    request_id, num_migrations = engine_request_id, 0
    if isinstance(engine_request_id, tuple) and len(engine_request_id) == 2:
        request_id, num_migrations = engine_request_id
    req = live.get(request_id)
    return req if req is not None and req.num_migrations == num_migrations else None


def can_migrate(req: RoutedRequest) -> bool:
    """``req`` has migrated fewer than `MAX_MIGRATIONS` times."""
    return req.num_migrations < MAX_MIGRATIONS


def resume(req: RoutedRequest) -> None:
    """Make ``req``'s next placement continue its stream (module docstring): its prompt gains the
    tokens streamed since its last migration, ``max_tokens`` loses them and ``draw_offset`` gains
    them (its seeded draws go on where they stopped), its engine id is a new one, and it is
    QUEUED with no instance, no reservation, nothing produced by any placement. The caller took
    it out of the ledger and released what it held (with the old engine id)."""
    streamed = req.output_token_ids[req.num_resumed_tokens:]
    params = req.params if req.params is not None else SamplingParams()
    assert params.max_tokens > len(streamed), (
        f"request {req.request_id!r}: a live request has fewer tokens streamed ({len(streamed)}) than max_tokens")
    req.prompt_token_ids = req.prompt_token_ids + streamed
    req.params = dataclasses.replace(params, max_tokens=params.max_tokens - len(streamed),
                                     draw_offset=params.draw_offset + len(streamed))
    req.num_resumed_tokens = len(req.output_token_ids)
    req.num_migrations += 1
    req.stage = Stage.QUEUED
    req.prefill = req.decode = req.colocated = req.dest = req.stale_end = None
    req.lease_deadline = req.first_token_at = None
    req.num_output, req.kv_landed, req.cached_tokens = 0, False, 0
