"""Where a kernel call runs, and whether its launcher may read index values.

Every launcher in `disagg.kernels` asks this module two questions before it launches:

- `use_triton(tensor)`: CUDA tensors run the Triton kernel; CPU tensors run the torch reference
  from `disagg.kernels.reference`, unless `TRITON_INTERPRET=1` is set, in which case the Triton
  kernel itself runs in Triton's interpreter (how CI tests the kernels). The variable is read at
  call time. Triton decides at *import* time whether `@triton.jit` makes interpreted functions,
  so the interpreter only works when the variable was already set when triton was imported; a
  launcher asked to interpret a compiled kernel says so instead of failing obscurely.
- `should_check_values(device, check_indices)`: reading index values (page ids, slots) on a CUDA
  device is a device-to-host copy, which blocks the host and is illegal while a CUDA graph is
  being captured. Policy: CPU tensors are always checked; CUDA tensors are checked unless the
  caller passes `check_indices=False` (its plan was validated on the host, e.g. by
  `disagg.cache`) or the current stream is capturing (then the check is skipped: capture only
  records work). `check_indices=True` during capture is refused.

`layer_pdl(device)` says whether the decoder layer's small kernels (`disagg.kernels.fused`,
`disagg.kernels.linear`, `disagg.kernels.rope_append`) launch with programmatic dependent launch,
on a CUDA device whose Triton has it: with the `layer_pdl` setting (`disagg.settings`, env
`DISAGG_LAYER_PDL`) "auto" (the default) inside the decode graphs of small batches
(`small_batch_graph`, which `disagg.engine.graphs` sets while it captures them), true always,
false never.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from collections.abc import Iterator
from typing import Callable, Sequence

import torch
from triton.runtime import driver
from triton.runtime.interpreter import InterpretedFunction

from disagg.settings import ENV_VARS, current

logger = logging.getLogger(__name__)


def interpreting() -> bool:
    """True when `TRITON_INTERPRET=1` is set in the environment now."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def use_triton(tensor: torch.Tensor) -> bool:
    """Whether a call on `tensor`'s device runs the Triton kernel (else the torch reference)."""
    return tensor.is_cuda or interpreting()


def runnable(kernel):
    """Return `kernel` after checking it can run where the caller's tensors live.

    Raises:
        RuntimeError: `TRITON_INTERPRET=1` was set after triton was imported, so the kernel was
            compiled for a GPU and cannot run on CPU tensors.
    """
    if interpreting() and not isinstance(kernel, InterpretedFunction):
        raise RuntimeError(
            f"TRITON_INTERPRET=1 is set but {kernel.fn.__name__} was built for the GPU: set "
            "TRITON_INTERPRET=1 before the first `import triton` (e.g. on the pytest command line)"
        )
    return kernel


LAYER_PDL_ENV = ENV_VARS["layer_pdl"]
_small_batch = threading.local()


@contextlib.contextmanager
def small_batch_graph(enabled: bool = True) -> Iterator[None]:
    """Mark the forwards run inside (on this thread) as a small batch's decode graph: there the
    layer kernels launch with PDL (`layer_pdl`) and the projections take the skinny GEMM
    (`disagg.model.layers.use_skinny_linear`), by default. Nests; restores the outer mark."""
    previous = getattr(_small_batch, "on", False)
    _small_batch.on = bool(enabled)
    try:
        yield
    finally:
        _small_batch.on = previous


def in_small_batch_graph() -> bool:
    """Whether this thread is inside `small_batch_graph()`."""
    return getattr(_small_batch, "on", False)


