"""disagg.model: the Llama-family model over the paged KV cache.

    from disagg.model import load_model, AttentionBatch
    model = load_model("dummy:tiny")            # or an HF directory; dtype=, device=, tp=
    kv = torch.zeros(model.kv_shape(num_pages, page_size), dtype=model.dtype, device=model.device)
    plan = cache.begin_forward(seq_ids, lengths)
    logits = model.forward(input_ids, AttentionBatch.from_plan(plan, model.device), kv)

Files: `config` (ModelConfig from config.json), `presets` (dummy shapes), `shard` (a
tensor-parallel rank's slices of each weight), `weights` (safetensors -> fused tensors, random
weights), `layers` (RMSNorm, RoPE, SwiGLU, tensor-parallel projections), `llama` (the Model and its
forward), `batch` (AttentionBatch: a plan's device tensors, static decode buffers for CUDA
graphs), `tokenizer` (tokenizers + jinja chat templates), `smollm2` (the real test weights),
`errors`. Importing this package imports torch and the kernels; `import disagg` does not.
"""

from disagg.model.batch import AttentionBatch
from disagg.model.config import ModelConfig
from disagg.model.errors import (ChatTemplateError, ModelConfigError, ModelError,
                                 UnsupportedArchitecture, WeightsError)
from disagg.model.llama import Model
from disagg.model.loader import load_model
from disagg.model.tokenizer import Tokenizer

__all__ = [
    "AttentionBatch",
    "ChatTemplateError",
    "Model",
    "ModelConfig",
    "ModelConfigError",
    "ModelError",
    "Tokenizer",
    "UnsupportedArchitecture",
    "WeightsError",
    "load_model",
]
