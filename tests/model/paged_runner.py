"""A minimal driver of `Model.forward` over a `PagedKVCache` for model tests, and the
comparison helpers against a transformers model's full forward.

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
