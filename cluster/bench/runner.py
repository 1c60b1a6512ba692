"""Drive one workload through a backend at one request rate and time every token at the client.

The runner knows nothing of clusters or HTTP: a backend turns a `SampleRequest` into an async
stream of `Chunk`s (tokens that arrived together, with the decode actor's emit times when it
has them). Timing follows `vllm bench serve`: a request's clock starts when it is sent (after
the `--max-concurrency` semaphore), TTFT is the first chunk with tokens, each later chunk adds
one ITL gap, E2EL ends at the last chunk. Arrivals come from `arrivals.arrival_offsets`. Runs
in the bench process, on an event loop of its own (`run`), or inside a caller's (`run_async`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from disagg.cluster.bench.arrivals import arrival_offsets
from disagg.cluster.bench.metrics import RequestOutput
from disagg.cluster.bench.workloads import SampleRequest

logger = logging.getLogger(__name__)


@dataclass
class Chunk:
    """Tokens of one request that reached the client together.

    Attributes:
        num_tokens: tokens in this chunk (0 for a chunk that only carries an error or usage).
        emit_times: time.time() at the decode actor when each token left it (may be empty).
        error: set when the server reports that the request failed.
        total_tokens: the server's own count of output tokens so far (HTTP usage), if known.
    """

    num_tokens: int
    emit_times: Sequence[float] = ()
    error: str | None = None
    total_tokens: int | None = None


class Backend(Protocol):
    """What the runner drives. `open`/`aclose` run on the run's event loop, around the run."""

    name: str

    def stream(self, request: SampleRequest) -> AsyncIterator[Chunk]: ...

    async def open(self) -> None: ...

    async def aclose(self) -> None: ...


@dataclass
class RunResult:
    """One run at one rate: per-request records and the run's wall time."""

    outputs: list[RequestOutput]
    duration_s: float
    request_rate: float
    burstiness: float
    max_concurrency: int | None
    warmup_outputs: list[RequestOutput] = field(default_factory=list)


class StreamError(RuntimeError):
    """The backend reported a failed request inside its stream."""


async def measure_request(backend: Backend, request: SampleRequest) -> RequestOutput:
    """Send one request and time what comes back (never raises for a failed request).

    Returns:
        a RequestOutput; on any error success=False, output_len=0 and error holds the reason.
    """
    out = RequestOutput(prompt_len=request.prompt_len, expected_output_len=request.expected_output_len)
    start = time.perf_counter()
    out.start_time = start
    last = start
    num_tokens, server_count = 0, None
    try:
        async with contextlib.aclosing(backend.stream(request)) as chunks:
            async for chunk in chunks:
                now, wall = time.perf_counter(), time.time()
                if chunk.error:
                    raise StreamError(chunk.error)
                if chunk.total_tokens is not None:
                    server_count = chunk.total_tokens
                if chunk.num_tokens <= 0:
                    continue
                if num_tokens == 0:
                    out.ttft = now - start
                else:
                    out.itl.append(now - last)
                last = now
                num_tokens += chunk.num_tokens
                out.client_overheads.extend(wall - emitted for emitted in chunk.emit_times)
        if num_tokens == 0:
            raise StreamError("the stream ended without a token")
        out.output_len = server_count if server_count is not None else num_tokens
        out.latency = last - start
        out.success = True
    except (Exception, asyncio.TimeoutError) as exc:  # a failed request is data, not a crash
        out.success, out.output_len = False, 0
        out.error = str(exc) if isinstance(exc, StreamError) else f"{type(exc).__name__}: {exc}"
    return out


async def run_async(backend: Backend, requests: Sequence[SampleRequest], *, request_rate: float,
                    burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                    num_warmups: int = 0, request_timeout_s: float | None = None,
                    on_done: Callable[[RequestOutput], None] | None = None) -> RunResult:
    """Send `requests` at `request_rate` and collect one RequestOutput each, in workload order.

    Args:
        backend: what serves the requests; opened and closed here.
        requests: the workload (>= 1 request).
        request_rate: requests per second (> 0, inf: all at once).
        burstiness: gamma shape of the gaps (1: Poisson).
        max_concurrency: at most this many requests in flight (None: no cap).
        seed: seeds the arrival gaps.
        num_warmups: requests of the workload (cycled) sent all at once before the timed run,
            as vLLM's warmups are; not counted (CUDA graphs, Triton compiles settle here).
        request_timeout_s: a request still open after this many seconds is cancelled (which
            aborts it on the server) and counted as failed.
        on_done: called with each finished RequestOutput (a progress bar).

    Raises:
        ValueError: empty workload, bad rate/burstiness, or max_concurrency < 1.
    """
    if not requests:
        raise ValueError("requests: expected at least one request, got an empty workload")
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"--max-concurrency: expected an integer >= 1, got {max_concurrency}")
    offsets = arrival_offsets(len(requests), request_rate, burstiness, seed)
    await backend.open()
    try:
        warmups = list(await asyncio.gather(*(measure_request(backend, requests[i % len(requests)])
                                              for i in range(num_warmups))))
        outputs, duration_s = await _timed_run(backend, requests, offsets, max_concurrency,
                                               request_timeout_s, on_done)
    finally:
        await backend.aclose()
    return RunResult(outputs, duration_s, request_rate, burstiness, max_concurrency, warmups)


async def _timed_run(backend: Backend, requests: Sequence[SampleRequest], offsets, max_concurrency,
                     request_timeout_s, on_done) -> tuple[list[RequestOutput], float]:
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()

    async def one(request: SampleRequest) -> RequestOutput:
        async with limit:
            sent = time.perf_counter()
            try:
                out = await asyncio.wait_for(measure_request(backend, request), request_timeout_s)
            except asyncio.TimeoutError:
                out = RequestOutput(prompt_len=request.prompt_len, start_time=sent,
                                    expected_output_len=request.expected_output_len,
                                    error=f"TimeoutError: no completion within {request_timeout_s} s")
        if on_done is not None:
            on_done(out)
        return out

    start = time.perf_counter()
    tasks = []
    for request, offset in zip(requests, offsets):
        delay = start + float(offset) - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(request)))
    outputs = await asyncio.gather(*tasks)
    return list(outputs), time.perf_counter() - start


def warm_up(backend: Backend, requests: Sequence[SampleRequest], num_warmups: int) -> list[RequestOutput]:
    """Send `num_warmups` requests of the workload (cycled) all at once and wait for them; untimed."""
    async def go() -> list[RequestOutput]:
        await backend.open()
        try:
            return list(await asyncio.gather(*(measure_request(backend, requests[i % len(requests)])
                                               for i in range(num_warmups))))
        finally:
            await backend.aclose()
    return asyncio.run(go()) if num_warmups > 0 and requests else []


def run(backend: Backend, requests: Sequence[SampleRequest], **kwargs) -> RunResult:
    """`run_async` on a fresh event loop (the bench command's entry)."""
    return asyncio.run(run_async(backend, requests, **kwargs))
