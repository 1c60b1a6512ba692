"""`AttentionBatch`: one forward's page tables and token indices as device tensors.

The model runner (in the engine's process) turns each `disagg.plan.ForwardPlan` into an
`AttentionBatch` and hands it to `Model.forward`, which passes its tensors to the kernels:

    batch = AttentionBatch.from_plan(plan, device)      # eager: one host->device copy
    logits = model.forward(input_ids, batch, kv)

A forward whose K/V also go elsewhere (a prefill pushing to decode workers) carries a
`LayerKVWriter` in ``batch.kv_writer``: each layer's attention hands its new K/V to
``kv_writer.save_layer`` instead of appending them itself (the KV connector's sender,
`disagg.transfer.connector.KVSender`, is one; the model knows only this hook).

CUDA graphs need tensors that stay put. A graph runner makes one static decode batch, takes a
prefix view per batch-size bucket, captures each bucket once, then per step copies the plan in
and replays the bucket's graph:

    static = AttentionBatch.static(max_batch_size, max_pages, num_qo_heads=..., num_kv_heads=...,
                                   head_dim=..., dtype=..., device=..., max_kv_len=...)
    bucket = static.view(8)                             # rows 0..7, own out/workspace/num_splits
    ...capture: model.forward(bucket.input_ids, bucket, kv)...
    static.copy_from_plan(plan, token_ids)              # n <= 8 sequences; rows n.. are padding
    graph.replay(); logits[:n]

Padding rows own no page (a sequence with no page attends to nothing and gets 0), append to
slot -1 (nothing written), sit at position 0: their logits are finite garbage to ignore.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import numpy as np
import torch

from disagg.kernels import choose_num_splits, decode_workspace
from disagg.kernels.dispatch import device_sms
from disagg.plan import ForwardPlan

# Order of the int32 arrays in the flat buffer that one copy moves to the device.
_FIELDS = ("qo_indptr", "page_indptr", "page_indices", "last_page_len", "append_slots",
           "positions", "logits_indices")
_ALIGN = 4  # int32 elements: 16 bytes


class LayerKVWriter(Protocol):
    """Where a forward's new K/V go instead of the model's own append (`AttentionBatch.kv_writer`).

    The writer's forward has begun before the model runs (it applied the plan's fork copies).
    """

    def save_layer(self, layer: int, k: torch.Tensor, v: torch.Tensor, *, k_scale: Any = None,
                   v_scale: Any = None) -> None:
        """Write layer ``layer``'s new K/V (``[T, H_kv, D]`` each, plan order) at the batch's
        ``append_slots`` (and wherever else they go); on return the current stream may read them
        from the layer's pages."""


