"""One simulated instance: the real `EngineCore` with a runner that runs no model.

`SimInstance` holds a `disagg.engine.core.EngineCore` (its scheduler, paged cache, prefix
cache, request life cycle, reserved and launched-ahead steps: docs/ARCHITECTURE.md §6) built with
two stand-ins: `SimRunner`, whose ``execute`` samples token 0 for every row (requests run to
``max_tokens``: EOS is ignored, as the bench's workloads do) and puts the forward on a virtual
stream, ``StepTimeModel.step_s`` of its shape (plus the host gap between forwards) after the
forward before it; and a `link.SimConnector`, whose sender pushes over the instance's link and
whose receiver's reservations land when the push of their last token is done. The model is a
`SimModel` (the profile's context, vocabulary; an empty KV tensor: pages are bookkeeping only).

Time: the fleet calls `begin_step` when the instance is idle and has work; it runs
``EngineCore.step`` at once (the launch, and the reading of the forward the step waits for), and
the step's outputs reach the fleet at that forward's end on the virtual stream (`finish_step`).
Calls made meanwhile (a new prompt, a reservation, a first token) run on the engine as it is after
the step, where the engine's actor runs them after it. A step whose next ones are surely the same
pure-decode batch, ending before ``horizon`` (the fleet's next event), runs them at once
(`fuse`): no event could have changed them. Used by `fleet.py` only.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Hashable, Mapping

import numpy as np
import torch

from disagg.cluster.simulate.link import SimConnector
from disagg.cluster.simulate.step_model import StepTimeModel
from disagg.engine.core import EngineCore
from disagg.engine.options import EngineOptions
from disagg.engine.request import RecvDest, TokenOutput, pages_for
from disagg.engine.runner import PendingTokens
from disagg.engine.steps import InstanceLoad, StepShape, prompt_pairs
from disagg.errors import OutOfPages
from disagg.sampling import SamplingParams


@dataclass(frozen=True)
class SimModelConfig:
    """What `EngineCore` reads of a model's config."""

    max_position_embeddings: int
    vocab_size: int
    eos_token_ids: tuple = ()


class SimModel:
    """The model object `EngineCore` holds: a config, a device and an empty KV shape."""

    dtype = torch.float16
    device = torch.device("cpu")

    def __init__(self, max_model_len: int, vocab_size: int) -> None:
        self.config = SimModelConfig(max_model_len, vocab_size)

    def kv_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        return (0,)


@dataclass(frozen=True)
class Forward:
    """One forward on the virtual stream: its shape, span (virtual seconds, the host gap after
    it included) and the KV tokens it pushed."""

    shape: StepShape
    start_s: float
    end_s: float
    num_pushed_tokens: int = 0

    @property
    def seconds(self) -> float:
        return self.end_s - self.start_s


