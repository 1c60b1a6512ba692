"""`ForwardPlan`: what one forward of the paged cache tells the kernels and the KV pusher.

Made by `PagedKVCache.begin_forward` (and `disagg_prepare_recv`, which is a one-sequence forward);
read by the model runner (page tables, slots, positions), by the KV storage (fork copies) and by
the KV pusher (push/copy arrays, send records). Pure numpy; every index array is int32.

Index ranges, for a batch of B sequences appending T tokens in all:

    qo_indptr     [B+1]   tokens of sequence i are rows qo_indptr[i]:qo_indptr[i+1] of q/k/v
    page_indptr   [B+1]   pages of sequence i are page_indices[page_indptr[i]:page_indptr[i+1]]
    page_indices  [nnz]   page ids, in sequence order, AFTER the append (attention follows it)
    last_page_len [B]     tokens in each sequence's last page after the append (1..page_size)
    append_slots  [T]     where each new token's K/V goes: page_id * page_size + offset; -1 for a
                          token that a sliding window drops before it is written (TVM)
    positions     [T]     each new token's position in its sequence (for RoPE); for a sliding
                          window, its position inside the cache (TVM's RoPE position)
    push_slots    [T]     receiver slot of each new token, -1 when the token is not sent
    push_pes      [T]     receiver PE of each new token, -1 when the token is not sent
    copy_local_slots / copy_remote_slots / copy_pes  [M]
                          KV that already existed when `disagg_mark_send` was called: local slot
                          -> receiver slot on PE, all layers (page-to-page path)
    fork_src_slots / fork_dst_slots  [F]
                          local slot copies that forks left pending (a partially filled page is
                          copied for the child); the KV storage applies them for every layer,
                          BEFORE this forward's appends, as ONE parallel batch: no pair reads a
                          slot that another pair writes (chains of forks are resolved to their
                          original sources) and destinations are distinct
    send_seq_ids / send_pes / send_complete  [S]
                          sequences whose KV moves in this forward (pushes or copies), their
                          receiver PE, and whether this forward writes the last token of their
                          remote map (the pusher rings the receiver's doorbell after it);
                          in the order of the `disagg_mark_send` calls
    sink_size / sliding_window_offset  [B]
                          sliding windows only: page-table slots [sink_size, sliding_window_offset)
                          of sequence i (counted over its pages, page_size per page) are dead (the
                          hole between attention sinks and the window; TVM's fields, flattened
                          over prefix blocks); both 0 when there is no hole. None in plans not
                          made by the cache means no sequence has a hole.

Ordering that consumers rely on: fork copies run (for every layer) before the forward's appends;
no slot a `copy_local_slots` entry reads is written by the same forward, so the pusher may copy
those at any point of it; `send_seq_ids` is int64 (sequence ids), `send_complete` bool.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class ForwardPlan:
    """Page tables and transfer lists for one forward; see the module docstring for shapes."""

    seq_ids: tuple[int, ...]
    qo_indptr: np.ndarray
    page_indptr: np.ndarray
    page_indices: np.ndarray
    last_page_len: np.ndarray
    append_slots: np.ndarray
    positions: np.ndarray
    push_slots: np.ndarray
    push_pes: np.ndarray
    copy_local_slots: np.ndarray
    copy_remote_slots: np.ndarray
    copy_pes: np.ndarray
    fork_src_slots: np.ndarray
    fork_dst_slots: np.ndarray
    send_seq_ids: np.ndarray
    send_pes: np.ndarray
    send_complete: np.ndarray
    sink_size: np.ndarray | None = field(default=None)
    sliding_window_offset: np.ndarray | None = field(default=None)

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def has_transfers(self) -> bool:
        return len(self.send_seq_ids) > 0
