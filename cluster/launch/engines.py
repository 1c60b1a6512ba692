"""How an instance actor turns the config into a model and an engine (the default engine module).

Three functions, called on the actor's step-loop thread, in this order:
`load(config, device)` loads the weights and returns the model; `describe(model, config, device)`
reports the KV geometry and memory that the launcher compares and sizes pages from;
`make_engine(role, model, heap, num_pages, config)` builds the `PrefillEngine`, `DecodeEngine`
or `ColocatedEngine` (prefill and decode engines allocate their KV from the symmetric heap,
collectively). Tests may hand the actors another module with the same three functions.
"""

from __future__ import annotations

import logging
from typing import Any

from disagg.cluster.routing.placement import policy_of
from disagg.config import Config

logger = logging.getLogger(__name__)

# Memory kept free for activations, logits, CUDA graphs and workspaces, beyond the KV pages.
ACTIVATION_RESERVE_BYTES = 2 << 30
CPU_DEFAULT_KV_BYTES = 256 << 20
# An instance sharing a GPU counts its CUDA context and NVSHMEM's own buffers as this much (torch's
# allocator does not see them).
CUDA_CONTEXT_BYTES = 1 << 30


def torch_dtype(name: str):
    """The torch dtype of a config dtype name (None for "auto")."""
    import torch

    return None if name == "auto" else getattr(torch, name)


def load(config: Config, device: str, tp: Any = None) -> Any:
    """Load the weights named by ``config.model`` on ``device`` ("cuda" or "cpu"): with ``tp`` (a
    `disagg.parallel.TPGroup`) this rank's shard of them; a dummy preset with
    ``model.num_layers`` decoder layers when that is set. The model runs with ``config.kernels``
    as given (the launcher applied its environment: no actor reads its own)."""
    import torch

    from disagg.model import load_model

    if device == "cuda":
        torch.cuda.set_device(0)  # Ray shows each actor exactly its own GPU
    target = "cuda:0" if device == "cuda" else "cpu"
    return load_model(config.model.source, dtype=torch_dtype(config.model.dtype), device=target,
                      settings=config.kernels, tp=tp, num_layers=config.model.num_layers)


def kv_torch_dtype(config: Config, model: Any):
    """The KV storage dtype: the model's, or float8_e4m3fn for ``cache.kv_dtype: fp8_e4m3``."""
    import torch

    return torch.float8_e4m3fn if config.cache.kv_dtype == "fp8_e4m3" else model.dtype


def describe(model: Any, config: Config, device: str) -> dict:
    """What the launcher compares across instances and sizes the cache from.

    Returns:
        {"geometry": {num_layers, num_kv_heads, page_size, head_dim, kv_dtype}, "page_bytes",
         "kv_budget_bytes" (bytes this instance may give to KV pages), "model_name",
         "max_position_embeddings", "num_qo_heads", "vocab_size", "eos_token_ids", "has_tokenizer",
         "device", "kernels" (the model's kernel switches), "tensor_parallel" (this instance's ranks),
         "model_num_kv_heads" (the checkpoint's: ``geometry`` holds a rank's share)}
    """
    import torch

    cache, cfg = config.cache, model.config
    shape = model.kv_shape(1, cache.page_size)  # (L, 1, 2, H_kv, P, D)
    kv_dtype = kv_torch_dtype(config, model)
    page_bytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=kv_dtype).element_size()
    if cache.num_pages is not None:
        budget = cache.num_pages * page_bytes
    elif cache.kv_bytes is not None:
        budget = cache.kv_bytes
    elif device == "cuda":
        budget = _gpu_kv_budget(config) - _activation_bytes(config, model)
    else:
        budget = CPU_DEFAULT_KV_BYTES
    return {
        "geometry": {"num_layers": int(shape[0]), "num_kv_heads": int(shape[3]),
                     "page_size": int(shape[4]), "head_dim": int(shape[5]), "kv_dtype": str(kv_dtype)},
        "page_bytes": page_bytes,
        "kv_budget_bytes": int(budget),
        "model_name": getattr(cfg, "name", config.model.source),
        "max_position_embeddings": int(cfg.max_position_embeddings),
        "num_qo_heads": int(cfg.num_qo_heads),
        "vocab_size": int(cfg.vocab_size),
        "eos_token_ids": [int(t) for t in getattr(cfg, "eos_token_ids", ())],
        "has_tokenizer": getattr(model, "tokenizer", None) is not None,
        "device": str(getattr(model, "device", device)),
        "kernels": model.settings.model_dump() if hasattr(model, "settings") else None,
        "tensor_parallel": int(getattr(getattr(model, "tp", None), "size", 1)),
        "model_num_kv_heads": int((getattr(model, "full_config", None) or cfg).num_kv_heads),
    }


