"""Split prefill attention: a prompt chunk's own tokens dense, its prefix from the pages, merged.

The model's prompt rows (`disagg.model.llama`, when `use_split` says so) run this instead of one
`paged_prefill` over the whole sequence. Each sequence's keys fall in two parts:

    keys:    [ 0 ............ prefix_len | prefix_len ............ kv_len )
               cached / earlier chunks      the chunk's own q_len tokens
               paged_prefill(prefix_only)   dense causal attention over the new
               reads the pages              tokens' K/V (cuDNN through torch)

The own part runs first (`own_attention`: cuDNN's fused attention on CUDA, torch's math in
float32 elsewhere) and returns each query's log-sum-exp; `paged_prefill` then attends to the
prefix only and merges its result with the own part by log-sum-exp (as FlashInfer's
merge_state) in its epilogue, writing the output once. cuDNN's dense kernel is what the paged
kernel is slower than on long prompts; the prefix stays in pages, so prefix-cache hits and chunked
prompts keep working. The own tokens' K/V are the post-RoPE k and v the layer appended, in the
activations' dtype: over an fp8 cache the own part reads unquantized K/V (the paged path reads
them back quantized), so `auto` keeps fp8 caches on the paged path.

Host work: the own part needs each sequence's q_len on the host (the cuDNN calls are shaped by
it), and cuDNN builds (and caches) an execution plan per new shape. Neither can happen inside a
CUDA-graph capture: the split path runs in eager forwards and between the piecewise prompt
graphs' replays (`disagg.engine.prompt_graphs`), never inside whole-forward graphs.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch

from disagg.kernels import checks, dispatch, reference
from disagg.kernels.prefill import paged_prefill

logger = logging.getLogger(__name__)

# `auto` splits prompt rows whose chunks average at least this many tokens: below it, the time
# the split saves per forward is less than cuDNN's plan for a prompt length it has not seen
# (~58 ms on an H200; benchmarks/records/prefill-split-2026-12-02).
SPLIT_MIN_TOKENS = 8192
CUDNN_DTYPES = (torch.float16, torch.bfloat16)


class _CudnnState:
    """What this process learnt about cuDNN's attention: whether it takes fewer K/V heads than
    q heads (else the heads are repeated), and whether it failed (then the paged path runs)."""

    native_gqa: bool | None = None
    failed: str | None = None


def use_split(setting: str, *, device: torch.device, dtype: torch.dtype, kv_dtype: torch.dtype,
              num_tokens: int, num_seqs: int, q_lens_known: bool) -> bool:
    """Whether the prompt rows of a forward take `split_prefill` (else `paged_prefill`).

    Args:
        setting: the `prefill_attention` switch (`disagg.settings`): "paged" never; "split"
            wherever it can run; "auto" where it is the faster: on CUDA, 16-bit activations over
            a cache of their dtype (not fp8), chunks of `SPLIT_MIN_TOKENS` tokens or more on
            average.
        device, dtype: the activations'. kv_dtype: the cache's.
        num_tokens, num_seqs: the prompt rows and their sequences.
        q_lens_known: the caller has each sequence's q_len on the host.

    On CUDA both "split" and "auto" need the q_lens on the host, no CUDA-graph capture in
    progress, and cuDNN not to have failed in this process (CPU: always possible).
    """
    if setting == "paged" or num_seqs < 1 or num_tokens == 0:
        return False
    cuda = device.type == "cuda"
    if cuda and (not q_lens_known or dispatch.is_capturing(device) or _CudnnState.failed):
        return False
    if setting == "split":
        return True
    return (cuda and dtype in CUDNN_DTYPES and kv_dtype == dtype
            and num_tokens >= SPLIT_MIN_TOKENS * num_seqs)


def own_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_lens: Sequence[int],
                  sm_scale: float) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Each sequence's queries over its own new tokens, causal: query i sees tokens 0 .. i of its run.

    Args:
        q: `[T, H_q, D]`; k, v: `[T, H_kv, D]` of q's dtype, head_dim contiguous (rows strided ok).
        q_lens: the runs' lengths, summing to T.
        sm_scale: softmax scale.

    Returns:
        (o `[T, H_q, D]` q's dtype, lse `[H_q, T]` float32 natural-log log-sum-exp, token stride 1),
        or None when cuDNN failed (logged once; the caller runs the paged path).
    """
    if q.is_cuda and q.dtype in CUDNN_DTYPES:
        return _cudnn_attention(q, k, v, q_lens, sm_scale)
    indptr = torch.tensor([0, *q_lens], dtype=torch.int64).cumsum(0)
    o, lse = reference.causal_attention_lse(q, k, v, indptr, sm_scale)
    return o.to(q.dtype), lse


def _cudnn_attention(q, k, v, q_lens, sm_scale):
    """`own_attention` through `torch.ops.aten._scaled_dot_product_cudnn_attention` (the op behind
    SDPA's cuDNN backend, which also returns the log-sum-exp): one call over `[B, H, L, D]` views
    when every run has the same length L, else one call per run."""
    num_tokens, num_qo_heads, head_dim = q.shape
    if _CudnnState.failed:
        return None
    try:
        if len(set(q_lens)) == 1:
            return _cudnn_runs(q, k, v, len(q_lens), sm_scale)
        o = torch.empty_like(q)
        lse = torch.empty(num_qo_heads, num_tokens, dtype=torch.float32, device=q.device)
        start = 0
        for q_len in q_lens:
            end = start + q_len
            if q_len:
                o[start:end], lse[:, start:end] = _cudnn_runs(q[start:end], k[start:end], v[start:end], 1, sm_scale)
            start = end
        return o, lse
    except RuntimeError as err:
        _CudnnState.failed = str(err).splitlines()[0] if str(err) else type(err).__name__
        logger.warning("cuDNN attention failed (%s): prompt attention runs paged_prefill from now on",
                       _CudnnState.failed)
        return None


