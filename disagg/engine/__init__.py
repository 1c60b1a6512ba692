"""disagg.engine: the engines that own a model, a KV cache and its page tables (no Ray).

    ColocatedEngine(model, num_pages=, page_size=, max_num_seqs=, max_num_batched_tokens=)
                                      .add(request_id, prompt_token_ids, params)
    PrefillEngine(model, heap, ...)   .add(request_id, prompt_token_ids, params, dest)
                                      (dest None: kept, decoded here)
    DecodeEngine(model, heap, ...)    .reserve(request_id, prompt_len, params, prompt_token_ids=)
                                      -> RecvDest (num_cached_tokens: push only past them)
                                      .start(request_id, first_token_id)
                                      .cancel_reservation(dest)  no sender will write: free now
                                      .add(request_id, prompt_token_ids, params)  prefilled here
    every engine: .step() -> list[TokenOutput], .abort(request_id), .has_work(), .stats();
    every constructor also takes options=EngineOptions(...) (graphs, async scheduling, prefix
    caching, leases, push timing; the sizes may go there too)
    (PrefillEngine.abort -> PushState | None: may a push of it still land in the decode pages?)

Files: `core` (`EngineCore`: the one step pipeline and request life cycle every engine is a
configuration of), `options` (`EngineOptions`: sizes and switches, validated once), `request`
(request state, TokenOutput, RecvDest, add-time checks), `scheduler`
(batching, page commitments, preemption), `runner` (plan -> forward -> sample), `graphs` (decode
CUDA graphs), `sampler` (on-device sampling), `colocated`, `prefill`, `decode` (the three roles).
Sampling parameters live in `disagg.sampling`; KV transfer (senders, receivers, their leases) in
`disagg.transfer` behind its KV connector, whose `RecvDest` and `PushState` are importable here.
"""

from __future__ import annotations

import importlib

from disagg.engine.request import PushState, RecvDest, TokenOutput
from disagg.sampling import SamplingParams

__all__ = ["ColocatedEngine", "DecodeEngine", "EngineOptions", "PrefillEngine", "PushState", "RecvDest", "SamplingParams",
           "TokenOutput"]

# The engines pull in torch, the model and the kernels: imported on first use, so that a caller
# that needs only RecvDest / TokenOutput (the router) stays light.
_ENGINES = {"ColocatedEngine": "colocated", "DecodeEngine": "decode", "EngineOptions": "options",
            "PrefillEngine": "prefill"}


def __getattr__(name: str):
    if name in _ENGINES:
        return getattr(importlib.import_module(f"disagg.engine.{_ENGINES[name]}"), name)
    raise AttributeError(f"module 'disagg.engine' has no attribute {name!r}")
