"""The step-time model: one step's seconds as a linear function of its shape, fitted online.

`StepTimeModel` predicts an engine step's seconds from its prompt tokens (more per token beyond
a knee), their attention pairs, decoding sequences and their context, with one intercept for
pure-decode steps (which replay CUDA graphs) and one for steps with prompt tokens (which run
piecewise or eagerly and pay more for their decodes); a non-negative ridge fit towards a prior,
outliers (first uses of a shape) left out. The adaptive placement (`disagg.cluster.routing.placement`)
fits one per instance from its `StepSample`s; `disagg profile` fits one to a grid of measured
steps and `disagg simulate` times its virtual steps with it (docs/ARCHITECTURE.md §7, §11).
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field

import numpy as np

MIN_SAMPLES_TO_FIT = 8
PRIOR_WEIGHT = 2.0  # the prior counts as this many samples in the fit
PROFILE_PRIOR_WEIGHT = 1e-3  # a profile's grid covers every direction: its fit barely leans on the prior
# A step over 3x the fit's prediction is a one-off (a first use of a shape), one under a third of it
# a timing artifact (`_inliers`): neither is fitted.
OUTLIER_RATIO = 3.0
# Per step (`features`): is it pure decode (0/1), prompt tokens, decoding sequences, their context
# tokens, has it prompt tokens (0/1), the prompt tokens' attention pairs (`disagg.engine.steps.
# prompt_pairs`), has it prompt tokens and decodes (0/1), context tokens again when it has prompt
# tokens, prompt tokens beyond the knee. Steps with prompt tokens run eagerly, pure-decode ones
# replay CUDA graphs: the mixed-step and eager-context terms are what decodes cost more in an
# eager step; below the knee an eager step is bound by its kernel launches (an H100's 8B step
# takes about as long at 128 prompt tokens as at 1024), beyond it by its compute.
FEATURES = ("decode_step", "prompt_tokens", "decode_seqs", "context_tokens", "prompt_step", "prompt_pairs",
            "mixed_step", "eager_context_tokens", "prompt_tokens_over_knee")
FEATURE_SCALE = np.array([1.0, 1e3, 1e2, 1e5, 1.0, 1e7, 1.0, 1e5, 1e3])
KNEE_TOKENS = 1024  # the prior's knee; a profile's fit picks the best of `KNEE_CHOICES`
KNEE_CHOICES = (256, 512, 1024, 2048, 4096)
# An older fit has the first 5 (or 4: one intercept for both kinds of step); the rest are 0 there,
# so it predicts what it did when it was written.
OLDER_NUM_COEF = (4, 5)


def features(num_prefill_tokens, num_decode_seqs, num_context_tokens, num_prompt_pairs,
             knee_tokens: int = KNEE_TOKENS) -> np.ndarray:
    """The model's features of steps (scalars or ``[N]`` arrays): ``[..., 9]`` as `FEATURES`."""
    prompt, seqs, context, pairs = (np.asarray(v, dtype=np.float64) for v in
                                    (num_prefill_tokens, num_decode_seqs, num_context_tokens, num_prompt_pairs))
    eager = (prompt > 0) * 1.0
    return np.stack(np.broadcast_arrays(1.0 - eager, prompt, seqs, context, eager, pairs, eager * (seqs > 0),
                                        eager * context, np.maximum(prompt - knee_tokens, 0.0)), axis=-1)


def _coefficients(values: tuple, what: str) -> tuple[float, ...]:
    """``values`` as the model's `FEATURES` coefficients (an older fit's 4 or 5 padded, above)."""
    values = tuple(float(v) for v in values)
    if len(values) not in OLDER_NUM_COEF + (len(FEATURES),) or any(not math.isfinite(v) or v < 0 for v in values):
        raise ValueError(f"{what}: expected {len(FEATURES)} finite coefficients >= 0 ({', '.join(FEATURES)}; "
                         f"an older profile's 5 or 4 also load), got {values!r}")
    if len(values) == 4:  # one intercept for both kinds of step
        values += (values[0],)
    return values + (0.0,) * (len(FEATURES) - len(values))


