"""Seeded synthetic workloads: prompts of random token ids and exact output lengths.

As vLLM's `random` dataset does, a request is a prompt of token ids and an output length that
the server is held to (``ignore_eos=True``, ``max_tokens = expected_output_len``), so the output
length is part of the workload, not of the model's whims. Nothing is downloaded: length
distributions are written here with where their parameters come from. Same arguments and seed,
same requests, token for token. Pure Python + numpy; called by the bench command before a run.

Datasets (``--dataset-name``):
  random         uniform lengths in [len*(1-r), len*(1+r)] (vLLM's defaults: 1024 in, 128 out).
  prefill-heavy  long prompts, short answers: 2048 in, 32 out, r=0.5. Shaped after the "coding"
                 trace of Splitwise (Patel et al., ISCA 2024, Sec. III: median prompt ~1500
                 tokens, median output ~13 tokens on Azure production traffic).
  decode-heavy   short prompts, long answers: 128 in, 1024 out, r=0.5.
  long-prompt    prompts uniform in [8192, 32768] tokens, answers in [16, 64]: long-document
                 summarization / QA (DistServe's LongBench workload, Zhong et al., OSDI 2024,
                 is of this shape); chunked prefill re-reads a growing prefix here.
  chat           lognormal lengths with the medians of Splitwise's "conversation" trace (median
                 prompt ~1020 tokens, median output ~129 tokens). The spreads (sigma 0.8 for
                 prompts, 0.9 for outputs, i.e. p90/p50 ~ 2.8x and 3.2x) are our assumption,
                 chosen to give the heavy right tail that ShareGPT/LMSYS-Chat-1M length histograms
                 show (Zheng et al. 2023, LMSYS-Chat-1M, Fig./Table 1); clipped to [4, 8192] in
                 and [4, 2048] out.
  shared-prefix  groups of 16 requests sharing a 2048-token system prompt, 128-token questions,
                 128 out (SGLang's generated-shared-prefix; `prefix_workloads`).
  multi-turn     conversations of 4 turns, each resending the conversation so far: 256-token
                 messages, 128-token answers, r=0.5 (`prefix_workloads`).
Every length is then clipped so that prompt + output fits `max_model_len`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field

import numpy as np

from disagg.cluster.bench import prefix_workloads

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SampleRequest:
    """One request of a workload.

    Attributes:
        request_id: unique within the workload ("<dataset>-<index>").
        prompt_token_ids: the prompt, ids in [0, vocab_size).
        expected_output_len: tokens the server must generate (max_tokens, EOS ignored).
    """

    request_id: str
    prompt_token_ids: list[int] = field(repr=False)
    expected_output_len: int

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True)
class DatasetDefaults:
    """Default lengths of a dataset (``--random-*`` flags override them where they apply)."""

    input_len: int
    output_len: int
    range_ratio: float
    source: str


DATASETS: dict[str, DatasetDefaults] = {
    "random": DatasetDefaults(1024, 128, 0.0, "uniform; vLLM random dataset defaults"),
    "prefill-heavy": DatasetDefaults(2048, 32, 0.5, "Splitwise coding trace shape (ISCA 2024)"),
    "decode-heavy": DatasetDefaults(128, 1024, 0.5, "short prompt, long answer"),
    "long-prompt": DatasetDefaults(20480, 40, 0.6, "prompts 8k-32k, answers 16-64 (LongBench-like)"),
    "chat": DatasetDefaults(1020, 129, 0.0, "lognormal; Splitwise conversation medians (ISCA 2024)"),
    "shared-prefix": DatasetDefaults(2048, 128, 0.0, "groups of 16 sharing a system prompt (input_len), "
                                     "128-token questions; SGLang generated-shared-prefix"),
    "multi-turn": DatasetDefaults(256, 128, 0.5, "4-turn conversations resending themselves; input_len per "
                                  "message, output_len per answer"),
}
PREFIX_DATASETS = {"shared-prefix": prefix_workloads.shared_prefix, "multi-turn": prefix_workloads.multi_turn}
CHAT_SIGMA_INPUT = 0.8
CHAT_SIGMA_OUTPUT = 0.9
CHAT_INPUT_CLIP = (4, 8192)
CHAT_OUTPUT_CLIP = (4, 2048)


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that determines a workload; stored in the result JSON.

    Attributes:
        dataset_name: a key of DATASETS.
        num_prompts: requests in the workload (>= 1).
        seed: the numpy seed of lengths and token ids.
        vocab_size: token ids are drawn from [0, vocab_size) minus `avoid_token_ids`.
        max_model_len: prompt + output never exceeds it (None: no limit).
        input_len / output_len / range_ratio: None takes the dataset's default.
        avoid_token_ids: ids never placed in a prompt (EOS and special tokens).
    """

    dataset_name: str = "random"
    num_prompts: int = 100
    seed: int = 0
    vocab_size: int = 32000
    max_model_len: int | None = None
    input_len: int | None = None
    output_len: int | None = None
    range_ratio: float | None = None
    avoid_token_ids: tuple[int, ...] = ()

    def resolved(self) -> WorkloadSpec:
        """Return a copy with the dataset defaults filled in, after checking every field.

        Raises:
            ValueError: unknown dataset, non-positive counts or lengths, range ratio outside
                [0, 1), or a vocabulary with no usable token.
        """
        if self.dataset_name not in DATASETS:
            raise ValueError(f"--dataset-name: expected one of {sorted(DATASETS)}, got {self.dataset_name!r}")
        base = DATASETS[self.dataset_name]
        spec = WorkloadSpec(
            self.dataset_name, self.num_prompts, self.seed, self.vocab_size, self.max_model_len,
            base.input_len if self.input_len is None else self.input_len,
            base.output_len if self.output_len is None else self.output_len,
            base.range_ratio if self.range_ratio is None else self.range_ratio,
            tuple(sorted(set(self.avoid_token_ids))))
        _check_positive("--num-prompts", spec.num_prompts)
        _check_positive("--random-input-len", spec.input_len)
        _check_positive("--random-output-len", spec.output_len)
        _check_positive("vocab_size", spec.vocab_size)
        if spec.max_model_len is not None:
            _check_positive("max_model_len", spec.max_model_len, minimum=2)
        if not 0.0 <= spec.range_ratio < 1.0:
            raise ValueError(f"--random-range-ratio: expected a number in [0, 1), got {spec.range_ratio}")
        if len([t for t in spec.avoid_token_ids if 0 <= t < spec.vocab_size]) >= spec.vocab_size:
            raise ValueError(f"avoid_token_ids: leaves no token of the {spec.vocab_size}-token vocabulary")
        return spec

    def to_dict(self) -> dict:
        out = asdict(self)
        out["avoid_token_ids"] = list(self.avoid_token_ids)
        out["source"] = DATASETS[self.dataset_name].source if self.dataset_name in DATASETS else None
        return out


