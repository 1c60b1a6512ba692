"""Prefill engine in one process, decode engine in another, over the shm heap (dummy:tiny, CPU):
the tokens equal ColocatedEngine's, greedy and seeded sampling alike, and both sides end with
every page free."""

from __future__ import annotations

import engine_scenarios
from engine_helpers import drain
from engine_procs import EngineProcs

from disagg.engine import ColocatedEngine
from disagg.sampling import SamplingParams
from disagg.transfer import new_unique_id
from disagg.transfer.shm_heap import shm_leftovers

PROMPTS = {"long": [5, 9, 17, 3, 88, 41, 7, 200, 13, 66, 21, 4, 4, 19], "one": [42],
           "mid": [150, 151, 3, 4, 90, 12, 8], "seeded": [7, 100, 101, 102, 103, 250]}
PARAMS = {rid: SamplingParams(max_tokens=8, ignore_eos=True) for rid in PROMPTS}
PARAMS["seeded"] = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=77, ignore_eos=True)
SIZES = dict(num_pages=32, page_size=4, max_num_seqs=4, max_num_batched_tokens=6, lease_s=60.0)


def test_prefill_and_decode_processes_match_colocated(tiny_model, torch_reference):
    colocated = ColocatedEngine(tiny_model, num_pages=64, page_size=4, max_num_seqs=4, max_num_batched_tokens=8)
    for rid, prompt in PROMPTS.items():
        colocated.add(rid, prompt, PARAMS[rid])
    want = {rid: r["tokens"] for rid, r in drain(colocated).items()}

    procs = EngineProcs(2)
    try:
        uid = new_unique_id("shm")
        procs.run("setup", {r: dict(backend="shm", uid=uid, rank=r, role=("prefill", "decode")[r],
                                    source="dummy:tiny", dtype="float32", sizes=SIZES,
                                    env={"TRITON_INTERPRET": "0"}) for r in (0, 1)})
        got = engine_scenarios.relay(procs.call, PROMPTS, PARAMS)
        stats = procs.run("teardown", {0: {}, 1: {}})
    finally:
        procs.close()
    assert shm_leftovers(uid) == []
    assert got == want
    for rank, s in stats.items():
        assert s["free_pages"] == s["total_pages"], (rank, s)
