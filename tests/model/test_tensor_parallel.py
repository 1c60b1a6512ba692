"""Tensor parallelism in the model: a rank's weights are its slices, and k ranks over gloo compute
the one-rank model's logits (fp32, CPU).

Ranks are forked child processes of the test (`run_ranks`), each joining a gloo world through
`init_tensor_parallel`; rank results come back as numpy arrays. Covered: TP=2 on tiny (prompt
chunks, a mixed decode + prefill forward, decode steps over the paged cache), TP=4 on tiny with
an uneven vocabulary (one KV head per rank, replicated; a padded last vocabulary shard), TP=3 on
the real SmolLM2 weights read sharded from safetensors (9 q heads, 3 KV heads, tied embeddings).
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import traceback

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from paged_runner import PagedRunner
from disagg.model import Model, ModelConfigError, load_model
from disagg.model.presets import preset_config
from disagg.model.shard import Shard
from disagg.model.weights import load_checkpoint, random_weights
from disagg.parallel import SINGLE, TPGroup, init_tensor_parallel, local_address

RANK_TIMEOUT_S = 120.0
CPU = torch.device("cpu")


def run_ranks(size: int, fn, *args):
    """`fn(tp, *args)` on `size` forked ranks of one gloo world: the ranks' results, in rank order.

    A rank that raises fails the test with its traceback; one that hangs fails it after
    RANK_TIMEOUT_S (every rank is then killed)."""
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    address = local_address("127.0.0.1")

    def rank_main(rank: int) -> None:
        try:
            tp = init_tensor_parallel(address, rank, size, "gloo", timeout_s=RANK_TIMEOUT_S)
            try:
                results.put((rank, fn(tp, *args), None))
            finally:
                tp.close()
        except BaseException:  # report everything to the parent, which fails the test
            results.put((rank, None, traceback.format_exc()))

    procs = [ctx.Process(target=rank_main, args=(rank,), daemon=True) for rank in range(size)]
    for p in procs:
        p.start()
    try:
        out = {}
        for _ in range(size):
            rank, value, error = results.get(timeout=RANK_TIMEOUT_S)
            assert error is None, f"rank {rank} of {size} failed:\n{error}"
            out[rank] = value
        return [out[rank] for rank in range(size)]
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()


def script_logits(model: Model) -> np.ndarray:
    """A fixed token script over the paged cache: two prompts in 4-token chunks, a mixed forward
    (two decodes and a third prompt), two decode steps. Every forward's logits, `[rows, V]`."""
    runner = PagedRunner(model, num_pages=32, page_size=4)
    steps = [runner.prefill([[5, 17, 200, 3, 9, 44], [1, 2, 3, 4, 5, 6, 7, 8, 9]], chunk=4),
             runner.forward({0: [11], 1: [12], 2: [30, 31, 32]}),
             runner.forward({0: [13], 1: [14], 2: [33]}),
             runner.forward({0: [15], 1: [16], 2: [34]})]
    return torch.cat(steps).numpy()


def tiny_logits(tp: TPGroup, vocab_size: int | None = None) -> np.ndarray:
    config = preset_config("tiny")
    if vocab_size is not None:
        config = dataclasses.replace(config, vocab_size=vocab_size)
    model = Model(config, random_weights(config, torch.float32, CPU, seed=1, tp=tp),
                  dtype=torch.float32, device=CPU, tp=tp)
    return script_logits(model)


def assert_ranks_match(ranks: list[np.ndarray], expected: np.ndarray) -> None:
    for rank, got in enumerate(ranks):
        assert got.shape == expected.shape, f"rank {rank}: logits {got.shape}, expected {expected.shape}"
        torch.testing.assert_close(torch.from_numpy(got), torch.from_numpy(expected), atol=2e-5, rtol=1e-5,
                                   msg=lambda m: f"rank {rank} of {len(ranks)}: {m}")
        assert (got.argmax(-1) == expected.argmax(-1)).all(), f"rank {rank}: greedy tokens differ"


