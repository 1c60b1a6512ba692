"""Degraded serving on tiny-1p1d (CPU actors): a fleet that lost a whole role keeps serving.

For every `router.placement`: with the prefill instance killed, new requests are computed by the
decode instance itself (local); with the decode instance killed, the prefill instance decodes what
it computes (kept). Either way their tokens equal an in-process colocated engine's (greedy),
`Cluster.healthy` stays True, and `stats()["degraded"]` names the dead instance. Over HTTP,
`/health` answers 200 with the dead instance named while one instance lives, `/metrics` counts it,
and `/health` answers 503 once none is left. The fleets here replace no instance
(``cluster.restart: false``; tests/cluster/test_restart.py covers replacement).
"""

from __future__ import annotations

import time

import httpx
import pytest
from cluster_helpers import launch, mixed_prompts, reference_tokens, wait_all_free
from prometheus_client.parser import text_string_to_metric_families

from disagg.cluster.serve import BackgroundServer, build_app
from disagg.sampling import SamplingParams

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 12
PROMPTS = mixed_prompts(5, seed=11)


@pytest.fixture(scope="module")
def want() -> list[list[int]]:
    return reference_tokens(PROMPTS, [MAX_TOKENS] * len(PROMPTS))


@pytest.mark.parametrize("victim", ["prefill-0", "decode-0"])
@pytest.mark.parametrize("placement", ["disaggregated", "local", "adaptive"])
def test_new_requests_are_served_once_a_whole_role_died(ray_local, want, placement, victim):
    with launch("tiny-1p1d", router__placement=placement, cluster__restart=False) as cluster:
        dead = cluster.instance(victim)
        ray_local.kill(dead.actor, no_restart=True)
        _wait_until(lambda: not dead.alive)
        done = cluster.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), timeout_s=120)
        assert [(c.finish_reason, c.error) for c in done] == [("length", None)] * len(PROMPTS)
        assert [c.token_ids for c in done] == want
        path = "local" if dead.role == "prefill" else "kept"
        assert cluster.router_stats()["placements"][path] == len(PROMPTS)
        assert cluster.healthy
        stats = wait_all_free(cluster)
        (entry,) = stats["degraded"]
        assert (entry["name"], entry["role"]) == (victim, dead.role) and "exited" in entry["why"], entry


def test_health_is_200_and_degraded_while_an_instance_serves_and_503_when_none_is_left(ray_local, want):
    with launch("tiny-1p1d", cluster__restart=False) as cluster, BackgroundServer(build_app(cluster)) as server:
        assert httpx.get(server.base_url + "/health").json() == {"status": "ok", "degraded": []}
        assert _degraded_gauge(server) == 0
        prefill, decode = cluster.instance("prefill-0"), cluster.instance("decode-0")
        ray_local.kill(prefill.actor, no_restart=True)
        _wait_until(lambda: not prefill.alive)

        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 200 and health.json()["status"] == "degraded", health.text
        assert [(d["name"], d["role"]) for d in health.json()["degraded"]] == [("prefill-0", "prefill")]
        assert _degraded_gauge(server) == 1
        body = {"prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True}
        answer = httpx.post(server.base_url + "/v1/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["choices"][0]["token_ids"] == want[0]

        ray_local.kill(decode.actor, no_restart=True)
        _wait_until(lambda: not decode.alive)
        assert not cluster.healthy
        health = httpx.get(server.base_url + "/health")
        assert health.status_code == 503, health.text
        assert [d["name"] for d in health.json()["degraded"]] == ["prefill-0", "decode-0"]
        assert httpx.post(server.base_url + "/v1/completions", json=body, timeout=60).status_code == 503


def _degraded_gauge(server) -> float:
    text = httpx.get(server.base_url + "/metrics").text
    (family,) = [f for f in text_string_to_metric_families(text) if f.name == "disagg:num_instances_degraded"]
    return family.samples[0].value


def _wait_until(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.02)
