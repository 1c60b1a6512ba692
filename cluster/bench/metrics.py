"""Client-side serving metrics, computed exactly as `vllm bench serve` computes them.

Every number here derives from per-request records (`RequestOutput`) that the runner fills at
the client: TTFT (send to first token), ITL (gaps between streamed chunks that carry tokens),
E2EL (send to last token) and TPOT = (E2EL - TTFT) / (output_len - 1). A request with one output
token has no TPOT: it is left out of the TPOT statistics, and counts as TPOT 0 when goodput is
judged (vLLM's rule). Failed requests add nothing to the latency statistics and count as
misses in SLO attainment. The key names of `compute_metrics` are vLLM's, so a result file reads
the same as one from `vllm bench serve`. Pure Python + numpy; runs in the bench's own process.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

MS_PER_S = 1000.0
DEFAULT_PERCENTILES: tuple[float, ...] = (50.0, 90.0, 99.0)
SLO_NAMES: tuple[str, ...] = ("ttft", "tpot", "e2el")
LATENCY_METRICS: tuple[str, ...] = ("ttft", "tpot", "itl", "e2el")


@dataclass
class RequestOutput:
    """What the client saw of one request (times in seconds).

    Attributes:
        success: the stream ended without an error.
        prompt_len: prompt tokens sent.
        output_len: output tokens received (0 when the request failed).
        ttft: send to first token.
        itl: gaps between consecutive chunks that carried tokens.
        latency: send to last token (E2EL).
        start_time: when the request was sent (time.perf_counter of the bench process).
        error: the error text of a failed request, else "".
        expected_output_len: the output length the workload asked for.
        client_overheads: per token, client receive time minus the time the decode actor emitted
            it (both time.time() on one host); empty when the backend gives no emit times.
    """

    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    error: str = ""
    expected_output_len: int = 0
    client_overheads: list[float] = field(default_factory=list)

    @property
    def tpot(self) -> float | None:
        """(E2EL - TTFT) / (output_len - 1); None for failed or one-token requests."""
        if not self.success or self.output_len <= 1:
            return None
        return (self.latency - self.ttft) / (self.output_len - 1)


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """Parse `--goodput` pairs such as ``["ttft:200", "tpot:50"]`` into ``{name: ms}``.

    Raises:
        ValueError: a pair that is not NAME:NUMBER, a name outside ttft/tpot/e2el, or a negative
            or non-finite value; the message names the pair and what was expected.
    """
    slos: dict[str, float] = {}
    for pair in pairs:
        for item in str(pair).replace(",", " ").split():
            name, sep, value = item.partition(":")
            if not sep:
                raise ValueError(f"--goodput: expected NAME:MILLISECONDS such as ttft:200, got {item!r}")
            if name not in SLO_NAMES:
                raise ValueError(f"--goodput: SLO name must be one of {list(SLO_NAMES)}, got {name!r} in {item!r}")
            try:
                value_ms = float(value)
            except ValueError:
                raise ValueError(f"--goodput: {name} expects a number of milliseconds, got {value!r} "
                                 f"in {item!r}") from None
            if not np.isfinite(value_ms) or value_ms < 0:
                raise ValueError(f"--goodput: {name} expects a finite number >= 0 ms, got {value!r}")
            slos[name] = value_ms
    return slos


def meets_slos(output: RequestOutput, slos_ms: Mapping[str, float]) -> bool:
    """True when a successful request is inside every SLO (vLLM's goodput test: value <= SLO).

    A one-token request's TPOT counts as 0. A failed request never meets its SLOs.
    """
    if not output.success:
        return False
    values = {"ttft": output.ttft, "tpot": output.tpot or 0.0, "e2el": output.latency}
    return all(values[name] <= limit / MS_PER_S for name, limit in slos_ms.items())


def slo_attainment(outputs: Sequence[RequestOutput], slos_ms: Mapping[str, float]) -> float:
    """Fraction of ALL requests (failed ones count as misses) inside every SLO (DistServe).

    Returns 0.0 for an empty list.
    """
    if not outputs:
        return 0.0
    return sum(meets_slos(out, slos_ms) for out in outputs) / len(outputs)


def summarize(values: Sequence[float], name: str,
              percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float]:
    """mean/median/std and percentiles of `values` (seconds) as vLLM's ``*_{name}_ms`` keys.

    An empty list gives zeros, as vLLM's ``np.mean(x or 0)`` does. Percentiles interpolate
    linearly between order statistics (numpy's default, vLLM's too).
    """
    data = np.asarray(list(values) or [0.0], dtype=np.float64) * MS_PER_S
    stats = {f"mean_{name}_ms": float(np.mean(data)), f"median_{name}_ms": float(np.median(data)),
             f"std_{name}_ms": float(np.std(data))}
    for p in percentiles:
        word = str(int(p)) if int(p) == p else str(p)
        stats[f"p{word}_{name}_ms"] = float(np.percentile(data, p))
    return stats


def compute_metrics(outputs: Sequence[RequestOutput], duration_s: float,
                    goodput_slos_ms: Mapping[str, float] | None = None,
                    percentiles: Sequence[float] = DEFAULT_PERCENTILES) -> dict[str, float | int | None]:
    """Aggregate metrics of one run, under vLLM's key names.

    Args:
        outputs: one record per request sent, failed ones included.
        duration_s: wall time of the run (first send to last completion), > 0.
        goodput_slos_ms: ``{"ttft"|"tpot"|"e2el": ms}``; empty or None: request_goodput is None.
        percentiles: which percentiles to report, e.g. (50, 90, 99).

    Returns:
        completed, failed, total_input_tokens, total_output_tokens, request_throughput,
        request_goodput, output_throughput, total_token_throughput, slo_attainment (None without
        SLOs), {mean,median,std,pXX}_{ttft,tpot,itl,e2el,client_overhead}_ms,
        max_output_tokens_per_s, max_concurrent_requests.

    Raises:
        ValueError: duration_s is not a positive finite number.
    """
    if not (duration_s > 0 and np.isfinite(duration_s)):
        raise ValueError(f"duration_s: expected a positive finite number of seconds, got {duration_s!r}")
    done = [out for out in outputs if out.success]
    total_input = sum(out.prompt_len for out in done)
    total_output = sum(out.output_len for out in done)
    metrics: dict[str, float | int | None] = {
        "completed": len(done), "failed": len(outputs) - len(done),
        "total_input_tokens": total_input, "total_output_tokens": total_output,
        "request_throughput": len(done) / duration_s,
        "request_goodput": None, "slo_attainment": None,
        "output_throughput": total_output / duration_s,
        "total_token_throughput": (total_input + total_output) / duration_s,
    }
    if goodput_slos_ms:
        metrics["request_goodput"] = sum(meets_slos(out, goodput_slos_ms) for out in done) / duration_s
        metrics["slo_attainment"] = slo_attainment(outputs, goodput_slos_ms)
    series = {
        "ttft": [out.ttft for out in done],
        "tpot": [out.tpot for out in done if out.tpot is not None],
        "itl": [gap for out in done for gap in out.itl],
        "e2el": [out.latency for out in done],
        "client_overhead": [lag for out in done for lag in out.client_overheads],
    }
    for name, values in series.items():
        metrics.update(summarize(values, name, percentiles))
    metrics["max_output_tokens_per_s"] = peak_output_tokens_per_s(done)
    metrics["max_concurrent_requests"] = peak_concurrency(done)
    return metrics


def peak_output_tokens_per_s(done: Sequence[RequestOutput]) -> float:
    """The busiest one-second bucket of token arrivals (vLLM's count: one token per streamed chunk)."""
    if not done:
        return 0.0
    origin = min(out.start_time for out in done)
    times = []
    for out in done:
        arrival = out.start_time + out.ttft
        times.append(arrival)
        for gap in out.itl:
            arrival += gap
            times.append(arrival)
    buckets = np.bincount(np.floor(np.asarray(times) - origin).astype(np.int64).clip(min=0))
    return float(buckets.max())


def peak_concurrency(done: Sequence[RequestOutput]) -> int:
    """Most successful requests open at once, over half-open [send, last token) intervals."""
    events = sorted([(out.start_time, 1) for out in done] + [(out.start_time + out.latency, -1) for out in done])
    peak = current = 0
    for _, step in events:
        current += step
        peak = max(peak, current)
    return peak
