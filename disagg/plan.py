"""`ForwardPlan`: what one forward of the paged cache tells the kernels and the KV pusher.

Made by `PagedKVCache.begin_forward` (and `disagg_prepare_recv`, which is a one-sequence forward);
read by the model runner (page tables, slots, positions), by the KV storage (fork copies) and by
the KV pusher (push/copy arrays, send records). Pure numpy; every index array is int32.

Index ranges, for a batch of B sequences appending T tokens in all:

    qo_indptr     [B+1]   tokens of sequence i are rows qo_indptr[i]:qo_indptr[i+1] of q/k/v
    page_indptr   [B+1]   pages of sequence i are page_indices[page_indptr[i]:page_indptr[i+1]]
    page_indices  [nnz]   page ids, in sequence order, AFTER the append (attention follows it)
    last_page_len [B]     tokens in each sequence's last page after the append (1..page_size)
    append_slots  [T]     where each new token's K/V goes: page_id * page_size + offset
    positions     [T]     each new token's position in its sequence (for RoPE)
    push_slots    [T]     receiver slot of each new token, -1 when the token is not sent
    push_pes      [T]     receiver PE of each new token, -1 when the token is not sent
    copy_local_slots / copy_remote_slots / copy_pes  [M]
                          KV that already existed when `disagg_mark_send` was called: local slot
                          -> receiver slot on PE, all layers (page-to-page path)
    fork_src_slots / fork_dst_slots  [F]
                          local slot copies that forks left pending (a partially filled page is
                          copied for the child); the KV storage applies them, in order, for every
                          layer, BEFORE this forward's appends
    send_seq_ids / send_pes / send_complete  [S]
                          sequences whose KV moves in this forward (pushes or copies), their
                          receiver PE, and whether this forward writes the last token of their
                          remote map (the pusher rings the receiver's doorbell after it)
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def batch_size(self) -> int:
        return len(self.seq_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def has_transfers(self) -> bool:
        return len(self.send_seq_ids) > 0
