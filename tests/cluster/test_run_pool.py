"""The planner's worker pool (`run_pool.search_in_pool`): the searches' answers, the rates they
hear, the order in which a free core takes runs, and the runs it judges ahead of being asked."""

from __future__ import annotations

import concurrent.futures
import functools
import multiprocessing
import random
import threading
import time

import pytest

from disagg.cluster.simulate import run_pool
from disagg.cluster.simulate.rate_search import max_rate, rate_search


def _knee(knee: float, rate: float) -> float:
    return 1.0 if rate <= knee else 0.0


def _pooled(knees, starts, jobs, *, probe=False, width=1, seconds=None):
    """Every search of ``knees`` (attainment 1 up to its knee, else 0) from ``starts`` in one
    pool of ``jobs`` threads: (goodputs, the rates each heard in order, every run as (search,
    rate, began, ended) in the order they began)."""
    runs, heard, goodputs = [], [[] for _ in knees], {}
    lock = threading.Lock()

    def run(i: int, rate: float) -> run_pool.Run:
        began = time.monotonic()
        if seconds is not None:
            time.sleep(seconds[i])
        with lock:
            runs.append((i, rate, began, time.monotonic()))
        return _knee(knees[i], rate), False

    def on_run(i, rate, result):
        heard[i].append(rate)
        return result[0]

    searches = [run_pool.Search(functools.partial(rate_search, start, width, probe=probe)) for start in starts]
    with concurrent.futures.ThreadPoolExecutor(jobs) as executor:
        run_pool.search_in_pool(searches, run, [(i,) for i in range(len(knees))], {}, jobs, on_run,
                                goodputs.__setitem__, pool=executor)
    return [goodputs[i] for i in range(len(knees))], heard, sorted(runs, key=lambda r: r[2])


@pytest.mark.parametrize("jobs", [1, 2, 3])
def test_the_pool_finds_each_searchs_rate_and_it_hears_only_what_it_asked_in_order(jobs):
    """Whatever the runs guessed ahead, each search's rate is the one-at-a-time search's, and it
    hears exactly the rates that search asks, in its order (a guessed run nobody asked is not
    heard)."""
    rng = random.Random(7)
    for _ in range(6):
        knees = [rng.uniform(1.0, 100.0) for _ in range(3)]
        starts = [rng.uniform(5.0, 50.0) for _ in range(3)]
        probe = rng.random() < 0.5
        goodputs, heard, runs = _pooled(knees, starts, jobs, probe=probe)
        for knee, start, goodput, rates in zip(knees, starts, goodputs, heard):
            asked = []
            assert goodput == max_rate(lambda r: asked.append(r) or _knee(knee, r), start, probe=probe)
            assert rates == asked
        assert {(i, r) for i, rates in enumerate(heard) for r in rates} <= {(i, r) for i, r, *_ in runs}


def test_a_lone_search_runs_its_next_rate_beside_the_one_it_waits_for():
    """Two cores, one search: the idle core runs a rate the search may ask next, so some rate it
    asks began before the run whose verdict it follows had ended; more runs than it asks."""
    (goodput,), (heard,), runs = _pooled([37.0], [10.0], 2, seconds=[0.05])
    assert goodput == max_rate(lambda r: _knee(37.0, r), 10.0)
    assert len(runs) > len(heard)
    began = {rate: b for _, rate, b, _ in runs}
    ended = {rate: e for _, rate, _, e in runs}
    assert any(began[b] < ended[a] for a, b in zip(heard, heard[1:])), (heard, runs)


def test_a_free_core_takes_the_slowest_searchs_waiting_run_first():
    """One core, a slow search and a fast one: once each has a run timed, every waiting run of
    the slow one goes first; the fast one's runs follow when it has ended."""
    goodputs, heard, runs = _pooled([37.0, 37.0], [10.0, 10.0], 1, seconds=[0.05, 0.0])
    assert goodputs[0] == goodputs[1] == max_rate(lambda r: _knee(37.0, r), 10.0)
    searches = [i for i, *_ in runs]
    assert searches[:2] == [0, 1]
    assert searches[2:] == [0] * (len(heard[0]) - 1) + [1] * (len(heard[1]) - 1)


def _failing(rate: float) -> run_pool.Run:
    raise RuntimeError(f"run at {rate} failed")


def _slow_unless_asked(knee: float, asked: frozenset, rate: float) -> run_pool.Run:
    time.sleep(0.01 if rate in asked else 60.0)
    return _knee(knee, rate), False


def test_worker_processes_stop_the_guessed_runs_nobody_asked_and_raise_a_runs_error():
    """In worker processes: every rate the search asks runs in 10 ms, every other in 60 s; the
    search ends while such a guessed run goes on, and the pool stops it instead of waiting. A
    run's error reaches the caller."""
    asked, ended = [], {}
    make = functools.partial(rate_search, 10.0, 1)
    expected = max_rate(lambda r: asked.append(r) or _knee(37.0, r), 10.0)
    began = time.monotonic()
    run_pool.search_in_pool([run_pool.Search(make)], _slow_unless_asked, [(37.0, frozenset(asked))], {}, 2,
                            lambda i, rate, run: run[0], ended.__setitem__, pool=_forked(2))
    assert ended == {0: expected} and time.monotonic() - began < 30.0
    with pytest.raises(RuntimeError, match="failed"):
        run_pool.search_in_pool([run_pool.Search(make)], _failing, [()], {}, 2, lambda i, rate, run: run[0],
                                ended.__setitem__, pool=_forked(2))


def _forked(workers: int) -> concurrent.futures.ProcessPoolExecutor:
    """A process pool forked from this one: this module's functions unpickle in it (the suite
    imports test modules by path, `--import-mode=importlib`, so a forkserver's workers cannot
    import them by name)."""
    return concurrent.futures.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork"))
