"""The Llama-family decoder over the paged KV cache (Llama, Qwen2, Mistral without windows).

`Model.forward` is one step of the model runner (in the engine's process): the new tokens of a
batch of sequences go through

    embed -> L x [ RMSNorm -> fused qkv proj (+bias) -> RoPE -> append K/V to the pages
                   (one launch where Triton runs: `disagg.kernels.rope_append`)
                   -> paged attention -> o proj -> + residual
                   -> RMSNorm -> SwiGLU MLP (fused gate_up) -> + residual ]
          -> RMSNorm -> lm_head on each sequence's last new token

Tensor parallel over `Model.tp` (Megatron; the slices are `disagg.model.shard`'s): each rank
runs the diagram above on its own heads and MLP columns, so `Model.config` is the rank's local
shape. The qkv and gate_up projections are column-parallel (no communication), attention is
local to the rank's heads and its pages, o proj and the MLP's down projection are row-parallel
(an all-reduce each), and the embedding and the LM head are vocabulary-parallel (an all-reduce,
and a gather of the logits). The residual stream and the norms are whole on every rank.

Each "+ residual" is folded into the next RMSNorm (`add_rms_norm`, which on GPU updates the
residual stream in place); norms, RoPE and the SwiGLU activation are one fused Triton launch each
on GPU (`disagg.kernels.fused`, chosen in `disagg.model.layers`).

Attention reads the whole sequence from the pages: `paged_prefill` (causal, ragged) for prompt
chunks and mixed batches, `paged_decode` (split-K, CUDA-graph capturable) when every sequence
appends one token. Long prompt chunks may take `split_prefill` instead (the `prefill_attention`
setting): the chunk's own tokens dense through cuDNN, the prefix from the pages, merged.
A forward whose K/V also go elsewhere (a prefill worker pushing to decode workers) carries a writer in ``batch.kv_writer`` (`disagg.model.batch.LayerKVWriter`): each
layer's K/V then goes to ``kv_writer.save_layer`` (local pages and the receivers' in one pass)
instead of the model's own append, and attention reads the local pages once it returns.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from disagg.kernels import append_kv, copy_slots, paged_decode, paged_prefill
from disagg.kernels.fp8 import FP8_DTYPE
from disagg.kernels.linear import row_tiles
from disagg.model.batch import AttentionBatch
from disagg.model.config import ModelConfig
from disagg.kernels.rope_append import rope_append
from disagg.kernels.split_prefill import split_prefill, use_split
from disagg.model.layers import (add_rms_norm, apply_rope, linear, preferred_blas, rope_cos_sin,
                                 rope_inv_freq, row_parallel_linear, swiglu, use_rope_append,
                                 vocab_parallel_embedding, vocab_parallel_logits)
from disagg.model.shard import Shard
from disagg.model.weights import LayerWeights, ModelWeights
from disagg.parallel import SINGLE, TPGroup
from disagg.settings import Settings, active, current

if TYPE_CHECKING:
    from disagg.model.tokenizer import Tokenizer

KVScales = tuple[Any, Any]  # (k_scale, v_scale): floats or 1-element float32 device tensors


class Model:
    """A loaded model (one tensor-parallel rank of it): config, weights on one device, optional
    tokenizer. Made by `load_model`.

    Attributes:
        config: this rank's `ModelConfig`: its num_qo_heads, num_kv_heads and intermediate_size
            (the full ones divided by `tp.size`; one KV head when there are more ranks than KV
            heads), the full vocab_size; `full_config` itself at one rank.
        full_config: the checkpoint's `ModelConfig`.
        tp: the `disagg.parallel.TPGroup` the forward communicates over (`SINGLE`: one rank).
        shard: the `disagg.model.shard.Shard` the weights hold.
        dtype: activations' and weights' dtype.
        device: where the weights live and the forward runs.
        tokenizer: a `disagg.model.tokenizer.Tokenizer`, or None (token ids only).
        settings: the kernel switches its forwards run with (`disagg.settings.Settings`), fixed
            when it is built: the given ones, else the defaults overridden by the DISAGG_*
            environment variables set then (an A/B test may assign others between forwards).
    """

    def __init__(self, config: ModelConfig, weights: ModelWeights, *, dtype: torch.dtype,
                 device: torch.device, tokenizer: "Tokenizer | None" = None,
                 settings: Settings | None = None, tp: TPGroup | None = None) -> None:
        """`config` is the checkpoint's; `weights` are rank `tp.rank`'s slices of it."""
        self.tp = SINGLE if tp is None else tp
        self.shard = Shard.of(config, self.tp.rank, self.tp.size)
        self.full_config = config
        self.config = self.shard.local_config() if self.tp.size > 1 else config
        self.weights = weights
        self.dtype = dtype
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" and "cuda:0" compare unequal
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.tokenizer = tokenizer
        self.settings = Settings.from_env() if settings is None else settings
        self.sm_scale = config.head_dim ** -0.5
        self.vocab_start = self.shard.vocab_range[0]
        self.inv_freq = rope_inv_freq(config.head_dim, config.rope_theta, config.rope_scaling, self.device)

    def __repr__(self) -> str:
        ranks = f", rank {self.tp.rank} of {self.tp.size}" if self.tp.size > 1 else ""
        return f"Model({self.config.name!r}, {self.config.num_layers} layers, {self.dtype}, {self.device}{ranks})"

    def kv_shape(self, num_pages: int, page_size: int) -> tuple[int, ...]:
        """Shape of this model's paged cache: `(L, num_pages, 2, H_kv, page_size, D)`."""
        c = self.config
        return (c.num_layers, num_pages, 2, c.num_kv_heads, page_size, c.head_dim)

    def static_decode_batch(self, max_batch_size: int, max_pages: int,
                            max_kv_len: int | None = None) -> AttentionBatch:
        """`AttentionBatch.static` with this model's attention shapes (see `disagg.model.batch`);
        `max_kv_len` defaults to the context limit."""
        c = self.config
        return AttentionBatch.static(
            max_batch_size, max_pages, num_qo_heads=c.num_qo_heads, num_kv_heads=c.num_kv_heads,
            head_dim=c.head_dim, dtype=self.dtype, device=self.device,
            max_kv_len=max_kv_len or c.max_position_embeddings)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: torch.Tensor, *,
                kv_scales: KVScales | None = None, pieces: Any = None) -> torch.Tensor:
        """Run the new tokens of one batch; append their K/V; return each sequence's logits.

        Args:
            input_ids: `[T]` int64 on `device`, all new tokens in plan order.
            batch: the forward's `AttentionBatch` (T tokens, B sequences); with a
                ``batch.kv_writer`` each layer's K/V are written through it.
            kv: `[L, N, 2, H_kv, P, D]` of the model's dtype, or float8_e4m3fn (then
                `kv_scales` or 1.0 for both); written in place at `batch.append_slots`.
            kv_scales: fp8 caches only: (k_scale, v_scale), one per tensor for all layers.
            pieces: runs the parts between attentions (`EagerPieces` when None; the engine's
                prompt graphs pass a `disagg.engine.prompt_graphs.GraphPieces`).

        Returns:
            `[B, vocab]` float32 logits of each sequence's last new token (the full vocabulary
            on every rank).

        Raises:
            ValueError, TypeError: input_ids or kv do not fit the model or the batch.
        """
        self._check_inputs(input_ids, batch, kv, kv_scales)
        with active(self.settings), preferred_blas(self.device, input_ids.shape[0]):
            return self._forward(input_ids, batch, kv, kv_scales, pieces)

    def _forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: torch.Tensor,
                 kv_scales: KVScales | None, pieces: Any = None) -> torch.Tensor:
        if batch.fork_src_slots is not None:
            copy_slots(kv, batch.fork_src_slots, kv, batch.fork_dst_slots,
                       check_indices=batch.check_indices)
        k_scale, v_scale = kv_scales if kv_scales is not None and kv.dtype == FP8_DTYPE else (None, None)
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, self.dtype)
        pieces = EagerPieces(self) if pieces is None else pieces
        qkv = pieces.embed(input_ids)
        for index, layer in enumerate(self.weights.layers):
            o = pieces.attention_out(index, batch)
            self._attention(index, layer, qkv, cos, sin, batch, kv[index], k_scale, v_scale, o)
            qkv = pieces.between(index, o)
        hidden, residual = qkv, pieces.residual
        # Only each sequence's last token reaches the head: gather, then add and norm those rows.
        last = batch.logits_indices
        x, _ = add_rms_norm(hidden[last], residual[last], self.weights.norm, self.config.rms_norm_eps)
        return vocab_parallel_logits(x, self.weights.lm_head, self.config.vocab_size, self.tp).float()

    # The forward between two attentions, in pieces (`EagerPieces` runs them as they come; the
    # prompt graphs of `disagg.engine.prompt_graphs` capture them per token bucket).
    def piece_embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Embedding, layer 0's input norm and qkv projection: `[T]` ids -> (qkv `[T, (H_q + 2
        H_kv) * D]`, residual stream `[T, H]`)."""
        first = self.weights.layers[0]
        embedded = vocab_parallel_embedding(input_ids, self.weights.embed, self.vocab_start, self.tp)
        x, residual = add_rms_norm(embedded, None, first.input_norm, self.config.rms_norm_eps)
        return linear(x, first.qkv, first.qkv_bias), residual

    def piece_between(self, index: int, o: torch.Tensor, residual: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer ``index`` after its attention output ``o`` `[T, H_q * D]`: o proj, + residual, post
        norm, SwiGLU, then layer ``index + 1``'s input norm and qkv projection. Returns (next qkv,
        residual), or for the last layer (its MLP output `[T, H]`, residual) for the final norm."""
        eps = self.config.rms_norm_eps
        layer = self.weights.layers[index]
        x, residual = add_rms_norm(row_parallel_linear(o, layer.o_proj, self.tp), residual,
                                   layer.post_norm, eps)
        hidden = self.tp.all_reduce(swiglu(x, layer.gate_up, layer.down))  # down is row-parallel
        if index + 1 == self.config.num_layers:
            return hidden, residual
        nxt = self.weights.layers[index + 1]
        x, residual = add_rms_norm(hidden, residual, nxt.input_norm, eps)
        return linear(x, nxt.qkv, nxt.qkv_bias), residual

    def warm_lm_head(self, max_rows: int) -> None:
        """Run the LM head once per row tile that its GEMM may pick for up to ``max_rows`` rows
        (one per sequence of a forward), so that every kernel variant compiles now, not when a
        batch of a new size arrives while serving (`disagg.kernels.linear.row_tiles`)."""
        for rows in row_tiles(max_rows):
            with active(self.settings), preferred_blas(self.device, rows):
                linear(torch.zeros(rows, self.config.hidden_size, dtype=self.dtype,
                                   device=self.device), self.weights.lm_head)

    def _attention(self, index: int, layer: LayerWeights, qkv: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor, batch: AttentionBatch, kv_layer: torch.Tensor,
                   k_scale: Any, v_scale: Any, out: torch.Tensor) -> None:
        """Self-attention of one layer over the paged cache: qkv `[T, (H_q + 2 H_kv) * D]` -> ``out``
        `[T, H_q * D]` (the o projection follows in `piece_between`)."""
        c = self.config
        num_tokens = qkv.shape[0]
        # Every layer's launches take tensors of the first layer's shapes, dtypes and strides: the
        # launchers check them for layer 0 only (~75 us of host time per layer otherwise).
        check_args = index == 0
        writer = batch.kv_writer
        q_lens = self._split_q_lens(batch, qkv, kv_layer)
        k = v = None  # post-RoPE k and v, where the split prefill needs them (not from rope_append)
        if writer is None and q_lens is None and use_rope_append(qkv, kv_layer):
            q = rope_append(qkv, cos, sin, kv_layer, batch.append_slots, c.num_qo_heads,
                            check_indices=batch.check_indices, check_args=check_args)
        else:
            # q and k heads are adjacent in qkv: one RoPE over both, then views (strided k is
            # fine for append_kv / the writer; attention only needs head_dim contiguous).
            qk = apply_rope(qkv[:, :c.q_size + c.kv_size].view(num_tokens, -1, c.head_dim), cos, sin)
            q, k = qk[:, :c.num_qo_heads], qk[:, c.num_qo_heads:]
            v = qkv[:, c.q_size + c.kv_size:].view(num_tokens, c.num_kv_heads, c.head_dim)
            if writer is not None:
                writer.save_layer(index, k, v, k_scale=k_scale, v_scale=v_scale)
            else:
                append_kv(k, v, kv_layer, batch.append_slots, k_scale=k_scale, v_scale=v_scale,
                          check_indices=batch.check_indices)
        self._paged_attention(q, kv_layer, batch, k_scale, v_scale, out.view(num_tokens, c.num_qo_heads, c.head_dim),
                              check_args, k=k, v=v, q_lens=q_lens)

    def _split_q_lens(self, batch: AttentionBatch, qkv: torch.Tensor, kv_layer: torch.Tensor
                      ) -> tuple[int, ...] | None:
        """The q_len of each prompt sequence (host ints) when the prompt rows take the split
        prefill (`disagg.kernels.split_prefill.use_split`, the `prefill_attention` setting), else
        None. The lengths are the batch's host copy (`AttentionBatch.prefill_q_lens`, set for
        batches built from a plan; a static or captured batch has none and stays paged)."""
        setting = current().prefill_attention
        if batch.is_decode or setting == "paged":
            return None
        d = batch.num_decodes
        num_seqs, num_tokens = batch.batch_size - d, qkv.shape[0] - d
        q_lens = batch.prefill_q_lens
        if use_split(setting, device=qkv.device, dtype=qkv.dtype,
                     kv_dtype=kv_layer.dtype, num_tokens=num_tokens, num_seqs=num_seqs,
                     q_lens_known=q_lens is not None):
            return q_lens
        return None

    def _paged_attention(self, q: torch.Tensor, kv_layer: torch.Tensor, batch: AttentionBatch,
                         k_scale, v_scale, out: torch.Tensor, check_args: bool = True, *,
                         k: torch.Tensor | None = None, v: torch.Tensor | None = None,
                         q_lens: tuple[int, ...] | None = None) -> None:
        """`[T, H_q, D]` attention output into ``out``: `paged_decode` for a decode batch,
        `paged_prefill` for prompts, and for a mixed batch both, each over its own rows (one query
        per sequence in the prefill kernel would read every KV page once per q head and waste its
        query tile). With ``q_lens`` (the prompts' lengths) the prompt rows take `split_prefill`
        over their post-RoPE ``k``, ``v`` `[T, H_kv, D]` instead."""
        scales = dict(k_scale=k_scale, v_scale=v_scale, check_indices=batch.check_indices, check_args=check_args)
        if batch.is_decode:
            paged_decode(q, kv_layer, batch.page_indptr, batch.page_indices, batch.last_page_len,
                         self.sm_scale, out=out, num_splits=batch.num_splits, max_seq_len=batch.max_kv_len,
                         workspace=batch.workspace, **scales)
            return
        d = batch.num_decodes
        tables = ((batch.prefill_qo_indptr, batch.prefill_page_indptr, batch.prefill_page_indices,
                   batch.prefill_last_page_len) if d else
                  (batch.qo_indptr, batch.page_indptr, batch.page_indices, batch.last_page_len))
        if q_lens is None:
            paged_prefill(q[d:], kv_layer, *tables, self.sm_scale, causal=True, out=out[d:], **scales)
        else:
            split_prefill(q[d:], k[d:], v[d:], kv_layer, *tables, self.sm_scale, q_lens, out=out[d:], **scales)
        if not d:
            return
        paged_decode(q[:d], kv_layer, batch.page_indptr[:d + 1], batch.page_indices,
                     batch.last_page_len[:d], self.sm_scale, out=out[:d], num_splits=batch.num_splits,
                     max_seq_len=batch.max_kv_len, workspace=batch.workspace, **scales)

    def _check_inputs(self, input_ids: torch.Tensor, batch: AttentionBatch, kv: torch.Tensor,
                      kv_scales: KVScales | None) -> None:
        """Shape/dtype/device checks only (no values read: capture-safe)."""
        if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 1:
            raise ValueError(f"input_ids: expected a [T] tensor, got "
                             f"{getattr(input_ids, 'shape', type(input_ids).__name__)}")
        if input_ids.dtype not in (torch.int64, torch.int32) or input_ids.device != self.device:
            raise TypeError(f"input_ids: expected int64 on {self.device}, got {input_ids.dtype} on "
                            f"{input_ids.device}")
        if input_ids.shape[0] != batch.num_tokens:
            raise ValueError(f"input_ids: expected {batch.num_tokens} tokens (the batch's), got "
                             f"{input_ids.shape[0]}")
        expected = self.kv_shape(kv.shape[1], kv.shape[4]) if kv.dim() == 6 else None
        if expected is None or tuple(kv.shape) != expected:
            raise ValueError(f"kv: expected [L, N, 2, H_kv, P, D] = [{self.config.num_layers}, N, 2, "
                             f"{self.config.num_kv_heads}, P, {self.config.head_dim}], got "
                             f"{list(kv.shape)}")
        if kv.dtype not in (self.dtype, FP8_DTYPE) or kv.device != self.device:
            raise TypeError(f"kv: expected {self.dtype} or {FP8_DTYPE} on {self.device}, got "
                            f"{kv.dtype} on {kv.device}")
        if kv_scales is not None and kv.dtype != FP8_DTYPE:
            raise ValueError(f"kv_scales: only for a {FP8_DTYPE} cache, got a {kv.dtype} cache")


class EagerPieces:
    """The forward's parts between attentions, run eagerly as `Model._forward` reaches them.

    The interface `Model._forward` drives (`disagg.engine.prompt_graphs.GraphPieces` has the same
    one over CUDA graphs): `embed(ids)` -> layer 0's qkv; per layer, `attention_out(index, batch)` -> the
    `[T, H_q * D]` tensor attention writes, then `between(index, o)` -> the next layer's qkv (the
    last layer: its MLP output); `residual` -> the residual stream after the last call.
    """

    def __init__(self, model: Model) -> None:
        self.model = model
        self.residual: torch.Tensor | None = None
        self._qkv: torch.Tensor | None = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        self._qkv, self.residual = self.model.piece_embed(input_ids)
        return self._qkv

    def attention_out(self, index: int, batch: AttentionBatch) -> torch.Tensor:
        if batch.out is not None:  # a decode graph's static buffer
            return batch.out.view(batch.out.shape[0], -1)
        return self._qkv.new_empty((self._qkv.shape[0], self.model.config.q_size))

    def between(self, index: int, o: torch.Tensor) -> torch.Tensor:
        self._qkv, self.residual = self.model.piece_between(index, o, self.residual)
        return self._qkv