class SimRunner:
    """`ModelRunner`'s ``execute`` without a model (module docstring).

    Args:
        model: the step-time model (a profile's fit).
        page_size: the cache's tokens per page (a plan's sequence lengths from its page table).
        clock: the instance's virtual clock (when the host launches a forward).
        step_gap_s: host seconds between two forwards, added to each.
    """

    num_graph_replays = num_prompt_graph_replays = num_mixed_graph_replays = num_pushes_after = 0
    needs_plan = False  # a forward that moves no KV comes as its `StepShape`, no plan (`EngineCore`)

    def __init__(self, model: StepTimeModel, page_size: int, clock: Callable[[], float], step_gap_s: float) -> None:
        self.model = model
        self.page_size = page_size
        self.clock = clock
        self.step_gap_s = step_gap_s
        self.free_at = 0.0  # when the stream has run every forward launched so far
        self.launched: list[Forward] = []  # launched, tokens not read yet (oldest first)
        self.num_forwards = 0

    def execute(self, plan, input_ids, sample_rows: np.ndarray, sample_requests: list, *, sender=None,
                step_offset=0, device_prefix=None, shape: StepShape | None = None) -> PendingTokens:
        """Put the forward on the stream (its pushes on ``sender``'s link); sample 0s. ``plan`` is
        None (``shape`` given) for a forward that moves no KV (`needs_plan`)."""
        if plan is not None:
            shape = self.shape_of(plan, sample_rows, sample_requests)
        start = max(self.clock(), self.free_at)
        end = start + self.forward_s(shape)
        self.free_at = end
        pushed, push_done = sender.push(plan, start, end) if sender is not None else (0, None)
        self.launched.append(Forward(shape, start, end, pushed))
        self.num_forwards += 1
        tokens = torch.zeros(len(sample_rows), dtype=torch.int64)
        return PendingTokens(tokens, tokens, None, push_done)

    def forward_s(self, shape: StepShape) -> float:
        """How long a forward of ``shape`` holds the instance: the model's time, then the gap."""
        return max(self.model.step_s(shape.num_prefill_tokens, shape.num_decode_seqs, shape.num_context_tokens,
                                     shape.num_prompt_pairs), 1e-6) + self.step_gap_s

    def shape_of(self, plan, sample_rows: np.ndarray, sample_requests: list) -> StepShape:
        """`StepShape.of` from the plan: a row is a decode when its sampled request decodes (a row
        not sampled is a prompt chunk); each row's tokens before the forward are its length after
        the append less its new tokens. Their sum over every row telescopes (the index pointers'
        ends, the last pages' lengths), so only the few chunk rows are read one by one."""
        qo, pages, last = plan.qo_indptr.tolist(), plan.page_indptr.tolist(), plan.last_page_len.tolist()
        num_rows, size = len(last), self.page_size
        rows = np.asarray(sample_rows, dtype=np.int64).tolist()
        chunks = [row for row, req in zip(rows, sample_requests) if not req.decoding]
        if len(rows) < num_rows:
            chunks += set(range(num_rows)).difference(rows)
        before_all = (pages[-1] - pages[0] - num_rows) * size + sum(last) - (qo[-1] - qo[0])
        num_prefill = chunks_before = pairs = 0
        for row in chunks:
            new = qo[row + 1] - qo[row]
            before = (pages[row + 1] - pages[row] - 1) * size + last[row] - new
            num_prefill += new
            chunks_before += before
            pairs += prompt_pairs(before, new)
        return StepShape(num_prefill, num_rows - len(chunks), before_all - chunks_before, pairs)


class SimCore(EngineCore):
    """An `EngineCore` that holds every kind of request (local, pushed, received), as any
    simulated instance may, over a `SimConnector`."""

    def __init__(self, model: SimModel, options: EngineOptions, runner: SimRunner, connector: SimConnector) -> None:
        super().__init__(model, options, runner=lambda model, kv, options: runner, connector=connector)

    def add(self, request_id: Hashable, prompt_token_ids: list[int], params: SamplingParams,
            dest: RecvDest | None = None) -> None:
        self._add(request_id, prompt_token_ids, params, dest)

    def reserve(self, request_id: Hashable, prompt_token_ids: list[int], params: SamplingParams) -> RecvDest:
        return self._reserve(request_id, len(prompt_token_ids), params, prompt_token_ids)

    def start(self, request_id: Hashable, first_token_id: int) -> None:
        self._start(request_id, first_token_id)


@dataclass
class SimStep:
    """The forwards one `begin_step` read (more than one when fused) and each one's outputs."""

    forwards: list[Forward]
    outputs: list[list[TokenOutput]]

    @property
    def shape(self) -> StepShape:
        return self.forwards[0].shape

    @property
    def durations(self) -> list[float]:
        return [f.seconds for f in self.forwards]

    @property
    def end_times(self) -> list[float]:
        return [f.end_s for f in self.forwards]

    @property
    def num_pushed_tokens(self) -> int:
        return sum(f.num_pushed_tokens for f in self.forwards)


