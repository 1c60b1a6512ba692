"""Replacing dead instances (`cluster.restart`): when, under which name, how many times.

The router tells the `Restarter` of each death (`Router._instance_died`); the survivors serve
the dead instance's work meanwhile (`degraded_path`). After a backoff (``restart_backoff_s``,
doubled for each next replacement of the same instance) it starts a replacement in the dead
instance's GPU share (`disagg.cluster.launch.bootstrap.start_replacement`, on a worker thread:
loading and warming up take seconds and the router's loop keeps serving), and hands it to
``on_ready`` on the router's loop, which routes to it from then on. A start that fails is
retried after the next backoff, up to ``restart_limit`` replacements per instance; past it that
instance stays dead and the fleet degraded. A rebuild of the whole fleet
(`disagg.cluster.routing.rebuild`) `cancel`s the replacements under way and pauses new ones
until its fresh fleet serves.

A replacement is no PE of the symmetric heap (its members are fixed once it is made): it is a
colocated instance ("colocated" role) that computes and decodes its own requests. Its name is
the dead instance's with a restart count, ``prefill-0`` -> ``prefill-0r1`` -> ``prefill-0r2``:
a new name, so that what refers to the dead instance (its PE, its error in `Cluster.degraded`,
the requests it failed, the router's sums per instance) never reaches the new actor, and each
request's metrics say which actor served it. Runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import re
import time
from typing import Any, Callable, Coroutine

from disagg.cluster.launch.instance import Instance

logger = logging.getLogger(__name__)

_RESTART_SUFFIX = re.compile(r"r\d+$")

# start(dead, name) -> the replacement, started, loaded and built (blocking)
Start = Callable[[Instance, str], Instance]


def original_name(name: str) -> str:
    """The name of the fleet's instance that ``name`` replaces, at whatever remove
    (``prefill-0r2`` -> ``prefill-0``)."""
    return _RESTART_SUFFIX.sub("", name)


class Restarter:
    """Starts a replacement for each dead instance (module docstring).

    Args:
        start: starts a replacement for a dead instance under a name (blocking; raises on failure).
        backoff_s: seconds before the first replacement of an instance; doubled for each next one.
        limit: replacements per instance of the fleet, at most (failed starts count).

    Attributes:
        restarts: replacements started (or tried) per original instance name.
        pending: names of dead instances whose replacement is being waited for or started.
        recovery_s: per replacement's name, seconds from the death to its serving (``on_ready``).
    """

    def __init__(self, start: Start, backoff_s: float, limit: int) -> None:
        self.start, self.backoff_s, self.limit = start, backoff_s, limit
        self.restarts: collections.Counter[str] = collections.Counter()
        self.pending: set[str] = set()
        self.recovery_s: dict[str, float] = {}
        self.stopped = False
        self.paused = False  # a rebuild is under way: it restarts every instance itself
        self._generation = 0  # bumped by `cancel`: a replacement of an older one gives up

    def replace(self, dead: Instance, on_ready: Callable[[Instance], None]) -> Coroutine | None:
        """The task that replaces ``dead`` (its caller runs it on the router's loop): it waits
        the backoff, starts the replacement off the loop and hands it to ``on_ready``, retried
        while the limit allows; ``dead`` is `pending` from now until it ends. None when the limit
        was reached already."""
        if self.paused:
            return None
        if self.stopped or self.restarts[original_name(dead.name)] >= self.limit:
            logger.error("%s stays dead: cluster.restart_limit (%d) reached; the fleet serves degraded",
                         dead.name, self.limit)
            return None
        self.pending.add(dead.name)
        return self._replace(dead, on_ready, time.monotonic())

    def cancel(self) -> None:
        """Give up every replacement under way (one being started is killed once it is up) and
        start none until `resume`: a rebuild of the fleet restarts every instance itself."""
        self._generation += 1
        self.paused = True
        self.pending.clear()

    def resume(self) -> None:
        """Replace dead instances again (the rebuilt fleet serves)."""
        self.paused = False

    def _cancelled(self, generation: int) -> bool:
        return self.stopped or generation != self._generation

    async def _replace(self, dead: Instance, on_ready: Callable[[Instance], None], died_at: float) -> None:
        slot, generation = original_name(dead.name), self._generation
        try:
            while self.restarts[slot] < self.limit and not self._cancelled(generation):
                self.restarts[slot] += 1
                attempt = self.restarts[slot]
                name = f"{slot}r{attempt}"
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                if self._cancelled(generation):
                    return
                logger.warning("starting %s in the place of %s (restart %d of %d)", name, dead.name, attempt,
                               self.limit)
                try:
                    inst = await asyncio.to_thread(self._start, dead, name, generation)
                except Exception as err:  # a failed start is one of the limit's restarts
                    logger.error("%s did not start: %s", name, err)
                    continue
                if inst is None:  # the router stopped, or a rebuild began, meanwhile
                    return
                self.recovery_s[name] = time.monotonic() - died_at
                dead.replaced_by = name
                logger.warning("%s serves in the place of %s, %.1f s after its death (a colocated instance: no "
                               "KV transfer to or from it until the fleet restarts)", name, dead.name,
                               self.recovery_s[name])
                on_ready(inst)
                return
            if not self._cancelled(generation):
                logger.error("%s stays dead: cluster.restart_limit (%d) reached; the fleet serves degraded",
                             dead.name, self.limit)
        finally:
            if not self._cancelled(generation) or self.stopped:
                self.pending.discard(dead.name)

    def _start(self, dead: Instance, name: str, generation: int) -> Instance | None:
        """On a worker thread: start the replacement; kill it again when the router stopped, or
        a rebuild began, while it started (nobody would route to it, nor stop it)."""
        inst = self.start(dead, name)
        if self._cancelled(generation):
            _kill(inst)
            return None
        return inst

    def snapshot(self) -> dict[str, Any]:
        """Restarts per instance, the ones under way, and each replacement's recovery seconds."""
        return {"restarts": dict(self.restarts), "pending": sorted(self.pending),
                "recovery_s": {name: round(s, 3) for name, s in self.recovery_s.items()}}


def _kill(inst: Instance) -> None:
    import ray

    for actor in inst.actors:
        ray.kill(actor, no_restart=True)
