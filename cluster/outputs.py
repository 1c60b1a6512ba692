"""What a caller of the cluster gets back: streamed deltas and finished completions.

`StreamDelta` is one batch of tokens of one request, as one engine step on one actor produced
them (never one message per token); `Completion` is a whole request, with the timings that
`disagg bench` and `Completion.metrics` report. Plain dataclasses, built in the router's thread
and handed to callers on any thread or event loop.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class StreamDelta:
    """New tokens of one request.

    Attributes:
        request_id: the request.
        token_ids: tokens produced since the previous delta (may be empty on an error or abort).
        emit_times: ``time.time()`` at the actor when the step that produced each token ended,
            one per token, seconds since the epoch.
        finished: True on the last delta of the request.
        finish_reason: None until finished; then "stop", "length", "abort" or "error".
        error: what went wrong when finish_reason is "error" (or "abort" by timeout), else None.
        cause: the typed error behind ``error`` (a `disagg.errors.DisaggError`: `NoLiveInstance`,
            `InstanceDied`, `RequestRefused`, `RequestTimedOut`, `SignalTimeout`, ...), else None;
            callers branch on its type, never on the text.
        metrics: the request's `RequestMetrics`, on the last delta only (`Cluster.stream`).
    """

    request_id: str
    token_ids: list[int]
    emit_times: list[float]
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    cause: Exception | None = None
    metrics: RequestMetrics | None = None


@dataclass
class RequestMetrics:
    """Timings of one request, seconds (wall clock, ``time.time()``).

    Attributes:
        arrival_time: when the cluster accepted the request.
        dispatch_time: when the router placed it (decode pages reserved, or handed to a
            colocated instance); None if it never left the queue.
        first_token_time: when the first token was produced (at the actor).
        finished_time: when the last delta was delivered.
        token_times: the actor's emit time of every output token.
        prefill_instance, decode_instance: names of the instances that served it ("prefill-0",
            "decode-1", "colocated-0"), None when not reached.
    """

    arrival_time: float
    dispatch_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    prefill_instance: str | None = None
    decode_instance: str | None = None

    @property
    def ttft_s(self) -> float | None:
        """Time to first token, seconds (arrival to the first token's emit time)."""
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first, seconds (None with fewer than two tokens)."""
        if len(self.token_times) < 2:
            return None
        return (self.token_times[-1] - self.token_times[0]) / (len(self.token_times) - 1)

    @property
    def itl_s(self) -> list[float]:
        """Inter-token latencies, seconds (tokens of one step share a time: 0 between them)."""
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]

    @property
    def e2el_s(self) -> float | None:
        """End-to-end latency, seconds."""
        return None if self.finished_time is None else self.finished_time - self.arrival_time

    @property
    def queue_s(self) -> float | None:
        """Time spent in the router's queue before placement, seconds."""
        return None if self.dispatch_time is None else self.dispatch_time - self.arrival_time


@dataclass
class Completion:
    """One finished request.

    Attributes:
        request_id: the request.
        prompt_token_ids: the prompt as tokens.
        token_ids: every output token.
        text: the decoded output when the model has a tokenizer, else None.
        finish_reason: "stop", "length", "abort" or "error".
        error: the reason when finish_reason is "error" (or a timeout abort), else None.
        metrics: timings (TTFT, TPOT, ...), see `RequestMetrics`.
    """

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str | None
    error: str | None
    metrics: RequestMetrics