def _gpu_kv_budget(config: Config) -> int:
    """Bytes of this GPU that this instance may still take: its share of
    ``cache.gpu_memory_fraction`` of the GPU, less what it holds already.

    Alone on a GPU (``gpus_per_instance: 1``) everything already in use counts against it
    (weights, CUDA context, other processes). Sharing a GPU with k - 1 other instances, it owns
    ``1/k`` of the fraction and counts only its own use (what torch reserved, plus a CUDA
    context): the others load concurrently, so the GPU's used memory would count their weights
    against every instance in turn.
    """
    import torch

    free, total = torch.cuda.mem_get_info()
    share = config.instances.gpus_per_instance
    if config.instances.ranks_per_gpu == 1:
        used = total - free
    else:
        used = torch.cuda.memory_reserved() + CUDA_CONTEXT_BYTES
    return int(total * config.cache.gpu_memory_fraction * share) - used


def _activation_bytes(config: Config, model: Any) -> int:
    """Memory for one forward's activations and logits at the token budget (a rough bound)."""
    cfg, tokens = model.config, config.scheduler.max_num_batched_tokens
    per_token = 4 * (cfg.vocab_size + 4 * cfg.intermediate_size + 8 * cfg.hidden_size)
    return ACTIVATION_RESERVE_BYTES + tokens * per_token


def make_engine(role: str, model: Any, heap: Any, num_pages: int, config: Config) -> Any:
    """Build this instance's engine (prefill/decode: KV from ``heap``, a collective allocation)."""
    from disagg.engine import ColocatedEngine, DecodeEngine, EngineOptions, PrefillEngine

    kv_dtype = None if config.cache.kv_dtype == "auto" else kv_torch_dtype(config, model)
    mode = config.scheduler.cuda_graphs
    tp = getattr(model, "tp", None)
    if tp is not None and tp.size > 1 and tp.backend == "gloo":
        mode = "none"  # gloo's collectives (ranks sharing a GPU) cannot be captured in a CUDA graph
    # every role decodes (a prefill instance the requests the adaptive router keeps on it)
    options = EngineOptions(
        num_pages=num_pages, page_size=config.cache.page_size, max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens, kv_dtype=kv_dtype,
        prefix_caching=config.cache.prefix_caching, use_cuda_graphs=False if mode == "none" else None,
        prompt_graphs=None if mode in ("full", "full_and_piecewise") else False,
        mixed_graphs=None if mode == "full" else False, async_scheduling=config.scheduler.async_scheduling,
        async_prompts=config.scheduler.async_prompts, verify_transfers=config.transfer.verify)
    if role == "prefill":
        # Decode graphs where the router may keep a request on it to decode (adaptive placement):
        # an eager decode step of an 8B model takes about twice the graph's.
        keeps = policy_of(config.router.placement).keeps and mode != "none"
        return PrefillEngine(model, heap, options=options.replace(
            use_cuda_graphs=None if keeps else False, force_segment_puts=config.transfer.force_segment_puts,
            push_after=config.transfer.push_after,
            peer_tensor_parallel=config.instances.tensor_parallel_of("decode")))
    if role == "decode":
        return DecodeEngine(model, heap, options=options.replace(
            lease_s=config.router.lease_s, peer_tensor_parallel=config.instances.tensor_parallel_of("prefill")))
    if role == "colocated":
        return ColocatedEngine(model, options=options)
    raise ValueError(f"role must be prefill, decode or colocated, got {role!r}")


def warm_up(engine: Any, role: str, config: Config) -> dict:
    """Compile the kernels and capture every decode graph before the first request.

    The engine's own `warmup` (a scratch sequence whose pages are freed again): on CUDA a prompt
    of the whole token budget (prefill and colocated instances; every instance when the router
    may place requests locally or keep them, `router.placement`) and the prompt graphs of every
    token bucket after it, and the decode graphs of every batch bucket and context class up to the
    model's length, so no capture or compile runs mid-serving (each stalls every running
    request); on the CPU a short prompt, which proves the path and costs little.

    Returns:
        The seconds per phase ("prefill", "decode", "graphs", "prompt_graphs").
    """
    model = engine.model
    gpu = model.device.type == "cuda"
    max_len = config.model.max_model_len or int(model.config.max_position_embeddings)
    budget = config.scheduler.max_num_batched_tokens
    prompt_len = budget if gpu else min(budget, 16)
    max_kv_len = max_len if gpu else min(max_len, 64)
    both = policy_of(config.router.placement).mixes_phases  # local / kept requests: both phases everywhere
    if role == "prefill":
        return engine.warmup(prompt_len=prompt_len, max_kv_len=max_kv_len if both else None)
    if role == "decode":
        return engine.warmup(max_kv_len=max_kv_len, prompt_len=prompt_len if both else None)
    return engine.warmup(prompt_len=prompt_len, max_kv_len=max_kv_len)


def tokenizer_of(model: Any) -> Any:
    """The model's tokenizer (None for dummy weights)."""
    return getattr(model, "tokenizer", None)
