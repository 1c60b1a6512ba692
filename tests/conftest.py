"""Shared pytest set-up: GPU markers skip with a reason when the hardware is absent, and one local
Ray for the modules that ask for it (`ray_local`).

``multigpu`` tests run two or more instances (Ray actors, NVSHMEM PEs): on one GPU per instance
where two GPUs are visible, else on one GPU shared by all of them (Ray fractional GPUs; NVSHMEM's
limited multi-process mode), so the whole NVSHMEM path is testable on any single GPU. The
``gpu_share`` fixture says which. ``two_gpus`` tests need two physical GPUs (bandwidth, NVLink).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest

# One intra-op thread per process (before anything imports torch; Ray's actors and the tests'
# subprocesses inherit it): with more, the test process and the fleets' actors oversubscribe a
# two-core CI machine, and a test beside a busy fleet runs tens of times slower.
os.environ.setdefault("OMP_NUM_THREADS", "1")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load_benchmark(name: str) -> ModuleType:
    """``benchmarks/<name>.py`` imported as module ``name`` (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses of the script resolve their module
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def benchmark_script():
    """`load_benchmark`, for tests of the scripts under benchmarks/."""
    return load_benchmark


def _num_cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@dataclass(frozen=True)
class GpuShare:
    """How a multigpu test places its instances.

    Attributes:
        ray_num_gpus: GPUs to give ``ray.init``.
        per_actor: ``num_gpus`` of each instance actor (1.0, or 0.5 when two share one GPU).
        shared: True when the instances share one GPU (timings then prove nothing).
    """

    ray_num_gpus: int
    per_actor: float
    shared: bool

    @property
    def config_overrides(self) -> dict:
        """Config overrides that place a fleet of two instances this way."""
        return {"instances.gpus_per_instance": self.per_actor} if self.shared else {}


@pytest.fixture(scope="session")
def gpu_share() -> GpuShare:
    """Two instances on two GPUs when two are visible, else both on GPU 0."""
    if _num_cuda_devices() >= 2:
        return GpuShare(ray_num_gpus=2, per_actor=1.0, shared=False)
    return GpuShare(ray_num_gpus=1, per_actor=0.5, shared=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    num_gpus = _num_cuda_devices()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    skip_two = pytest.mark.skip(reason=f"needs two physical CUDA GPUs; {num_gpus} visible")
    for item in items:
        if "two_gpus" in item.keywords and num_gpus < 2:
            item.add_marker(skip_two)
        elif ("gpu" in item.keywords or "multigpu" in item.keywords) and num_gpus < 1:
            item.add_marker(skip_gpu)


# ---------------------------------------------------------------------------------------- Ray
# Starting and stopping a local Ray costs ~4 s; ~15 modules ask for one. `ray_local` starts it
# once and keeps it for the modules that follow in a row; a test that does not ask for it gets no
# Ray of ours (it may start its own, or check that none runs: `pytest_runtest_setup`), except in
# the folders of `KEEPS_RAY`: there the tests without it neither start a Ray in this process nor
# look for one (stand-in fleets; a command in a subprocess starts its own head there), so Ray stays
# up across them for the folder's next module that asks (one start for bench/ and serve/, not three).
RAY_INIT = {"num_cpus": 4, "include_dashboard": False, "log_to_driver": False, "namespace": "disagg-tests"}
KEEPS_RAY = {Path(__file__).parent / "cluster" / "bench", Path(__file__).parent / "cluster" / "serve"}
RELEASE_WAIT_S = 5.0  # a module's fleets are gone; their actors' CPUs come back within this
_ray_ours = False      # the running Ray was started by `ray_local`


def _shutdown_ours() -> None:
    global _ray_ours
    if _ray_ours:
        import gc

        import ray
        # The tests' cyclic garbage that holds Ray handles is freed while Ray still runs: a full
        # collection after the shutdown (a simulated run's, `run.collections_deferred`) would run
        # their finalizers against a Ray that is gone (suspected: a worker lost mid-test).
        gc.collect()
        ray.shutdown()
        _ray_ours = False


@pytest.fixture(scope="module")
def ray_local():
    """A local Ray with 4 logical CPUs, shared by the modules that ask for it in a row.

    At the end of the module every CPU must be free again (its fleets shut down); where one is
    still held (a test failed before its fleet's teardown, say), Ray is stopped so that the next
    module starts on an empty one. With GPUs it is stopped after every module: a
    killed actor's process may still hold its GPU memory when the next module's actors start.
    """
    global _ray_ours
    ray = pytest.importorskip("ray")
    if ray.is_initialized() and not _ray_ours and ray.cluster_resources().get("CPU", 0.0) < RAY_INIT["num_cpus"]:
        # A Ray an earlier test's launch left in this process (an embedded head of os.cpu_count()
        # CPUs): too small for the fleets here (a TP fleet's four ranks would wait for CPUs).
        ray.shutdown()
    if not ray.is_initialized():
        ray.init(**RAY_INIT)
        _ray_ours = True
    yield ray
    if not _ray_ours:
        return  # a Ray the module found running is not ours to judge or stop
    if ray.cluster_resources().get("GPU"):
        _shutdown_ours()
        return
    deadline = time.monotonic() + RELEASE_WAIT_S
    while ray.available_resources().get("CPU", 0.0) < ray.cluster_resources().get("CPU", 0.0):
        if time.monotonic() > deadline:
            _shutdown_ours()
            return
        time.sleep(0.05)


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item: pytest.Item) -> None:
    if "ray_local" not in item.fixturenames and item.path.parent not in KEEPS_RAY:
        _shutdown_ours()


def pytest_sessionfinish(session: pytest.Session) -> None:
    _shutdown_ours()


class LedgerChecks:
    """What the routers of this test session found checking their `Ledger` (`router_ledgers_checked`):
    checks made and the first mismatch of each failed one."""

    def __init__(self) -> None:
        self.count = 0
        self.failures: list[str] = []


LEDGER_CHECKS = LedgerChecks()


@pytest.fixture(autouse=True, scope="session")
def router_ledgers_checked():
    """Every router that runs in this process (the cluster, serve and reliability tests') checks
    its ledger against the sums over its placed requests before each placement and after each end
    (`RequestFlow.check`): a move the request flow missed fails the test that made it
    (`ledger_clean`). A mismatch is recorded, not raised: raised, it would end the router's
    dispatcher, and the test would hang rather than fail."""
    from disagg.cluster.routing.router import Router

    place, place_colocated, end = Router._place, Router._place_colocated, Router._end

    def check(router) -> None:
        LEDGER_CHECKS.count += 1
        try:
            router.flow.check()  # the ledger's sums against those over the placed requests
        except AssertionError as err:
            LEDGER_CHECKS.failures.append(str(err))

    async def checked_place(self, req):
        check(self)
        return await place(self, req)

    def checked_place_colocated(self, req):
        check(self)
        place_colocated(self, req)

    def checked_end(self, req, *args, **kwargs):
        end(self, req, *args, **kwargs)
        check(self)

    Router._place, Router._place_colocated, Router._end = checked_place, checked_place_colocated, checked_end
    yield LEDGER_CHECKS
    Router._place, Router._place_colocated, Router._end = place, place_colocated, end


@pytest.fixture(autouse=True)
def ledger_clean():
    """Fail a test during which a router's ledger check failed (`router_ledgers_checked`)."""
    LEDGER_CHECKS.failures.clear()
    yield
    failures, LEDGER_CHECKS.failures[:] = list(LEDGER_CHECKS.failures), []
    assert not failures, f"{len(failures)} router ledger check(s) failed; the first: {failures[0]}"
