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
"""

from __future__ import annotations

import functools
import logging
import os

import torch
from triton.runtime.interpreter import InterpretedFunction

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