@dataclass
class AttentionBatch:
    """Device tensors of one forward, B sequences, T new tokens (int32 unless noted).

    Attributes:
        qo_indptr: `[B+1]` rows of sequence b are `qo_indptr[b]:qo_indptr[b+1]`.
        page_indptr: `[B+1]`; page_indices: `[nnz_pages]`; last_page_len: `[B]` (the CSR page
            table after this forward's appends).
        append_slots: `[T]` where each new token's K/V goes, -1 skips it.
        positions: `[T]` RoPE position of each new token.
        logits_indices: `[B]` the row of each sequence's last new token (`qo_indptr[1:] - 1`).
        is_decode: every sequence appends exactly one token (the model runs `paged_decode`).
        num_decodes: mixed batches only: how many leading sequences append one token each (the
            colocated engine schedules running decodes first). Their queries go through
            `paged_decode` with the table's first rows, the rest through `paged_prefill` with
            the `prefill_*` tables; 0: one kernel for the whole batch.
        prefill_qo_indptr, prefill_page_indptr, prefill_page_indices, prefill_last_page_len:
            mixed batches only: the CSR tables of sequences num_decodes.. rebased to start at 0
            (own 16-byte-aligned views, so no slice offset reaches a kernel), or None.
        max_kv_len: the longest sequence's tokens after the append (host int; decode split
            heuristic).
        fork_src_slots, fork_dst_slots: `[F]` slot copies a fork left pending, applied to every
            layer before the appends, or None (none, or ``kv_writer`` applied them).
        check_indices: passed to the kernel launchers (None: their default policy; False: the
            plan was validated on the host, skip the device-to-host check).
        out: decode only: `[B, H_q, D]` attention output buffer (model dtype), or None.
        workspace: `paged_decode`'s split workspace (decode rows of a static batch), or None
            (allocated per call).
        num_splits: the decode rows' splits per sequence, or None (heuristic per call).
        input_ids: static batches only: `[B]` int64 token buffer filled by `copy_from_plan`.
        kv_writer: writes each layer's new K/V instead of the model's append (`LayerKVWriter`),
            or None.
        prefill_q_lens: host ints, the new tokens of each prompt sequence (rows
            ``num_decodes ..``), where the batch was built from a plan (the split prefill reads
            them without a device sync); None for decode and static batches.
    """

    qo_indptr: torch.Tensor
    page_indptr: torch.Tensor
    page_indices: torch.Tensor
    last_page_len: torch.Tensor
    append_slots: torch.Tensor
    positions: torch.Tensor
    logits_indices: torch.Tensor
    is_decode: bool
    max_kv_len: int
    fork_src_slots: torch.Tensor | None = None
    fork_dst_slots: torch.Tensor | None = None
    check_indices: bool | None = None
    out: torch.Tensor | None = None
    workspace: torch.Tensor | None = None
    num_splits: int | None = None
    input_ids: torch.Tensor | None = None
    num_decodes: int = 0
    prefill_qo_indptr: torch.Tensor | None = None
    prefill_page_indptr: torch.Tensor | None = None
    prefill_page_indices: torch.Tensor | None = None
    prefill_last_page_len: torch.Tensor | None = None
    kv_writer: LayerKVWriter | None = None
    prefill_q_lens: tuple[int, ...] | None = None
    _static: "_StaticBuffers | None" = field(default=None, repr=False)

    @property
    def batch_size(self) -> int:
        return self.page_indptr.numel() - 1

    @property
    def num_tokens(self) -> int:
        return self.append_slots.numel()

    @classmethod
    def from_plan(cls, plan: ForwardPlan, device: torch.device | str, *,
                  check_indices: bool | None = None, kv_writer: LayerKVWriter | None = None) -> "AttentionBatch":
        """Copy `plan`'s attention arrays to `device` (one host-to-device copy).

        Args:
            plan: from `PagedKVCache.begin_forward`; sliding-window holes are not supported.
            device: the model's device.
            check_indices: see the attribute; an engine whose plans come from the cache passes
                False on CUDA to skip the launchers' host syncs.
            kv_writer: see the attribute; its forward for ``plan`` has begun (so the plan's fork
                copies are its, not the batch's).

        Raises:
            ValueError: an empty plan, or a plan with a sliding-window hole.
        """
        _check_plan(plan)
        qo_indptr = np.asarray(plan.qo_indptr, dtype=np.int32)
        arrays = {name: np.asarray(getattr(plan, name), dtype=np.int32) for name in _FIELDS[:-1]}
        arrays["logits_indices"] = qo_indptr[1:] - 1
        single = np.diff(qo_indptr) == 1
        is_decode = bool(np.all(single))
        num_decodes = 0 if is_decode else int(np.argmin(single))  # leading one-token sequences
        if num_decodes:
            arrays.update(_prefill_tables(arrays, num_decodes))
        views = _to_device(arrays, torch.device(device))
        fork_src = fork_dst = None
        if len(plan.fork_src_slots) and kv_writer is None:
            fork_src, fork_dst = (torch.as_tensor(np.asarray(a, dtype=np.int64), device=device)
                                  for a in (plan.fork_src_slots, plan.fork_dst_slots))
        max_kv_len = int(arrays["positions"][arrays["logits_indices"]].max()) + 1
        return cls(**views, is_decode=is_decode, num_decodes=num_decodes, max_kv_len=max_kv_len,
                   fork_src_slots=fork_src, fork_dst_slots=fork_dst, check_indices=check_indices,
                   kv_writer=kv_writer,
                   prefill_q_lens=None if is_decode else tuple(np.diff(qo_indptr)[num_decodes:].tolist()))

    @classmethod
    def static(cls, max_batch_size: int, max_pages: int, *, num_qo_heads: int, num_kv_heads: int,
               head_dim: int, dtype: torch.dtype, device: torch.device | str,
               max_kv_len: int) -> "AttentionBatch":
        """A decode batch of fixed buffers for CUDA-graph capture, every row padding until
        `copy_from_plan` fills it (see the module docstring).

        Args:
            max_batch_size: rows (sequences); views take prefixes of them.
            max_pages: capacity of `page_indices` (pages of all sequences of one step together).
            num_qo_heads, head_dim, dtype: the model's attention shapes (for `out`).
            num_kv_heads: for the split heuristic.
            device: the model's device.
            max_kv_len: the longest sequence a step may hold (split heuristic; usually the
                context limit).
        """
        if max_batch_size < 1 or max_pages < 1:
            raise ValueError(f"max_batch_size, max_pages: expected >= 1, got {max_batch_size}, "
                             f"{max_pages}")
        device = torch.device(device)
        buffers = _StaticBuffers(max_batch_size, max_pages, device,
                                 (num_qo_heads, num_kv_heads, head_dim, dtype))
        base = cls(**buffers.views, is_decode=True, max_kv_len=max_kv_len, check_indices=False,
                   input_ids=buffers.input_ids, _static=buffers)
        return base.view(max_batch_size)

    def view(self, batch_size: int, num_splits: int | None = None) -> "AttentionBatch":
        """The first `batch_size` rows of a static batch, sharing its buffers, with its own
        `out`, `workspace` and `num_splits` (default: `choose_num_splits` for this size)."""
        buffers = self._require_static("view")
        if not 1 <= batch_size <= buffers.max_batch_size:
            raise ValueError(f"batch_size: expected 1..{buffers.max_batch_size}, got {batch_size}")
        num_qo_heads, num_kv_heads, head_dim, dtype = buffers.attention
        if num_splits is None:
            num_splits = choose_num_splits(batch_size, num_kv_heads, self.max_kv_len,
                                           device_sms(buffers.device))
        b = batch_size
        v = buffers.views
        return replace(
            self, qo_indptr=v["qo_indptr"][:b + 1], page_indptr=v["page_indptr"][:b + 1],
            last_page_len=v["last_page_len"][:b], append_slots=v["append_slots"][:b],
            positions=v["positions"][:b], logits_indices=v["logits_indices"][:b],
            input_ids=buffers.input_ids[:b], num_splits=num_splits,
            out=torch.empty(b, num_qo_heads, head_dim, dtype=dtype, device=buffers.device),
            workspace=decode_workspace(b, num_qo_heads, head_dim, num_splits, buffers.device),
        )

    def copy_from_plan(self, plan: ForwardPlan, token_ids: np.ndarray | list[int] | None = None) -> None:
        """Fill a static batch from a pure-decode `plan` (and its token ids), padding the rest.

        With `token_ids` None, `input_ids` is left alone (a caller whose ids are already on the
        device copies them into `input_ids[:n]` itself, after this call on the same stream).

        Asynchronous on CUDA (pinned staging, double-buffered: a call waits only for the copy
        made two calls before), enqueued on the current stream: call it on the stream that
        replays the graphs, so the copy lands after the previous replay read the buffers. Every
        view of the batch sees the new values.

        Raises:
            ValueError: not a static batch, not a decode plan, too many sequences or pages,
                or token_ids of the wrong length; nothing is written then.
        """
        self._require_static("copy_from_plan").fill(plan, token_ids)

    def clear_static(self) -> None:
        """Make every row of a static batch padding again: a forward over it (a graph
        capture's warm-up runs) then reads and writes no page. Enqueued on the current stream."""
        self._require_static("clear_static").clear()

    def _require_static(self, what: str) -> "_StaticBuffers":
        if self._static is None:
            raise ValueError(f"AttentionBatch.{what}: only for batches made by AttentionBatch.static")
        return self._static


