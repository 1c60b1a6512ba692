"""The sampler: logits of a batch -> one token per row, on the logits' device, no host sync.

Called by `disagg.engine.runner` after each forward, in the engine's process. Each row carries
its own temperature, top-k, top-p, seed and step (the index of the token being sampled, counted
from ``SamplingParams.draw_offset``: a migrated request's draws go on where they stopped). Greedy
rows take the argmax. Sampled rows take ``argmax(logits / T + gumbel)`` over the tokens that
survive top-k/top-p (the Gumbel-max trick: an exact draw from the softmax), with the Gumbel noise
a counter-based hash of ``(seed, step, token id)``: no generator state, so a request's draws do
not depend on which other rows share its batch, on the batch order, or on preemption; and the
whole thing is plain tensor ops (capturable).

`SamplingBatch` packs the per-row values once per step (host -> device in one copy) and knows
which paths are needed, so an all-greedy batch is one argmax (and sends nothing to the device).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from disagg.engine.request import Request

_MASK32 = 0xFFFFFFFF
_MUL = 0x45D9F3B  # < 2**31: a product with a 32-bit value stays below 2**63 (no int64 overflow)


@dataclass
class SamplingBatch:
    """Per-row sampling values of one step, on the device.

    Attributes:
        temperature: ``[B]`` float32 (0 for greedy rows).
        top_k: ``[B]`` int64 (0: no cut). top_p: ``[B]`` float32.
        seed: ``[B]`` int64. step: ``[B]`` int64 (tokens the request has generated so far, plus
            its ``draw_offset``).
        sampled_rows: ``[S]`` int64 indices of the non-greedy rows; None when every row is greedy,
            and then the five tensors above are None too (an argmax needs none of them, so the
            usual all-greedy decode step packs and copies nothing).
        any_top_k, any_top_p: whether some sampled row cuts.
    """

    temperature: torch.Tensor | None
    top_k: torch.Tensor | None
    top_p: torch.Tensor | None
    seed: torch.Tensor | None
    step: torch.Tensor | None
    sampled_rows: torch.Tensor | None
    any_top_k: bool
    any_top_p: bool

    @classmethod
    def from_requests(cls, requests: list[Request], device: torch.device,
                      step_offset: int | list[int] = 0) -> SamplingBatch:
        """Pack the rows of ``requests`` (in batch order) into one host->device copy; a row's
        step is its request's generated tokens + ``step_offset`` (1 when the previous step's
        token is not appended yet; a list: one per row) + its params' ``draw_offset``."""
        n = len(requests)
        if all(req.params.temperature == 0.0 for req in requests):
            return cls(None, None, None, None, None, None, False, False)
        offsets = [step_offset] * n if isinstance(step_offset, int) else step_offset
        floats = np.empty((2, n), dtype=np.float32)
        ints = np.empty((3, n), dtype=np.int64)
        for i, req in enumerate(requests):
            p = req.params
            floats[0, i], floats[1, i] = p.temperature, p.top_p
            ints[0, i], ints[1, i], ints[2, i] = (p.top_k, req.seed,
                                                 p.draw_offset + req.num_output_tokens + offsets[i])
        sampled = np.flatnonzero(floats[0] > 0)
        any_top_k = bool((ints[0, sampled] > 0).any())
        any_top_p = bool((floats[1, sampled] < 1.0).any())
        packed = np.concatenate([floats.view(np.int32).astype(np.int64).ravel(), ints.ravel(),
                                 sampled.astype(np.int64)])
        dev = _to_device(packed, device)
        as_float = dev[: 2 * n].to(torch.int32).view(torch.float32)
        ints_dev = dev[2 * n: 5 * n].view(3, n)
        return cls(temperature=as_float[:n], top_p=as_float[n:], top_k=ints_dev[0], seed=ints_dev[1],
                   step=ints_dev[2], sampled_rows=dev[5 * n:] if len(sampled) else None,
                   any_top_k=any_top_k, any_top_p=any_top_p)


def _to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    host = torch.from_numpy(array)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host


def sample(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Pick one token per row.

    Args:
        logits: ``[B, vocab]`` float32.
        batch: the rows' values (B rows).

    Returns:
        ``[B]`` int64 token ids, on the logits' device.
    """
    tokens = logits.argmax(dim=-1)
    rows = batch.sampled_rows
    if rows is None:
        return tokens
    x = logits.index_select(0, rows) / batch.temperature.index_select(0, rows).unsqueeze(1)
    if batch.any_top_k or batch.any_top_p:
        x = _cut(x, batch.top_k.index_select(0, rows), batch.top_p.index_select(0, rows),
                 batch.any_top_k, batch.any_top_p)
    noise = gumbel_noise(batch.seed.index_select(0, rows), batch.step.index_select(0, rows), x.shape[1])
    picked = (x + noise).argmax(dim=-1)
    return tokens.index_copy(0, rows, picked)


def _cut(x: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, any_top_k: bool,
         any_top_p: bool) -> torch.Tensor:
    """Mask to -inf every token outside each row's top-k, then outside its top-p nucleus.

    Args:
        x: ``[S, V]`` float32 scaled logits. top_k: ``[S]`` int64 (0: none). top_p: ``[S]`` float32.
    """
    sorted_x, _ = x.sort(dim=-1, descending=True)
    vocab = x.shape[1]
    if any_top_k:
        k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
        kth = sorted_x.gather(1, (k - 1).unsqueeze(1))
        sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
    else:
        kth = sorted_x[:, -1:]
    if any_top_p:
        probs = sorted_x.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass of the strictly more likely tokens
        keep = before < top_p.unsqueeze(1)
        keep[:, 0] = True
        num_keep = keep.sum(dim=-1, keepdim=True)
        kth = torch.maximum(kth, sorted_x.gather(1, num_keep - 1))
    return x.masked_fill(x < kth, float("-inf"))


def _mix(h: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer finalizer (values kept in [0, 2**32) inside int64)."""
    h = ((h ^ (h >> 16)) * _MUL) & _MASK32
    h = ((h ^ (h >> 16)) * _MUL) & _MASK32
    return h ^ (h >> 16)


def gumbel_noise(seed: torch.Tensor, step: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Standard Gumbel noise, a pure function of (seed, step, token id).

    Args:
        seed: ``[S]`` int64 (>= 0). step: ``[S]`` int64. vocab_size: V.

    Returns:
        ``[S, V]`` float32.
    """
    row = _mix(_mix(seed & _MASK32) ^ ((seed >> 32) & _MASK32))
    row = _mix(row ^ (step & _MASK32))
    token = torch.arange(vocab_size, device=seed.device, dtype=torch.int64)
    h = _mix(row.unsqueeze(1) ^ _mix(token + 0x3C6EF372).unsqueeze(0))
    u = ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))  # (0, 1), never 0 or 1
    return -torch.log(-torch.log(u))
