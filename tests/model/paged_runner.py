"""A minimal driver of `Model.forward` over a `PagedKVCache` for model tests.

Feeds prompts in one forward or in chunks, then greedy decode steps, and returns the logits of
each forward, so tests can compare them with transformers' full forward on the same tokens.
"""

from __future__ import annotations

import torch

from disagg.cache import PagedKVCache
from disagg.model import AttentionBatch, Model


class PagedRunner:
    """One model, one KV allocation, one page table; sequences are numbered 0..n-1."""

    def __init__(self, model: Model, *, num_pages: int = 64, page_size: int = 4,
                 kv_dtype: torch.dtype | None = None) -> None:
        self.model = model
        self.cache = PagedKVCache(num_pages, page_size)
        self.kv = torch.zeros(model.kv_shape(num_pages, page_size), dtype=kv_dtype or model.dtype,
                              device=model.device)

    def forward(self, chunks: dict[int, list[int]], **kwargs) -> torch.Tensor:
        """One forward appending `chunks[seq]` to each named sequence: `[B, vocab]` logits."""
        for seq in chunks:
            if seq not in self.cache:
                self.cache.add_sequence(seq)
        seq_ids = list(chunks)
        plan = self.cache.begin_forward(seq_ids, [len(chunks[s]) for s in seq_ids])
        try:
            batch = AttentionBatch.from_plan(plan, self.model.device)
            ids = torch.tensor([t for s in seq_ids for t in chunks[s]], device=self.model.device)
            return self.model.forward(ids, batch, self.kv, **kwargs)
        finally:
            self.cache.end_forward()

    def prefill(self, prompts: list[list[int]], chunk: int | None = None) -> torch.Tensor:
        """All prompts, `chunk` tokens per sequence per forward (all at once when None):
        the logits of each prompt's last token, `[n, vocab]`."""
        done = [0] * len(prompts)
        last: dict[int, torch.Tensor] = {}
        while any(d < len(p) for d, p in zip(done, prompts)):
            step = {}
            for i, p in enumerate(prompts):
                if done[i] < len(p):
                    end = len(p) if chunk is None else min(len(p), done[i] + chunk)
                    step[i] = p[done[i]:end]
                    done[i] = end
            logits = self.forward(step)
            for row, seq in enumerate(step):
                last[seq] = logits[row]
        return torch.stack([last[i] for i in range(len(prompts))])

    def decode(self, tokens: list[int]) -> torch.Tensor:
        """One decode step, token i appended to sequence i: `[n, vocab]`."""
        return self.forward({i: [t] for i, t in enumerate(tokens)})