class SimInstance:
    """One simulated instance's engine, on the fleet's clock (module docstring).

    Args:
        model: the step-time model (a profile's fit).
        options: the engine's (`EngineOptions`: sizes, async scheduling and prompts, prefix caching).
        max_model_len, vocab_size: the stand-in model's.
        clock: the fleet's virtual clock.
        pe: this instance's PE (what its reservations name).
        bytes_per_token: KV bytes per token of one rank (its heads); link_bytes_per_s: each rank's
            push link's bandwidth; link_bytes: per receiver PE, the bytes per token of a push's
            busiest link (`link.link_bytes_per_token`; absent: ``bytes_per_token``).
        step_gap_s: host seconds between two forwards (the served trace's step gap).
    """

    def __init__(self, model: StepTimeModel, options: EngineOptions, *, max_model_len: int, vocab_size: int,
                 clock: Callable[[], float], pe: int, bytes_per_token: float, link_bytes_per_s: float,
                 link_bytes: Mapping[int, float] | None = None, step_gap_s: float = 0.0) -> None:
        self._clock = clock
        self._host_now: float | None = None  # the launch time of a fused step (the fleet's clock lags it)
        self.runner = SimRunner(model, options.page_size, self.now, step_gap_s)
        self.connector = SimConnector(pe, self.now, bytes_per_token, link_bytes_per_s, link_bytes)
        self.bytes_per_token = bytes_per_token
        self.vocab_size = vocab_size
        self.core = SimCore(SimModel(max_model_len, vocab_size), options, self.runner, self.connector)
        self.core.on_gpu_wait = self._mid_step
        self.step_gap_s = step_gap_s
        self.current: SimStep | None = None  # the step whose outputs have not reached the fleet
        self._pushed: set[Hashable] = set()  # pushed prompts here (their first token ends their stay)
        self.busy_s = 0.0
        self.num_steps = 0
        self.min_free_pages = self.core.scheduler.free_pages()
        self.step_log: list[StepShape] | None = None  # shapes, when a test asks for them
        self._load: InstanceLoad | None = None  # `load` since the engine last changed

    def now(self) -> float:
        return self._clock() if self._host_now is None else self._host_now

    # ------------------------------------------------------------------ requests
    def add(self, request_id: Hashable, prompt_token_ids: list[int], max_tokens: int,
            dest: RecvDest | None = None) -> None:
        """Queue a local request, or (``dest``) a prompt whose KV goes to a decode instance."""
        self._load = None
        self.core.add(request_id, self._ids(prompt_token_ids), _params(max_tokens), dest)
        if dest is not None:
            self._pushed.add(request_id)

    def reserve(self, request_id: Hashable, prompt_token_ids: list[int], max_tokens: int) -> RecvDest | None:
        """Reserve pages for a pushed prompt and its whole answer (`EngineCore`'s, forked from the
        cached whole pages of its prompt); None when too few pages are free (OutOfPages)."""
        self._load = None
        try:
            return self.core.reserve(request_id, self._ids(prompt_token_ids), _params(max_tokens))
        except OutOfPages:
            return None

    def start(self, request_id: Hashable) -> bool:
        """The prompt's first token came (its KV landed): it decodes here once a step sees the
        landing. True when that token already ended it."""
        self._load = None
        self.core.start(request_id, 0)
        return request_id not in self.core.requests

    def _ids(self, prompt_token_ids: list[int]) -> list[int]:
        """The engine's ids of a prompt: a negative id (the fleet's own prefix of a prompt given
        by its length) becomes one of the vocabulary's last ones."""
        return np.remainder(np.asarray(prompt_token_ids, dtype=np.int64), self.vocab_size).tolist()

    # ------------------------------------------------------------------ steps
    def has_work(self) -> bool:
        return self.core.has_work()

    def begin_step(self) -> SimStep | None:
        """Run the engine's next step; None when it read no forward (nothing can run yet)."""
        self._load = None
        outputs = self.core.step()
        if self.core.last_step_shape is None:
            assert not outputs, "a simulated engine's step outputs only the tokens of a forward"
            return None
        self.current = SimStep([], [])
        self._read(outputs)
        return self.current

    def fuse(self, horizon: float) -> None:
        """Run in the step begun the pure-decode steps that surely follow it and end before
        ``horizon`` (the fleet's next event): no event could change them."""
        step = self.current
        self._load = None
        try:
            while self._surely_same_before(step, horizon):
                self._host_now = step.forwards[-1].end_s
                self._read(self.core.step())
        finally:
            self._host_now = None

    def _read(self, outputs: list[TokenOutput]) -> None:
        """The forward a step read, with its outputs, joins the step begun."""
        forward = self.runner.launched.pop(0)
        self.current.forwards.append(forward)
        self.current.outputs.append(outputs)
        self.num_steps += 1
        self.busy_s += forward.seconds - self.step_gap_s
        if self.step_log is not None:
            self.step_log.append(forward.shape)

    def _surely_same_before(self, step: SimStep, horizon: float) -> bool:
        """The next step reads a pure decode of every running request, as the last did, nobody
        ended, joins or is preempted, and its forward ends before ``horizon``."""
        last, core = step.forwards[-1], self.core
        running = core.running
        if (last.shape.num_prefill_tokens or last.num_pushed_tokens or core.scheduler.waiting or core.ready
                or not running or len(step.outputs[-1]) != len(running)
                or any(out.finished for out in step.outputs[-1])):
            return False
        if self.runner.launched:  # launched ahead (async scheduling): its end is known
            return self.runner.launched[0].end_s < horizon
        size = core.cache.page_size
        lengths = [core.cache.seq_length(r.seq_id) for r in running if not r.committed_pages]
        if sum(pages_for(n + 1, size) - pages_for(n, size) for n in lengths) > core.scheduler.free_pages():
            return False
        shape = StepShape(0, len(running), sum(r.num_computed for r in running), 0)
        return last.end_s + self.runner.forward_s(shape) < horizon

    def _mid_step(self, is_ready: Callable[[], bool]) -> None:
        """While a launched forward runs (`EngineCore.on_gpu_wait`): its pages are taken."""
        self.min_free_pages = min(self.min_free_pages, self.core.scheduler.free_pages(),
                                  self.core.cache.num_free_pages)

    def finish_step(self) -> list[tuple[Hashable, bool, list[float], bool]]:
        """The step's outputs reach the fleet: per request sampled, ``(request_id, finished,
        token times, pushed)`` (pushed: a pushed prompt's first token, which ends its stay here),
        in the order of their first outputs."""
        step, self.current = self.current, None
        pushed = self._pushed
        first = step.outputs[0]
        if len(step.forwards) == 1 and len({out.request_id for out in first}) == len(first):  # one output each
            end_s = step.forwards[0].end_s
            rows = [(out.request_id, out.finished, [end_s], False) for out in first]
        else:
            times: dict[Hashable, list[float]] = {}
            finished: dict[Hashable, bool] = {}
            for forward, outputs in zip(step.forwards, step.outputs):
                end_s = forward.end_s
                for out in outputs:
                    times.setdefault(out.request_id, []).append(end_s)
                    finished[out.request_id] = out.finished
            rows = [(request_id, finished[request_id], token_times, False) for request_id, token_times in times.items()]
        if pushed:
            for i, (request_id, done, token_times, _) in enumerate(rows):
                if request_id in pushed:
                    pushed.discard(request_id)
                    rows[i] = (request_id, done, token_times, True)
        return rows

    def load(self) -> InstanceLoad:
        """`EngineCore.load`, kept until the engine next changes: the engine changes only through
        this object's calls, and the adaptive placement reads every instance's load at each
        placement (of a burst at one instant, mostly of instances no call touched since)."""
        if self._load is None:
            self._load = self.core.load()
        return self._load

    @property
    def cache(self):
        return self.core.cache

    @property
    def num_pushed_tokens(self) -> int:
        """KV tokens this instance pushed (the engine's ``pushed_bytes`` over its bytes per token)."""
        return self.connector.sender.num_pushed_tokens

    def stats(self) -> dict:
        """The engine's prefix-cache counters (`PagedKVCache.prefix_stats`) and the KV it pushed,
        in tokens."""
        return {**self.core.cache.prefix_stats(), "num_pushed_tokens": self.num_pushed_tokens}


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)
