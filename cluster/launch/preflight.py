"""The checks a fleet passes before its first request, over what each instance reported.

Pure functions over the dicts `engines.describe` and the heap bootstrap return, so they are
tested without Ray: every instance loaded the same model with the same KV geometry; the pages
that fit in memory (or the configured number) hold at least one sequence of the context limit;
every decode PE is load/store reachable from every prefill PE, or the pair takes the segment-put
path (said once in the log). One check runs before Ray starts, over the config alone
(`check_model_source`). Called by `disagg.cluster.launch.bootstrap` in the launching process.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from disagg.config import DUMMY_PREFIX, SMOLLM2_SOURCE, Config
from disagg.errors import PreflightError

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

    Raises:
        PreflightError: an unknown preset; a directory that is missing (Ray to start here), has no
            readable config.json, holds an architecture the model cannot run, or no *.safetensors.
    """
    from disagg.model.config import ModelConfig
    from disagg.model.errors import ModelError
    from disagg.model.presets import PRESETS
    from disagg.model.weights import check_checkpoint_present

    source = config.model.source
    if source == SMOLLM2_SOURCE:  # a conversion built by the launch itself (bootstrap.resolve_source)
        return
    if source.startswith(DUMMY_PREFIX):
        if source[len(DUMMY_PREFIX):] not in PRESETS:
            raise PreflightError(f"model.source {source!r}: unknown preset; expected one of "
                                 f"{', '.join(DUMMY_PREFIX + name for name in sorted(PRESETS))}")
        return
    try:
        model_dir = Path(source).expanduser()
        if not model_dir.is_dir():
            _missing_source(config, model_dir)
            return
        ModelConfig.from_dir(model_dir)
        check_checkpoint_present(model_dir)
    except ModelError as err:
        raise PreflightError(f"model.source {source!r}: {err}") from None


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
        for key in ("model_name", "geometry", "page_bytes"):
            if info[key] != first[key]:
                diff = _diff(first[key], info[key]) if isinstance(first[key], dict) else \
                    f"{first[key]!r} vs {info[key]!r}"
                raise PreflightError(f"instances {names[0]} and {name} differ in {key}: {diff}; every "
                                     "instance must load the same model with the same cache geometry")


def _diff(a: dict, b: dict) -> str:
    return ", ".join(f"{k} {a.get(k)!r} vs {b.get(k)!r}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k))


def size_cache(config: Config, names: list[str], infos: list[dict]) -> CacheSizing:
    """Pages per instance (the least any instance can hold) and the context limit.

    Raises:
        PreflightError: no page fits in some instance's memory; or ``model.max_model_len`` exceeds
            the model's limit or what the pages hold.
    """
    page_bytes = infos[0]["page_bytes"]
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
