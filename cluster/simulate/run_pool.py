"""The planner's worker pool: every candidate's goodput search (`rate_search`) judged in one pool of
``jobs`` processes (`plan.plan` with ``--jobs`` above 1), each simulated run one task of one core.

Which run a free core takes: the waiting run of the search whose runs have taken longest so far
(its chain of runs, each asked after the last one's verdict, is the one that ends the plan), a
search not yet timed before any, in search order; with no run waiting, one that a search may ask next
(its next rates under each verdict of the rates it waits for, `next_rates`): asked then, it is
already under way or done. A run's result is a function of its candidate and rate alone, and a
search hears only the rates it asked, in the order it asked them, so every goodput, attainment
and cut is the one of the searches run one after the other. Runs in the planner's process; the
workers fork from a server that imported only the run function's module (`worker_pool`).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import math
import time
from collections.abc import Callable, Generator, Sequence
from dataclasses import dataclass, field
from typing import Any

# A search is sent attainments it compares with its target only: these stand for a held and a
# missed run when `next_rates` asks what it would ask after them.
HELD, MISSED = math.inf, -math.inf
# `next_rates`: the verdicts of at most this many of the rates a search waits for are guessed
# (2^n next batches); the rest of a wider batch are taken as missed.
GUESSED_RATES = 3

Run = tuple[float, bool]  # a run's (attainment, stopped early): `plan.rate_attainment`


@dataclass
class Search:
    """One candidate's search in the pool: ``make`` starts it afresh (the same search every time:
    `rate_search` is a function of what it is sent), ``sent`` what it has been sent, ``asked``
    the rates it waits for, ``judged`` its runs' results by rate (asked or guessed), ``taken``
    the rates submitted (judged or running), ``seconds`` its runs' times."""

    make: Callable[[], Generator[list[float], list[float], float]]
    sent: list[list[float]] = field(default_factory=list)
    asked: list[float] = field(default_factory=list)
    judged: dict[float, Run] = field(default_factory=dict)
    taken: set[float] = field(default_factory=set)
    seconds: list[float] = field(default_factory=list)
    live: Generator[list[float], list[float], float] | None = None

    def start(self) -> None:
        self.live = self.make()
        self.asked = next(self.live)

    def send(self, attainments: list[float]) -> float | None:
        """Send the attainments of ``asked``; its goodput when the search ended, else None (it
        asks its next rates)."""
        self.sent.append(attainments)
        try:
            self.asked = self.live.send(attainments)
        except StopIteration as end:
            self.asked, self.live = [], None
            return end.value
        return None

    def next_rates(self) -> list[float]:
        """The rates it would ask next under each verdict of the asked rates not yet judged (held
        first), replayed on a fresh search: none where every verdict ends it."""
        judged = self.judged
        unknown = [rate for rate in self.asked if rate not in judged][:GUESSED_RATES]
        out: list[float] = []
        for guess in itertools.product((HELD, MISSED), repeat=len(unknown)):
            guessed = dict(zip(unknown, guess))
            attainments = [judged[r][0] if r in judged else guessed.get(r, MISSED) for r in self.asked]
            replay = self.make()
            try:
                next(replay)
                for sent in self.sent:
                    replay.send(sent)
                out += [rate for rate in replay.send(attainments) if rate not in out]
            except StopIteration:
                continue
        return out

    def priority(self, order: int) -> tuple[float, int]:
        """The sort key of its runs: a search not yet timed first, then the longest mean run, then
        the search order."""
        return (-sum(self.seconds) / len(self.seconds) if self.seconds else -math.inf, order)


def worker_pool(workers: int, module: str) -> concurrent.futures.ProcessPoolExecutor:
    """A pool of ``workers`` processes, forked from a server process that has imported ``module``
    and nothing of the caller's (``forkserver``, where the platform has it; else spawned). Forked
    from the caller itself, a worker would share its heap and its threads: a run's full collection
    (`run.collections_deferred`) would then copy every page it inherited, and would run the
    finalizers of the caller's garbage in it, Ray's handles among them, which then speak on the
    caller's connections."""
    import multiprocessing

    if "forkserver" in multiprocessing.get_all_start_methods():
        context = multiprocessing.get_context("forkserver")
        context.set_forkserver_preload([module])
    else:
        context = multiprocessing.get_context("spawn")
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=context)


def search_in_pool(searches: Sequence[Search], run: Callable[..., Run], args: Sequence[tuple], kwargs: dict[str, Any],
                   jobs: int, on_run: Callable[[int, float, Run], float], on_end: Callable[[int, float], None],
                   pool: concurrent.futures.Executor | None = None) -> None:
    """Run every search of ``searches`` to its end, ``jobs`` runs at a time (module docstring):
    search i's run at a rate is ``run(*args[i], rate, **kwargs)``. Each asked rate's run goes to
    ``on_run(i, rate, run)`` (in the order the search asked them), which returns the attainment the
    search is sent; each search's goodput to ``on_end(i, goodput)`` as it ends. ``pool``: the
    executor of at least ``jobs`` workers (default `worker_pool`), shut down at the end, the runs
    no search asked stopped."""
    if pool is None:
        pool = worker_pool(jobs, run.__module__)
    running: dict[concurrent.futures.Future, tuple[int, float, float]] = {}
    try:
        for search in searches:
            search.start()
        while any(search.live is not None for search in searches):
            _fill(searches, running, jobs, lambda i, rate: pool.submit(run, *args[i], rate, **kwargs))
            done, _ = concurrent.futures.wait(running, return_when=concurrent.futures.FIRST_COMPLETED)
            for future in done:
                i, rate, began = running.pop(future)
                searches[i].judged[rate] = future.result()
                searches[i].seconds.append(time.monotonic() - began)
            for i, search in enumerate(searches):
                while search.live is not None and all(rate in search.judged for rate in search.asked):
                    goodput = search.send([on_run(i, rate, search.judged[rate]) for rate in search.asked])
                    if goodput is not None:
                        on_end(i, goodput)
    finally:
        _stop(pool, bool(running))


def _fill(searches: Sequence[Search], running: dict, jobs: int,
          submit: Callable[[int, float], concurrent.futures.Future]) -> None:
    """Submit runs while fewer than ``jobs`` run: the asked ones by priority, then the next rates."""
    live = sorted((i for i, s in enumerate(searches) if s.live is not None), key=lambda i: searches[i].priority(i))
    asked = ((i, rate) for i in live for rate in searches[i].asked)
    guessed = ((i, rate) for i in live for rate in searches[i].next_rates())
    for i, rate in itertools.chain(asked, guessed):
        if len(running) >= jobs:
            return
        if rate not in searches[i].taken:
            searches[i].taken.add(rate)
            running[submit(i, rate)] = (i, rate, time.monotonic())


def _stop(pool: concurrent.futures.Executor, guessing: bool) -> None:
    """Shut ``pool`` down; runs still going (guessed ones no search asked, or an error's siblings)
    are stopped, not waited for (a process pool's `terminate_workers` where Python has it, 3.14;
    else its processes, which the pool then reaps; a thread pool's run to their end)."""
    if guessing:
        terminate = getattr(pool, "terminate_workers", None)
        if terminate is not None:
            terminate()
            return
        for process in list((getattr(pool, "_processes", None) or {}).values()):
            process.terminate()
    pool.shutdown(wait=True, cancel_futures=True)
