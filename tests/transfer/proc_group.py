"""A group of spawned worker processes that run `transfer_scenarios` steps, one per rank.

Each worker keeps its heap, cache and pusher between steps (module state in
`transfer_scenarios`), so a test drives a protocol step by step: the receiver reserves pages and
arms a doorbell, the driver hands the map to the sender, the sender pushes, the receiver checks.
Every wait has a timeout, and a group that timed out is killed, so a failure never hangs CI.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Any

import transfer_scenarios


class StepFailed(AssertionError):
    """A rank raised inside a step; carries its traceback."""


class ProcGroup:
    """``world_size`` spawned processes running `transfer_scenarios.worker_loop`."""

    def __init__(self, world_size: int) -> None:
        ctx = mp.get_context("spawn")
        self.world_size = world_size
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self.procs = [ctx.Process(target=transfer_scenarios.worker_loop, args=(rank, self._inboxes[rank], self._outbox),
                                  daemon=True, name=f"transfer-pe{rank}") for rank in range(world_size)]
        for proc in self.procs:
            proc.start()
        self.broken = False

    def run(self, step: str, per_rank: dict[int, dict[str, Any]], timeout_s: float = 60.0) -> dict[int, Any]:
        """Run ``step(**kwargs)`` on every rank in ``per_rank`` concurrently; return results by rank.

        Raises:
            StepFailed: a rank raised (its traceback is in the message) or a rank died.
            TimeoutError: not every rank answered within ``timeout_s`` (the group is killed).
        """
        for rank, kwargs in per_rank.items():
            self._inboxes[rank].put((step, kwargs))
        results: dict[int, Any] = {}
        errors = []
        deadline = time.monotonic() + timeout_s
        while len(results) + len(errors) < len(per_rank):
            try:
                rank, ok, value = self._outbox.get(timeout=0.2)
            except queue.Empty:
                dead = [p.name for p in self.procs if not p.is_alive()]
                if dead or time.monotonic() > deadline:
                    self.kill()
                    if dead:
                        raise StepFailed(f"step {step}: worker(s) {dead} died")
                    raise TimeoutError(f"step {step}: no answer from every rank within {timeout_s} s")
                continue
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise StepFailed(f"step {step} failed:\n" + "\n".join(errors))
        return results

    def run_all(self, step: str, timeout_s: float = 60.0, **kwargs: Any) -> dict[int, Any]:
        """`run` with the same kwargs on every rank plus ``rank=``."""
        return self.run(step, {r: dict(kwargs, rank=r) for r in range(self.world_size)}, timeout_s)

    def close(self, timeout_s: float = 10.0) -> None:
        """Stop the workers (join with a timeout; kill stragglers)."""
        for inbox in self._inboxes:
            inbox.put(None)
        for proc in self.procs:
            proc.join(timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        self.broken = True
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
