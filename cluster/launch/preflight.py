"""The checks a fleet passes before its first request, over what each instance reported.

Pure functions over the dicts `engines.describe` and the heap bootstrap return, so they are
tested without Ray: every instance loaded the same model with the same KV geometry; the pages
that fit in memory (or the configured number) hold at least one sequence of the context limit;
every decode PE is load/store reachable from every prefill PE, or the pair takes the segment-put
path (said once in the log). Two checks run before Ray starts, over the config and the model's
config.json or preset: the source is there (`check_model_source`), and it shards over each role's
``instances.tensor_parallel`` (`check_tensor_parallel`). Called by `disagg.cluster.launch.bootstrap`
in the launching process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from disagg.config import DUMMY_PREFIX, SMOLLM2_SOURCE, Config
from disagg.config_instances import TP_ROLES
from disagg.errors import PreflightError

if TYPE_CHECKING:
    from disagg.model.config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheSizing:
    """What the fleet's caches hold.

    Attributes:
        num_pages: pages per instance (equal on every PE of one heap).
        page_bytes: bytes of one page over all layers (K and V).
        max_model_len: the longest prompt + output accepted, tokens.
    """

    num_pages: int
    page_bytes: int
    max_model_len: int


def check_model_source(config: Config) -> None:
    """Before Ray starts: ``model.source`` is a known preset, or a model directory this host reads.

    The instances read the source again when they load it; checked here, a wrong path fails at
    once instead of after Ray's start-up and the actors' placement. Instances of a joined cluster
    (``cluster.address`` set) may run on hosts whose copy this one lacks: there a directory
    missing here is said in the log and left to them.

    The model's shapes read here (config.json, or the preset's) then go through
    `check_tensor_parallel`.

    Raises:
        PreflightError: an unknown preset; a directory that is missing (Ray to start here), has no
            readable config.json, holds an architecture the model cannot run, or no *.safetensors;
            a ``tensor_parallel`` the model does not shard over (`check_tensor_parallel`).
    """
    from disagg.model.config import ModelConfig
    from disagg.model.errors import ModelError
    from disagg.model.presets import PRESETS, preset_config
    from disagg.model.weights import check_checkpoint_present

    source = config.model.source
    if source == SMOLLM2_SOURCE:  # converted by the launch itself (bootstrap.resolve_source), to these shapes
        check_tensor_parallel(config, replace(preset_config("smollm2-135m"), name=SMOLLM2_SOURCE))
        return
    if source.startswith(DUMMY_PREFIX):
        if source[len(DUMMY_PREFIX):] not in PRESETS:
            raise PreflightError(f"model.source {source!r}: unknown preset; expected one of "
                                 f"{', '.join(DUMMY_PREFIX + name for name in sorted(PRESETS))}")
        check_tensor_parallel(config, preset_config(source[len(DUMMY_PREFIX):]))
        return
    try:
        model_dir = Path(source).expanduser()
        if not model_dir.is_dir():
            _missing_source(config, model_dir)
            return
        model = ModelConfig.from_dir(model_dir)
        check_checkpoint_present(model_dir)
    except ModelError as err:
        raise PreflightError(f"model.source {source!r}: {err}") from None
    check_tensor_parallel(config, model)


def check_tensor_parallel(config: Config, model: ModelConfig) -> None:
    """Every role's ``instances.tensor_parallel`` shards ``model`` evenly.

    At k ranks each rank holds num_qo_heads / k query heads and intermediate_size / k of the MLP;
    its KV heads are num_kv_heads / k of them, or, when k is a multiple of num_kv_heads, one
    replicated on k / num_kv_heads ranks.

    The prefill side (a ranks) and the decode side (b ranks) may differ: prefill rank i then
    writes each of its KV heads into the decode ranks that hold it (`disagg.transfer.heads`),
    which needs both a and b to shard the model; a pair is refused naming both numbers.

    Raises:
        PreflightError: naming the role, its tensor_parallel (with the other side's when the two
            differ), every shape that does not divide (with the numbers) and the degrees that
            would.
    """
    inst = config.instances
    prefill, decode = inst.tensor_parallel_of("prefill"), inst.tensor_parallel_of("decode")
    pair = f"prefill {prefill} pushing into decode {decode}: " if inst.mode == "disaggregated" and \
        prefill != decode else ""
    for role in (role for role in TP_ROLES if getattr(inst, role)):
        ranks = inst.tensor_parallel_of(role)
        problems = _unsharded(model, ranks)
        if problems:
            fits = [str(k) for k in range(1, model.num_qo_heads + 1) if not _unsharded(model, k)]
            raise PreflightError(
                f"instances.tensor_parallel: {pair}{role} instances at tensor_parallel {ranks} cannot shard "
                f"{model.name}: {'; '.join(problems)}; degrees that shard it: {', '.join(fits)}")


def _unsharded(model: ModelConfig, ranks: int) -> list[str]:
    """What of ``model`` does not split over ``ranks`` ranks (empty when everything does)."""
    problems = []
    if model.num_qo_heads % ranks:
        problems.append(f"its {model.num_qo_heads} query heads (num_qo_heads) do not divide by {ranks}")
    if model.intermediate_size % ranks:
        problems.append(f"its MLP width (intermediate_size {model.intermediate_size}) does not divide by {ranks}")
    if model.num_kv_heads % ranks and ranks % model.num_kv_heads:
        problems.append(f"its {model.num_kv_heads} KV heads (num_kv_heads) do not divide by {ranks}, nor is "
                        f"{ranks} a multiple of {model.num_kv_heads} (a multiple replicates each KV head)")
    return problems


def _missing_source(config: Config, model_dir: Path) -> None:
    source = config.model.source
    where = "" if model_dir.is_absolute() else f" ({model_dir.absolute()}: a relative path is read next to the " \
        "config, else in the working directory)"
    what = "no such directory" if not model_dir.exists() else "not a directory"
    if config.cluster.address is not None:
        logger.warning("model.source %r: %s on this host%s; the instances on the cluster's nodes read it there",
                       source, what, where)
        return
    raise PreflightError(f"model.source {source!r}: {what}{where}; expected an HF model directory (config.json "
                         f"+ *.safetensors), '{DUMMY_PREFIX}<preset>' or '{SMOLLM2_SOURCE}'")


def check_same_model(names: list[str], infos: list[dict]) -> None:
    """Raise PreflightError unless every instance has the same model and KV geometry.

    Args:
        names: instance names, parallel to ``infos``.
        infos: `engines.describe` of each instance.
    """
    first = infos[0]
    for name, info in zip(names[1:], infos[1:]):
        # A rank of another tensor parallelism holds another share of the heads (and so of a page).
        other_tp = info.get("tensor_parallel", 1) != first.get("tensor_parallel", 1)
        for key in ("model_name", "geometry", "page_bytes", "model_num_kv_heads"):
            mine, theirs = first.get(key), info.get(key)
            if other_tp and key == "geometry":
                mine, theirs = _without_heads(mine), _without_heads(theirs)
            if mine != theirs and not (other_tp and key == "page_bytes"):
                diff = _diff(mine, theirs) if isinstance(mine, dict) else f"{mine!r} vs {theirs!r}"
                raise PreflightError(f"instances {names[0]} and {name} differ in {key}: {diff}; every "
                                     "instance must load the same model with the same cache geometry")


def _without_heads(geometry: dict) -> dict:
    return {k: v for k, v in geometry.items() if k != "num_kv_heads"}


def _diff(a: dict, b: dict) -> str:
    return ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def size_cache(config: Config, names: list[str], infos: list[dict]) -> CacheSizing:
    """Pages per instance (the least any instance can hold) and the context limit.

    Raises:
        PreflightError: no page fits in some instance's memory; or ``model.max_model_len`` exceeds
            the model's limit or what the pages hold.
    """
    # Every PE allocates the widest page of the fleet (the heap is symmetric; ranks of the side at
    # the lower tensor parallelism hold more heads per page).
    page_bytes = max(info["page_bytes"] for info in infos)
    fits = {name: info["kv_budget_bytes"] // page_bytes for name, info in zip(names, infos)}
    tightest = min(fits, key=fits.get)
    num_pages = config.cache.num_pages or fits[tightest]
    if num_pages < 1:
        raise PreflightError(
            f"{tightest}: no memory left for KV pages: budget {infos[names.index(tightest)]['kv_budget_bytes']} "
            f"bytes after the weights, one page is {page_bytes} bytes; raise cache.gpu_memory_fraction, "
            "set cache.num_pages, or use a smaller model")
    model_limit = min(info["max_position_embeddings"] for info in infos)
    capacity = num_pages * config.cache.page_size
    wanted = config.model.max_model_len
    if wanted is not None and wanted > model_limit:
        raise PreflightError(f"model.max_model_len ({wanted} tokens) exceeds the model's "
                             f"max_position_embeddings ({model_limit})")
    if wanted is not None and wanted > capacity:
        raise PreflightError(f"model.max_model_len ({wanted} tokens) does not fit in one instance's cache: "
                             f"{num_pages} pages x {config.cache.page_size} = {capacity} tokens")
    max_model_len = wanted or min(model_limit, capacity)
    if wanted is None and capacity < model_limit:
        logger.warning("the cache holds %d tokens per instance, fewer than the model's %d: "
                       "max_model_len is %d", capacity, model_limit, capacity)
    logger.info("KV cache: %d pages x %d tokens per instance (%.1f MiB), max_model_len %d",
                num_pages, config.cache.page_size, num_pages * page_bytes / 2**20, max_model_len)
    return CacheSizing(num_pages=num_pages, page_bytes=page_bytes, max_model_len=max_model_len)


def transfer_paths(prefill_pes: list[int], decode_pes: list[int], reachable: dict[int, dict[int, bool]],
                   force_segment_puts: bool) -> dict[tuple[int, int], str]:
    """How each prefill PE reaches each decode PE: "load/store" or "segment puts".

    Args:
        prefill_pes, decode_pes: the PEs of each role.
        reachable: per prefill PE, {decode PE: load/store reachable}, as the heap reported it.
        force_segment_puts: ``transfer.force_segment_puts`` (every pair takes segment puts).
    """
    paths = {}
    for src in prefill_pes:
        for dst in decode_pes:
            direct = bool(reachable[src].get(dst)) and not force_segment_puts
            paths[(src, dst)] = "load/store" if direct else "segment puts"
    slow = [pair for pair, path in paths.items() if path == "segment puts"]
    if slow and not force_segment_puts:
        logger.info("PE pairs %s are not load/store reachable (another node or no peer access): their "
                    "KV goes by host-initiated segment puts", slow)
    return paths