def sample_requests(spec: WorkloadSpec) -> list[SampleRequest]:
    """Draw the workload of `spec` (deterministic in its fields).

    Raises:
        ValueError: as `WorkloadSpec.resolved`.
    """
    spec = spec.resolved()
    if spec.dataset_name in PREFIX_DATASETS:
        return _prefix_requests(spec, np.random.default_rng(spec.seed))
    prompts, output_lens = sample_prompts(spec)
    return [SampleRequest(f"{spec.dataset_name}-{index}", ids.tolist(), num_out)
            for index, (ids, num_out) in enumerate(zip(prompts, output_lens.tolist()))]


def sample_prompts(spec: WorkloadSpec) -> tuple[list[np.ndarray], np.ndarray]:
    """The prompts and output lengths of `sample_requests(spec)`, the prompts as int32 arrays (the
    simulator's workloads: 3,000 long-prompt prompts as lists of ints would take ~2.5 GB).

    Returns:
        ``[num_prompts]`` int32 arrays of prompt ids and ``[num_prompts]`` int64 output lengths,
        request by request.

    Raises:
        ValueError: as `WorkloadSpec.resolved`.
    """
    spec = spec.resolved()
    rng = np.random.default_rng(spec.seed)
    if spec.dataset_name in PREFIX_DATASETS:
        requests = _prefix_requests(spec, rng)
        return ([np.asarray(r.prompt_token_ids, dtype=np.int32) for r in requests],
                np.array([r.expected_output_len for r in requests], dtype=np.int64))
    input_lens, output_lens = _lengths(spec, rng)
    allowed = _allowed_ids(spec.vocab_size, spec.avoid_token_ids).astype(np.int32)
    return [allowed[rng.integers(0, len(allowed), size=num_in)] for num_in in input_lens.tolist()], output_lens


