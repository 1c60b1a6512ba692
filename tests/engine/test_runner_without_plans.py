"""A runner that runs without plans (`ModelRunner.needs_plan` False, the simulator's): the engine
reserves the same pages (`PagedKVCache.append_without_plan`), hands it each forward's shape, and
every step's outputs and the cache come out as with plans. CPU only, no model."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest
import torch

from disagg.engine import EngineOptions
from disagg.engine.core import EngineCore
from disagg.engine.runner import PendingTokens
from disagg.engine.steps import StepShape, prompt_pairs
from disagg.sampling import SamplingParams


@dataclass(frozen=True)
class StubConfig:
    max_position_embeddings: int = 256
    vocab_size: int = 100
    eos_token_ids: tuple = ()


class StubModel:
    dtype = torch.float16
    device = torch.device("cpu")
    config = StubConfig()

    def kv_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        return (num_pages * page_size,)


def shape_of_plan(plan, sample_rows: np.ndarray, sample_requests: list) -> StepShape:
    """`StepShape.of` read off a plan: a row is a decode when its sampled request decodes."""
    new = np.diff(plan.qo_indptr)
    before = (np.diff(plan.page_indptr) - 1) * PAGE + plan.last_page_len - new
    decodes = np.zeros(len(new), dtype=bool)
    decodes[np.asarray(sample_rows, dtype=np.int64)] = [r.decoding for r in sample_requests]
    chunks = ~decodes
    pairs = sum(prompt_pairs(int(done), int(n)) for done, n in zip(before[chunks], new[chunks]))
    return StepShape(int(new[chunks].sum()), int(decodes.sum()), int(before[decodes].sum()), pairs)


class StubRunner:
    """Samples token ``7`` for every row; records each forward's shape (from its plan, or given)."""

    num_graph_replays = num_prompt_graph_replays = num_mixed_graph_replays = num_pushes_after = 0

    def __init__(self, needs_plan: bool) -> None:
        self.needs_plan = needs_plan
        self.num_forwards = 0
        self.shapes: list[StepShape] = []

    def execute(self, plan, input_ids, sample_rows, sample_requests, *, sender=None, step_offset=0,
                device_prefix=None, shape=None) -> PendingTokens:
        assert (plan is None) == (not self.needs_plan), "a plan exactly when the runner needs one"
        self.shapes.append(shape if plan is None else shape_of_plan(plan, sample_rows, sample_requests))
        self.num_forwards += 1
        tokens = torch.full((len(sample_rows),), 7, dtype=torch.int64)
        return PendingTokens(tokens, tokens, None, None)


PAGE = 4


def run(needs_plan: bool, async_scheduling: bool):
    """A workload with shared prefixes (mid-page hits), chunked prompts, joins and page pressure."""
    options = EngineOptions(num_pages=40, page_size=PAGE, max_num_seqs=6, max_num_batched_tokens=24,
                            use_cuda_graphs=False, async_scheduling=async_scheduling, async_prompts=async_scheduling)
    runner = StubRunner(needs_plan)
    engine = EngineCore(StubModel(), options, runner=lambda model, kv, options: runner)
    rng = np.random.default_rng(0)
    shared = rng.integers(0, 100, 30).tolist()
    steps = []
    for step in range(400):
        if step % 5 == 0 and step < 120:
            prompt = shared[: int(rng.integers(5, 30))] + rng.integers(0, 100, int(rng.integers(1, 20))).tolist()
            engine._add(step, prompt, SamplingParams(max_tokens=int(rng.integers(1, 40)), ignore_eos=True))
        if not engine.has_work():
            break
        outputs = engine.step()
        engine.cache.check_integrity()
        steps.append((outputs, engine.last_step_shape, engine.cache.num_free_pages,
                      sorted((i, s.state()) for i, s in engine.cache._seqs.items())))
    assert not engine.has_work()
    return steps, runner


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_runner_without_plans_sees_the_same_run_and_the_plans_shapes(async_scheduling):
    with_plans, planned = run(True, async_scheduling)
    without, unplanned = run(False, async_scheduling)
    assert without == with_plans
    assert unplanned.shapes == planned.shapes
    assert planned.num_forwards > 100 and any(s.num_prompt_pairs for s in planned.shapes)
