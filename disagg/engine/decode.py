"""`DecodeEngine`: receives prompts' KV from prefill workers and runs batched decode steps.

One per decode worker process: a configuration of `EngineCore` (`core.py`) whose KV tensor comes
from the symmetric heap. The request path:

    reserve(request_id, prompt_len, params) -> RecvDest    pages (disagg_prepare_recv) + doorbell
        ... the prefill worker pushes the prompt's KV into those pages and rings the doorbell ...
    start(request_id, first_token_id)                       the first token, sampled by prefill
    step()                                                  polls doorbells; admits a request once
                                                            rung AND started; one decode forward

Pages: `reserve` commits the pages of the request's whole life (prompt + max_tokens, capped by
the context), so a decode step never runs out of pages and never preempts; when the commitment
does not fit, `reserve` raises `OutOfPages` and the caller queues. Until the doorbell rings the
pages belong to the sender (the connector's receiver holds the reservation under a lease:
`disagg.transfer.connector.KVReceiver`): an abort quarantines them, a lease expiry frees them
and fails the request (finish_reason "error"). When the caller knows that no sender
will write them (the prefill side refused the request or never got it, or its abort reported
`PushState.QUIESCED`), `cancel_reservation(dest)` frees them at once, quarantined or not.

`add(request_id, prompt, params)` also takes a request to prefill here in chunks beside the
decodes (the router's "local" placement), as a colocated engine would; such a request, unlike a
received one, may be preempted and recomputed when pages run short.

Host/GPU overlap of a step (CUDA): the decode forward is a CUDA-graph replay (`runner`), followed
by sampling; while the GPU runs them, the host polls the doorbells and leases (requests rung now
join the next step), then reserves the next step's slots and builds its plan (`begin_forward` +
`end_forward`, the plan arrays kept) for every request that surely continues (not at its length
limit). After the sync, if the batch is unchanged (nobody stopped, aborted or
was admitted), the next step reuses that plan and feeds the sampled ids, still on the device,
straight in as its input ids; otherwise the speculative slots are rolled back (`popn(seq, 1)`)
and the plan is rebuilt. Output bookkeeping (stop checks, TokenOutputs) stays after the sync.

`async_scheduling=True` (vLLM's name) also hides that bookkeeping: when the reserved next step
holds exactly this step's requests and nobody waits to join, it is launched before this step's
sync, its input ids the sampled ids still on the device; `step()` then returns this step's
outputs while the next one runs. A request that stops on this step's token (a stop id) wastes
its row of the step already launched: that token is discarded, and the pages of a request that
ends or is aborted are freed only once no launched step writes them. Seeded draws stay a function
of (seed, token index). On by default: without it the GPU idles between steps while the host
does the bookkeeping (`benchmarks/bench_engine.py`, row decode_idle_B64; figures in
benchmarks/records/tuning-notes.md).
"""

from __future__ import annotations

from typing import Hashable

from disagg.engine.core import EngineCore
from disagg.engine.options import EngineOptions
from disagg.engine.request import RecvDest
from disagg.sampling import SamplingParams