def _nonnegative_ridge(x: np.ndarray, y: np.ndarray, lam: np.ndarray, prior: np.ndarray) -> np.ndarray:
    """``argmin |x c - y|^2 + sum_j lam_j (c_j - prior_j)^2`` over ``c >= 0``: the ridge as extra
    rows, then Lawson and Hanson's active-set non-negative least squares."""
    a = np.vstack([x, np.diag(np.sqrt(lam))])
    b = np.concatenate([y, np.sqrt(lam) * prior])
    coef, free = np.zeros(a.shape[1]), np.zeros(a.shape[1], dtype=bool)
    tol = 1e-12 * float(np.abs(a).max() * np.abs(b).max() or 1.0)
    for _ in range(3 * a.shape[1]):
        gradient = a.T @ (b - a @ coef)
        if free.all() or gradient[~free].max() <= tol:
            break
        free[np.flatnonzero(~free)[int(np.argmax(gradient[~free]))]] = True
        for _ in range(a.shape[1]):  # each pass holds one more coefficient at 0
            trial = np.zeros_like(coef)
            trial[free] = np.linalg.lstsq(a[:, free], b, rcond=None)[0]
            if (trial[free] > 0).all():
                break
            bad = free & (trial <= 0)
            step = float(np.min(coef[bad] / np.maximum(coef[bad] - trial[bad], 1e-300)))
            coef = coef + step * (trial - coef)
            free &= coef > 1e-12 * float(np.abs(coef).max() or 1.0)
            coef[~free] = 0.0
        coef = np.maximum(trial, 0.0)
    return coef


