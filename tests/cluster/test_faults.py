"""Faults in the middle of a push, on a prefill + decode fleet: one body per fault, two fleets.

The fleets: tiny-1p1d (CPU actors over the /dev/shm heap, what CI runs) and a Llama-3-8B-shaped
1P1D sharing one GPU over NVSHMEM (``-m multigpu``; two layers, float32, as
tests/cluster/test_cluster_gpu.py). Each fault catches long prompts (several prefill forwards
each) mid-push, with `hooked_actor.HookedInstanceActor.hold_push`: the prefill instance's forward
holds right after its first layer's K/V went out.

- The prefill instance killed mid-push: its requests migrate to the decode instance (local); the
  reservations the dead sender was filling are quarantined until their lease.
- The decode instance killed while pushes land in it (its reservations open): the prefill
  instance's requests migrate to it (kept) once its forward goes on.
- The prefill instance silent past ``router.lease_s``: the requests it was pushing fail with
  `SignalTimeout`; requests handed to it meanwhile (their decode pages may be the ones its held
  forward was writing) complete once its forward goes on.

Each time: nothing hangs (every wait is bounded), the survivors serve new requests, every
request that completed has the tokens of the fleet's colocated twin (greedy, float32), and every
page of a survivor is free once it is idle. The fleets replace no instance
(``cluster.restart: false``).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from dataclasses import dataclass

import pytest
from cluster_helpers import (CONFIGS, BackgroundStream, launch_config, mixed_prompts, reference_tokens,
                             wait_all_free)
from hooked_actor import HookedInstanceActor

from disagg.cluster import Cluster
from disagg.config import Config
from disagg.errors import SignalTimeout
from disagg.sampling import SamplingParams

pytestmark = pytest.mark.timeout(600)

HANG_S = 120.0  # any wait longer than this is a hang


@dataclass(frozen=True)
class Fleet:
    """A prefill + decode fleet under test and how to get its reference tokens.

    Attributes:
        config: ``configs/<config>.yaml``, with ``overrides`` (dotted keys).
        prompts: served after the fault (the survivors serve them).
        long_prompts: several prefill forwards each: the ones a fault catches mid-push.
        max_tokens: tokens per request.
        reference: (fleet, prompts) -> each prompt's greedy tokens on the colocated twin.
    """

    config: str
    overrides: dict
    prompts: list[list[int]]
    long_prompts: list[list[int]]
    max_tokens: int
    reference: Callable[[Fleet, list[list[int]]], list[list[int]]]

    @property
    def lease_s(self) -> float:
        return self.overrides["router.lease_s"]

    @property
    def params(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, ignore_eos=True)

    def launch(self) -> Cluster:
        config = Config.from_yaml(CONFIGS / f"{self.config}.yaml").override(self.overrides)
        return launch_config(config, HookedInstanceActor)


def _in_process_colocated(fleet: Fleet, prompts: list[list[int]]) -> list[list[int]]:
    return reference_tokens(prompts, [fleet.max_tokens] * len(prompts))


def _colocated_twin(fleet: Fleet, prompts: list[list[int]]) -> list[list[int]]:
    """The tokens of ``llama3-8b-1gpu-colocated`` with the fleet's overrides (its weights, its
    kernels, one instance)."""
    config = Config.from_yaml(CONFIGS / "llama3-8b-1gpu-colocated.yaml").override(
        {k: v for k, v in fleet.overrides.items() if not k.startswith("cluster.")})
    with launch_config(config) as cluster:
        done = cluster.generate(prompts, fleet.params, timeout_s=HANG_S)
        wait_all_free(cluster)
    assert all(c.error is None for c in done), [c.error for c in done if c.error][:3]
    return [c.token_ids for c in done]


def _gpu_prompts(lengths: list[int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 128000) for _ in range(n)] for n in lengths]


# The lease covers the silent case's late requests too: handed to prefill-0 while its forward is
# held, they wait for the test to release it, which takes over 2 s on a loaded runner (measured:
# three pytest workers on two cores failed them with `SignalTimeout`).
CPU = Fleet("tiny-1p1d", {"router.lease_s": 4.0, "cluster.restart": False},
            prompts=mixed_prompts(4, seed=7),
            long_prompts=[[3 + (11 * i + 5 * j) % 250 for j in range(420 + 45 * i)] for i in range(3)],  # 2 chunks
            max_tokens=12, reference=_in_process_colocated)
# The lease is generous (a prefill shape not seen before compiles Triton kernels, and the two
# instances time-slice one GPU), and the silent case waits it out once.
GPU = Fleet("llama3-8b-1gpu-1p1d", {"model.num_layers": 2, "model.dtype": "float32", "cache.num_pages": 4096,
                                    "scheduler.max_num_batched_tokens": 512, "router.lease_s": 20.0,
                                    "cluster.restart": False},
            prompts=_gpu_prompts([1, 15, 17, 511, 513, 900], seed=7),
            long_prompts=_gpu_prompts([1500, 2100, 3000], seed=8),  # 3-6 chunks of 512
            max_tokens=16, reference=_colocated_twin)


@pytest.fixture(scope="module", params=[pytest.param(CPU, id="cpu"),
                                        pytest.param(GPU, id="gpu", marks=pytest.mark.multigpu)])
def fleet(request) -> Fleet:
    return request.param


@pytest.fixture(scope="module")
def want(ray_local, fleet) -> dict[str, list[list[int]]]:
    """The colocated twin's tokens: ``long`` for the long prompts, ``new`` for the prompts."""
    tokens = fleet.reference(fleet, fleet.long_prompts + fleet.prompts)
    return {"long": tokens[:len(fleet.long_prompts)], "new": tokens[len(fleet.long_prompts):]}


