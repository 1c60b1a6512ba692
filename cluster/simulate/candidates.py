"""The deployments `disagg plan` searches for N GPUs, each a `Candidate`: its label and the YAML
sections that make it.

    colocated-N[chunk=C]   N colocated instances, prompt chunks of C tokens (`--chunk-sizes`)
    xPyD                   x prefill + y decode instances (x + y = N; beyond 8 GPUs nine
                           ratios, `prefill_counts`), every prompt pushed
    xPyD-adaptive[chunk=C] the same fleet with `router.placement: adaptive` (per-request
                           remote / local / kept from the profile's step-time model), at each
                           `--adaptive-chunk-sizes` C (default: `--chunk-sizes`; the label drops
                           [chunk=C] when there is one) and each `--adaptive-prefer` P
                           (`router.adaptive_prefer`; labelled [prefer=P] when there are several)

With profiles of several TP degrees (``tensor_parallel``) the search runs once per degree a over
N // a instances of a ranks each, and once per pair of degrees a != b over the splits of x
prefill instances of TP a and y decode instances of TP b that fill the GPUs (`tp_splits`); the
labels name the TPs: ``colocated-n(TPa)[chunk=C]``, ``xP(TPa)+yD(TPb)``,
``xP(TPa)+yD(TPb)-adaptive``. A single profile of TP 1 keeps the labels above. Pure Python;
`plan.py` judges them.
"""

from __future__ import annotations

import difflib

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from disagg.cluster.routing.placement import ADAPTIVE
from disagg.config import RouterSection

if TYPE_CHECKING:
    from disagg.cluster.simulate.screen import Screened

DEFAULT_CHUNK_SIZES = (512, 2048, 8192)
ROLES = ("prefill", "decode", "colocated")
# `prefill_counts`, `tp_splits`: beyond 8 instances, the splits nearest these fractions of prefill.
SPLIT_FRACTIONS = (1 / 8, 1 / 6, 1 / 4, 1 / 3, 1 / 2, 2 / 3, 3 / 4, 5 / 6, 7 / 8)


@dataclass
class Candidate:
    """One deployment of the search, its screen and its goodput once judged."""

    label: str
    sections: dict[str, Any]  # the YAML sections that make it (instances, scheduler, router)
    goodput_rps: float = 0.0
    attainment_at: dict[float, float] = field(default_factory=dict)
    cut_at: set[float] = field(default_factory=set)  # rates whose runs stopped at a certain verdict
    screened: Screened | None = None  # its analytic rate (`plan.screen`), None until screened

    @property
    def roles(self) -> tuple[str, ...]:
        """The roles it runs instances of."""
        return tuple(role for role in ROLES if self.sections["instances"].get(role, 0))

    def tensor_parallel_of(self, role: str) -> int:
        """The ranks of each of its ``role`` instances (``instances.tensor_parallel``, an int or per role)."""
        tp = self.sections["instances"].get("tensor_parallel", 1)
        return int(tp.get(role, 1) if isinstance(tp, dict) else tp)

    @property
    def tensor_parallels(self) -> tuple[int, ...]:
        """The TP degrees its instances run at, increasing (one, or a split's two)."""
        return tuple(sorted({self.tensor_parallel_of(role) for role in self.roles}))

    @property
    def tensor_parallel(self) -> int:
        """The ranks of each of its instances, where every role runs at one TP."""
        (tp,) = self.tensor_parallels or (1,)
        return tp

    @property
    def num_gpus(self) -> int:
        inst = self.sections["instances"]
        return sum(inst.get(role, 0) * self.tensor_parallel_of(role) for role in ROLES)

    @property
    def goodput_per_gpu(self) -> float:
        return self.goodput_rps / self.num_gpus

    def note(self, rate: float, attained: float, cut: bool) -> float:
        """Its attainment at ``rate`` (``cut``: the run stopped at a certain miss or hold, and
        ``attained`` is a bound below the whole run's); returns it."""
        self.attainment_at[rate] = attained
        if cut:
            self.cut_at.add(rate)
        return attained


def prefill_counts(num_gpus: int) -> list[int]:
    """The prefill instance counts x of the xPyD splits searched: every one up to 8 GPUs, beyond
    that the splits nearest to x/N = 1/8, 1/6, 1/4, 1/3, 1/2, 2/3, 3/4, 5/6, 7/8."""
    if num_gpus <= 8:
        return list(range(1, num_gpus))
    return sorted({min(num_gpus - 1, max(1, round(num_gpus * f))) for f in SPLIT_FRACTIONS})


