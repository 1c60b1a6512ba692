"""The Llama family's building blocks: RMSNorm, RoPE, SwiGLU, tensor-parallel projections.

`disagg.model.llama` composes them per layer. Each op has a torch version (`*_torch`) that
defines the numerics: they follow HF transformers' Llama/Qwen2 modules step for step (float32
norm statistics, cos/sin computed in float32 and cast to the activations' dtype, rotate-half
RoPE), so a float32 model matches transformers to rounding and a bf16 one rounds at the same
places. Where `disagg.kernels.dispatch.use_triton` says Triton runs (CUDA tensors; CPU tensors
under TRITON_INTERPRET=1) the plain names launch one fused kernel of `disagg.kernels.fused`
instead, rounding at the same places. Everything here is shape-static and sync-free: it runs
inside CUDA-graph capture.

Every switch below is a field of `disagg.settings.Settings` (the config's `kernels:` section,
overridden by its DISAGG_* variable when the model is built): the ops read the settings of the
forward running on their thread (`disagg.settings.current()`), never the environment.

On CUDA the fused kernels run unless `fused_layers` is false (`DISAGG_FUSED_LAYERS=0`; the torch
ops then run, for comparison): one launch instead of a chain of eager ops, which at decode sizes
is what a step's time is made of. Their GPU tests: `tests/kernels/test_fused_gpu.py`,
`tests/model/test_model_fused.py`. Under the interpreter they always run.

The projections go through `linear`: torch's `F.linear` (cuBLAS), or the skinny-GEMM kernel of
`disagg.kernels.linear` for decode-sized batches (<= 64 rows) of 16-bit models. `linear`
(`DISAGG_LINEAR`) picks: `auto` (the default), `cublas` (never the skinny kernel) or `triton`
(every projection; any dtype under the interpreter). `auto` takes the skinny kernel where it reads
the weights closer to their bandwidth bound than cuBLAS does:
- vocabulary-wide weights (the LM head) at any decode batch;
- every projection inside the decode graphs of small batches (`dispatch.small_batch_graph`, set
  by `disagg.engine.graphs` for <= 16 sequences), where the layer kernels also launch under
  programmatic dependent launch (`dispatch.layer_pdl`, `layer_pdl: auto`), so each kernel's
  prologue and weight prefetch overlap the previous one's tail. At 32-64 rows cuBLAS(Lt) wins on
  the layer weights, and PDL outside small batches costs more than it hides.
A forward's cuBLAS GEMMs run through cuBLASLt or cuBLAS by its token count (`preferred_blas`;
`blas`, `DISAGG_BLAS`): cuBLASLt reads the weights faster at 17-128 rows, slower at 8-16. RoPE and
the K/V append run as one launch (`use_rope_append`) unless `rope_append` is false
(`DISAGG_ROPE_APPEND=0`). The measurements behind each rule: benchmarks/records/tuning-notes.md.

Tensor parallelism (`disagg.parallel.TPGroup`, shards of `disagg.model.shard`): a column-parallel
projection is a plain `linear` over the rank's rows; `row_parallel_linear` sums the ranks'
partial products (o_proj, down_proj); `vocab_parallel_embedding` and `vocab_parallel_logits`
embed and score over the rank's vocabulary rows. With one rank each is the plain op and calls
no collective. All of them are capturable in CUDA graphs over NCCL.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from disagg.kernels import dispatch, fused
from disagg.kernels import linear as skinny
from disagg.settings import ENV_VARS, allowed_values, current

if TYPE_CHECKING:
    from disagg.parallel import TPGroup

FUSED_ENV = ENV_VARS["fused_layers"]
LINEAR_ENV = ENV_VARS["linear"]
ROPE_APPEND_ENV = ENV_VARS["rope_append"]
LINEAR_BACKENDS = allowed_values("linear")
# `auto`: weights at least this wide (output features) take the skinny kernel: vocabularies,
# never a layer projection (llama3-8b's widest, gate_up, is 28672).
AUTO_MIN_OUT_FEATURES = 65536


BLAS_ENV = ENV_VARS["blas"]
BLAS_LIBRARIES = allowed_values("blas")
# `auto`: cuBLASLt for forwards of this many tokens (rows of every GEMM), cuBLAS otherwise:
# cuBLASLt wins at 17-128 rows, loses at 8-16 and slightly at 256, ties at 1-4 rows and at
# prefill sizes (benchmarks/records/tuning-notes.md).
CUBLASLT_MIN_TOKENS, CUBLASLT_MAX_TOKENS = 17, 128


def blas_library(num_tokens: int) -> str:
    """The library torch's GEMMs use in a CUDA forward of ``num_tokens`` tokens: the `blas`
    setting "cublaslt" or "cublas", or by default ("auto") the measured choice above.

    Raises:
        ConfigError (a ValueError): outside a forward, `DISAGG_BLAS` holds another value.
    """
    library = current().blas
    if library == "auto":
        fits = CUBLASLT_MIN_TOKENS <= num_tokens <= CUBLASLT_MAX_TOKENS
        return "cublaslt" if fits else "cublas"
    return library


@contextlib.contextmanager
def preferred_blas(device: torch.device, num_tokens: int) -> Iterator[None]:
    """Run the block's CUDA GEMMs (a forward of ``num_tokens`` tokens) through
    `blas_library(num_tokens)`, then restore the process's choice.

    torch reads its preferred BLAS library at each GEMM call, so a CUDA graph captured inside
    keeps the kernels chosen here. The setting is process-wide while the block runs: the engine
    is the only thread that runs GEMMs in its process.
    """
    if device.type != "cuda":
        yield
        return
    previous = torch.backends.cuda.preferred_blas_library()
    torch.backends.cuda.preferred_blas_library(blas_library(num_tokens))
    try:
        yield
    finally:
        torch.backends.cuda.preferred_blas_library(previous)


def use_fused(x: torch.Tensor) -> bool:
    """Whether the fused kernel runs for `x` (see the module docstring)."""
    if not dispatch.use_triton(x):
        return False
    return x.device.type != "cuda" or current().fused_layers


def linear_backend() -> str:
    """The `linear` setting: "auto" (the default), "cublas" or "triton".

    Raises:
        ConfigError (a ValueError): outside a forward, `DISAGG_LINEAR` holds another value.
    """
    return current().linear


def use_skinny_linear(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear` runs the skinny-GEMM kernel for `x @ weight.T` (see the module docstring)."""
    backend = linear_backend()
    if backend == "cublas" or not dispatch.use_triton(x):
        return False
    if (backend == "auto" and weight.shape[0] < AUTO_MIN_OUT_FEATURES
            and not dispatch.in_small_batch_graph()):
        return False
    if x.device.type == "cuda" and x.dtype == torch.float32:
        return False  # float32 GPU models (tests) keep cuBLAS's numerics
    return 1 <= x.shape[0] <= skinny.MAX_ROWS and x.stride(-1) == 1