def _check_plan(plan: ForwardPlan) -> None:
    if plan.batch_size == 0 or plan.num_tokens == 0:
        raise ValueError(f"plan: expected at least one sequence and token, got {plan.batch_size} "
                         f"sequences and {plan.num_tokens} tokens")
    if plan.sink_size is not None and np.any(plan.sliding_window_offset > plan.sink_size):
        raise ValueError("plan: sliding-window holes (sink_size < sliding_window_offset) are not "
                         "supported by the model's attention")


def _prefill_tables(arrays: dict[str, np.ndarray], num_decodes: int) -> dict[str, np.ndarray]:
    """The CSR tables of sequences ``num_decodes``.. of a mixed batch, rebased to start at 0."""
    d = num_decodes
    qo, pages = arrays["qo_indptr"], arrays["page_indptr"]
    return {"prefill_qo_indptr": qo[d:] - qo[d], "prefill_page_indptr": pages[d:] - pages[d],
            "prefill_page_indices": arrays["page_indices"][pages[d]:],
            "prefill_last_page_len": arrays["last_page_len"][d:]}


def _to_device(arrays: dict[str, np.ndarray], device: torch.device) -> dict[str, torch.Tensor]:
    """Concatenate int32 arrays, copy once, return contiguous views under the same names.

    Every view starts 16 bytes aligned: Triton specializes pointer arguments on 16-byte
    alignment, so views at offsets that followed the batch size compiled new kernel variants (1-3
    s each) mid-serving.
    """
    names = list(arrays)
    sizes = [len(arrays[name]) for name in names]
    starts = np.cumsum([0] + [-(-n // _ALIGN) * _ALIGN for n in sizes])
    host = np.zeros(int(starts[-1]), dtype=np.int32)
    for name, start, n in zip(names, starts, sizes):
        host[start:start + n] = arrays[name]
    flat = torch.from_numpy(host)
    if device.type == "cuda":
        flat = flat.pin_memory().to(device, non_blocking=True)
    return {name: flat[start:start + n] for name, start, n in zip(names, starts, sizes)}


class _PinnedStaging:
    """Fixed device buffers (one flat int32 index buffer, the int64 token ids) filled by one
    asynchronous copy per step from pinned host staging, double-buffered on CUDA: a fill waits
    only for the copy made two fills before. The static decode batch's and the mixed graphs'."""

    def __init__(self, numel: int, num_ids: int, device: torch.device) -> None:
        pin = device.type == "cuda"
        self.flat = torch.zeros(numel, dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(num_ids, dtype=torch.int64, device=device)
        self.staging = [(torch.zeros(numel, dtype=torch.int32, pin_memory=pin),
                         torch.zeros(num_ids, dtype=torch.int64, pin_memory=pin)) for _ in range(2 if pin else 1)]
        self.events = [torch.cuda.Event() for _ in self.staging] if pin else []
        self.turn = 0

    def _next_staging(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This turn's host staging (flat indices, ids), once the copy that last read it is done."""
        if self.events:
            self.events[self.turn].synchronize()
        return self.staging[self.turn]

    def _upload(self, flat: torch.Tensor, ids: torch.Tensor | None, numel: int | None = None) -> None:
        """Copy this turn's staging to the device buffers (the first ``numel`` indices, default
        all; ids unless None); the next turn's."""
        used = flat.numel() if numel is None else numel
        self.flat[:used].copy_(flat[:used], non_blocking=True)
        if ids is not None:
            self.input_ids.copy_(ids, non_blocking=True)
        if self.events:
            self.events[self.turn].record()
            self.turn = (self.turn + 1) % len(self.staging)


class _StaticBuffers(_PinnedStaging):
    """Device buffers of a static decode batch and the pinned host staging that fills them."""

    def __init__(self, max_batch_size: int, max_pages: int, device: torch.device,
                 attention: tuple[int, int, int, torch.dtype]) -> None:
        self.max_batch_size, self.max_pages, self.device = max_batch_size, max_pages, device
        self.attention = attention
        b = max_batch_size
        self.sizes = dict(qo_indptr=b + 1, page_indptr=b + 1, page_indices=max_pages,
                          last_page_len=b, append_slots=b, positions=b, logits_indices=b)
        super().__init__(sum(self.sizes.values()), b, device)
        self.views = self._split(self.flat)
        padding = self._split(self.staging[0][0])
        self._pad(padding, 0, 0)
        self.flat.copy_(self.staging[0][0])

    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        views, start = {}, 0
        for name in _FIELDS:
            views[name] = flat[start:start + self.sizes[name]]
            start += self.sizes[name]
        return views

    def _pad(self, host: dict[str, torch.Tensor], n: int, nnz: int) -> None:
        """Rows n.. (and the constant rows) in the host staging: no pages, slot -1, position 0."""
        b = self.max_batch_size
        host["qo_indptr"].copy_(torch.arange(b + 1, dtype=torch.int32))
        host["logits_indices"].copy_(torch.arange(b, dtype=torch.int32))
        host["page_indptr"][n + 1:] = nnz
        host["last_page_len"][n:] = 1
        host["append_slots"][n:] = -1
        host["positions"][n:] = 0

    def clear(self) -> None:
        """Every row padding again (no pages, slot -1, token 0), enqueued like `fill`."""
        flat, ids = self._next_staging()
        self._pad(self._split(flat), 0, 0)
        ids.zero_()
        self._upload(flat, ids)

    def fill(self, plan: ForwardPlan, token_ids) -> None:
        n, nnz = plan.batch_size, len(plan.page_indices)
        if n == 0 or not np.all(np.diff(plan.qo_indptr) == 1):
            raise ValueError("plan: expected a decode plan (one new token per sequence, at least one)")
        if n > self.max_batch_size or nnz > self.max_pages:
            raise ValueError(f"plan: expected at most {self.max_batch_size} sequences and "
                             f"{self.max_pages} pages, got {n} and {nnz}")
        if token_ids is not None and len(token_ids) != n:
            raise ValueError(f"token_ids: expected {n} ids (one per sequence), got {len(token_ids)}")
        flat, ids = self._next_staging()
        host = self._split(flat)
        host["page_indptr"][:n + 1] = torch.from_numpy(np.asarray(plan.page_indptr, dtype=np.int32))
        host["page_indices"][:nnz] = torch.from_numpy(np.asarray(plan.page_indices, dtype=np.int32))
        host["last_page_len"][:n] = torch.from_numpy(np.asarray(plan.last_page_len, dtype=np.int32))
        host["append_slots"][:n] = torch.from_numpy(np.asarray(plan.append_slots, dtype=np.int32))
        host["positions"][:n] = torch.from_numpy(np.asarray(plan.positions, dtype=np.int32))
        self._pad(host, n, nnz)
        if token_ids is not None:
            ids.zero_()
            ids[:n] = torch.as_tensor(np.asarray(token_ids, dtype=np.int64))
        self._upload(flat, ids if token_ids is not None else None)


class MixedBuffers(_PinnedStaging):
    """Fixed device buffers for whole-forward CUDA graphs of prompt and mixed steps, and the
    pinned staging that fills them (`disagg.engine.mixed_graphs`).

    A graph is captured per (token bucket ``T``, decode bucket ``D``). Its rows: ``0..D-1`` the
    decodes (one token each; rows past the plan's ``d`` decodes are padding: no pages, slot -1),
    ``D..`` the prompt tokens of up to ``max_prompts`` sequences, then padding up to ``T`` (slot -1,
    position 0, owned by no sequence). The prompt sequences' tables are padded with empty
    sequences (no query rows, no pages); their page table indexes the one `page_indices` buffer
    after the decodes' pages. `logits_indices` lists the plan's rows in plan order (decodes, then
    each prompt's last row), so the forward's logits ``[:B]`` are the plan's.

    Args:
        max_tokens, max_decodes, max_prompts, max_pages: the largest bucket's sizes.
        num_qo_heads, head_dim, num_kv_heads, dtype: the model's attention shapes.
        device: the model's device.
        max_kv_len: the longest sequence (the decode split count of every view follows it).
    """

    FIELDS = ("positions", "append_slots", "logits_indices", "dec_page_indptr", "dec_last_page_len",
              "pre_qo_indptr", "pre_page_indptr", "pre_last_page_len", "page_indices")

    def __init__(self, max_tokens: int, max_decodes: int, max_prompts: int, max_pages: int, *,
                 num_qo_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                 device: torch.device | str, max_kv_len: int) -> None:
        if min(max_tokens, max_prompts, max_pages) < 1 or max_decodes < 0:
            raise ValueError(f"max_tokens, max_prompts, max_pages: expected >= 1 and max_decodes >= 0, got "
                             f"{max_tokens}, {max_prompts}, {max_pages}, {max_decodes}")
        self.max_tokens, self.max_decodes, self.max_prompts = max_tokens, max_decodes, max_prompts
        self.max_pages, self.device, self.max_kv_len = max_pages, torch.device(device), max_kv_len
        self.attention = (num_qo_heads, num_kv_heads, head_dim, dtype)
        t, d, p = max_tokens, max_decodes, max_prompts
        self.sizes = dict(positions=t, append_slots=t, logits_indices=d + p, dec_page_indptr=d + 1,
                          dec_last_page_len=max(d, 1), pre_qo_indptr=p + 1, pre_page_indptr=p + 1,
                          pre_last_page_len=p, page_indices=max_pages)
        self.starts = dict(zip(self.FIELDS, np.cumsum([0] + [-(-self.sizes[f] // _ALIGN) * _ALIGN
                                                             for f in self.FIELDS]).tolist()))
        super().__init__(self.starts["page_indices"] + -(-max_pages // _ALIGN) * _ALIGN, t, self.device)
        self.views = self._split(self.flat)
        self.clear()

    def _split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        return {f: flat[self.starts[f]:self.starts[f] + self.sizes[f]] for f in self.FIELDS}

    def bucket_view(self, num_tokens: int, num_decodes: int) -> AttentionBatch:
        """The batch a graph of ``num_tokens`` rows with ``num_decodes`` decode rows captures
        (``num_decodes`` 0: every sequence is a prompt; see the class docstring)."""
        t, dec = num_tokens, num_decodes
        if not (0 <= dec < t <= self.max_tokens and dec <= self.max_decodes):
            raise ValueError(f"bucket: expected 0 <= decodes < tokens <= {self.max_tokens} and decodes <= "
                             f"{self.max_decodes}, got {t} tokens, {dec} decodes")
        num_qo_heads, num_kv_heads, head_dim, _ = self.attention
        v = self.views
        prompts = dict(prefill_qo_indptr=v["pre_qo_indptr"], prefill_page_indptr=v["pre_page_indptr"],
                       prefill_page_indices=v["page_indices"], prefill_last_page_len=v["pre_last_page_len"])
        common = dict(positions=v["positions"][:t], append_slots=v["append_slots"][:t],
                      logits_indices=v["logits_indices"][:dec + self.max_prompts], page_indices=v["page_indices"],
                      is_decode=False, max_kv_len=self.max_kv_len, check_indices=False,
                      input_ids=self.input_ids[:t])
        if dec == 0:  # one paged_prefill over every row
            return AttentionBatch(qo_indptr=v["pre_qo_indptr"], page_indptr=v["pre_page_indptr"],
                                  last_page_len=v["pre_last_page_len"], **common)
        num_splits = choose_num_splits(dec, num_kv_heads, self.max_kv_len, device_sms(self.device))
        return AttentionBatch(qo_indptr=v["pre_qo_indptr"], page_indptr=v["dec_page_indptr"][:dec + 1],
                              last_page_len=v["dec_last_page_len"][:dec], num_decodes=dec, num_splits=num_splits,
                              workspace=decode_workspace(dec, num_qo_heads, head_dim, num_splits, self.device),
                              **prompts, **common)

    @staticmethod
    def shape_of(plan: ForwardPlan) -> tuple[int, int]:
        """(leading one-token sequences d, prompt sequences p) of a plan, as `from_plan` splits it."""
        single = np.diff(np.asarray(plan.qo_indptr)) == 1
        d = len(single) if bool(np.all(single)) else int(np.argmin(single))
        return d, len(single) - d

    def fill(self, plan: ForwardPlan, token_ids, num_tokens: int, num_decodes: int) -> None:
        """Lay ``plan`` (and its ids) out for the graph of bucket (``num_tokens``, ``num_decodes``).

        Asynchronous on CUDA like `AttentionBatch.copy_from_plan` (double-buffered pinned staging,
        enqueued on the current stream). Raises ValueError (nothing written) when the plan does not
        fit the bucket."""
        _check_plan(plan)
        qo = np.asarray(plan.qo_indptr, dtype=np.int64)
        pages = np.asarray(plan.page_indptr, dtype=np.int64)
        d, p = self.shape_of(plan)
        total, nnz = int(qo[-1]), int(pages[-1])
        dec = num_decodes
        if not (d <= dec and (dec == 0) == (d == 0) and dec + total - d <= num_tokens <= self.max_tokens
                and p <= self.max_prompts and nnz <= self.max_pages and len(token_ids) == total):
            raise ValueError(f"plan: {d} decodes, {p} prompts, {total} tokens, {nnz} pages, {len(token_ids)} ids "
                             f"do not fit the bucket of {num_tokens} tokens, {dec} decodes, "
                             f"{self.max_prompts} prompts, {self.max_pages} pages")
        flat, ids = self._next_staging()
        h = {f: a.numpy() for f, a in self._split(flat).items()}
        ids_np = ids.numpy()
        self._pad(h, ids_np)
        tokens = np.asarray(token_ids, dtype=np.int64)
        rest = slice(dec, dec + total - d)  # the prompts' rows in the graph
        for name, src in (("positions", plan.positions), ("append_slots", plan.append_slots)):
            src = np.asarray(src)
            h[name][:d], h[name][rest] = src[:d], src[d:]
        ids_np[:d], ids_np[rest] = tokens[:d], tokens[d:]
        h["page_indices"][:nnz] = plan.page_indices
        h["dec_page_indptr"][:d + 1] = pages[:d + 1]
        h["dec_page_indptr"][d + 1:] = pages[d]
        h["dec_last_page_len"][:d] = np.asarray(plan.last_page_len)[:d]
        h["pre_qo_indptr"][:p + 1] = qo[d:] - qo[d]
        h["pre_qo_indptr"][p + 1:] = total - qo[d]
        h["pre_page_indptr"][:p + 1] = pages[d:]
        h["pre_page_indptr"][p + 1:] = nnz
        h["pre_last_page_len"][:p] = np.asarray(plan.last_page_len)[d:]
        h["logits_indices"][:d] = np.arange(d)
        h["logits_indices"][d:d + p] = dec + qo[d + 1:] - qo[d] - 1
        self._upload(flat, ids, self.starts["page_indices"] + nnz)  # page_indices is last

    def clear(self) -> None:
        """Every row padding (a forward over any view reads and writes no page), enqueued like `fill`."""
        flat, ids = self._next_staging()
        self._pad({f: a.numpy() for f, a in self._split(flat).items()}, ids.numpy())
        self._upload(flat, ids, self.starts["page_indices"])

    @staticmethod
    def _pad(h: dict[str, np.ndarray], ids: np.ndarray) -> None:
        h["positions"][:] = 0
        h["append_slots"][:] = -1
        h["logits_indices"][:] = 0
        h["dec_page_indptr"][:] = 0
        h["dec_last_page_len"][:] = 1
        h["pre_qo_indptr"][:] = 0
        h["pre_page_indptr"][:] = 0
        h["pre_last_page_len"][:] = 1
        ids[:] = 0  # page_indices stays: no padding row reads it
