"""Shared pytest set-up: GPU markers skip with a reason when the hardware is absent."""

from __future__ import annotations

import pytest


def _num_cuda_devices() -> int:
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    num_gpus = _num_cuda_devices()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA GPU; none is visible")
    skip_multi = pytest.mark.skip(reason=f"needs 2+ CUDA GPUs; {num_gpus} visible")
    for item in items:
        if "multigpu" in item.keywords and num_gpus < 2:
            item.add_marker(skip_multi)
        elif "gpu" in item.keywords and num_gpus < 1:
            item.add_marker(skip_gpu)
