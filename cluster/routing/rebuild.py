"""Rebuilding the fleet's data plane after a death (`cluster.rebuild`): back to full strength.

NVSHMEM fixes a heap's PEs when it is made: a replacement (`disagg.cluster.routing.restart`)
serves outside it, and a survivor can neither leave it (its finalize does not return once a PE
died) nor join another. Full strength (every prefill instance pushing to every decode instance)
needs every member restarted into one new heap. `Rebuilder` does that for a prefill + decode
fleet that lost an instance, in three phases (``phase``) and a swap, failing no accepted request:

1. ``waiting``: ``cluster.rebuild_after_s`` from the first death, the survivors (and a
   replacement, once it serves) serve degraded; later deaths fold into this one rebuild.
2. ``draining``: the router holds its queue (new requests wait there; replacements under way
   are given up) while the requests in flight finish, for at most ``cluster.rebuild_drain_s``
   (longer for one at its migration bound, `MAX_MIGRATIONS`, which could not migrate: the
   drain waits for it to end).
3. ``restarting``: those still in flight migrate (`disagg.cluster.routing.migration`: queued
   again with the tokens they streamed); every old actor is killed (no heap is closed: the
   finalize would hang) and its placement group freed; `start_fleet` starts a fresh fleet of the
   same config, one heap over every rank, on a worker thread.
4. The router adopts it (`Router.adopt`: same instance names, new actors) and releases its queue.

Unavailability (admission held) is the drain plus the fresh fleet's start; on GPUs the two
cannot overlap, as the new fleet needs the old one's GPUs. A start that fails is tried again
after ``cluster.restart_backoff_s`` (doubled each time), up to ``cluster.restart_limit`` starts
per rebuild; past it nothing serves and the queued requests fail `NoLiveInstance`. Rebuilds over
the fleet's life are bounded by ``cluster.restart_limit`` too. Runs on the router's event loop.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol

from disagg.cluster.routing.migration import can_migrate
from disagg.cluster.routing.requests import RoutedRequest, Stage
from disagg.config import ClusterSection

if TYPE_CHECKING:
    from disagg.cluster.launch.bootstrap import Fleet

logger = logging.getLogger(__name__)

DRAIN_POLL_S = 0.02  # how often the drain looks whether the requests in flight have finished
WAIT_POLL_S = 0.05  # how often the waiting phase looks at its deadline
PHASES = ("waiting", "draining", "restarting")


class Rebuilt(Protocol):
    """What a rebuild drives: the router (`disagg.cluster.routing.router.Router`)."""

    requests: dict[str, RoutedRequest]  # the live requests, by id

    def migrate_all(self, reason: str) -> int:
        """Migrate every placed request off the fleet (queued again); return how many."""

    def adopt(self, fleet: Fleet | None) -> None:
        """Serve on ``fleet`` from now on and release the queue (None: no fleet started; the
        queued requests fail, as nothing serves)."""


class Rebuilder:
    """The fleet's rebuilds (module docstring); `schedule` at each death.

    Args:
        router: what the rebuild drives (`Rebuilt`).
        fleet: the router's fleet: killed, and its config started afresh (its actors' class and
            environment), at each rebuild.
        section: the cluster section (``rebuild_after_s``, ``rebuild_drain_s``,
            ``restart_backoff_s``, ``restart_limit``).
        on_hold: called when admission is held (the drain begins): the router gives up its
            replacements under way.

    Attributes:
        phase: None at full strength, else one of `PHASES`.
        rebuilds: rebuilds begun over the fleet's life.
        last: the latest finished rebuild's seconds (``recovery_s``: first death to full
            strength; ``unavailable_s``: admission held; ``drain_s``, ``kill_s`` (the old actors
            killed), ``start_s`` (the fresh fleet started)), ``migrated``
            (requests moved to the new fleet) and ``starts`` (fleet starts it took).
    """

    def __init__(self, router: Rebuilt, fleet: Fleet, section: ClusterSection, on_hold: Callable[[], None]) -> None:
        self.router, self.fleet, self.section, self.on_hold = router, fleet, section, on_hold
        self.phase: str | None = None
        self.rebuilds = 0
        self.last: dict[str, Any] | None = None
        self.stopped = False
        self.died_at: float | None = None

    @property
    def holds(self) -> bool:
        """Admission is held: the router's queue waits for the new fleet."""
        return self.phase in ("draining", "restarting")

    @property
    def restarting(self) -> bool:
        """The fleet is being started: a request no instance can serve waits for it."""
        return self.phase is not None

    def schedule(self, now: float) -> Any | None:
        """A death at ``now``: the coroutine of a new rebuild (its caller runs it on the router's
        loop), or None when one is under way already (the death folds into it), the router
        stopped, or ``cluster.restart_limit`` rebuilds were made."""
        if self.stopped or self.phase is not None:
            return None
        if self.rebuilds >= self.section.restart_limit:
            logger.error("no rebuild: cluster.restart_limit (%d) rebuilds made; the fleet serves degraded",
                         self.section.restart_limit)
            return None
        self.rebuilds += 1
        self.phase, self.died_at = "waiting", now
        return self._run(now)

    async def _run(self, died_at: float) -> None:
        section = self.section
        try:
            logger.warning("the fleet is rebuilt in %.1f s (cluster.rebuild_after_s); the survivors serve degraded "
                           "meanwhile", section.rebuild_after_s)
            while time.monotonic() < died_at + self.section.rebuild_after_s:  # read each turn: it may change
                await asyncio.sleep(WAIT_POLL_S)
            self.phase, held_at = "draining", time.monotonic()
            self.on_hold()
            logger.warning("rebuilding the fleet: new requests queue; %d in flight drain for at most %.1f s "
                           "(cluster.rebuild_drain_s)", self._placed()[0], section.rebuild_drain_s)
            deadline = held_at + section.rebuild_drain_s
            while True:
                placed, pinned = self._placed()
                if not placed or not pinned and time.monotonic() >= deadline:
                    break
                await asyncio.sleep(DRAIN_POLL_S)
            self.phase, drained_at = "restarting", time.monotonic()
            migrated = self.router.migrate_all("stopped for the fleet's rebuild (cluster.rebuild)")
            await asyncio.to_thread(self.fleet.kill)
            killed_at = time.monotonic()
            fleet, starts = await self._start()
            self.phase = None  # before the queue goes: the dispatcher holds it while a phase is on
            self.router.adopt(fleet)
            if fleet is None:
                return
            done_at = time.monotonic()
            self.last = {"recovery_s": round(done_at - died_at, 3), "unavailable_s": round(done_at - held_at, 3),
                         "drain_s": round(drained_at - held_at, 3), "kill_s": round(killed_at - drained_at, 3),
                         "start_s": round(done_at - killed_at, 3),
                         "migrated": migrated, "starts": starts}
            logger.warning("the fleet is rebuilt: full strength %.1f s after the death (%.1f s holding new "
                           "requests: %.1f s draining, %.1f s restarting; %d requests migrated)",
                           done_at - died_at, done_at - held_at, drained_at - held_at, done_at - drained_at,
                           migrated)
        finally:
            self.phase = None

    async def _start(self) -> tuple[Any | None, int]:
        """Start a fresh fleet, retried after the backoff up to the limit: (fleet or None, starts)."""
        section = self.section
        for attempt in range(1, max(1, section.restart_limit) + 1):
            if self.stopped:
                return None, attempt - 1
            if attempt > 1:
                await asyncio.sleep(section.restart_backoff_s * 2 ** (attempt - 2))
            try:
                fleet = await asyncio.to_thread(self._start_once)
            except Exception as err:  # a failed start is one of the limit's
                logger.error("the rebuilt fleet did not start (start %d of %d): %s", attempt,
                             max(1, section.restart_limit), err)
                continue
            return fleet, attempt
        logger.error("the fleet could not be rebuilt (cluster.restart_limit starts failed): nothing serves")
        return None, max(1, section.restart_limit)

    def _start_once(self) -> Any | None:
        """On a worker thread: start the fleet; stop it again when the router stopped meanwhile."""
        from disagg.cluster.launch.bootstrap import start_fleet  # ray: imported where a fleet starts

        old = self.fleet
        fleet = start_fleet(old.config, old.actor_class, old.env)
        if self.stopped:  # nobody would stop it: Ray stays up (the old fleet's to shut down)
            fleet.started_ray = False
            fleet.stop()
            raise RuntimeError("the router stopped while the fleet was rebuilt")
        return fleet

    def _placed(self) -> tuple[int, int]:
        """(live requests placed on an instance, those of them at their migration bound)."""
        placed = [req for req in self.router.requests.values() if req.stage != Stage.QUEUED]
        return len(placed), sum(not can_migrate(req) for req in placed)

    def snapshot(self) -> dict[str, Any]:
        """The phase, the rebuilds begun, the latest one's figures (`last`)."""
        return {"phase": self.phase, "rebuilds": self.rebuilds, "last": self.last}


class Starting:
    """The names of what is being started (`Placer.restarting`): replacements under way
    (`Restarter.pending`) and, while a rebuild is, every instance of the fleet."""

    def __init__(self, pending: set[str], rebuild: Rebuilder | None, instances: list) -> None:
        self.pending, self.rebuild, self.instances = pending, rebuild, instances

    def _all(self) -> set[str]:
        rebuilding = self.rebuild is not None and self.rebuild.restarting
        return self.pending | {inst.name for inst in self.instances} if rebuilding else set(self.pending)

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._all()))

    def __len__(self) -> int:
        return len(self._all())

    def __contains__(self, name: object) -> bool:
        return name in self._all()
