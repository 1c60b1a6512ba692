"""Request arrival times: Poisson or gamma with a burstiness factor, as `vllm bench serve` does.

Gaps between requests are gamma(shape=burstiness, scale=1/(rate*burstiness)): mean 1/rate for
every burstiness; burstiness 1 is a Poisson process, < 1 burstier, > 1 more regular, inf a
constant gap. Rate inf sends everything at once. Like vLLM, the cumulative offsets are rescaled
so the last one lands at num_requests/rate exactly (a run's offered rate does not drift by the
1-2% that a finite gamma sample would add). Pure numpy; used by the runner.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

ARRIVAL_STREAM = 0xA771  # keeps arrival draws apart from the workload's draws of the same seed


def parse_rates(text: str | Sequence[float]) -> list[float]:
    """Parse ``--request-rate`` values: "4", "1,2,4,inf" or a list of numbers.

    Returns:
        the rates in the order given (requests per second; inf sends all at once).

    Raises:
        ValueError: an empty list, a value that is not a number, or one <= 0 or NaN.
    """
    items = text.replace(" ", "").split(",") if isinstance(text, str) else list(text)
    rates: list[float] = []
    for item in items:
        if item == "":
            continue
        try:
            rate = float(item)
        except (TypeError, ValueError):
            raise ValueError(f"--request-rate: expected numbers > 0 (or inf) separated by commas, "
                             f"got {item!r}") from None
        if math.isnan(rate) or rate <= 0:
            raise ValueError(f"--request-rate: expected a rate > 0 requests/s (or inf), got {item!r}")
        rates.append(rate)
    if not rates:
        raise ValueError(f"--request-rate: expected at least one rate such as 4 or 1,2,4,inf, got {text!r}")
    return rates


def check_burstiness(burstiness: float) -> float:
    """Return `burstiness` after checking it is > 0 (inf allowed).

    Raises:
        ValueError: burstiness <= 0 or NaN.
    """
    if math.isnan(burstiness) or burstiness <= 0:
        raise ValueError(f"--burstiness: expected a factor > 0 (1 = Poisson), got {burstiness}")
    return burstiness


def arrival_offsets(num_requests: int, request_rate: float, burstiness: float = 1.0, seed: int = 0,
                    *, normalize: bool = True) -> np.ndarray:
    """Send offsets of `num_requests` requests from the start of a run.

    Args:
        num_requests: >= 1.
        request_rate: requests per second, > 0; inf sends all at offset 0.
        burstiness: gamma shape, > 0; 1 is Poisson; inf gives constant gaps.
        seed: seeds the gaps (same seed, same offsets).
        normalize: rescale so the last offset is num_requests / request_rate (vLLM's rule).

    Returns:
        [num_requests] float64 seconds, non-decreasing; the first gap is drawn too (as vLLM
        does), so offset 0 is not forced.

    Raises:
        ValueError: num_requests < 1, a rate <= 0, or burstiness <= 0.
    """
    if isinstance(num_requests, bool) or not isinstance(num_requests, int) or num_requests < 1:
        raise ValueError(f"num_requests: expected an integer >= 1, got {num_requests!r}")
    parse_rates([request_rate])
    check_burstiness(burstiness)
    if math.isinf(request_rate):
        return np.zeros(num_requests)
    if math.isinf(burstiness):
        gaps = np.full(num_requests, 1.0 / request_rate)
    else:
        rng = np.random.default_rng((seed, ARRIVAL_STREAM))
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num_requests)
    offsets = np.cumsum(gaps)
    if normalize and offsets[-1] > 0:
        offsets *= (num_requests / request_rate) / offsets[-1]
    return offsets
