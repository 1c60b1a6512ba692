"""`PrefillEngine`: computes prompts and pushes their KV, layer by layer, into decode workers' pages.

One per prefill worker process: a configuration of `EngineCore` (`core.py`) whose KV tensor
comes from the symmetric heap. A request arrives
with the decode side's `RecvDest` (compressed map of the reserved slots, PE, doorbell ticket).
When it is admitted into the local cache, `disagg_mark_send(seq, 0, cmap, pe)` names where every
prompt token goes and the connector's sender is attached to the destination
(`disagg.transfer.connector.KVSender`); then each forward (prompts batched, long ones chunked
under ``max_num_batched_tokens``) runs

    plan = cache.begin_forward(...) -> sender.begin_forward(plan) -> model.forward(...), whose
    attention hands each layer's K/V to sender.save_layer (`AttentionBatch.kv_writer`)
    -> sender.end_forward()  (rings the doorbells of prompts this forward completed)

so the push of a chunked prompt continues across forwards. A completed prompt yields its first
sampled token (`TokenOutput`, ``finished`` only when that token already ends the request) and
leaves the local cache once its pushes and doorbell are done (the end_forward event on CUDA;
at once on CPU, where the push ran inline). A request is admitted only when its whole prompt
fits in the free pages, so a started push never waits for pages.

A request added without a ``dest`` is kept: computed and decoded here (the router's "kept"
placement, for when the decode side is full); its decode steps run eagerly (no CUDA graphs on a
prefill worker).

An abort says whether the decode pages may still be written (`PushState`): QUIESCED when no
forward pushed the request (still queued, or admitted but never scheduled) or every forward that
did has completed; IN_FLIGHT while the last such forward's transfers may run on (CUDA: a fence
event after them has not completed). An IN_FLIGHT abort's ``"abort"`` output comes from the step
that sees the fence complete: that output is the word that its decode reservation may be freed.
"""

from __future__ import annotations

from typing import Hashable

from disagg.engine.core import EngineCore
from disagg.engine.options import EngineOptions
from disagg.engine.request import PushState, RecvDest
from disagg.sampling import SamplingParams

# A prefill engine's options when none are given: no decode graphs (it decodes only the requests
# the router keeps on it, which a fixed disaggregated fleet never does).
PREFILL_DEFAULTS = EngineOptions(use_cuda_graphs=False)


class PrefillEngine(EngineCore):
    """Batched, chunked prefill with layer-wise KV push.

    Args:
        model: a `disagg.model` Model.
        heap: this PE's symmetric heap (the KV tensor is allocated from it: collective).
        num_pages, page_size: this worker's KV cache.
        max_num_seqs: prompts per forward.
        max_num_batched_tokens: tokens per forward.
        options: everything else (`EngineOptions`: ``force_segment_puts``, ``push_after``, graphs,
            prefix caching (pushes still start at the decode side's ``dest.num_cached_tokens``),
            async scheduling of the requests it keeps and decodes); the sizes may be given there
            instead of as keywords. None: `PREFILL_DEFAULTS` (decode graphs off: a prefill engine
            of a fixed disaggregated fleet never decodes). Its ``prompt_graphs`` None means on
            (on CUDA), whatever ``use_cuda_graphs`` says.
    """

    def __init__(self, model, heap, *, num_pages: int | None = None, page_size: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 options: EngineOptions | None = None) -> None:
        options = (PREFILL_DEFAULTS if options is None else options).with_sizes(
            num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens)
        super().__init__(model, options.replace(prompt_graphs=options.prompt_graphs is not False), heap=heap)

    def add(self, request_id: Hashable, prompt_token_ids: list[int], params: SamplingParams | None,
            dest: RecvDest | None) -> None:
        """Queue a prompt whose KV goes to ``dest`` (None: keep and decode it here).

        Raises:
            ValueError / TypeError: bad id, prompt, params or ``dest`` (nothing changes).
        """
        self._add(request_id, prompt_token_ids, params, dest)

    def abort(self, request_id: Hashable) -> PushState | None:
        """Stop a prompt: it leaves the queue or the cache, its pushes stop, its doorbell never rings.

        Returns:
            None when the request is not here (unknown, or its prompt already completed: the
            doorbell rang or will, which ends the decode side's lease). Else whether a push of it
            may still land in its decode pages (`PushState`): QUIESCED, the ``"abort"`` output
            follows in the next step; IN_FLIGHT, the ``"abort"`` output comes from the step that
            sees the pushes complete, and the id cannot be added again before it.
        """
        return self._abort(request_id)

    def stats(self) -> dict:
        """Pages, queue lengths (``running``: prompts in the cache and kept requests decoding;
        ``quiescing``: aborts whose pushes may still land) and push totals: ``pushed_bytes`` (KV
        sent to decode workers), ``push_s`` (seconds of the forwards that sent it) and
        ``push_gbps`` (their ratio, GB/s: the rate KV leaves this worker while it prefills, a
        lower bound of the link's)."""
        in_cache = sum(r.in_cache for r in self.scheduler.waiting)
        sender = self._sender
        return {**self._core_stats(), "running": len(self.running) + in_cache,
                "waiting": len(self.scheduler.waiting) - in_cache,
                "draining": sender.num_retiring if sender is not None else 0,
                "quiescing": sender.num_quiescing if sender is not None else 0,
                "pushed_bytes": self.pushed_bytes, "push_s": self.push_s,
                "push_gbps": self.pushed_bytes / self.push_s / 1e9 if self.push_s else 0.0}

    def warmup(self, prompt_len: int | None = None, max_kv_len: int | None = None) -> dict[str, float]:
        """Compile the prefill kernels (attention, projections) before the first request (idle
        only); with ``max_kv_len``, the decode kernels too (for kept requests). The push kernel
        compiles on the first push."""
        if self.has_work():
            raise RuntimeError("warmup: the engine has requests; call it before the first add")
        return self._warmup(prompt_len=prompt_len or self.max_num_batched_tokens, decode=max_kv_len is not None,
                            max_kv_len=max_kv_len)
