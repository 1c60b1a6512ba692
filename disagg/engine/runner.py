"""The model runner: a `ForwardPlan` and its token ids -> one forward -> sampled tokens.

Every engine owns one, in its own process, next to its KV tensor. A step is:

    plan (host, from PagedKVCache) -> AttentionBatch (device) -> model.forward -> sample rows

Pure-decode batches on CUDA replay a CUDA graph of the forward (`disagg.engine.graphs`), padded
up to the next batch-size bucket; with ``mixed_graphs`` prompt and mixed batches of up to
`MAX_FULL_TOKENS` tokens replay whole-forward graphs too (`disagg.engine.mixed_graphs`), their
pushes, if any, after the graph (`push_after`); other prompt chunks and mixed batches up to
`MAX_GRAPH_TOKENS` tokens replay the piecewise graphs between their attentions, which run eagerly
and push layer by layer (`disagg.engine.prompt_graphs`); larger forwards and the CPU run eagerly. Sampling runs after the forward on the same stream, and the sampled ids come back
through a pinned buffer with an event (`PendingTokens`), so a caller can do host work for the
next step before it waits for them.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import numpy as np
import torch

from disagg.engine.graphs import DecodeGraphs
from disagg.engine.mixed_graphs import MixedGraphs
from disagg.engine.prompt_graphs import PromptGraphs
from disagg.cache import PagedKVCache
from disagg.engine.options import PUSH_AFTER
from disagg.engine.request import Request, RequestFactory
from disagg.engine.sampler import SamplingBatch, sample
from disagg.model.batch import AttentionBatch
from disagg.plan import ForwardPlan
from disagg.sampling import SamplingParams

logger = logging.getLogger(__name__)



@dataclass
class PendingTokens:
    """Sampled ids of one step, possibly still on their way to the host.

    Attributes:
        device_tokens: ``[S]`` int64 on the model's device (S = rows sampled).
        push_done: on CUDA with pushes, the event after this forward's transfers and doorbells.
    """

    device_tokens: torch.Tensor
    host_tokens: torch.Tensor
    ready: torch.cuda.Event | None
    push_done: torch.cuda.Event | None = None

    def is_ready(self) -> bool:
        """Whether the ids are on the host (`result` would not wait)."""
        return self.ready is None or self.ready.query()

    def result(self) -> list[int]:
        """Wait for the ids (a host sync on CUDA) and return them."""
        if self.ready is not None:
            self.ready.synchronize()
        return self.host_tokens.tolist()


class ModelRunner:
    """Runs forwards of one model over one KV tensor.

    Args:
        model: a `disagg.model` Model.
        kv: ``[L, num_pages, 2, H_kv, P, D]`` this engine's KV (local or from the heap).
        max_num_seqs: largest batch; CUDA graphs are captured for buckets up to it.
        max_num_batched_tokens: largest forward; caps the prompt graphs' token buckets (None: no
            prompt graphs).
        use_cuda_graphs: decode graphs; None = on CUDA devices; False = always eager.
        prompt_graphs: the piecewise graphs of prompt and mixed forwards; None = as the decode graphs.
        mixed_graphs: whole-forward graphs of short prompt and mixed forwards (needs the decode
            graphs and a token budget; CUDA only); None = as the decode graphs.
        kv_scales: fp8 caches only, handed to ``model.forward``.
        push_after: when a forward with receivers pushes its K/V (`transfer.push_after`):
            "graphs", after the forward where a whole-forward graph runs it (the graph cannot hold
            the layer-by-layer push), layer by layer in the others; "never": always layer by
            layer; "always": after every forward (the path the graphs take, on any device).
    """

    # The engine hands `execute` every forward's plan. A runner that runs no model (the
    # simulator's) sets this False: a forward that moves no KV then comes as ``plan=None`` plus
    # ``shape=`` its `StepShape`, its slots reserved without a plan (`PagedKVCache.append_without_plan`).
    needs_plan = True

    def __init__(self, model, kv: torch.Tensor, *, max_num_seqs: int, max_num_batched_tokens: int | None = None,
                 use_cuda_graphs: bool | None = None, prompt_graphs: bool | None = None,
                 mixed_graphs: bool | None = None, kv_scales=None, push_after: str = "graphs") -> None:
        if push_after not in PUSH_AFTER:
            raise ValueError(f"push_after: expected one of {PUSH_AFTER}, got {push_after!r}")
        self.push_after = push_after
        self.model = model
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.device = kv.device
        self.kv_scales = kv_scales
        on_gpu = self.device.type == "cuda"
        use = on_gpu if use_cuda_graphs is None else (use_cuda_graphs and on_gpu)
        self.graphs = DecodeGraphs(model, kv, max_num_seqs, kv_scales) if use else None
        pieces = use if prompt_graphs is None else (bool(prompt_graphs) and on_gpu)
        self.prompt_graphs = (PromptGraphs(model, max_num_batched_tokens)
                              if pieces and max_num_batched_tokens else None)
        self.mixed_graphs = (MixedGraphs(model, kv, max_num_seqs, max_num_batched_tokens, kv_scales=kv_scales)
                             if use and (mixed_graphs is None or mixed_graphs) and max_num_batched_tokens else None)
        # Plans come from PagedKVCache, already checked on the host: no device-to-host checks.
        self._check_indices = False if on_gpu else None
        self.num_forwards = 0
        self.num_pushes_after = 0  # forwards whose pushes ran after them (`_pushes_after`)
        self.num_graph_replays = 0

    # ------------------------------------------------------------------ steps
    def execute(self, plan: ForwardPlan, input_ids: np.ndarray | list[int] | torch.Tensor,
                sample_rows: np.ndarray, sample_requests: list[Request], *,
                sender=None, step_offset: int | list[int] = 0,
                device_prefix: torch.Tensor | None = None) -> PendingTokens:
        """Run one forward and sample the rows that finished their computation.

        Args:
            plan: the open forward's plan (B sequences, T new tokens).
            input_ids: ``[T]`` token ids in plan order (host ints, or an int64 device tensor).
            sample_rows: ``[S]`` batch rows whose last new token is sampled.
            sample_requests: the S requests of those rows (their sampling values).
            sender: the KV connector's `KVSender` for a forward with receivers (begin/end handled
                here; the model writes each layer through it: `AttentionBatch.kv_writer`).
            step_offset: tokens each request will have generated before this one beyond those
                it holds now (1 for a step launched before the previous step's tokens were
                appended): keeps seeded draws a function of the token's index; a list: one per
                sampled row.
            device_prefix: the ids of the first k rows, on the device (a step launched behind the
                one that samples them); ``input_ids`` then holds the other T - k (host ints).

        Returns:
            The sampled ids (``result()`` waits for them).
        """
        push_done = None
        host_ids = None if isinstance(input_ids, torch.Tensor) else np.asarray(input_ids, np.int64)
        if device_prefix is not None:  # rows :k come from the device; zeros stand in for them here
            host_ids = np.concatenate([np.zeros(device_prefix.shape[0], np.int64), host_ids])
        # The whole-forward graph's bucket, first where a sender asks whether to push after it
        # (a pure-decode step takes the decode graphs before anyone needs it).
        bucket = self._mixed_bucket(plan, host_ids) if sender is not None else None
        after = sender is not None and self._pushes_after(plan, sender, bucket)
        if sender is not None and not after:
            sender.begin_forward(plan)  # (applies the plan's fork copies)
            batch = AttentionBatch.from_plan(plan, self.device, check_indices=self._check_indices, kv_writer=sender)
            logits = self.model.forward(self._device_ids(input_ids, host_ids, device_prefix), batch, self.kv,
                                        kv_scales=self.kv_scales, pieces=self._pieces(plan))
            push_done = sender.end_forward()
        elif self.graphs is not None and device_prefix is None and self.graphs.can_run(plan):
            # Host ids travel with the plan's indices (one staging copy); device ids are copied
            # device to device.
            logits = self.graphs.run(plan, input_ids if host_ids is None else host_ids)
            self.num_graph_replays += 1
        elif (bucket := bucket if sender is not None else self._mixed_bucket(plan, host_ids)) is not None:
            logits = self.mixed_graphs.run(plan, host_ids, bucket, device_prefix=device_prefix)
        else:  # (the model applies the plan's fork copies: `AttentionBatch.fork_src_slots`)
            batch = AttentionBatch.from_plan(plan, self.device, check_indices=self._check_indices)
            logits = self.model.forward(self._device_ids(input_ids, host_ids, device_prefix), batch, self.kv,
                                        kv_scales=self.kv_scales, pieces=self._pieces(plan))
        if after:
            push_done = sender.save_written(plan)
            self.num_pushes_after += 1
        self.num_forwards += 1
        return self._sample(logits, sample_rows, sample_requests, push_done, step_offset)

    def _mixed_bucket(self, plan: ForwardPlan, host_ids: np.ndarray | None) -> tuple[int, int] | None:
        """The whole-forward graph bucket that runs ``plan`` (None: none; ids only on the device)."""
        return None if self.mixed_graphs is None or host_ids is None else self.mixed_graphs.bucket(plan)

    def _pushes_after(self, plan: ForwardPlan, sender, bucket: tuple[int, int] | None) -> bool:
        """Whether ``plan``'s pushes go after its forward, every layer at once (``push_after``).

        A whole-forward graph (a short prompt, a mixed step) cannot push layer by layer, and its
        forward run eagerly to push so cost P's decodes the graph's speed: two H200s, decode-heavy
        at 27 req/s, a mixed step of ~150 prompt tokens beside ~80 decodes took 28.6 ms pushing
        eagerly against 10.0 ms graphed (benchmarks/records/headline-h200x2-2026-11-28f/). After
        the graph the push is one copy of the forward's few MiB over NVLink (a 512-token forward
        of an 8B model: 64 MiB, ~0.2 ms); long prompts keep the layer-by-layer overlap. Every
        pushed token must have a local slot to copy from (`KVSender.can_save_written`)."""
        if self.push_after == "never" or not sender.can_save_written(plan):
            return False
        return self.push_after == "always" or bucket is not None

    def _pieces(self, plan: ForwardPlan):
        """The prompt graphs' pieces for an eager forward of ``plan`` (None: run it all eagerly)."""
        return None if self.prompt_graphs is None else self.prompt_graphs.pieces(plan.num_tokens)

    @property
    def num_prompt_graph_replays(self) -> int:
        return 0 if self.prompt_graphs is None else self.prompt_graphs.num_replays

    @property
    def num_mixed_graph_replays(self) -> int:
        return 0 if self.mixed_graphs is None else self.mixed_graphs.num_replays

    def _device_ids(self, input_ids, host_ids: np.ndarray | None, device_prefix: torch.Tensor | None) -> torch.Tensor:
        """The forward's ids on the device: ``input_ids`` when they are there already, else the
        host ids (after the ``device_prefix`` rows, which come first)."""
        if host_ids is None:
            return input_ids.to(self.device, torch.int64, non_blocking=True)
        k = 0 if device_prefix is None else int(device_prefix.shape[0])
        host = torch.from_numpy(host_ids[k:])
        if self.device.type == "cuda":
            host = host.pin_memory().to(self.device, non_blocking=True)
        return host if device_prefix is None else torch.cat([device_prefix.to(torch.int64), host])

    def _sample(self, logits: torch.Tensor, rows: np.ndarray, requests: list[Request],
                push_done, step_offset: int = 0) -> PendingTokens:
        rows = np.asarray(rows, dtype=np.int64)
        if len(rows) == 0:
            empty = torch.zeros(0, dtype=torch.int64)
            return PendingTokens(empty, empty, None, push_done)
        if len(rows) != logits.shape[0] or not np.array_equal(rows, np.arange(len(rows))):
            logits = logits.index_select(0, torch.as_tensor(rows).to(self.device, non_blocking=True))
        tokens = sample(logits, SamplingBatch.from_requests(requests, self.device, step_offset))
        if self.device.type != "cuda":
            return PendingTokens(tokens, tokens, None, push_done)
        host = torch.empty(tokens.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(tokens, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return PendingTokens(tokens, host, ready, push_done)

    # ------------------------------------------------------------------ warm-up
    def warmup(self, cache: PagedKVCache, *, prompt_len: int, prefill: bool = True, decode: bool = True,
               max_kv_len: int | None = None) -> dict[str, float]:
        """Compile the kernels and capture the decode graphs before the first request.

        Runs a prompt of ``prompt_len`` tokens (``prefill``) and one eager decode step plus the
        graph captures of every bucket (``decode``) on a scratch sequence of ``cache``, whose
        pages are freed afterwards. Call it while the engine is idle.

        Returns:
            Seconds per phase: "prefill", "decode", "graphs" (decode graphs), "prompt_graphs",
            "mixed_graphs".
        """
        seconds = {"prefill": 0.0, "decode": 0.0, "graphs": 0.0, "prompt_graphs": 0.0, "mixed_graphs": 0.0}
        # Room for the prompt, its decode token and the fork's copied page (`_warm_fork_copy`).
        prompt_len = max(1, min(prompt_len, (cache.num_free_pages - 1) * cache.page_size - 1))
        factory = RequestFactory(())
        req = factory.new("warmup", [0] * prompt_len, SamplingParams())
        cache.add_sequence(req.seq_id)
        try:
            for phase, n, wanted in (("prefill", prompt_len, prefill), ("decode", 1, decode)):
                if wanted:
                    start = time.perf_counter()
                    self._warm_forward(cache, req, n)
                    if phase == "prefill":
                        self.model.warm_lm_head(self.max_num_seqs)
                        self._warm_fork_copy(cache, factory, req)
                    seconds[phase] = time.perf_counter() - start
                    if phase == "prefill" and self.prompt_graphs is not None:
                        seconds["prompt_graphs"] = self.prompt_graphs.capture_all()
            if decode:
                seconds["graphs"] = self.capture_graphs(None, max_kv_len)
                if self.mixed_graphs is not None:
                    seconds["mixed_graphs"] = self.mixed_graphs.capture_all(max_kv_len)
        finally:
            cache.remove_sequence(req.seq_id)
        return seconds

    def _warm_forward(self, cache: PagedKVCache, req: Request, num_tokens: int) -> None:
        """One eager forward of ``num_tokens`` tokens of ``req`` (compiles what it launches)."""
        plan = cache.begin_forward([req.seq_id], [num_tokens])
        try:
            saved = self.graphs, self.prompt_graphs, self.mixed_graphs
            self.graphs = self.prompt_graphs = self.mixed_graphs = None
            self.execute(plan, [0] * num_tokens, np.zeros(1, dtype=np.int64), [req]).result()
        finally:
            self.graphs, self.prompt_graphs, self.mixed_graphs = saved
            cache.end_forward()

    def _warm_fork_copy(self, cache: PagedKVCache, factory: RequestFactory, parent: Request) -> None:
        """A child forked one token into ``parent``'s first page and run one token: the plan's
        partial-page copy compiles the slot-copy kernel, as a prefix-cache hit that ends mid page
        would otherwise do while serving (a compile stalls every request for seconds)."""
        if cache.page_size < 2 or cache.seq_length(parent.seq_id) < 2 or cache.num_free_pages < 1:
            return
        child = factory.new("warmup-fork", [0, 0], SamplingParams())
        cache.fork_sequence(parent.seq_id, child.seq_id, 1)
        try:
            self._warm_forward(cache, child, 1)
        finally:
            cache.remove_sequence(child.seq_id)

    def capture_graphs(self, batch_sizes: list[int] | None = None, max_kv_len: int | None = None) -> float:
        """Capture decode graphs ahead of serving; return the seconds it took (0 without graphs)."""
        if self.graphs is None:
            return 0.0
        return self.graphs.capture_all(batch_sizes, max_kv_len)