def test_prefill_instance_killed_mid_push(ray_local, fleet, want):
    with fleet.launch() as cluster:
        prefill = cluster.instance("prefill-0").actor
        streams = _held_mid_push(ray_local, cluster, fleet)
        ray_local.kill(prefill, no_restart=True)
        _check_completed(streams, want["long"])
        stats = _check_survivors_serve(cluster, fleet, want["new"], ["decode-0"])
        assert stats["router"]["counts"]["migrated"] >= 1, stats["router"]["counts"]
        assert stats["router"]["failures"] == {}


def test_decode_instance_killed_while_pushes_land_in_it(ray_local, fleet, want):
    with fleet.launch() as cluster:
        prefill, decode = (cluster.instance(name) for name in ("prefill-0", "decode-0"))
        streams = _held_mid_push(ray_local, cluster, fleet)
        assert ray_local.get(decode.actor.stats.remote(), timeout=HANG_S)["leases"] >= 1  # reservations open
        ray_local.kill(decode.actor, no_restart=True)
        _wait_until(lambda: not decode.alive)
        ray_local.get(prefill.actor.release_push.remote(), timeout=HANG_S)  # its pushes go on into the dead PE
        _check_completed(streams, want["long"])
        stats = _check_survivors_serve(cluster, fleet, want["new"], ["prefill-0"])
        assert stats["router"]["counts"]["migrated"] >= 1, stats["router"]["counts"]
        assert stats["router"]["failures"] == {}


def test_prefill_instance_silent_past_the_lease(ray_local, fleet, want):
    with fleet.launch() as cluster:
        prefill = cluster.instance("prefill-0").actor
        streams = _held_mid_push(ray_local, cluster, fleet)
        _wait_until(lambda: cluster.router_stats()["failures"].get("signal_timeout", 0) >= 1,
                    timeout_s=fleet.lease_s + HANG_S)
        # Requests handed to it now may get the decode pages its held forward was writing: its
        # late writes and doorbells must not reach them.
        late = [BackgroundStream(cluster, p, fleet.params, request_id=f"late-{i}")
                for i, p in enumerate(fleet.prompts)]
        _wait_until(lambda: set(cluster.router_stats()["stages"]) <= {"prefilling"})
        ray_local.get(prefill.release_push.remote(), timeout=HANG_S)
        _check_completed(late, want["new"])
        failed = 0
        for i, (stream, tokens) in enumerate(zip(streams, want["long"])):
            last = stream.result(HANG_S)
            if last.finish_reason == "error":  # pushing when the prefill instance went silent
                assert isinstance(last.cause, SignalTimeout), (i, last)
                failed += 1
            else:  # handed to it after its lease ran out: served once it went on
                assert (last.finish_reason, last.error, stream.token_ids) == ("length", None, tokens), (i, last)
        stats = _check_survivors_serve(cluster, fleet, want["new"], ["prefill-0", "decode-0"])
        assert stats["router"]["failures"] == {"signal_timeout": failed}
        assert stats["router"]["counts"].get("migrated", 0) == 0  # no instance died


def _held_mid_push(ray, cluster: Cluster, fleet: Fleet) -> list[BackgroundStream]:
    """Stream the long prompts with prefill-0's next pushing forward held after its first layer;
    return once it holds."""
    prefill = cluster.instance("prefill-0").actor
    ray.get(prefill.hold_push.remote(HANG_S), timeout=HANG_S)
    streams = [BackgroundStream(cluster, p, fleet.params, request_id=f"long-{i}")
               for i, p in enumerate(fleet.long_prompts)]
    assert ray.get(prefill.wait_push_held.remote(HANG_S), timeout=HANG_S + 5), "no push started"
    return streams


def _check_completed(streams: list[BackgroundStream], want: list[list[int]]) -> None:
    for i, (stream, tokens) in enumerate(zip(streams, want)):
        last = stream.result(HANG_S)
        assert (last.finish_reason, last.error) == ("length", None), (i, last)
        assert stream.token_ids == tokens, i


def _check_survivors_serve(cluster: Cluster, fleet: Fleet, want: list[list[int]], survivors: list[str]) -> dict:
    """New requests complete with the colocated tokens, and once idle every page of every
    survivor is free (a quarantined reservation after its lease); the stats then."""
    done = cluster.generate(fleet.prompts, fleet.params, timeout_s=HANG_S)
    assert [(c.finish_reason, c.error) for c in done] == [("length", None)] * len(done), done
    assert [c.token_ids for c in done] == want
    stats = wait_all_free(cluster, timeout_s=fleet.lease_s + 30)
    assert [inst["name"] for inst in stats["instances"] if inst["alive"]] == survivors
    assert cluster.healthy
    return stats


def _wait_until(predicate, timeout_s: float = HANG_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