def test_tp2_tiny_equals_tp1():
    """Prompt chunks, a mixed batch and decode steps at TP=2: every rank returns TP=1's logits."""
    expected = tiny_logits(SINGLE)
    assert_ranks_match(run_ranks(2, tiny_logits), expected)


def test_tp4_replicated_kv_and_uneven_vocab_equals_tp1():
    """TP=4 on tiny (2 KV heads: each rank holds one, shared by ranks 0-1 and 2-3) with a vocabulary
    of 250 (shards of 63 rows, the last one 61 + 2 padding)."""
    expected = tiny_logits(SINGLE, vocab_size=250)
    assert expected.shape[-1] == 250
    assert_ranks_match(run_ranks(4, tiny_logits, 250), expected)


def test_group_collectives():
    """all_reduce sums in place, all_gather concatenates in rank order along the dim, objects go
    from rank 0 (broadcast) and from every rank (all_gather_object)."""

    def collectives(tp: TPGroup):
        x = torch.full((2, 3), float(tp.rank + 1))
        reduced = tp.all_reduce(x)
        gathered = tp.all_gather(torch.arange(3.0).view(1, 3) + 10 * tp.rank, dim=-1)
        return (reduced is x, x.numpy(), gathered.numpy(), tp.broadcast_object({"rank": tp.rank}),
                tp.all_gather_object(("r", tp.rank)))

    for same, reduced, gathered, broadcast, objects in run_ranks(3, collectives):
        assert same and (reduced == 6.0).all()
        np.testing.assert_array_equal(gathered, [[0, 1, 2, 10, 11, 12, 20, 21, 22]])
        assert broadcast == {"rank": 0} and objects == [("r", 0), ("r", 1), ("r", 2)]


def test_single_group_is_the_identity():
    x = torch.ones(2, 2)
    assert SINGLE.all_reduce(x) is x and SINGLE.all_gather(x, dim=0) is x
    assert SINGLE.broadcast_object("a") == "a" and SINGLE.all_gather_object("a") == ["a"]
    assert not torch.distributed.is_initialized()
    with pytest.raises(RuntimeError, match="has no process group"):
        TPGroup(rank=0, size=2).all_reduce(x)


