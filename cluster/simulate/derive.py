"""Profiles of instances nobody timed: another TP, another model shape, or a whole model from its
first N layers, derived from a measured profile (`disagg profile --derive`, `disagg profile
--num-layers N`; cluster/simulate/command.py). CPU arithmetic in the CLI process.

Each coefficient of the step-time fit (`step_model.FEATURES`) is priced by what one rank of the
instance does per step, computed from the model's shapes (`rank_work`):

    decode_step, prompt_step           weight bytes one rank streams per step (its layers and LM
                                       head rows): a decode step at a small batch, or a prompt
                                       step below the knee, reads every weight once
    prompt_tokens, ..._over_knee       matmul FLOPs per prompt token (2 x a rank's layer weights)
    decode_seqs                        the same plus its LM head rows (each sequence samples)
    context_tokens, eager_context_...  KV bytes per context token (a rank's KV heads, all layers)
    prompt_pairs                       attention FLOPs per pair (a rank's q heads x head_dim x layers)
    mixed_step                         layers (the kernels per layer a decode adds to an eager step)

A derived coefficient is the base's times (target's work / base's), so each term scales with the
layers it spans and the rank's share of them; that is all of them but the host's own time per
step (scheduling, sampling, a graph's launch), which one profile cannot tell apart from the
intercepts' weight streaming: it is scaled with them, which overstates a larger model's
intercepts by that host time x (ratio - 1) (for an 8B on an H200, c0 = 5.2 ms of which 3.3 ms
is its 16 GB at the 4.8 TB/s spec: the host is at most the rest).

A target of TP k > 1 adds its collectives: per step 2 all-reduces per layer (o_proj and down_proj
are row-parallel) and one for the vocabulary-parallel embedding, each of (prompt tokens + decoding
sequences) x hidden_size x the activation bytes over a ring (2 (k - 1) / k of the payload), and
the logits' all-gather per decoding sequence; priced at a latency per collective and a bus
bandwidth measured from a TP > 1 profile of the base's model (`allreduce_from_profile`), else
`NvlinkModel`'s stated figures. Pages: the memory the base's weights and activations left to KV,
less the target's (`derived_pages`). Every derived profile says what was measured and what derived
(``derived``: `provenance_lines`, which `disagg profile`, `simulate` and `plan` print).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

from disagg.cluster.simulate.step_model import FEATURES
from disagg.model.config import ModelConfig

logger = logging.getLogger(__name__)

# Bytes of one element by the profile's dtype names (torch's, with or without "torch.").
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}
# What each fit term scales with (module docstring): an attribute of `RankWork`.
DRIVERS = {"decode_step": "streamed_bytes", "prompt_tokens": "token_flops", "decode_seqs": "seq_flops",
           "context_tokens": "kv_bytes_per_token", "prompt_step": "streamed_bytes", "prompt_pairs": "pair_flops",
           "mixed_step": "num_layers", "eager_context_tokens": "kv_bytes_per_token",
           "prompt_tokens_over_knee": "token_flops"}
assert tuple(DRIVERS) == FEATURES, "every fit term has its driver, in FEATURES' order"
# As `disagg.cluster.launch.engines`: memory kept for activations, logits and graphs beyond KV pages.
ACTIVATION_RESERVE_BYTES = 2 << 30


@dataclass(frozen=True)
class NvlinkModel:
    """The collectives of a TP instance when no TP > 1 profile measured them.

    H200 (and H100) SXM NVLink 4: 18 links, 900 GB/s per GPU both directions together (450 GB/s
    each way; NVIDIA's H200 datasheet). nccl-tests' all_reduce bus bandwidth on 8-GPU HGX H100/H200
    boards reaches about 360-480 GB/s for messages of hundreds of MB and far less for the KB-MB
    ones a step sends; 300 GB/s is taken as a conservative achievable bus bandwidth (this
    project's NVLink KV pushes measured 364 GB/s). Latency: NCCL's small-message all-reduce over
    NVLink is about 8-20 us within a graph; 15 us is taken, the high side.
    """

    bus_gbps: float = 300.0
    latency_s: float = 15e-6
    source: str = "NVLink model (300 GB/s bus bandwidth, 15 us per collective: derive.NvlinkModel)"


@dataclass(frozen=True)
class RankWork:
    """What one rank of an instance computes and reads per step (`rank_work`); the drivers of `DRIVERS`."""

    source: str  # the model's name
    num_layers: int
    tensor_parallel: int
    streamed_bytes: float  # layer weights + LM head rows, read once per step
    weight_bytes: float  # every weight the rank holds (memory): the above + embedding, norms
    token_flops: float  # per prompt token, the layers' matmuls
    seq_flops: float  # per decoding sequence: the same + the LM head rows
    kv_bytes_per_token: float
    pair_flops: float  # per attention pair, all layers
    hidden_size: int
    vocab_rows: int  # the rank's LM head rows (ceil(V / k))
    activation_bytes: float  # `activation_bytes` at the profile's token budget


def model_config_of(source: str, num_layers: int | None = None) -> ModelConfig:
    """The shapes of model SOURCE: a "dummy:<preset>" or a directory with config.json, cut (or
    grown) to ``num_layers`` when given.

    Raises:
        ValueError: SOURCE is neither (the message names the presets).
    """
    from disagg.model.presets import PRESETS, preset_config

    if source.startswith("dummy:"):
        config = preset_config(source.removeprefix("dummy:"))  # raises naming the presets
    elif (Path(source) / "config.json").is_file():
        config = ModelConfig.from_dir(source)
    else:
        raise ValueError(f"--model: expected dummy:<preset> (one of {', '.join(sorted(PRESETS))}) or a model "
                         f"directory with config.json, got {source!r}")
    return config if num_layers is None else dataclasses.replace(config, num_layers=int(num_layers))


def activation_bytes(config: ModelConfig, tokens: int) -> float:
    """`engines._activation_bytes` of a rank whose local config is ``config`` at a budget of ``tokens``."""
    return ACTIVATION_RESERVE_BYTES + tokens * 4 * (config.vocab_size + 4 * config.intermediate_size
                                                    + 8 * config.hidden_size)


def rank_work(config: ModelConfig, tensor_parallel: int, dtype: str, kv_dtype: str, budget_tokens: int) -> RankWork:
    """One rank's share of a step of ``config`` at TP ``tensor_parallel`` (`disagg.model.shard`'s split).

    Raises:
        ValueError: the TP cannot split the model (`check_tensor_parallel`), an unknown dtype.
    """
    from disagg.model.shard import Shard

    shard = Shard.of(config, 0, tensor_parallel)
    c, local = config, shard.local_config()
    b, kv_b = dtype_bytes(dtype), dtype_bytes(kv_dtype)
    q, kv = shard.num_qo_heads * c.head_dim, shard.num_kv_heads * c.head_dim
    matmul = c.hidden_size * (2 * q + 2 * kv) + 3 * c.hidden_size * shard.intermediate_size  # q, k, v, o; MLP
    bias = (q + 2 * kv) if c.attention_bias else 0
    layer = matmul + bias + 2 * c.hidden_size  # + the two norms
    head = shard.vocab_rows * c.hidden_size
    embed = 0 if c.tie_word_embeddings else head
    return RankWork(
        source=c.name, num_layers=c.num_layers, tensor_parallel=tensor_parallel,
        streamed_bytes=b * (c.num_layers * layer + head), weight_bytes=b * (c.num_layers * layer + head + embed
                                                                           + c.hidden_size),
        token_flops=2.0 * c.num_layers * matmul, seq_flops=2.0 * (c.num_layers * matmul + head),
        kv_bytes_per_token=2.0 * c.num_layers * kv * kv_b, pair_flops=4.0 * c.num_layers * q,
        hidden_size=c.hidden_size, vocab_rows=shard.vocab_rows,
        activation_bytes=activation_bytes(local, budget_tokens))


def dtype_bytes(name: str) -> int:
    key = str(name).removeprefix("torch.")
    if key not in DTYPE_BYTES:
        raise ValueError(f"a profile's dtype: expected one of {', '.join(DTYPE_BYTES)}, got {name!r}")
    return DTYPE_BYTES[key]


def scaled_coefficients(coef: Iterable[float], base: RankWork, target: RankWork) -> list[float]:
    """The fit's coefficients (`FEATURES` order) for ``target``: each x its driver's ratio."""
    return [float(v) * getattr(target, DRIVERS[name]) / getattr(base, DRIVERS[name])
            for name, v in zip(FEATURES, coef)]


@dataclass(frozen=True)
class Collectives:
    """What a TP step's collectives cost: ``latency_s`` each, payloads at ``bus_gbps``; ``source``
    says where the figures come from (a profile, or `NvlinkModel`)."""

    latency_s: float
    bus_gbps: float | None  # None: no bandwidth term (a measured profile showed none)
    source: str

    def added(self, work: RankWork, act_bytes: int) -> dict[str, float]:
        """Seconds per fit term that ``work``'s collectives add (none at TP 1): the module docstring."""
        k = work.tensor_parallel
        if k == 1:
            return {}
        count = 2 * work.num_layers + 1  # two per layer, one for the embedding
        per_byte = 0.0 if self.bus_gbps is None else 1.0 / (self.bus_gbps * 1e9)
        ring = 2.0 * (k - 1) / k
        token = count * ring * work.hidden_size * act_bytes * per_byte
        gather = (k - 1) * work.vocab_rows * act_bytes * per_byte  # (k-1)/k of the k x rows logits
        return {"decode_step": (count + 1) * self.latency_s, "prompt_step": (count + 1) * self.latency_s,
                "prompt_tokens": token, "decode_seqs": token + gather}


def allreduce_from_profile(measured: dict, base: dict, base_config: ModelConfig, source: str) -> Collectives:
    """The collectives' latency and bus bandwidth a TP > 1 profile of the base's model shows: its
    decode intercept and per-prompt-token cost over the base's divided as `rank_work` splits them
    (what is left is what its collectives took).

    Raises:
        ValueError: ``measured`` is at TP 1 or times another model than ``base``.
    """
    k = int(measured.get("tensor_parallel", 1))
    if k == 1:
        raise ValueError(f"--allreduce-from: expected a profile of tensor_parallel > 1 (it prices the "
                         f"collectives), got {source} at TP 1")
    if measured.get("model") != base.get("model"):
        raise ValueError(f"--allreduce-from: expected a profile of the base's model {base.get('model')!r}, got "
                         f"{source} of {measured.get('model')!r}")
    budget = int(base["engine"]["max_num_batched_tokens"])
    one = rank_work(base_config, 1, base["dtype"], base["kv_dtype"], budget)
    at_k = rank_work(base_config, k, base["dtype"], base["kv_dtype"], budget)
    split = scaled_coefficients(base["fit"]["coef_s"], one, at_k)
    got = measured["fit"]["coef_s"]
    count = 2 * base_config.num_layers + 1
    if got[0] <= split[0] or got[1] <= split[1]:
        logger.warning("--allreduce-from %s: its decode intercept %.3g s / per-token cost %.3g s is not above the "
                       "base's TP %d split (%.3g / %.3g): that collective cost is taken as 0", source, got[0], got[1],
                       k, split[0], split[1])
    latency = max(got[0] - split[0], 0.0) / (count + 1)
    per_token = max(got[1] - split[1], 0.0)
    payload = count * 2.0 * (k - 1) / k * base_config.hidden_size * dtype_bytes(base["dtype"])
    gbps = payload / per_token / 1e9 if per_token > 0 else None
    return Collectives(latency, gbps, f"measured: {source} (TP {k}) over the base's per-rank split")


def base_model_config(profile: dict, num_layers: int | None = None) -> ModelConfig:
    """The shapes of the model ``profile`` timed (at ``num_layers``, else the layers it ran),
    checked against its KV bytes per token.

    Raises:
        ValueError: an unknown model, or one whose KV per token is not the profile's (another model
            than it names).
    """
    engine = profile["engine"]
    layers = num_layers or engine.get("num_layers")
    config = model_config_of(str(profile.get("model")), layers)
    tp = int(profile.get("tensor_parallel", 1))
    work = rank_work(config, tp, profile["dtype"], profile["kv_dtype"], int(engine["max_num_batched_tokens"]))
    if int(work.kv_bytes_per_token) != int(engine["kv_bytes_per_token"]):
        raise ValueError(f"a profile of {profile.get('model')!r} ({config.num_layers} layers, TP {tp}): expected "
                         f"{int(work.kv_bytes_per_token)} KV bytes per token per rank, the profile has "
                         f"{engine['kv_bytes_per_token']}: it did not time the model it names")
    return config


def derived_pages(base: dict, base_work: RankWork, target_work: RankWork) -> tuple[int, dict]:
    """Pages per rank of the target: where the base sized its pages from GPU memory, that memory
    (its pages, weights and activations) less the target's weights and activations; where its
    config set ``cache.num_pages``, as many; where ``cache.kv_bytes`` (or the CPU's default
    budget), the base's KV bytes. A profile that does not say (``engine.kv_pages_from``) is
    taken as sized from memory on a GPU, the CPU's budget elsewhere, and the result says so."""
    engine = base["engine"]
    page_size = int(engine["page_size"])
    base_kv = int(engine["num_pages"]) * page_size * float(engine["kv_bytes_per_token"])
    sized = engine.get("kv_pages_from")
    on_gpu = str((base.get("device") or {}).get("torch_device", "cpu")).startswith("cuda")
    assumed = "" if sized else " (assumed: the profile does not say how its pages were sized)"
    sized = sized or ("gpu_memory" if on_gpu else "cpu_default")
    held = base_kv + base_work.weight_bytes + base_work.activation_bytes
    if sized == "gpu_memory":
        # A base that was itself scaled past its GPU (`scale_layers`) keeps what the GPU held.
        held = float(((base.get("derived") or {}).get("memory") or {}).get("held_bytes") or held)
        budget = held - target_work.weight_bytes - target_work.activation_bytes
        how = (f"the {held / 1e9:.1f} GB per GPU the measured instance's pages, weights and activations took, "
               f"less the target's weights ({target_work.weight_bytes / 1e9:.1f}) and activations "
               f"({target_work.activation_bytes / 1e9:.1f}) per rank{assumed}")
    elif sized == "num_pages":  # what a launch of the same config holds
        budget = int(engine["num_pages"]) * page_size * target_work.kv_bytes_per_token
        how = f"the base's {engine['num_pages']} (its config's cache.num_pages)"
    else:
        budget = base_kv
        how = f"the base's {base_kv / 1e9:.3f} GB of KV (its {sized.replace('_', ' ')}, not GPU memory){assumed}"
    pages = max(0, int(budget // (page_size * target_work.kv_bytes_per_token)))
    return pages, {"kv_budget_bytes": int(budget), "sized_from": sized, "how": how, "held_bytes": int(held),
                   "weight_bytes_per_rank": int(target_work.weight_bytes)}


def derive_profile(base: dict, *, tensor_parallel: int, model: str | None = None,
                   collectives: Collectives | None = None, base_path: str = "the base profile") -> dict:
    """The profile of ``model`` (default: the base's) at TP ``tensor_parallel``, from ``base``, a
    TP 1 profile (module docstring); its collectives priced by ``collectives`` (default `NvlinkModel`).

    Raises:
        ValueError: a base at TP > 1 (its steps hold its own collectives), nothing to derive (the
            base's model at TP 1), a TP the target cannot be split by, an unknown model, a target
            whose weights leave no room for one max_model_len request per rank.
    """
    from disagg.cluster.simulate.profile import profile_tensor_parallel

    base_tp = profile_tensor_parallel(base)
    if base_tp != 1:
        raise ValueError(f"expected a profile of tensor_parallel 1 as the base (a TP {base_tp} "
                         f"profile's steps hold its own all-reduces, which a per-rank split would count "
                         f"again), got {base_path} at TP {base_tp}; give its TP 1 profile, and this one as "
                         f"--allreduce-from")
    if isinstance(tensor_parallel, bool) or not isinstance(tensor_parallel, int) or tensor_parallel < 1:
        raise ValueError(f"--tensor-parallel: expected an integer >= 1, got {tensor_parallel!r}")
    if tensor_parallel == 1 and (model is None or model == base.get("model")):
        raise ValueError("expected --tensor-parallel > 1 or another --model than the base's "
                         f"({base.get('model')}): that is the base itself")
    base_config = base_model_config(base)
    target_config = base_config if model is None or model == base.get("model") else model_config_of(model)
    return _derived(base, base_config, target_config, str(model or base["model"]), tensor_parallel,
                    collectives or Collectives(NvlinkModel.latency_s, NvlinkModel.bus_gbps, NvlinkModel.source),
                    base_path, f"{model or base['model']} at TP {tensor_parallel} from {base['model']} at TP 1")


def scale_layers(profile: dict, num_layers_timed: int) -> dict:
    """``profile``, which timed the first ``num_layers_timed`` layers of its model, as the whole
    model (`disagg profile --num-layers N`): its terms scaled by `DRIVERS` from N layers to all,
    its pages from the memory the other layers' weights take; ``num_layers_timed`` and
    ``num_layers`` (the model's) recorded. A whole model that does not fit the GPU at the timed
    TP gets no pages: a base for `derive_profile` to a TP that fits, which `load_profile` refuses
    to simulate.

    Raises:
        ValueError: an unknown model (as `derive_profile`).
    """
    full = model_config_of(str(profile["model"]))
    timed = base_model_config(profile, num_layers_timed)
    tp = int(profile.get("tensor_parallel", 1))
    how = f"timed {num_layers_timed} of {full.num_layers} layers, scaled"
    out = _derived(profile, timed, full, str(profile["model"]), tp, None, "the timed layers", how, must_fit=False)
    return dict(out, num_layers_timed=num_layers_timed)


def _derived(base: dict, base_config: ModelConfig, target_config: ModelConfig, target_source: str, tp: int,
             collectives: Collectives | None, base_path: str, how: str, must_fit: bool = True) -> dict:
    engine, base_tp = base["engine"], int(base.get("tensor_parallel", 1))
    budget = int(engine["max_num_batched_tokens"])
    base_work = rank_work(base_config, base_tp, base["dtype"], base["kv_dtype"], budget)
    work = rank_work(target_config, tp, base["dtype"], base["kv_dtype"], budget)
    coef = scaled_coefficients(base["fit"]["coef_s"], base_work, work)
    added = collectives.added(work, dtype_bytes(base["dtype"])) if collectives and tp > base_tp else {}
    coef = [v + added.get(name, 0.0) for name, v in zip(FEATURES, coef)]
    pages, memory = derived_pages(base, base_work, work)
    max_len = min(int(engine["max_model_len"]), int(target_config.max_position_embeddings))
    fits = pages * int(engine["page_size"]) >= max_len
    if not fits and not must_fit:
        pages, memory["how"] = 0, (f"none: {memory['how']} leaves too little for one {max_len}-token request "
                                   f"(a base for `disagg profile --derive` to a TP that fits)")
    elif not fits:
        raise ValueError(f"{target_source} at TP {tp} does not fit the base's GPU: {memory['how']} leaves "
                         f"{pages} pages of {engine['page_size']} tokens, under one {max_len}-token request; "
                         f"a larger --tensor-parallel splits the weights further")
    record = _record(base, base_path, how, work, base_work, collectives if added else None,
                     f"num_pages {pages}: {memory['how']}")
    record["memory"] = memory
    return dict(base, model=target_source, model_name=target_config.name, tensor_parallel=tp,
                tp_backend=base.get("tp_backend") if tp == base_tp else "nccl",
                num_layers=target_config.num_layers,
                engine=dict(engine, num_pages=pages, kv_bytes_per_token=int(work.kv_bytes_per_token),
                            max_model_len=max_len, vocab_size=int(target_config.vocab_size),
                            eos_token_ids=[int(t) for t in target_config.eos_token_ids], num_layers=None,
                            kv_pages_from=memory["sized_from"]),
                fit=dict(base["fit"], coef_s=coef), derived=record)


def _record(base: dict, base_path: str, how: str, work: RankWork, base_work: RankWork,
            collectives: Collectives | None, pages_line: str) -> dict:
    """The ``derived`` section: the base, how, what was measured and what derived (a base that was
    itself derived passes on its measured and derived lists)."""
    device = base.get("device") or {}
    was = base.get("derived") or {}
    where = (device.get("gpus") or [device.get("torch_device", "cpu")])[0]
    layers = f"{base_work.num_layers} layer{'s' if base_work.num_layers != 1 else ''}"
    timed = (f"step times: {len(base.get('samples') or ())} steps of {base.get('model')} ({layers}, TP "
             f"{base_work.tensor_parallel}) on {where} ({base_path}, {base.get('date')}, "
             f"commit {str(base.get('commit'))[:10]})")
    measured = list(was.get("measured") or [timed, "the scheduler budgets, page size and max_num_seqs of that "
                                                   "instance, and the fit's error"])
    derived_what = [f"the fit's coefficients: the base's x the per-rank work of {work.source} "
                    f"({work.num_layers} layers) at TP {work.tensor_parallel} over the base's (derive.DRIVERS)"]
    if collectives is not None:
        gbps = "no bandwidth term" if collectives.bus_gbps is None else f"{collectives.bus_gbps:.0f} GB/s"
        line = (f"collectives: {2 * work.num_layers + 1} all-reduces and a logits all-gather per step at "
                f"{collectives.latency_s * 1e6:.1f} us each, {gbps} ({collectives.source})")
        (measured if collectives.source.startswith("measured") else derived_what).append(line)
    derived_what += [pages_line, f"kv_bytes_per_token {int(work.kv_bytes_per_token)}: a rank's KV heads of "
                                 f"{work.source}"]
    record = {"from": {"profile": base_path, "model": base.get("model"), "tensor_parallel": base_work.tensor_parallel,
                       "num_layers": base_work.num_layers, "device": device.get("gpus") or device.get("torch_device"),
                       "date": base.get("date"), "commit": base.get("commit")},
              "how": how, "measured": measured, "derived": list(was.get("derived") or []) + derived_what,
              "ratios": {name: getattr(work, d) / getattr(base_work, d) for name, d in DRIVERS.items()},
              "collectives": dataclasses.asdict(collectives) if collectives is not None else None}
    if was:
        record["base_derived"] = {"how": was.get("how"), "from": was.get("from")}
    return record


def provenance_lines(profile: dict, prefix: str = "") -> list[str]:
    """What a derived profile measured and what it derived (none for a measured one)."""
    record = profile.get("derived")
    if not record:
        return []
    lines = [f"{prefix}{profile.get('model')} at TP {profile.get('tensor_parallel', 1)}: derived ({record['how']})"]
    lines += [f"{prefix}  measured: {what}" for what in record["measured"]]
    lines += [f"{prefix}  derived:  {what}" for what in record["derived"]]
    return lines


def profiles_provenance_lines(profiles: Iterable[dict]) -> list[str]:
    """`provenance_lines` of each derived profile a plan or simulation reads; a note when any is."""
    lines = [line for prof in profiles for line in provenance_lines(prof, "  ")]
    return ["derived profiles (a prediction from these; no run measured them):"] + lines if lines else []


def yaml_comment(profiles: Iterable[dict]) -> str:
    """The comment `disagg plan` heads its YAML with where any profile was derived: which, from
    what ("" where every profile was measured)."""
    derived = [p for p in profiles if p.get("derived")]
    if not derived:
        return ""
    names = "; ".join(p["derived"]["how"] if p["derived"]["how"].startswith(str(p.get("model"))) else
                      f"{p.get('model')} at TP {p.get('tensor_parallel', 1)}, {p['derived']['how']}" for p in derived)
    return f"# derived step times, not measured (a prediction until a run measures it): {names}\n"
