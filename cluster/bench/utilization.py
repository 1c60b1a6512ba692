"""GPU utilization over a run, sampled with nvidia-smi on the bench's host.

`nvidia-smi`'s ``utilization.gpu`` is the share of its sample period (1/6 s to 1 s) during which
one or more kernels ran on the GPU: a kernel-busy fraction that needs nothing from the cluster.
Averaged over a run it says which GPU was the bottleneck (a saturated prefill GPU beside an
idle decode GPU, or two colocated GPUs both busy). The sampler is a child process that prints
a line per GPU every `interval_ms`; on a host without nvidia-smi it yields None. Runs in the
bench process (the Ray driver), which must share the host with the GPUs it reports.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Iterator

logger = logging.getLogger(__name__)
QUERY = ["--query-gpu=index,utilization.gpu", "--format=csv,noheader,nounits"]


def mean_utilization(lines: Iterable[str]) -> dict[str, float] | None:
    """Mean utilization (0..1) per GPU index from ``"index, percent"`` lines; None without any.

    Lines that do not parse (a header, "[N/A]", a cut-off last line) are skipped.
    """
    samples: dict[str, list[float]] = {}
    for line in lines:
        index, sep, percent = line.partition(",")
        try:
            value = float(percent)
        except ValueError:
            continue
        if sep and index.strip().isdigit():
            samples.setdefault(f"gpu{index.strip()}", []).append(value / 100.0)
    return {gpu: sum(values) / len(values) for gpu, values in sorted(samples.items())} or None


@contextlib.contextmanager
def sample_gpus(interval_ms: int = 250) -> Iterator[dict[str, float | None]]:
    """Sample every GPU while the block runs; afterwards ``holder["gpu_utilization"]`` is the
    per-GPU mean (None on a host without nvidia-smi or when no sample came)."""
    holder: dict[str, float | None] = {"gpu_utilization": None}
    binary = shutil.which("nvidia-smi")
    if binary is None:
        yield holder
        return
    with tempfile.TemporaryFile(mode="w+") as sink:  # a file, not a pipe: a long run never blocks it
        process = subprocess.Popen([binary, *QUERY, f"--loop-ms={interval_ms}"], stdout=sink,
                                   stderr=subprocess.DEVNULL, text=True)
        try:
            yield holder
        finally:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            sink.seek(0)
            holder["gpu_utilization"] = mean_utilization(sink.read().splitlines())