class DecodeEngine(EngineCore):
    """Doorbell admission, continuous batching of decode steps, leases.

    Args:
        model: a `disagg.model` Model.
        heap: this PE's symmetric heap (the KV tensor is allocated from it: collective).
        num_pages, page_size: this worker's KV cache (same geometry as the prefill workers').
        max_num_seqs: sequences per decode step.
        max_num_batched_tokens: tokens per forward when it prefills local requests (default:
            ``max(max_num_seqs, 2048)``).
        options: everything else (`EngineOptions`: ``lease_s`` and ``clock`` of the reservations,
            graphs, ``async_scheduling`` (module docstring), prefix caching, KV dtype); the sizes
            may be given there instead of as keywords. None: the defaults.
    """

    def __init__(self, model, heap, *, num_pages: int | None = None, page_size: int | None = None,
                 max_num_seqs: int | None = None, max_num_batched_tokens: int | None = None,
                 options: EngineOptions | None = None) -> None:
        options = (EngineOptions() if options is None else options).with_sizes(
            num_pages=num_pages, page_size=page_size, max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens)
        if options.max_num_batched_tokens is None and options.max_num_seqs is not None:
            options = options.replace(max_num_batched_tokens=max(options.max_num_seqs, 2048))
        super().__init__(model, options, heap=heap)

    def reserve(self, request_id: Hashable, prompt_len: int, params: SamplingParams | None = None, *,
                prompt_token_ids: list[int] | None = None) -> RecvDest:
        """Reserve pages for a prompt's KV and arm its doorbell.

        With ``prompt_token_ids`` (and prefix caching on), the prompt forks from the longest prefix
        of whole pages this instance holds in its prefix cache (never the whole prompt), pages are
        reserved only for the rest, and the returned `RecvDest` says how many tokens that prefix
        holds (``num_cached_tokens``): its map covers only the positions after them. Without the
        ids nothing is matched, and the request's KV is not kept in the cache when it ends.

        Raises:
            ValueError / TypeError: bad id, length or params (nothing changes).
            OutOfPages: the request's pages do not fit now (nothing changes; queue and retry).
            HeapError: every doorbell word is armed (nothing changes).
        """
        return self._reserve(request_id, prompt_len, params, prompt_token_ids)

    def start(self, request_id: Hashable, first_token_id: int) -> None:
        """Hand over the first token (sampled by the prefill side); decoding starts once rung.

        A first token that already ends the request (stop id, max_tokens == 1) ends it here
        with no output of its own (the prefill side reported it); its pages are freed once safe.

        Raises:
            ValueError / TypeError: unknown or already started request, bad token id.
        """
        self._start(request_id, first_token_id)

    def add(self, request_id: Hashable, prompt_token_ids: list[int], params: SamplingParams | None = None) -> None:
        """Queue a request to prefill and decode here (local placement). Raises ValueError /
        TypeError (nothing changes) on bad input."""
        self._add(request_id, prompt_token_ids, params)

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request; pages a sender may still write are quarantined (until the ring, the
        lease expiry or `cancel_reservation`). False if unknown."""
        return self._abort(request_id) is not None

    def cancel_reservation(self, dest: RecvDest) -> None:
        """Free a reservation at once: the caller asserts that no sender will write its pages.

        For a reservation whose KV will never land: the prefill side refused the request or never
        received ``dest``, or its `PrefillEngine.abort` returned `PushState.QUIESCED` (or its
        IN_FLIGHT abort's output came). Its lease closes and its pages go back to the free list:
        a live request ends with an ``"abort"`` output; a quarantined one (aborted earlier) just
        stops waiting for its ring or lease expiry. Calling it while a push may still land hands
        pages that are being written to the next reservation.

        Args:
            dest: what `reserve` returned for the request (its ticket names this reservation, not
                a later one under the same id).

        Raises:
            TypeError: ``dest`` is not a RecvDest.
            ValueError: no open reservation here matches ``dest`` (unknown id, already freed, or
                reserved again), or its doorbell has rung (the KV landed: use `abort`, which
                frees it at once). Nothing changes.
        """
        self._cancel_reservation(dest)

    def stats(self) -> dict:
        """Pages, requests by state, leases, and doorbell totals: ``doorbell_wait_s`` is the time
        reservations waited for their KV (reserve to the ring seen by a step), summed over the
        ``num_doorbells_rung`` that rang; ``num_reservations_cancelled`` counts `cancel_reservation`."""
        receiver = self.receiver
        return {**self._core_stats(), "waiting": len(self.requests) - len(self.running),
                "leases": len(receiver), "quarantined": receiver.num_quarantined,
                "committed_pages": self.num_committed_pages,
                "num_doorbells_rung": receiver.num_landed, "doorbell_wait_s": receiver.wait_s,
                "num_reservations_cancelled": receiver.num_cancelled}

    def warmup(self, max_kv_len: int | None = None, prompt_len: int | None = None) -> dict[str, float]:
        """Compile the decode kernels and capture the graphs before the first request (idle only);
        with ``prompt_len``, the prefill kernels too (for local requests)."""
        return self._warmup(prompt_len=prompt_len, decode=True, max_kv_len=max_kv_len)
