"""disagg: disaggregated prefill/decode LLM serving on Ray, PyTorch, Triton and NVSHMEM.

The core package holds what every process needs and nothing heavy: page-table bookkeeping
(`disagg.cache`), compressed position maps (`disagg.posmap`) and the error types
(`disagg.errors`). Kernels (`disagg.kernels`), symmetric-memory transfer (`disagg.transfer`) and
the Ray cluster (`disagg.cluster`) are subpackages imported on demand, so `import disagg` never
pulls in torch, triton, ray or nvshmem.
"""

__version__ = "0.1.0"
