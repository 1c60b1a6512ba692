"""The config's `kernels:` switches reach every actor of a fleet through the config, with the
launcher's DISAGG_* overrides folded in, whatever the actors' own environment says (an actor on
another host has none of the launcher's variables). And a request whose top_k exceeds the model's
vocabulary is refused by name, leaving no page behind."""

from __future__ import annotations

import pytest
from cluster_helpers import CONFIGS, launch_config, wait_all_free
from hooked_actor import with_own_environment

from disagg.cluster.launch.actors import InstanceActor
from disagg.config import Config
from disagg.sampling import SamplingParams
from disagg.settings import ENV_VARS

pytestmark = pytest.mark.slow  # a Ray fleet of two actors: ~15 s alone, more on a busy runner


@pytest.fixture(scope="module")
def cluster(ray_local):
    mp = pytest.MonkeyPatch()
    for variable in ENV_VARS.values():
        mp.delenv(variable, raising=False)
    mp.setenv("DISAGG_ROPE_APPEND", "0")  # the launcher's override of the file's true
    config = Config.from_yaml(CONFIGS / "tiny-1p1d.yaml").override(
        {"kernels.linear": "triton", "kernels.layer_pdl": True, "kernels.rope_append": True,
         "cluster.warmup": False})
    # The actors' own environment says otherwise: they must not read it.
    actor_class = with_own_environment(InstanceActor, DISAGG_LINEAR="cublas", DISAGG_LAYER_PDL="0",
                                       DISAGG_BLAS="not-a-library")
    try:
        cluster = launch_config(config, actor_class)
    finally:
        mp.undo()
    yield cluster
    cluster.shutdown()


def test_every_actor_builds_its_model_with_the_config_s_switches(cluster):
    expected = {"linear": "triton", "blas": "auto", "layer_pdl": True, "rope_append": False,
                "fused_layers": True, "prefill_attention": "auto"}
    assert [(inst.role, inst.info["kernels"]) for inst in cluster.fleet.instances] == \
        [("prefill", expected), ("decode", expected)]
    assert cluster.config.kernels.model_dump() == expected  # the folded config the actors received
    done = cluster.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert done[0].error is None and len(done[0].token_ids) == 4
    wait_all_free(cluster)


def test_top_k_above_the_vocabulary_is_refused_by_name(cluster):
    vocab = cluster.vocab_size
    bad, good = cluster.generate([[5, 6, 7], [5, 6, 7]], [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=vocab + 1),
        SamplingParams(max_tokens=3, temperature=1.0, top_k=vocab, seed=1, ignore_eos=True)])
    assert bad.finish_reason == "error" and "top_k" in bad.error and f"({vocab} tokens" in bad.error, bad.error
    assert f"got {vocab + 1}" in bad.error
    assert good.error is None and len(good.token_ids) == 3
    wait_all_free(cluster)