def use_rope_append(qkv: torch.Tensor, kv_layer: torch.Tensor) -> bool:
    """Whether a layer without receivers runs RoPE and the append as one launch
    (`disagg.kernels.rope_append`): unless the `rope_append` setting is false, with the fused
    kernels on and a cache of the activations' dtype (fp8 caches quantize in `append_kv`)."""
    return current().rope_append and use_fused(qkv) and kv_layer.dtype == qkv.dtype


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ weight.T + bias`: `[T, K]` x `[N, K]` -> `[T, N]` in x's dtype (see `linear_backend`)."""
    if use_skinny_linear(x, weight):
        return skinny.linear(x, weight, bias)
    return F.linear(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight * x / rms(x)` over the last dim; statistics in float32, result in x's dtype.

    Args:
        x: `[T, H]` activations. weight: `[H]`. eps: added to the mean square.
    """
    if use_fused(x):
        return fused.rms_norm(x, weight, eps)
    return rms_norm_torch(x, weight, eps)


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`rms_norm` in eager torch ops (the reference)."""
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Add `x` into the residual stream, then normalize: `(rms_norm(x + residual), x + residual)`.

    The first layer passes `residual=None` (the stream starts as `x`). The sum is taken in x's
    dtype, as transformers does. The fused kernel writes the sum into `residual` in place (CUDA
    graphs keep one buffer), the torch version returns a new tensor: callers use the returned
    stream and never read the `residual` they passed again.
    """
    if use_fused(x):
        return fused.add_rms_norm(x, residual, weight, eps)
    return add_rms_norm_torch(x, residual, weight, eps)


def add_rms_norm_torch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rms_norm` in eager torch ops (the reference; `residual` is left unchanged)."""
    residual = x if residual is None else residual + x
    return rms_norm_torch(residual, weight, eps), residual


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None,
                  device: torch.device) -> torch.Tensor:
    """RoPE inverse frequencies `[head_dim // 2]` float32, with llama3 or linear scaling.

    Args:
        head_dim: rotated dims per head (all of them).
        theta: the RoPE base (`rope_theta`).
        scaling: None, or `ModelConfig.rope_scaling` (rope_type "llama3" or "linear").
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    if scaling is None:
        return inv_freq.to(device)
    if scaling["rope_type"] == "linear":
        return (inv_freq / scaling["factor"]).to(device)
    return _llama3_inv_freq(inv_freq, scaling).to(device)


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    """Llama 3.1's frequency-dependent scaling: long wavelengths divided by `factor`, short ones
    kept, the band between interpolated smoothly."""
    factor = scaling["factor"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_context = scaling["original_max_position_embeddings"]
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin `[T, head_dim]` of each token's position (float32 math, cast to `dtype`).

    Args:
        positions: `[T]` int32/int64 token positions. inv_freq: `[head_dim // 2]` float32.
    """
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE: `x * cos + rotate_half(x) * sin`, a new contiguous tensor.

    Args:
        x: `[T, heads, head_dim]` (a view of the fused qkv output is fine).
        cos, sin: `[T, head_dim]` from `rope_cos_sin`, x's dtype.
    """
    if use_fused(x):
        return fused.apply_rope(x, cos, sin)
    return apply_rope_torch(x, cos, sin)


def apply_rope_torch(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`apply_rope` in eager torch ops (the reference)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU's activation `silu(gate) * up` of the fused projection `[T, 2 I]` -> `[T, I]`."""
    if use_fused(gate_up):
        return fused.silu_mul(gate_up)
    return silu_mul_torch(gate_up)


