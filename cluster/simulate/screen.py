"""The analytic screen of `disagg plan`: each candidate's sustainable rate from its profiles' step
time models, before anything is simulated.

Every instance's capacity comes from its role's `StepTimeModel` at the workload's mean lengths
(`WorkloadShape`), each within the SLOs (the steps of the rate are full, as at the knee):

    prefill    prompts/s of steps of C prompt tokens (the chunk budget), the largest C' <= C whose
               prompt latency (ceil(L_in / C') full steps) is within the TTFT SLO; at most what
               the instance's links carry (L_in x KV bytes per token, one link per rank)
    decode     B sequences decoding together, B / (step(B) x (L_out - 1)) requests/s, at the
               largest B that fits the pages and max_num_seqs whose step is within the TPOT SLO
    colocated  B decodes and the prompt tokens that keep B in flight (B x L_in / (L_out - 1)) in
               one step, within the chunk budget and both SLOs, at the best B

A split's rate is TRT-LLM's rate matching: min(x prefill capacities, y decode capacities); an
adaptive split's the better of that and its instances each serving colocated (it may do either);
a colocated fleet's, n capacities. `shortlist` keeps the candidates within a margin of the best
rate per GPU, and the best colocated one (the ranking's reference); `disagg plan` simulates only
those, each search starting at its screened rate. Prefix-cache hits, queueing and the router's
hops are not in the screen: it ranks, the simulation judges. Pure Python; `plan.py` calls it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from disagg.cluster.simulate.step_model import StepTimeModel

DEFAULT_MARGIN = 0.7  # `shortlist`: simulate candidates screened at >= this fraction of the best per GPU
DEFAULT_MAX_SIMULATED = 6  # `shortlist`: `disagg plan`'s default cap on the candidates it simulates
# Step sizes tried below a chunk budget whose full steps miss the TTFT SLO (fractions of it).
CHUNK_FRACTIONS = (1.0, 0.75, 0.5, 0.375, 0.25, 0.125, 0.0625, 0.03125)


@dataclass(frozen=True)
class WorkloadShape:
    """The workload's requests on average: prompt and output tokens, and the attention pairs per
    prompt token (E[L (L + 1) / 2] / E[L]: pairs grow with the square of a prompt's length)."""

    input_len: float
    output_len: float
    pairs_per_prompt_token: float

    @classmethod
    def of(cls, input_lens: Sequence[int], output_lens: Sequence[int]) -> WorkloadShape:
        """The shape of requests of these lengths (`workloads.sample_lengths`)."""
        inputs = np.asarray(input_lens, dtype=np.float64)
        outputs = np.asarray(output_lens, dtype=np.float64)
        if not len(inputs) or len(inputs) != len(outputs):
            raise ValueError(f"WorkloadShape.of: expected as many output lengths as prompt lengths (>= 1), got "
                             f"{len(inputs)} and {len(outputs)}")
        return cls(float(inputs.mean()), float(outputs.mean()),
                   float((inputs * (inputs + 1) / 2).mean() / max(inputs.mean(), 1.0)))

    @property
    def decode_tokens(self) -> float:
        """Tokens a request decodes after its first (which its prefill samples)."""
        return max(self.output_len - 1.0, 0.0)

    @property
    def context_len(self) -> float:
        """A decoding sequence's context on average: its prompt and half its output."""
        return self.input_len + self.output_len / 2


@dataclass(frozen=True)
class InstanceShape:
    """What the screen reads of one instance: its step-time model, chunk budget (tokens per
    step), batch (sequences per step), pages and their size, and the KV bytes per token of its
    busiest push link (one rank's share at equal TPs: `link.link_bytes_per_token`) with the
    link bandwidth each rank pushes over."""

    model: StepTimeModel
    chunk_tokens: int
    max_num_seqs: int
    num_pages: int
    page_size: int
    kv_bytes_per_token: float
    link_bytes_per_s: float


def _ttft_s(slos_ms: Mapping[str, float]) -> float:
    return slos_ms.get("ttft", math.inf) / 1e3


def _tpot_s(slos_ms: Mapping[str, float]) -> float:
    return slos_ms.get("tpot", math.inf) / 1e3


def _e2el_ok(slos_ms: Mapping[str, float], ttft_s: float, tpot_s: float, work: WorkloadShape) -> bool:
    return ttft_s + tpot_s * work.decode_tokens <= slos_ms.get("e2el", math.inf) / 1e3


def _prompt_step_s(inst: InstanceShape, tokens: float, work: WorkloadShape, decodes: int = 0) -> float:
    """One step of ``tokens`` prompt tokens (of prompts of the workload's lengths) beside
    ``decodes`` decoding sequences."""
    return inst.model.step_s(tokens, decodes, decodes * work.context_len, tokens * work.pairs_per_prompt_token)


def prefill_rate(inst: InstanceShape, work: WorkloadShape, slos_ms: Mapping[str, float]) -> float:
    """Prompts/s one prefill instance sustains within the TTFT SLO (module docstring); 0.0 when
    even its smallest steps miss it."""
    best = 0.0
    for fraction in CHUNK_FRACTIONS:
        tokens = max(1.0, inst.chunk_tokens * fraction)
        step = _prompt_step_s(inst, tokens, work)
        if math.ceil(work.input_len / tokens) * step <= _ttft_s(slos_ms):
            best = max(best, tokens / (work.input_len * step))
    pushed = work.input_len * inst.kv_bytes_per_token
    return min(best, inst.link_bytes_per_s / pushed) if pushed > 0 else best


def _batches(inst: InstanceShape, work: WorkloadShape) -> range:
    """The decode batches an instance can hold: max_num_seqs, and a whole request's pages each."""
    pages = math.ceil((work.input_len + work.output_len) / inst.page_size)
    return range(1, min(inst.max_num_seqs, inst.num_pages // max(pages, 1)) + 1)


def decode_rate(inst: InstanceShape, work: WorkloadShape, slos_ms: Mapping[str, float]) -> float:
    """Requests/s one decode instance sustains within the TPOT SLO (module docstring): inf for
    one-token answers (nothing left to decode), 0.0 when even one sequence's step misses it."""
    if work.decode_tokens == 0:
        return math.inf
    best = 0.0
    for batch in _batches(inst, work):
        step = inst.model.step_s(0, batch, batch * work.context_len, 0)
        if step > _tpot_s(slos_ms):
            break
        best = max(best, batch / (step * work.decode_tokens))
    return best


def colocated_rate(inst: InstanceShape, work: WorkloadShape, slos_ms: Mapping[str, float]) -> float:
    """Requests/s one colocated instance sustains within both SLOs (module docstring): each step
    decodes B sequences and computes the prompt tokens that replace those finishing."""
    if work.decode_tokens == 0:
        return prefill_rate(inst, work, slos_ms)
    best = 0.0
    for batch in _batches(inst, work):
        if batch >= inst.max_num_seqs or batch >= inst.chunk_tokens:
            break  # a prompt needs a seat and budget beside the batch
        tokens = min(batch * work.input_len / work.decode_tokens, inst.chunk_tokens - batch)
        step = _prompt_step_s(inst, tokens, work, batch)
        ttft = math.ceil(work.input_len / (inst.chunk_tokens - batch)) * step
        if step > _tpot_s(slos_ms) or ttft > _ttft_s(slos_ms) or not _e2el_ok(slos_ms, ttft, step, work):
            continue
        best = max(best, min(batch / (step * work.decode_tokens), tokens / (step * work.input_len)))
    return best


@dataclass(frozen=True)
class Screened:
    """One candidate's screen: its rate (req/s, the whole deployment's) and what bounds it."""

    label: str
    rate_rps: float
    num_gpus: int
    bound: str  # "prefill" or "decode" (a split's), "colocated", "adaptive" or "local" (`split_rate`)
    family: str = ""  # its kind and TPs (e.g. "adaptive TP1+TP2"): `shortlist` takes each family's best first

    @property
    def rate_per_gpu(self) -> float:
        return self.rate_rps / self.num_gpus


def split_rate(prefill: InstanceShape, num_prefill: int, decode: InstanceShape, num_decode: int,
               work: WorkloadShape, slos_ms: Mapping[str, float], adaptive: bool = False) -> tuple[float, str]:
    """The rate of ``num_prefill`` prefill + ``num_decode`` decode instances, and its bound.

    A split's is min(prefill capacity, decode capacity) (rate matching; bound "prefill" or
    "decode"). An ``adaptive`` one may also keep a request on its prefill instance or prefill it
    on its decode instance (colocated work, `colocated_rate`): the best mix of the three paths is
    at a corner (the rate is linear in the pushed share), either as many pushed as the split
    carries and the side it leaves idle serving colocated ("adaptive"), or none pushed, every
    instance serving colocated ("local")."""
    prefill_one, decode_one = prefill_rate(prefill, work, slos_ms), decode_rate(decode, work, slos_ms)
    prefill_rps, decode_rps = num_prefill * prefill_one, num_decode * decode_one
    pushed, bound = (prefill_rps, "prefill") if prefill_rps <= decode_rps else (decode_rps, "decode")
    if not adaptive:
        return pushed, bound
    local_prefill, local_decode = colocated_rate(prefill, work, slos_ms), colocated_rate(decode, work, slos_ms)
    local = num_prefill * local_prefill + num_decode * local_decode
    idle_prefill = num_prefill - (pushed / prefill_one if prefill_one > 0 else 0.0)
    idle_decode = num_decode - (pushed / decode_one if 0 < decode_one < math.inf else 0.0)
    mixed = pushed + idle_prefill * local_prefill + idle_decode * local_decode
    if local >= mixed and local > pushed:
        return local, "local"
    return (mixed, "adaptive") if mixed > pushed * (1 + 1e-12) else (pushed, bound)


def _alike(screened: Screened) -> tuple[str, str]:
    """What the screen tells apart of a candidate: its label without its chunk size, and without
    its split where it serves every request colocated (bound "local"), and its rate."""
    label = re.sub(r"\[chunk=\d+\]", "", screened.label)
    if screened.bound == "local":
        label = re.sub(r"^\d+P(\(TP\d+\)\+)?\d+D(\(TP\d+\))?", "*", label)
    return label, f"{screened.rate_rps:.9g}"


def shortlist(screened: Sequence[Screened], margin: float = DEFAULT_MARGIN,
              max_simulated: int | None = None) -> dict[str, str | None]:
    """Which of ``screened`` to simulate: per label, None to simulate it, else why not.

    Kept: each whose rate per GPU is at least ``margin`` x the best one's, and the best colocated
    one (the ranking's reference). Of candidates the screen cannot tell apart only the first is
    kept: alike but for their chunk size at the same rate (the chunk does not bind this workload),
    or adaptive splits serving every request colocated at the same rate (their split does not
    matter). Of those kept, at most ``max_simulated`` (None: all): the reference, then the best of
    each family (kind and TPs), best first, then the rest, best first: near-ties within a family
    are the screen's noise, the families are the choices. A ``margin`` of 0 keeps every one.

    Raises:
        ValueError: ``margin`` outside [0, 1], or ``max_simulated`` below 1.
    """
    if not 0 <= margin <= 1:
        raise ValueError(f"--screen-margin: expected a fraction of the best screened rate in [0, 1], got {margin}")
    if max_simulated is not None and max_simulated < 1:
        raise ValueError(f"--max-simulated: expected at least 1 candidate, got {max_simulated}")
    best = max((s.rate_per_gpu for s in screened), default=0.0)
    colocated = [s for s in screened if s.bound == "colocated"]
    reference = max(colocated, key=lambda s: s.rate_per_gpu).label if colocated else None
    out: dict[str, str | None] = {}
    first: dict[tuple[str, str], str] = {}
    for s in screened:
        twin = first.setdefault(_alike(s), s.label)
        if twin != s.label and margin > 0:
            out[s.label] = f"as {twin}"
        elif s.rate_per_gpu >= margin * best or s.label == reference:
            out[s.label] = None
        else:
            out[s.label] = f"below {margin:g}x the best"
    if max_simulated is not None:
        kept = sorted((s for s in screened if out[s.label] is None), key=lambda s: -s.rate_per_gpu)  # stable
        heads = {s.family: s for s in reversed(kept)}  # each family's first: its best
        order = sorted(kept, key=lambda s: (s.label != reference, heads[s.family] is not s))
        for s in order[max_simulated:]:
            out[s.label] = f"beyond the {max_simulated} simulated (--max-simulated)"
    return out
