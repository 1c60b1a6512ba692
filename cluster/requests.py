"""A request's state in the router, and which instance gets the next one.

`Request` records where a request is (queued -> reserving -> prefilling -> decoding -> done in
disaggregated mode; queued -> running -> done colocated), which instances hold it, its deadlines,
and what it has produced. `Picker` chooses an instance per role: least-loaded (prefill: queued
prompt tokens; decode and colocated: reserved + running tokens) or round-robin. Used only by
`disagg.cluster.router`, on the router's event loop.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from disagg.cluster.bootstrap import Instance
from disagg.cluster.outputs import RequestMetrics, StreamDelta

# sink(delta, metrics): called on the router's loop for every delta; metrics only with the last.
Sink = Callable[[StreamDelta, "RequestMetrics | None"], None]

STAGES = ("queued", "reserving", "prefilling", "decoding", "running", "done")


@dataclass
class Request:
    """One request inside the router.

    Attributes:
        request_id: the caller's id (unique among live requests).
        prompt_token_ids: the prompt.
        params: the `SamplingParams`, passed to the engines as is.
        sink: where deltas go (see `Sink`).
        metrics: timings, filled as the request moves.
        stage: one of `STAGES`.
        prefill, decode, colocated: the instances it was placed on (None until placed);
            `holders` says which of them it still depends on.
        dest: the decode reservation (`RecvDest`) handed to the prefill instance, or None.
        deadline: ``time.monotonic()`` after which it is aborted (request_timeout_s), or None.
        lease_deadline: ``time.monotonic()`` after which a reservation whose KV has not landed
            (no first token yet) is failed, or None.
        num_output: tokens produced so far.
        kv_landed: the decode instance produced a token of it: the doorbell rang, so every push
            of the prefill instance landed and the prefill instance has let the request go.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: Any
    sink: Sink
    metrics: RequestMetrics
    stage: str = "queued"
    prefill: Instance | None = None
    decode: Instance | None = None
    colocated: Instance | None = None
    dest: Any = None
    deadline: float | None = None
    lease_deadline: float | None = None
    num_output: int = 0
    kv_landed: bool = False

    @property
    def done(self) -> bool:
        return self.stage == "done"

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    def holders(self) -> list[Instance]:
        """The instances that can still affect this request: the death of one fails it.

        Colocated: its one instance. Disaggregated: the prefill and the decode instance while
        the prompt is with the prefill side (queued there, prefilling, pushing: its first token
        may have come, but until the decode side produced a token its KV may not have landed);
        then the decode instance alone (`kv_landed`).
        """
        if self.colocated is not None:
            return [self.colocated]
        if self.kv_landed:
            return [self.decode]
        return [inst for inst in (self.prefill, self.decode) if inst is not None]


@dataclass
class Picker:
    """Chooses instances by policy; loads are computed from the router's live requests.

    Args:
        policy: "least_loaded" or "round_robin".
    """

    policy: str
    _turns: dict[str, itertools.count] = field(default_factory=dict)

    def order(self, candidates: list[Instance], requests: list[Request]) -> list[Instance]:
        """Live ``candidates`` in the order to try them (best first)."""
        live = [inst for inst in candidates if inst.alive]
        if not live:
            return []
        if self.policy == "round_robin":
            turn = next(self._turns.setdefault(live[0].role, itertools.count()))
            start = turn % len(live)
            return live[start:] + live[:start]
        loads = self.loads(live, requests)
        return sorted(live, key=lambda inst: loads[inst.name])

    def loads(self, instances: list[Instance], requests: list[Request]) -> dict[str, int]:
        """Each of ``instances``' load in tokens, as `order` counts it."""
        loads = {inst.name: 0 for inst in instances}
        for req in requests:
            for inst, tokens in _load_of(req):
                if inst.name in loads:
                    loads[inst.name] += tokens
        return loads


def _load_of(req: Request) -> list[tuple[Instance, int]]:
    """What ``req`` weighs on each instance holding it, tokens."""
    out = []
    if req.prefill is not None and req.stage in ("reserving", "prefilling"):
        out.append((req.prefill, req.prompt_len))  # queued prompt tokens
    for inst in (req.decode, req.colocated):
        if inst is not None and not req.done:
            out.append((inst, req.prompt_len + req.num_output))  # reserved + running tokens
    return out
