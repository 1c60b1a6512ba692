"""Two spawned PE processes running `engine_scenarios` steps (the CPU/shm twin of two actors).

Every wait has a timeout, and a group that timed out or lost a worker is killed, so a failure
never hangs CI.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import time
from typing import Any

import engine_scenarios


class StepFailed(AssertionError):
    """A rank raised inside a step; carries its traceback."""


class EngineProcs:
    """``world_size`` spawned processes running `engine_scenarios.worker_loop`."""

    def __init__(self, world_size: int = 2) -> None:
        ctx = mp.get_context("spawn")
        self._inboxes = [ctx.Queue() for _ in range(world_size)]
        self._outbox = ctx.Queue()
        self.procs = [ctx.Process(target=engine_scenarios.worker_loop, args=(r, self._inboxes[r], self._outbox),
                                  daemon=True, name=f"engine-pe{r}") for r in range(world_size)]
        for proc in self.procs:
            proc.start()

    def run(self, step: str, per_rank: dict[int, dict[str, Any]], timeout_s: float = 120.0) -> dict[int, Any]:
        """Run ``step(**kwargs)`` on every rank of ``per_rank`` concurrently; results by rank."""
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
                    raise StepFailed(f"step {step}: workers {dead} died") if dead else \
                        TimeoutError(f"step {step}: no answer within {timeout_s} s")
                continue
            if ok:
                results[rank] = value
            else:
                errors.append(f"--- rank {rank} ---\n{value}")
        if errors:
            raise StepFailed(f"step {step} failed:\n" + "\n".join(errors))
        return results

    def call(self, rank: int, method: str, args: tuple) -> Any:
        return self.run("call", {rank: {"method": method, "args": args}})[rank]

    def close(self, timeout_s: float = 10.0) -> None:
        for inbox in self._inboxes:
            inbox.put(None)
        for proc in self.procs:
            proc.join(timeout=timeout_s)
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
                proc.join(timeout=5)
