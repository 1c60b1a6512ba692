"""disagg.kernels: Triton kernels for the paged KV cache and their pure-torch references.

Launchers (each checks its inputs, then runs Triton on CUDA tensors, the torch reference in
`disagg.kernels.reference` on CPU tensors, or the Triton kernel in Triton's interpreter when
`TRITON_INTERPRET=1`):

    append_kv(k, v, kv_layer, slots)                        new K/V -> local pages
    append_push_kv(k, v, kv_layer, slots, dst_layers, dst_slots, dst_index)
                                                            ... and into receivers' pages, one pass
    prepare_append_push(kv, slots, dst_kv, dst_slots, dst_index) -> PreparedAppend
                                                            the same, checked once per forward and
                                                            launched per layer with no re-checks
    paged_decode(q, kv_layer, page_indptr, page_indices, last_page_len, sm_scale) -> o
    paged_prefill(q, kv_layer, qo_indptr, page_indptr, page_indices, last_page_len, sm_scale,
                  causal=True) -> o
    copy_slots(src, src_slots, dst, dst_slots)              slot runs between caches (peer views ok)

`kv_layer` is `[num_pages, 2, H_kv, page_size, head_dim]` (index 0 of the 2-axis is K). Importing
this package imports torch and triton; `import disagg` does not import it.
"""

from disagg.kernels.append import (PreparedAppend, append_kv, append_push_kv, build_dst_table,
                                   prepare_append_push)
from disagg.kernels.copy import copy_slots
from disagg.kernels.decode import (choose_num_splits, decode_workspace, decode_workspace_numel,
                                   paged_decode)
from disagg.kernels.prefill import paged_prefill

__all__ = [
    "PreparedAppend",
    "append_kv",
    "append_push_kv",
    "build_dst_table",
    "choose_num_splits",
    "copy_slots",
    "decode_workspace",
    "decode_workspace_numel",
    "paged_decode",
    "paged_prefill",
    "prepare_append_push",
]
