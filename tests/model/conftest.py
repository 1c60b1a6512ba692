"""Model test fixtures: kernel paths, CPU threads, the real SmolLM2 weights, transformers parity.

`reference_kernels` runs the kernel launchers' torch references (TRITON_INTERPRET=0; the variable
is read at call time) for real-size models, whose Triton-interpreter runs would take minutes.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # the helper module paged_runner

from paged_runner import PagedRunner  # noqa: E402


@pytest.fixture
def reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """CPU kernels run their torch references in this test."""
    monkeypatch.setenv("TRITON_INTERPRET", "0")


@pytest.fixture(autouse=True)
def one_cpu_thread():
    """One intra-op thread: on a shared 2-core runner, torch's thread pool spin-waits behind
    other processes and small GEMMs take 5-50x longer."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """SmolLM2-135M-Instruct as an HF directory (converted once, cached outside the repo)."""
    from disagg.model.smollm2 import SmolLM2Unavailable, ensure_smollm2

    try:
        return ensure_smollm2()
    except SmolLM2Unavailable as exc:
        pytest.skip(f"real-weights tests need the SmolLM2 GGUF: {exc}")


def paged_vs_full(model, prompts: list[list[int]], *, chunk: int | None, num_decode: int,
                  page_size: int = 4, num_pages: int = 128):
    """Run `prompts` through our paged forward (prefill in `chunk`-token pieces, then greedy
    decode steps feeding back the argmax) and return (ours `[n, steps, V]`, the tokens each
    prefix ends with `[n][steps]` positions, full token lists) for comparison with a full forward."""
    runner = PagedRunner(model, page_size=page_size, num_pages=num_pages)
    steps = [runner.prefill(prompts, chunk)]
    tokens = [list(p) for p in prompts]
    for _ in range(num_decode):
        next_ids = steps[-1].argmax(-1).tolist()
        for seq, t in zip(tokens, next_ids):
            seq.append(t)
        steps.append(runner.decode(next_ids))
    ours = torch.stack(steps, dim=1)  # [n, steps, V]
    positions = [[len(p) - 1 + s for s in range(num_decode + 1)] for p in prompts]
    return ours, positions, tokens


def hf_logits_at(hf_model, tokens: list[list[int]], positions: list[list[int]]) -> torch.Tensor:
    """transformers' logits of each full sequence at `positions`: `[n, steps, V]` float32."""
    rows = []
    with torch.no_grad():
        for seq, pos in zip(tokens, positions):
            logits = hf_model(torch.tensor([seq])).logits[0].float()
            rows.append(logits[pos])
    return torch.stack(rows)
