"""One HTTP request's run on the cluster: `cluster.stream` deltas in, text chunks out.

`Generation.chunks()` opens `cluster.stream(prompt, params, request_id=...)`, turns each
`StreamDelta` into a `Chunk` (token ids + the text they add, stop strings applied), and closes
the cluster stream on every exit path: finished, stop string matched, client gone (the consumer
closed or cancelled it), or failed. Closing an unfinished cluster stream aborts the request and
releases its pages on both sides (the Cluster contract). The timings it keeps feed the server's
Prometheus histograms. Runs in the server's event loop; the cluster bridges to its router loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

from disagg.cluster.serve.detokenize import OutputText
from disagg.cluster.serve.prompts import PreparedRequest


class GenerationFailed(Exception):
    """The cluster ended a request with an error (a worker failed, a lease expired, ...).

    Attributes:
        finish_reason: the cluster's finish reason ("error" or "abort").
        cause: the typed error the cluster gave (`StreamDelta.cause`), or None.
    """

    def __init__(self, message: str, finish_reason: str = "error", cause: BaseException | None = None) -> None:
        super().__init__(message)
        self.finish_reason = finish_reason
        self.cause = cause


@dataclass
class Chunk:
    """What one cluster delta adds to the response.

    Attributes:
        text: new output text (may be empty: held back, or no tokenizer).
        token_ids: new output token ids, exactly as the cluster produced them.
        finish_reason: None while running; "stop", "length" or "abort" on the last chunk.
        stop_reason: the stop string or stop token id that ended the output, or None.
    """

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class GenerationTimes:
    """Timings of one request for the metrics (seconds; monotonic unless named otherwise)."""

    arrival: float = field(default_factory=time.monotonic)
    first_token: float | None = None
    finished: float | None = None
    token_emit_times: list[float] = field(default_factory=list)  # time.time() at the actors
    num_output_tokens: int = 0
    outcome: str = "running"  # then a finish reason, "client_disconnect", or "error"
    cluster_metrics: Any = None  # the cluster's `RequestMetrics` (wall clock), from the last delta


class Generation:
    """One request's stream of chunks from the cluster.

    Args:
        cluster: the `Cluster` (its `stream` method is used).
        request_id: the id the cluster knows the request by.
        prepared: prompt ids, sampling params, stop strings.
        tokenizer: the model's tokenizer, or None (then every chunk's text is empty).
    """

    def __init__(self, cluster: Any, request_id: str, prepared: PreparedRequest, tokenizer: Any | None) -> None:
        self.cluster = cluster
        self.request_id = request_id
        self.prepared = prepared
        self.times = GenerationTimes()
        self.released = False  # set by the app once it has counted the request out
        self._text = OutputText(tokenizer, prepared.stop_strings)

    async def chunks(self) -> AsyncIterator[Chunk]:
        """Yield the output chunk by chunk; the last has a finish_reason.

        Raises:
            GenerationFailed: the cluster reported an error for this request.
            Exception: whatever `cluster.stream` raises before the first delta (queue full, no
                healthy instance), unchanged, for the app to map to an HTTP status.
        """
        stream = self.cluster.stream(self.prepared.prompt_token_ids, self.prepared.params,
                                     request_id=self.request_id)
        try:
            async for delta in stream:
                chunk = self._on_delta(delta)
                yield chunk
                if chunk.finish_reason is not None:
                    self.times.outcome = chunk.finish_reason
                    return
            raise GenerationFailed(f"request {self.request_id}: the cluster stream ended without a "
                                   "finished output")
        except GenerationFailed:
            self.times.outcome = "error"
            raise
        finally:
            if self.times.outcome == "running":
                self.times.outcome = "client_disconnect"
            self.times.finished = time.monotonic()
            await stream.aclose()  # aborts the request on the cluster if it has not finished

    def _on_delta(self, delta: Any) -> Chunk:
        if delta.error is not None:
            raise GenerationFailed(f"request {self.request_id} failed: {delta.error}",
                                   delta.finish_reason or "error", getattr(delta, "cause", None))
        ids = list(delta.token_ids)
        if getattr(delta, "metrics", None) is not None:
            self.times.cluster_metrics = delta.metrics
        if ids and self.times.first_token is None:
            self.times.first_token = time.monotonic()
        self.times.num_output_tokens += len(ids)
        self.times.token_emit_times.extend(delta.emit_times)
        stop_reason: int | str | None = None
        text_ids = ids
        if delta.finished and delta.finish_reason == "stop" and ids and ids[-1] in self.prepared.text_stop_ids:
            stop_reason = ids[-1]  # EOS or a stop token id: emitted as an id, not as text
            text_ids = ids[:-1]
        text = self._text.add(text_ids)
        if text.stop is not None:
            return Chunk(text.text, ids, "stop", text.stop)
        if delta.finished:
            tail = self._text.flush()
            reason = "stop" if tail.stop is not None else delta.finish_reason
            return Chunk(text.text + tail.text, ids, reason, tail.stop or stop_reason)
        return Chunk(text.text, ids)
