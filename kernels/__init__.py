"""disagg.kernels: Triton kernels for the paged KV cache and their pure-torch references."""