def layer_pdl(device: torch.device) -> bool:
    """Whether the layer kernels launch with PDL on `device` (see the module docstring), by the
    settings of the forward running on this thread (`disagg.settings.current`).

    Raises:
        ConfigError (a ValueError): outside a forward, `DISAGG_LAYER_PDL` is not one of auto, 1, 0.
    """
    setting = current().layer_pdl
    on = setting is True or (setting == "auto" and in_small_batch_graph())
    if device.type != "cuda" or not on:
        return False
    from disagg.kernels.paged_tile import HAS_PDL, note_missing_pdl
    if not HAS_PDL:
        note_missing_pdl()
    return HAS_PDL


def pdl_options(device: torch.device) -> dict[str, object]:
    """Launch keywords of a layer kernel with a `PDL` constexpr: `PDL`, and `launch_pdl` when on."""
    on = layer_pdl(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}


def is_capturing(device: torch.device) -> bool:
    """True while the current CUDA stream of `device` is capturing a graph."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def should_check_values(device: torch.device, check_indices: bool | None) -> bool:
    """Whether a launcher should read index values to range-check them (see module docstring).

    Args:
        device: the device of the index tensors.
        check_indices: the caller's choice; None means "check when it is free of side effects".

    Raises:
        ValueError: `check_indices=True` while a CUDA graph is being captured.
    """
    capturing = is_capturing(device)
    if check_indices is None:
        return not capturing
    if check_indices and capturing:
        raise ValueError(
            "check_indices=True needs index values on the host, which a CUDA graph capture "
            "cannot read; pass check_indices=False (validate the plan on the host) or None"
        )
    return bool(check_indices)


@functools.lru_cache(maxsize=None)
def num_sms(device_index: int) -> int:
    """Streaming multiprocessors of CUDA device `device_index` (cached)."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(device: torch.device) -> int:
    """SM count of `device`; a nominal 132 (one H100/H200) for CPU runs of the same heuristics."""
    if device.type != "cuda":
        return 132
    index = device.index if device.index is not None else torch.cuda.current_device()
    return num_sms(index)


def compiled_launcher(kernel, grid: Sequence[int], args: Sequence[object],
                      options: dict[str, object]) -> Callable[..., None] | None:
    """The compiled `kernel` for `args`, as a raw launcher `launch(*args, stream=handle)`.

    Uses what Triton 3.6 and 3.9 both provide: `JITFunction.warmup(*args, grid=, **options)`
    compiles (or finds in Triton's caches) the kernel for the arguments' specialization without
    launching it and returns the `CompiledKernel`; `CompiledKernel[grid]` is its launcher, which
    takes every argument positionally (constexprs included, in signature order) and a raw stream
    handle. The launcher does not re-derive the specialization: the caller must pass arguments
    that specialize like `args` (same dtypes, same 16-byte alignment of every pointer, same int
    values' divisibility by 16 and equality to 1) and must launch on the device current now.

    Args:
        kernel: a `@triton.jit` function.
        grid: up to 3 program counts.
        args: every kernel argument, in signature order, constexprs included.
        options: launch options such as `num_warps`.

    Returns:
        The launcher, or None when there is no compiled kernel to launch directly (Triton's
        interpreter; a JIT cache hook that declined to compile): launch the usual way then.
    """
    if isinstance(kernel, InterpretedFunction):
        return None
    compiled = kernel.warmup(*args, grid=tuple(grid), **options)
    if compiled is not None and hasattr(compiled, "result"):  # async compile mode: a future
        compiled = compiled.result()
    if compiled is None:
        return None
    return compiled[tuple(grid) + (1,) * (3 - len(grid))]


def stream_handle_getter() -> Callable[[int], int]:
    """Triton's own "current stream of device i" (a raw handle, no Stream object made)."""
    return driver.active.get_current_stream


def compiled_variants(kernel) -> int:
    """How many specializations of `kernel` Triton has compiled in this process (all devices).

    Serving must not compile after warm-up (a compile stalls every request for seconds); tests
    count variants before and after a workload to prove it. 0 under the interpreter.
    """
    caches = getattr(kernel, "device_caches", None) or {}
    return sum(len(entry[0]) for entry in caches.values())
