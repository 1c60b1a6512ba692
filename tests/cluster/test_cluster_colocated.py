"""tiny-colocated.yaml: the same router spreading requests over two ColocatedEngine actors."""

from __future__ import annotations

import pytest
from cluster_helpers import BackgroundStream, launch, mixed_prompts, reference_tokens, wait_all_free

from disagg.sampling import SamplingParams


@pytest.fixture(scope="module")
def cluster(ray_local):
    cluster = launch("tiny-colocated")
    yield cluster
    cluster.shutdown()


def test_colocated_parity_over_both_instances(cluster):
    stats = cluster.stats()
    assert stats["mode"] == "colocated" and stats["backend"] is None and stats["paths"] == {}
    assert [(i["name"], i["pe"]) for i in stats["instances"]] == [("colocated-0", None), ("colocated-1", None)]
    prompts = mixed_prompts(12, seed=6)
    max_tokens = [3, 17, 1, 8] * 3
    got = cluster.generate(prompts, [SamplingParams(max_tokens=n) for n in max_tokens])
    assert [c.token_ids for c in got] == reference_tokens(prompts, max_tokens)
    assert {c.metrics.decode_instance for c in got} == {"colocated-0", "colocated-1"}
    assert all(c.metrics.prefill_instance == c.metrics.decode_instance for c in got)
    wait_all_free(cluster)


def test_colocated_abort_and_timeout_free_pages(cluster):
    stream = BackgroundStream(cluster, [5] * 40, SamplingParams(max_tokens=3000, ignore_eos=True), request_id="c1")
    stream.started.wait(60)
    cluster.abort("c1")
    assert stream.result().finish_reason == "abort"
    router = cluster._router
    saved = router.settings
    router.settings = saved.model_copy(update={"request_timeout_s": 0.5})
    try:
        last = BackgroundStream(cluster, [6] * 40, SamplingParams(max_tokens=3000, ignore_eos=True)).result()
    finally:
        router.settings = saved
    assert last.finish_reason == "abort" and "timed out" in last.error
    wait_all_free(cluster)