@dataclass
class StepTimeModel:
    """One step's seconds, linear in `features`:

        (c4 if prompt_tokens else c0) + c1 * prompt_tokens + c2 * decode_seqs + c3 * context_tokens
        + c5 * prompt_pairs + (c6 if prompt_tokens and decode_seqs) + (c7 * context_tokens if prompt_tokens)
        + c8 * max(prompt_tokens - knee_tokens, 0)

    Ridge-fitted to the samples (newest ``max_samples``), pulled towards ``prior`` (the seed:
    defaults of the right order for an 8B model on one H100-class GPU, or a profile's fit), so a
    direction no sample varies (a prefill instance that never decodes) keeps its prior;
    coefficients >= 0. A step over `OUTLIER_RATIO` x the first fit's prediction (a first use of a
    shape: allocator growth, a kernel's first launch) or under 1 / `OUTLIER_RATIO` of it (a
    timing artifact, `_inliers`) is left out of the second fit and counted in ``num_outliers``.
    `from_samples` also picks ``knee_tokens`` (`KNEE_CHOICES`: the one that fits best).
    """

    # The first five of an 8B model's order, per prompt token ~4x high (prefill is not
    # underrated before the first samples); pairs, mixed step and eager context near the fits of
    # llama3-8b profiles on H100s (benchmarks/records/stepmodel-2026-11-27), the mixed step's
    # halved: an unmeasured instance is not talked out of the local path by it; no knee (c8 = 0):
    # a prompt token costs alike at any chunk size until measured.
    prior: tuple[float, ...] = (8e-3, 8e-5, 3e-5, 5e-8, 8e-3, 2e-9, 5e-3, 5e-8, 0.0)
    knee_tokens: int = KNEE_TOKENS
    max_samples: int = 512
    prior_weight: float = PRIOR_WEIGHT
    relative: bool = False  # fit relative errors (each step weighs 1 / seconds): a profile's 7 ms and 200 ms steps alike
    coef: np.ndarray = field(init=False)  # set by `_set_coef` only
    _terms: tuple[float, ...] = field(init=False, repr=False)  # ``coef`` as Python floats, for `step_s`
    error: float = field(init=False, default=0.3)  # relative RMS error of the fit, outliers aside (the margin)
    num_outliers: int = field(init=False, default=0)
    _samples: collections.deque = field(init=False)
    _since_fit: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        self.prior = _coefficients(self.prior, "prior")
        self._set_coef(np.asarray(self.prior, dtype=np.float64))
        self._samples = collections.deque(maxlen=self.max_samples)

    def observe(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int,
                num_prompt_pairs: int, seconds: float) -> None:
        """Record one measured step (a `StepSample`'s fields); refit every few samples."""
        if seconds <= 0 or num_prefill_tokens + num_decode_seqs == 0:
            return
        self._samples.append((num_prefill_tokens, num_decode_seqs, num_context_tokens, num_prompt_pairs, seconds))
        self._since_fit += 1
        if len(self._samples) >= MIN_SAMPLES_TO_FIT and self._since_fit >= max(1, len(self._samples) // 8):
            self.fit()

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def fit(self) -> None:
        """Refit ``coef``, ``error`` and ``num_outliers`` to the samples (class docstring)."""
        self._since_fit = 0
        data = np.asarray(self._samples, dtype=np.float64)
        raw, y = features(*data[:, :4].T, self.knee_tokens), data[:, 4]
        weight = 1.0 / y if self.relative else np.ones_like(y)
        x = raw / FEATURE_SCALE * weight[:, None]
        prior = np.asarray(self.prior) * FEATURE_SCALE
        lam = np.full(len(FEATURES), self.prior_weight * float(np.mean(x * x, axis=0).mean() or 1.0))
        kept = np.ones(len(y), dtype=bool)
        for _ in range(2):  # fit, then fit again without the outliers of the first
            scaled = _nonnegative_ridge(x[kept], y[kept] * weight[kept], lam, prior)
            self._set_coef(scaled / FEATURE_SCALE)
            predicted = np.maximum(raw @ self.coef, 1e-9)
            kept = _inliers(y, predicted)
        self.num_outliers = int(np.count_nonzero(~kept))
        self.error = float(np.sqrt(np.mean(((predicted[kept] - y[kept]) / y[kept]) ** 2))) if kept.any() else 1.0

    def _set_coef(self, coef: np.ndarray) -> None:
        self.coef, self._terms = coef, tuple(coef.tolist())

    @classmethod
    def from_samples(cls, samples: list[tuple], prior: tuple[float, ...] | None = None) -> StepTimeModel:
        """A model fitted to every one of ``samples`` (``(prompt_tokens, decode_seqs,
        context_tokens, prompt_pairs, seconds)`` each, e.g. `disagg profile`'s grid), ridge
        towards ``prior``, with the knee of `KNEE_CHOICES` that fits them best."""
        best = None
        for knee in KNEE_CHOICES:
            model = cls(prior=prior or cls.prior, knee_tokens=knee, max_samples=max(len(samples), 1),
                        prior_weight=PROFILE_PRIOR_WEIGHT, relative=True)
            for sample in samples:
                model.observe(*sample)
            if model.num_samples:
                model.fit()
            if best is None or (model.error, model.num_outliers) < (best.error, best.num_outliers):
                best = model
        return best

    @classmethod
    def from_dict(cls, data: dict) -> StepTimeModel:
        """The model `to_dict` wrote (a profile's fit): its coefficients, as the prior too. An
        older profile's 5 (or 4) coefficients load as they predicted (`OLDER_NUM_COEF`)."""
        model = cls(prior=_coefficients(data["coef_s"], "coef_s"), knee_tokens=int(data.get("knee_tokens", KNEE_TOKENS)))
        model.error = float(data.get("error", model.error))
        return model

    def errors_by_region(self, samples: list[tuple]) -> dict[str, dict]:
        """Relative RMS error of the fit over ``samples`` (as `from_samples` takes), per region:
        prefill (no decodes), decode (no prompt tokens) and mixed steps; over all of them and
        without the steps outside `OUTLIER_RATIO` of the prediction either way (``num_outliers``)."""
        regions: dict[str, list[float]] = {"prefill": [], "decode": [], "mixed": []}
        for prompt, seqs, context, pairs, seconds in samples:
            region = "decode" if prompt == 0 else "prefill" if seqs == 0 else "mixed"
            regions[region].append(self.step_s(prompt, seqs, context, pairs) / seconds - 1.0)
        out = {}
        for name, errs in regions.items():
            errs = np.asarray(errs)
            inliers = errs[_inliers(1.0, errs + 1.0)]
            out[name] = {"num_samples": len(errs), "rms_rel_error": _rms(errs), "num_outliers": len(errs) - len(inliers),
                         "rms_rel_error_without_outliers": _rms(inliers)}
        return out

    def step_s(self, num_prefill_tokens: float, num_decode_seqs: float, num_context_tokens: float,
               num_prompt_pairs: float) -> float:
        """Predicted seconds of one step computing that much (`features` @ ``coef``, in Python
        floats, the same IEEE arithmetic as numpy's: the simulator calls it once a step, the
        adaptive placement hundreds of times a decision)."""
        c0, c1, c2, c3, c4, c5, c6, c7, c8 = self._terms
        seconds = c1 * num_prefill_tokens + c2 * num_decode_seqs + c3 * num_context_tokens + c5 * num_prompt_pairs
        if num_prefill_tokens <= 0:
            return float(c0 + seconds)
        over = num_prefill_tokens - self.knee_tokens
        return float(c4 + seconds + (c6 if num_decode_seqs > 0 else 0.0) + c7 * num_context_tokens
                     + c8 * (0 if over < 0 else over))  # max(over, 0), as `features`, without the call

    def to_dict(self) -> dict:
        return {"coef_s": [float(v) for v in self.coef], "features": list(FEATURES), "knee_tokens": self.knee_tokens,
                "error": self.error, "num_samples": self.num_samples, "num_outliers": self.num_outliers}


def _inliers(seconds, predicted):
    """Which steps the fit keeps: those within `OUTLIER_RATIO` of the prediction either way.

    Over it, a one-off (a first use of a shape). Under a third of it, a timing artifact: with
    async scheduling the step loop times `engine.step()`, which waits for a step launched in the
    call before; where the host was busy between the calls (the router's calls, a reservation)
    the GPU ran that step meanwhile and the call timed only its tail. Rare as they are, under the
    relative weighting of a profile's fit a few such steps would price a prompt chunk at nothing."""
    return (seconds <= OUTLIER_RATIO * predicted) & (seconds * OUTLIER_RATIO >= predicted)


def _rms(errs: np.ndarray) -> float | None:
    return float(np.sqrt(np.mean(np.square(errs)))) if len(errs) else None