def tp_splits(num_gpus: int, prefill_tp: int, decode_tp: int) -> list[tuple[int, int]]:
    """The (x, y) of the splits of x prefill instances of TP ``prefill_tp`` and y decode instances
    of TP ``decode_tp`` searched on ``num_gpus``: each that leaves no room for one more instance
    of either role; beyond 8 of them, those nearest the prefill GPU fractions of `prefill_counts`."""
    fits = [(x, y) for x in range(1, num_gpus // prefill_tp + 1)
            for y in range(1, (num_gpus - x * prefill_tp) // decode_tp + 1)
            if num_gpus - x * prefill_tp - y * decode_tp < min(prefill_tp, decode_tp)]
    if len(fits) <= 8:
        return fits

    def share(split: tuple[int, int]) -> float:
        return split[0] * prefill_tp / (split[0] * prefill_tp + split[1] * decode_tp)

    return sorted({min(fits, key=lambda s: abs(share(s) - f)) for f in SPLIT_FRACTIONS})


def candidates(num_gpus: int, chunk_sizes: Sequence[int] = DEFAULT_CHUNK_SIZES, *, splits: bool = True,
               adaptive: bool = True, colocated: bool = True,
               adaptive_chunk_sizes: Sequence[int] | None = None,
               adaptive_prefers: Sequence[str] | None = None,
               tensor_parallel: Sequence[int] = (1,)) -> list[Candidate]:
    """Every deployment of the search for ``num_gpus`` (module docstring); ``adaptive_chunk_sizes``
    defaults to ``chunk_sizes``; ``adaptive_prefers``: the adaptive candidates'
    `router.adaptive_prefer` values (default: the config's default alone; set in their YAML
    unless it is that default); ``tensor_parallel``: the TP degrees of the instances (those
    profiled): each degree's search over ``num_gpus // tp`` instances, then each pair's splits."""
    if num_gpus < 1:
        raise ValueError(f"--gpus: expected at least 1 GPU, got {num_gpus}")
    degrees = sorted(set(tensor_parallel))
    named = degrees != [1]
    kinds = dict(splits=splits, adaptive=adaptive, adaptive_chunk_sizes=adaptive_chunk_sizes,
                 adaptive_prefers=adaptive_prefers)
    out = []
    for tp in degrees:
        num = num_gpus // tp
        if num < 1:
            continue
        if colocated:
            at = f"(TP{tp})" if named else ""
            ranks = {"tensor_parallel": tp} if tp > 1 else {}
            out += [Candidate(f"colocated-{num}{at}[chunk={chunk}]", {
                "instances": {"colocated": num, **ranks}, "scheduler": {"max_num_batched_tokens": chunk}})
                for chunk in chunk_sizes]
        for x in prefill_counts(num) if splits or adaptive else ():
            out += _split(x, tp, num - x, tp, named, chunk_sizes, **kinds)
    for prefill_tp in degrees:
        for decode_tp in degrees:
            if prefill_tp != decode_tp and (splits or adaptive):
                for x, y in tp_splits(num_gpus, prefill_tp, decode_tp):
                    out += _split(x, prefill_tp, y, decode_tp, named, chunk_sizes, **kinds)
    return out


def _split(x: int, prefill_tp: int, y: int, decode_tp: int, named: bool, chunk_sizes: Sequence[int], *,
           splits: bool, adaptive: bool, adaptive_chunk_sizes: Sequence[int] | None,
           adaptive_prefers: Sequence[str] | None) -> list[Candidate]:
    """The candidates of x prefill instances of TP ``prefill_tp`` and y decode instances of TP
    ``decode_tp``: the split (``splits``) and its adaptive ones (``adaptive``); ``named``: the
    labels name the TPs (``xP(TPa)+yD(TPb)``; else ``xPyD``)."""
    default_prefer = RouterSection.model_fields["adaptive_prefer"].default
    prefers = (default_prefer,) if adaptive_prefers is None else tuple(adaptive_prefers)
    instances: dict[str, Any] = {"prefill": x, "decode": y}
    if prefill_tp != decode_tp:
        instances["tensor_parallel"] = {"prefill": prefill_tp, "decode": decode_tp}
    elif prefill_tp > 1:
        instances["tensor_parallel"] = prefill_tp
    label = f"{x}P(TP{prefill_tp})+{y}D(TP{decode_tp})" if named else f"{x}P{y}D"
    out = [Candidate(label, {"instances": instances})] if splits else []
    chunks = list(chunk_sizes if adaptive_chunk_sizes is None else adaptive_chunk_sizes)
    for chunk in chunks if adaptive else ():
        for prefer in prefers:
            suffix = (f"[chunk={chunk}]" if len(chunks) > 1 else "") + (f"[prefer={prefer}]" if len(prefers) > 1 else "")
            router = {"placement": ADAPTIVE.name, **({"adaptive_prefer": prefer} if prefer != default_prefer else {})}
            out.append(Candidate(f"{label}-adaptive{suffix}", {
                "instances": instances, "router": router, "scheduler": {"max_num_batched_tokens": chunk}}))
    return out


def only(search: Sequence[Candidate], labels: Sequence[str]) -> list[Candidate]:
    """The candidates of ``search`` named in ``labels`` (as `candidates` labels them), in the
    search's order: `disagg plan --only`, to judge a few deployments of a fleet too large to
    search whole on the CPUs at hand (64 GPUs: ~4 minutes of a core per adaptive candidate).

    Raises:
        ValueError: a label not in the search (the message lists those that are).
    """
    known = [c.label for c in search]
    unknown = [label for label in labels if label not in known]
    if unknown or not labels:
        raise ValueError(f"--only: expected labels of this search ({_some_labels(known, unknown)}), got "
                         f"{', '.join(unknown) if unknown else 'none'}")
    return [c for c in search if c.label in labels]


# `only`'s message lists every label of a search up to this many, else the closest to those asked.
MAX_LISTED_LABELS = 12


def _some_labels(known: Sequence[str], asked: Sequence[str]) -> str:
    """The labels of a search, for `only`'s message: all of them, or (of a large search, 264 at
    64 GPUs and four TPs) the closest to each label asked and how many there are."""
    if len(known) <= MAX_LISTED_LABELS:
        return ", ".join(known)
    close = list(dict.fromkeys(match for label in asked
                               for match in difflib.get_close_matches(label, known, n=4, cutoff=0.0)))
    shown = close[:MAX_LISTED_LABELS] or list(known[:MAX_LISTED_LABELS])
    return f"{len(known)} in all; {'closest' if close else 'the first'}: {', '.join(shown)}"


def config_of(base: dict[str, Any], candidate: Candidate) -> dict[str, Any]:
    """The base sections with the candidate's merged in (a YAML-ready dict)."""
    merged = {name: dict(section) for name, section in base.items()}
    for name, section in candidate.sections.items():
        merged.setdefault(name, {}).update(section)
    return merged
