"""`Shard`: which part of each weight one tensor-parallel rank holds (Megatron sharding).

`load_model` makes one per rank; the weights (`disagg.model.weights`) slice through it and the
model (`disagg.model.llama`) reads its local shapes and vocabulary range from it. Every rule of
the sharding lives here, on one rank `r` of `k`:

    q_proj, k_proj, v_proj   rows by heads           (column-parallel: no communication)
    o_proj                   columns by q heads      (row-parallel: partial sums, all-reduced)
    gate_proj, up_proj       rows, I / k each        (column-parallel)
    down_proj                columns, I / k each     (row-parallel, all-reduced)
    embed_tokens, lm_head    rows by vocabulary      (vocabulary-parallel)
    norms                    whole, on every rank

KV heads: with k dividing num_kv_heads each rank holds num_kv_heads / k of them; with k a
multiple of num_kv_heads each holds one, head `r * num_kv_heads // k` (replicated over the k /
num_kv_heads ranks whose q heads read it, as vLLM does). Vocabulary: shards of ceil(V / k)
rows, rank r holding tokens [r * rows, min((r + 1) * rows, V)); a short last shard is padded
with zero rows so that every rank's logits have one width for the gather.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from disagg.model.config import ModelConfig
from disagg.model.errors import ModelConfigError

Span = tuple[int, int]  # [start, stop) along one dim of a full tensor


def check_tensor_parallel(config: ModelConfig, size: int) -> None:
    """Refuse a tensor-parallel degree that the model's shapes cannot be split by.

    Raises:
        ModelConfigError: `size` < 1, or it does not divide num_qo_heads or intermediate_size,
            or it neither divides num_kv_heads nor is a multiple of it.
    """
    where = f"{config.name}: tensor_parallel={size}"
    if not isinstance(size, int) or size < 1:
        raise ModelConfigError(f"{where}: expected an int >= 1")
    c = config
    if c.num_qo_heads % size:
        raise ModelConfigError(f"{where} must divide num_qo_heads={c.num_qo_heads} (each rank holds "
                               f"whole query heads); got a remainder of {c.num_qo_heads % size}")
    if c.intermediate_size % size:
        raise ModelConfigError(f"{where} must divide intermediate_size={c.intermediate_size} (the MLP "
                               f"width); got a remainder of {c.intermediate_size % size}")
    if c.num_kv_heads % size and size % c.num_kv_heads:
        raise ModelConfigError(f"{where} must divide num_kv_heads={c.num_kv_heads} or be a multiple "
                               f"of it (then KV heads are replicated); it is neither")


@dataclass(frozen=True)
class Shard:
    """Rank `rank` of `size`'s part of a model of `config` (the checkpoint's full config).

    Made by `Shard.of`, which checks the degree; `Shard.of(config)` is the whole model.
    """

    config: ModelConfig
    rank: int = 0
    size: int = 1

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> "Shard":
        """The checked shard of rank `rank` of `size`.

        Raises:
            ModelConfigError: see `check_tensor_parallel`; `rank` outside [0, size).
        """
        check_tensor_parallel(config, size)
        if not 0 <= rank < size:
            raise ModelConfigError(f"{config.name}: tensor-parallel rank {rank} is outside [0, {size})")
        return cls(config, rank, size)

    @property
    def num_qo_heads(self) -> int:
        return self.config.num_qo_heads // self.size

    @property
    def num_kv_heads(self) -> int:
        return max(1, self.config.num_kv_heads // self.size)

    @property
    def intermediate_size(self) -> int:
        return self.config.intermediate_size // self.size

    @property
    def vocab_rows(self) -> int:
        """Rows of this rank's embedding and LM head (every rank's alike: ceil(V / size))."""
        return -(-self.config.vocab_size // self.size)

    @property
    def vocab_range(self) -> Span:
        """[start, stop) of the token ids this rank embeds and scores (stop - start may be less
        than `vocab_rows` on the last ranks: the rest is zero padding)."""
        v = self.config.vocab_size
        return min(v, self.rank * self.vocab_rows), min(v, (self.rank + 1) * self.vocab_rows)

    def local_config(self) -> ModelConfig:
        """The config of the model this rank runs: its heads and MLP width, the full vocabulary."""
        return dataclasses.replace(self.config, num_qo_heads=self.num_qo_heads,
                                   num_kv_heads=self.num_kv_heads,
                                   intermediate_size=self.intermediate_size)

    # Spans in the full tensors, along the dim that `hf_slice` names.
    def q_span(self) -> Span:
        rows = self.num_qo_heads * self.config.head_dim
        return self.rank * rows, (self.rank + 1) * rows

    def kv_span(self) -> Span:
        c, d = self.config, self.config.head_dim
        first = (self.rank * c.num_kv_heads // self.size if self.size > c.num_kv_heads
                 else self.rank * self.num_kv_heads)
        return first * d, (first + self.num_kv_heads) * d

    def mlp_span(self) -> Span:
        return self.rank * self.intermediate_size, (self.rank + 1) * self.intermediate_size

    def qkv_spans(self) -> list[Span]:
        """This rank's rows of the fused `[Q + 2 KV, H]` qkv matrix (its q, then k, then v rows)."""
        q, kv = self.config.q_size, self.config.kv_size
        (q0, q1), (k0, k1) = self.q_span(), self.kv_span()
        return [(q0, q1), (q + k0, q + k1), (q + kv + k0, q + kv + k1)]

    def gate_up_spans(self) -> list[Span]:
        """This rank's rows of the fused `[2 I, H]` gate_up matrix (its gate, then up rows)."""
        (a, b), i = self.mlp_span(), self.config.intermediate_size
        return [(a, b), (i + a, i + b)]

    def hf_slice(self, name: str) -> tuple[int, Span] | None:
        """(dim, [start, stop)) of HF tensor `name` that this rank reads (dim 0: rows, 1:
        columns), or None for the whole tensor (norms, and every tensor at size 1)."""
        if self.size == 1 or name.endswith("norm.weight"):
            return None
        if name.endswith(("embed_tokens.weight", "lm_head.weight")):
            return 0, self.vocab_range
        rules = {"q_proj": (0, self.q_span), "k_proj": (0, self.kv_span), "v_proj": (0, self.kv_span),
                 "o_proj": (1, self.q_span), "gate_proj": (0, self.mlp_span),
                 "up_proj": (0, self.mlp_span), "down_proj": (1, self.mlp_span)}
        module = name.rsplit(".", 2)[-2]
        if module not in rules:
            raise AssertionError(f"no sharding rule for tensor {name!r}: every tensor of "
                                 "expected_shapes has one")
        dim, span = rules[module]
        return dim, span()


def take(full: torch.Tensor, dim: int, spans: list[Span]) -> torch.Tensor:
    """The spans of `full` along `dim`, concatenated into a new contiguous tensor (so that
    dropping `full` frees it)."""
    parts = [full.narrow(dim, start, stop - start) for start, stop in spans]
    if len(parts) == 1:
        return parts[0].clone(memory_format=torch.contiguous_format)
    return torch.cat(parts, dim=dim)


def pad_vocab_rows(rows: torch.Tensor, shard: Shard) -> torch.Tensor:
    """An embedding or LM head shard `[stop - start, H]` padded with zero rows to
    `[shard.vocab_rows, H]` (unchanged when it is full)."""
    missing = shard.vocab_rows - rows.shape[0]
    if not missing:
        return rows
    return torch.cat([rows, rows.new_zeros((missing, rows.shape[1]))])
