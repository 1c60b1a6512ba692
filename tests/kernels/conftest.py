"""Fixtures for kernel tests: where kernels run, and random paged caches with exact page tables.

Kernel tests compare a launcher against `disagg.kernels.reference`. On a CPU they must run the
Triton kernel itself, which needs `TRITON_INTERPRET=1` set before triton is imported (the
Makefile's `make test` does). Without it and without a GPU, every test that asks for `device`
FAILS, saying how to run it: on CPU tensors the launchers would run the reference, so the tests
would compare the reference with itself and pass without testing a kernel (a quiet green).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import pytest
import torch


@pytest.fixture
def device() -> torch.device:
    """CPU under the Triton interpreter, else the GPU; fail (with how to run) when neither."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.fail(
        "kernel tests need the Triton interpreter or a GPU: without TRITON_INTERPRET=1 the CPU "
        "launchers run the torch reference, and these tests would compare it with itself. Run "
        "`make test`, or `TRITON_INTERPRET=1 pytest tests/kernels` (set before triton is imported)",
        pytrace=False,
    )


@dataclass
class PageTable:
    """A CSR page table over shuffled pages, plus the slots of each sequence's tokens."""

    page_indptr: torch.Tensor
    page_indices: torch.Tensor
    last_page_len: torch.Tensor
    kv_lens: list[int]
    seq_slots: list[torch.Tensor]


def make_page_table(kv_lens: list[int], page_size: int, num_pages: int, *, device,
                    index_dtype=torch.int32, generator=None) -> PageTable:
    """Give each sequence ceil(kv_len / page_size) distinct random pages of a `num_pages` cache."""
    pages_per_seq = [(n + page_size - 1) // page_size for n in kv_lens]
    assert sum(pages_per_seq) <= num_pages, "cache too small for the requested sequences"
    perm = torch.randperm(num_pages, generator=generator)[: sum(pages_per_seq)]
    indptr = [0]
    for n in pages_per_seq:
        indptr.append(indptr[-1] + n)
    last = [n - (p - 1) * page_size if p else 0 for n, p in zip(kv_lens, pages_per_seq)]
    slots = []
    for b, n in enumerate(kv_lens):
        pages = perm[indptr[b]:indptr[b + 1]]
        pos = torch.arange(n)
        slots.append(pages[pos // page_size] * page_size + pos % page_size)
    as_index = lambda x: torch.as_tensor(x, dtype=index_dtype).to(device)
    return PageTable(as_index(indptr), perm.to(index_dtype).to(device), as_index(last),
                     list(kv_lens), slots)


@pytest.fixture
def page_table():
    """The `make_page_table` factory."""
    return make_page_table