def sample_lengths(spec: WorkloadSpec) -> tuple[np.ndarray, np.ndarray]:
    """The prompt and output lengths of `sample_requests(spec)`, without drawing any token id
    (the simulator's workloads where no prefix cache reads the ids).

    Returns:
        ``([num_prompts], [num_prompts])`` int64 prompt and output lengths, request by request.
    """
    spec = spec.resolved()
    rng = np.random.default_rng(spec.seed)
    if spec.dataset_name in PREFIX_DATASETS:  # their lengths come with their shared prompts
        requests = _prefix_requests(spec, rng)
        return (np.array([r.prompt_len for r in requests], dtype=np.int64),
                np.array([r.expected_output_len for r in requests], dtype=np.int64))
    return _lengths(spec, rng)


def _lengths(spec: WorkloadSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    input_lens, output_lens = _sample_lengths(spec, rng)
    return _fit_context(input_lens, output_lens, spec.max_model_len)


def _prefix_requests(spec: WorkloadSpec, rng: np.random.Generator) -> list[SampleRequest]:
    """The workloads whose prompts share prefixes (`prefix_workloads`), clipped to the context."""
    allowed = _allowed_ids(spec.vocab_size, spec.avoid_token_ids)
    pairs = PREFIX_DATASETS[spec.dataset_name](spec.num_prompts, spec.input_len, spec.output_len,
                                               spec.range_ratio, rng, allowed)
    input_lens, output_lens = _fit_context(np.array([len(p) for p, _ in pairs], dtype=np.int64),
                                           np.array([n for _, n in pairs], dtype=np.int64), spec.max_model_len)
    return [SampleRequest(f"{spec.dataset_name}-{i}", prompt[:num_in], num_out)
            for i, ((prompt, _), num_in, num_out) in enumerate(zip(pairs, input_lens.tolist(), output_lens.tolist()))]


def _sample_lengths(spec: WorkloadSpec, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    n = spec.num_prompts
    if spec.dataset_name == "chat":
        num_in = rng.lognormal(math.log(spec.input_len), CHAT_SIGMA_INPUT, size=n)
        num_out = rng.lognormal(math.log(spec.output_len), CHAT_SIGMA_OUTPUT, size=n)
        return (np.clip(np.rint(num_in), *CHAT_INPUT_CLIP).astype(np.int64),
                np.clip(np.rint(num_out), *CHAT_OUTPUT_CLIP).astype(np.int64))
    if spec.dataset_name == "long-prompt" and spec.input_len == DATASETS["long-prompt"].input_len:
        return rng.integers(8192, 32768 + 1, size=n), rng.integers(16, 64 + 1, size=n)
    return (_uniform_around(rng, spec.input_len, spec.range_ratio, n),
            _uniform_around(rng, spec.output_len, spec.range_ratio, n))


def _uniform_around(rng: np.random.Generator, mean: int, ratio: float, n: int) -> np.ndarray:
    """vLLM's bounds: integers in [floor(mean*(1-r)), ceil(mean*(1+r))], at least 1."""
    low = max(1, math.floor(mean * (1.0 - ratio)))
    high = max(low, math.ceil(mean * (1.0 + ratio)))
    return rng.integers(low, high + 1, size=n)


def _fit_context(input_lens: np.ndarray, output_lens: np.ndarray,
                 max_model_len: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Clip outputs to max_model_len - 1, then prompts to what is left (at least one token)."""
    if max_model_len is None:
        return input_lens, output_lens
    output_lens = np.minimum(output_lens, max_model_len - 1)
    clipped = np.minimum(input_lens, max_model_len - output_lens)
    if (clipped < input_lens).any():
        logger.warning("%d of %d prompts clipped to fit max_model_len=%d",
                       int((clipped < input_lens).sum()), len(input_lens), max_model_len)
    return clipped, output_lens


def _allowed_ids(vocab_size: int, avoid: Iterable[int]) -> np.ndarray:
    mask = np.ones(vocab_size, dtype=bool)
    avoid_in_vocab = [t for t in avoid if 0 <= t < vocab_size]
    mask[avoid_in_vocab] = False
    return np.flatnonzero(mask)


def _check_positive(name: str, value: object, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