def silu_mul_torch(gate_up: torch.Tensor) -> torch.Tensor:
    """`silu_mul` in eager torch ops (the reference)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def swiglu(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """The MLP: `down(silu(gate(x)) * up(x))` with gate and up as one GEMM.

    Args:
        x: `[T, H]`. gate_up: `[2 I, H]` (gate rows first). down: `[H, I]`.
    """
    return linear(silu_mul(linear(x, gate_up)), down)


def row_parallel_linear(x: torch.Tensor, weight: torch.Tensor, tp: "TPGroup") -> torch.Tensor:
    """A row-parallel projection: each rank multiplies its input columns by its weight columns,
    the all-reduce sums the partial products.

    Args:
        x: `[T, K / tp]`, this rank's part of the input (a column-parallel output).
        weight: `[N, K / tp]`, this rank's columns of the full `[N, K]`.

    Returns:
        `[T, N]`, the full product, the same on every rank.
    """
    return tp.all_reduce(linear(x, weight))


def vocab_parallel_embedding(input_ids: torch.Tensor, embed: torch.Tensor, vocab_start: int,
                             tp: "TPGroup") -> torch.Tensor:
    """Embed `[T]` token ids with this rank's rows `[V / tp, H]` of the embedding (token ids
    `vocab_start` on): ids outside them embed as zeros, the all-reduce sums each token's one row
    in. Returns `[T, H]`, the same on every rank."""
    if tp.size == 1:
        return F.embedding(input_ids, embed)
    local = input_ids - vocab_start
    outside = (local < 0) | (local >= embed.shape[0])
    x = F.embedding(local.masked_fill(outside, 0), embed)
    return tp.all_reduce(x.masked_fill_(outside[:, None], 0))


def vocab_parallel_logits(x: torch.Tensor, lm_head: torch.Tensor, vocab_size: int,
                          tp: "TPGroup") -> torch.Tensor:
    """The LM head over this rank's vocabulary rows, every rank's logits gathered.

    Args:
        x: `[B, H]` final hidden states. lm_head: `[ceil(V / tp), H]`, this rank's rows (a short
            last shard padded with zero rows, whose logits the trim drops).
        vocab_size: V, the full vocabulary.

    Returns:
        `[B, V]` logits in x's dtype, the same on every rank.
    """
    logits = linear(x, lm_head)
    if tp.size == 1:
        return logits
    return tp.all_gather(logits, dim=-1)[:, :vocab_size]