def _rank_slices(full, config, rank: int, size: int) -> dict[str, torch.Tensor]:
    """Rank `rank`'s expected slices of the one-rank weights, by the sharding rules written out."""
    d = config.head_dim
    q_rows = config.num_qo_heads // size * d
    kv_heads = max(1, config.num_kv_heads // size)
    kv_first = rank * config.num_kv_heads // size if size > config.num_kv_heads else rank * kv_heads
    q, kv, i = config.q_size, config.kv_size, config.intermediate_size // size
    layer = full.layers[0]
    k_rows = slice(q + kv_first * d, q + (kv_first + kv_heads) * d)
    v_rows = slice(q + kv + kv_first * d, q + kv + (kv_first + kv_heads) * d)
    vocab = -(-config.vocab_size // size)
    embed = torch.zeros(vocab, config.hidden_size)
    own = full.embed[rank * vocab:(rank + 1) * vocab]
    embed[:own.shape[0]] = own
    return {
        "qkv": torch.cat([layer.qkv[rank * q_rows:(rank + 1) * q_rows], layer.qkv[k_rows], layer.qkv[v_rows]]),
        "o_proj": layer.o_proj[:, rank * q_rows:(rank + 1) * q_rows],
        "gate_up": torch.cat([layer.gate_up[rank * i:(rank + 1) * i],
                              layer.gate_up[config.intermediate_size + rank * i:][:i]]),
        "down": layer.down[:, rank * i:(rank + 1) * i], "embed": embed,
        "input_norm": layer.input_norm, "post_norm": layer.post_norm,
    }


def _held(weights) -> dict[str, torch.Tensor]:
    layer = weights.layers[0]
    return {"qkv": layer.qkv, "o_proj": layer.o_proj, "gate_up": layer.gate_up, "down": layer.down,
            "embed": weights.embed, "input_norm": layer.input_norm, "post_norm": layer.post_norm}


@pytest.mark.parametrize("size", [2, 4])
def test_dummy_rank_weights_are_tp1_slices(size):
    """Each rank's dummy tensors are exactly its slices of the TP=1 weights (same seed), and the
    TP=1 weights are what they were before tensor parallelism (SINGLE or no tp: one stream)."""
    config = dataclasses.replace(preset_config("tiny"), vocab_size=250)
    full = random_weights(config, torch.float32, CPU, seed=4)
    one = random_weights(config, torch.float32, CPU, seed=4, tp=TPGroup(0, 1))
    assert all(torch.equal(a, b) for a, b in zip(_held(full).values(), _held(one).values()))
    for rank in range(size):
        held = _held(random_weights(config, torch.float32, CPU, seed=4, tp=TPGroup(rank, size)))
        expected = _rank_slices(full, config, rank, size)
        for name, tensor in expected.items():
            assert held[name].shape == tensor.shape, f"rank {rank}: {name} {held[name].shape} vs {tensor.shape}"
            assert torch.equal(held[name], tensor), f"rank {rank} of {size}: {name} is not its slice"
            assert held[name].is_contiguous(), f"rank {rank}: {name} is a strided view of a full tensor"


def _save_hf(weights, config, path) -> None:
    """Save one-rank fused weights as an HF checkpoint (q/k/v and gate/up apart)."""
    tensors = {"model.embed_tokens.weight": weights.embed, "model.norm.weight": weights.norm,
               "lm_head.weight": weights.lm_head}
    q, kv, i = config.q_size, config.kv_size, config.intermediate_size
    for n, layer in enumerate(weights.layers):
        p = f"model.layers.{n}."
        parts = {"input_layernorm": layer.input_norm, "post_attention_layernorm": layer.post_norm,
                 "self_attn.q_proj": layer.qkv[:q], "self_attn.k_proj": layer.qkv[q:q + kv],
                 "self_attn.v_proj": layer.qkv[q + kv:], "self_attn.o_proj": layer.o_proj,
                 "mlp.gate_proj": layer.gate_up[:i], "mlp.up_proj": layer.gate_up[i:],
                 "mlp.down_proj": layer.down}
        tensors.update({f"{p}{name}.weight": tensor for name, tensor in parts.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path))


def test_checkpoint_rank_reads_only_its_slices(tmp_path, monkeypatch):
    """load_checkpoint at TP=2 gives each rank the slices random_weights gives it, and reads whole
    tensors only for the norms (everything else through get_slice)."""
    config = preset_config("tiny")
    full = random_weights(config, torch.float32, CPU, seed=2)
    _save_hf(full, config, tmp_path / "model.safetensors")
    import disagg.model.weights as weights_module

    whole: list[str] = []
    real_open = weights_module._open

    class Recording:
        """An open safetensors file that records the names read whole."""

        def __init__(self, f):
            self.f = f

        def __enter__(self):
            self.inner = self.f.__enter__()
            return self

        def __exit__(self, *exc):
            return self.f.__exit__(*exc)

        def get_tensor(self, name):
            whole.append(name)
            return self.inner.get_tensor(name)

        def __getattr__(self, attr):  # keys, get_slice
            return getattr(self.inner, attr)

    monkeypatch.setattr(weights_module, "_open", lambda path, device: Recording(real_open(path, device)))
    for rank in range(2):
        whole.clear()
        read = load_checkpoint(tmp_path, config, torch.float32, CPU, tp=TPGroup(rank, 2))
        made = random_weights(config, torch.float32, CPU, seed=2, tp=TPGroup(rank, 2))
        for name, tensor in _held(made).items():
            assert torch.equal(_held(read)[name], tensor), f"rank {rank}: {name}"
        assert torch.equal(read.lm_head, made.lm_head)
        assert whole and all(name.endswith("norm.weight") for name in whole), whole


def test_tp_that_does_not_split_the_model_is_refused():
    tiny = preset_config("tiny")  # 4 q heads, 2 KV heads, intermediate 128
    with pytest.raises(ModelConfigError, match=r"tensor_parallel=3 must divide num_qo_heads=4"):
        load_model("dummy:tiny", device="cpu", tp=TPGroup(0, 3))
    with pytest.raises(ModelConfigError, match=r"tensor_parallel=4 must divide intermediate_size=130"):
        random_weights(dataclasses.replace(tiny, intermediate_size=130), torch.float32, CPU, tp=TPGroup(0, 4))
    odd_kv = dataclasses.replace(tiny, num_qo_heads=12, num_kv_heads=4, intermediate_size=120)
    with pytest.raises(ModelConfigError, match=r"tensor_parallel=6 must divide num_kv_heads=4 or be a multiple"):
        Shard.of(odd_kv, 0, 6)
    with pytest.raises(ModelConfigError, match=r"rank 2 is outside \[0, 2\)"):
        Shard.of(tiny, 2, 2)
    with pytest.raises(ModelConfigError, match=r"tensor_parallel=3 must divide num_qo_heads"):
        load_checkpoint("/nonexistent", tiny, torch.float32, CPU, tp=TPGroup(0, 3))  # before any file


def test_shard_arithmetic():
    """Local shapes, KV heads of replicated ranks, and uneven vocabulary ranges."""
    smollm2 = preset_config("smollm2-135m")  # 9 q heads, 3 KV heads, head_dim 64
    local = Shard.of(smollm2, 1, 3).local_config()
    assert (local.num_qo_heads, local.num_kv_heads, local.intermediate_size, local.vocab_size) == (3, 1, 512, 49152)
    # TP=9 (an MLP width it divides): one q head per rank; q head r reads KV head r // 3, so rank r
    # holds KV head r // 3.
    wide = dataclasses.replace(smollm2, intermediate_size=1728)
    assert [Shard.of(wide, r, 9).kv_span() for r in range(9)] == [(h * 64, h * 64 + 64) for h in
                                                                    [0, 0, 0, 1, 1, 1, 2, 2, 2]]
    tiny = dataclasses.replace(preset_config("tiny"), vocab_size=250)
    assert [Shard.of(tiny, r, 4).vocab_range for r in range(4)] == [(0, 63), (63, 126), (126, 189), (189, 250)]
    assert Shard.of(dataclasses.replace(tiny, vocab_size=5), 3, 4).vocab_range == (5, 5)  # all padding
    assert Shard.of(tiny, 1, 2).hf_slice("model.layers.0.self_attn.o_proj.weight") == (1, (32, 64))
    assert Shard.of(tiny, 1, 2).hf_slice("model.layers.0.input_layernorm.weight") is None


def smollm2_tokens(tp: TPGroup, model_dir: str, prompt: list[int], steps: int):
    """Greedy decode of `prompt` for `steps` tokens: (tokens, logits of every step `[steps, V]`)."""
    model = load_model(model_dir, device="cpu", dtype="float32", tp=tp)
    runner = PagedRunner(model, num_pages=16, page_size=8)
    logits = [runner.prefill([prompt])[0]]
    tokens = [int(logits[-1].argmax())]
    for _ in range(steps - 1):
        logits.append(runner.decode([tokens[-1]])[0])
        tokens.append(int(logits[-1].argmax()))
    return tokens, torch.stack(logits).numpy()


def test_tp3_smollm2_equals_tp1(smollm2_dir, reference_kernels):
    """The real SmolLM2 at TP=3 (3 q heads, 1 KV head per rank; tied embeddings sharded by
    vocabulary): the greedy tokens and logits of TP=1."""
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 2]
    tokens, logits = smollm2_tokens(SINGLE, str(smollm2_dir), prompt, 4)
    for rank, (rank_tokens, rank_logits) in enumerate(run_ranks(3, smollm2_tokens, str(smollm2_dir), prompt, 4)):
        assert rank_tokens == tokens, f"rank {rank}"
        scale = float(np.abs(logits).max())
        np.testing.assert_allclose(rank_logits, logits, atol=1e-4 * scale, rtol=0, err_msg=f"rank {rank}")