def _cudnn_runs(q, k, v, num_runs, sm_scale):
    """cuDNN causal attention of `num_runs` equal runs laid end to end in q/k/v `[T, H, D]`."""
    num_tokens, num_qo_heads, _ = q.shape

    def dense(x):  # [T, H, D] -> [B, H, L, D], a view (cuDNN takes the strides as they are)
        return x.unflatten(0, (num_runs, num_tokens // num_runs)).transpose(1, 2)

    def call(keys, values):
        return torch.ops.aten._scaled_dot_product_cudnn_attention(
            dense(q), dense(keys), dense(values), None, True, 0.0, True, False, scale=sm_scale)[:2]

    group = num_qo_heads // k.shape[1]
    if group == 1 or _CudnnState.native_gqa:
        o, lse = call(k, v)
    elif _CudnnState.native_gqa is None:
        try:
            o, lse = call(k, v)
            _CudnnState.native_gqa = True
        except RuntimeError as err:
            _CudnnState.native_gqa = False
            logger.warning("cuDNN attention refused %d K/V heads for %d q heads (%s): repeating "
                           "the K/V heads", k.shape[1], num_qo_heads, str(err).splitlines()[0])
            o, lse = call(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    else:
        o, lse = call(k.repeat_interleave(group, 1), v.repeat_interleave(group, 1))
    o = o.transpose(1, 2).reshape(num_tokens, num_qo_heads, -1)
    lse = lse.reshape(num_runs, num_qo_heads, -1).transpose(0, 1).reshape(num_qo_heads, num_tokens)
    return o, lse


def _check_split_inputs(q, k, v, qo_indptr, q_lens) -> None:
    num_tokens, num_qo_heads, head_dim = q.shape
    for name, x in (("k", k), ("v", v)):
        checks.check_tensor(name, x, dims="[num_tokens, num_kv_heads, head_dim]",
                            shape=(num_tokens, None, head_dim), dtypes=(q.dtype,), device=q.device)
        checks.check_rows(name, x)
    if k.shape[1] != v.shape[1] or num_qo_heads % k.shape[1]:
        raise ValueError(f"k, v: expected the same num_kv_heads dividing num_qo_heads={num_qo_heads}, "
                         f"got {k.shape[1]} and {v.shape[1]}")
    if q_lens is not None and (len(q_lens) != qo_indptr.numel() - 1 or sum(q_lens) != num_tokens
                               or min(q_lens, default=0) < 0):
        raise ValueError(f"q_lens: expected {qo_indptr.numel() - 1} non-negative lengths summing to "
                         f"num_tokens={num_tokens}, got {len(q_lens)} summing to {sum(q_lens)}")


def split_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    qo_indptr: torch.Tensor,
    page_indptr: torch.Tensor,
    page_indices: torch.Tensor,
    last_page_len: torch.Tensor,
    sm_scale: float,
    q_lens: Sequence[int] | None = None,
    *,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    check_indices: bool | None = None,
    check_args: bool = True,
) -> torch.Tensor:
    """Causal prefill attention as `paged_prefill` computes it, in two parts (module docstring).

    Args:
        q: `[T, H_q, D]` float16/bfloat16/float32, the prompt rows (as `paged_prefill`'s q).
        k, v: `[T, H_kv, D]` of q's dtype: the same rows' post-RoPE keys and values, which the
            pages already hold at the end of each sequence (the layer's append ran before).
        kv_layer, qo_indptr, page_indptr, page_indices, last_page_len, sm_scale, k_scale,
            v_scale, out, check_indices, check_args: as `paged_prefill`'s.
        q_lens: each sequence's q_len on the host (`qo_indptr`'s differences); required for
            CUDA tensors, read from `qo_indptr` for CPU ones when None.

    Returns:
        o: `[T, H_q, D]`, q's dtype (`out` when given).

    Raises:
        ValueError, TypeError: as `paged_prefill`; k, v or q_lens that do not fit q.
    """
    if q_lens is None:
        if qo_indptr.is_cuda:
            raise ValueError("q_lens: expected the host q_len of each sequence for CUDA tensors, got None")
        q_lens = torch.diff(qo_indptr).tolist()
    if check_args:
        _check_split_inputs(q, k, v, qo_indptr, q_lens)
    if dispatch.should_check_values(qo_indptr.device, check_indices):
        if torch.diff(qo_indptr).tolist() != list(q_lens):
            raise ValueError("q_lens: expected qo_indptr's differences, got other lengths")
    paged = dict(k_scale=k_scale, v_scale=v_scale, out=out, check_indices=check_indices,
                 check_args=check_args)
    own = own_attention(q, k, v, q_lens, sm_scale) if q.shape[0] else None
    if own is None:
        return paged_prefill(q, kv_layer, qo_indptr, page_indptr, page_indices, last_page_len,
                             sm_scale, True, **paged)
    o_own, lse_own = own
    return paged_prefill(q, kv_layer, qo_indptr, page_indptr, page_indices, last_page_len, sm_scale,
                         True, prefix_only=True, lse=lse_own, merge_with=o_own, **paged)
