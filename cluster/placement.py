"""Where a request's prompt is prefilled: the step-time model and the adaptive decision.

`router.placement: adaptive` (docs/ARCHITECTURE.md §7) chooses per request among three paths:

    remote  a prefill instance P computes the prompt and pushes its KV layer by layer into a
            decode instance D's pages; D decodes it
    local   a decode instance D prefills it itself, in chunks beside its running decodes
    kept    a prefill instance P prefills it and also decodes it

from predicted times: each instance has a `StepTimeModel` (one step's seconds as a linear
function of its prompt tokens, decoding sequences and their context, with one intercept for
pure-decode steps, which replay CUDA graphs, and one for steps with prompt tokens, which run
eagerly) fitted online from the
instance's own measured steps (`disagg.cluster.messages.StepSample`) and seeded with a prior, and
an `InstanceView` of its live load (prompt tokens queued, sequences decoding, free pages).
`decide` predicts TTFT and TPOT on every path and keeps the admissible ones: the pages fit, and
the targets (`router.slo_ttft_ms` / `slo_tpot_ms`) hold; without a TPOT target, a path may not
slow any running decode step by more than 10% beyond the remote path's step. Among admissible
paths it takes the lowest predicted TTFT (ties within the model's error margin go to local, then
remote, then kept: `PREFERENCE`); when none is admissible, the smallest violation. Pure functions of
their inputs, used by the router (`disagg.cluster.router`) on its event loop.
"""

from __future__ import annotations

import collections
import math
from dataclasses import dataclass, field, replace

import numpy as np

PATHS = ("remote", "local", "kept")
# Near-equal TTFTs (within the model's error margin) go to the path that disturbs least: local
# (admissible only when it slows no running decode step beyond the bound, it uses a decode
# instance's spare compute and needs no transfer), then remote, then kept.
PREFERENCE = ("local", "remote", "kept")
TPOT_SLACK = 1.1  # without a TPOT target: a decode step may grow to 1.1 x the remote path's step
MIN_SAMPLES_TO_FIT = 8
PRIOR_WEIGHT = 2.0  # the prior counts as this many samples in the fit
PROFILE_PRIOR_WEIGHT = 1e-3  # a profile's grid covers every direction: its fit barely leans on the prior
# Per step: is it pure decode (0/1), prompt tokens, sequences, context tokens, has it prompt tokens (0/1).
FEATURE_SCALE = np.array([1.0, 1e3, 1e2, 1e5, 1.0])
FEATURES = ("decode_step", "prompt_tokens", "decode_seqs", "context_tokens", "prompt_step")


def features(num_prefill_tokens, num_decode_seqs, num_context_tokens) -> np.ndarray:
    """The model's features of steps (scalars or ``[N]`` arrays): ``[..., 5]`` as `FEATURES`."""
    prompt = np.asarray(num_prefill_tokens, dtype=np.float64)
    step = (prompt > 0) * 1.0
    return np.stack(np.broadcast_arrays(1.0 - step, prompt, np.asarray(num_decode_seqs, np.float64),
                                        np.asarray(num_context_tokens, np.float64), step), axis=-1)


@dataclass
class StepTimeModel:
    """One step's seconds ~= (c4 if prompt_tokens else c0) + c1 * prompt_tokens + c2 * decode_seqs
    + c3 * context_tokens.

    Ridge-fitted to the samples (newest ``max_samples``), pulled towards ``prior`` (the seed:
    defaults of the right order for an 8B model on one H100-class GPU, or a profile's fit), so a
    direction no sample varies (a prefill instance that never decodes) keeps its prior.
    """

    prior: tuple[float, ...] = (8e-3, 8e-5, 3e-5, 5e-8, 8e-3)  # 4 values: one intercept for both kinds
    max_samples: int = 512
    prior_weight: float = PRIOR_WEIGHT
    relative: bool = False  # fit relative errors (each step weighs 1 / seconds): a profile's 7 ms and 200 ms steps alike
    coef: np.ndarray = field(init=False)
    error: float = field(init=False, default=0.3)  # relative RMS error of the fit (the margin)
    _samples: collections.deque = field(init=False)
    _since_fit: int = field(init=False, default=0)

    def __post_init__(self) -> None:
        if len(self.prior) not in (4, 5):
            raise ValueError(f"prior: expected 4 or 5 coefficients ({', '.join(FEATURES)}), got {self.prior!r}")
        self.prior = tuple(float(v) for v in self.prior) + (float(self.prior[0]),) * (5 - len(self.prior))
        self.coef = np.asarray(self.prior, dtype=np.float64)
        self._samples = collections.deque(maxlen=self.max_samples)

    def observe(self, num_prefill_tokens: int, num_decode_seqs: int, num_context_tokens: int,
                seconds: float) -> None:
        """Record one measured step; refit every few samples."""
        if seconds <= 0 or num_prefill_tokens + num_decode_seqs == 0:
            return
        self._samples.append((num_prefill_tokens, num_decode_seqs, num_context_tokens, seconds))
        self._since_fit += 1
        if len(self._samples) >= MIN_SAMPLES_TO_FIT and self._since_fit >= max(1, len(self._samples) // 8):
            self.fit()

    @property
    def num_samples(self) -> int:
        return len(self._samples)

    def fit(self) -> None:
        """Refit ``coef`` and ``error`` to the samples (ridge towards the prior, coefficients >= 0)."""
        self._since_fit = 0
        data = np.asarray(self._samples, dtype=np.float64)
        raw = features(data[:, 0], data[:, 1], data[:, 2])
        y = data[:, 3]
        weight = 1.0 / y if self.relative else np.ones_like(y)
        x = raw / FEATURE_SCALE * weight[:, None]
        prior = np.asarray(self.prior) * FEATURE_SCALE
        lam = self.prior_weight * float(np.mean(x * x, axis=0).mean() or 1.0)
        a = x.T @ x + lam * np.eye(len(FEATURES))
        scaled = np.linalg.solve(a, x.T @ (y * weight) + lam * prior)
        self.coef = np.maximum(scaled, 0.0) / FEATURE_SCALE
        predicted = np.maximum(raw @ self.coef, 1e-9)
        self.error = float(np.sqrt(np.mean(((predicted - y) / y) ** 2)))

    @classmethod
    def from_samples(cls, samples: list[tuple[int, int, int, float]],
                     prior: tuple[float, ...] | None = None) -> StepTimeModel:
        """A model fitted to every one of ``samples`` (``(prompt_tokens, decode_seqs,
        context_tokens, seconds)`` each, e.g. `disagg profile`'s grid), ridge towards ``prior``."""
        model = cls(prior=prior or cls.prior, max_samples=max(len(samples), 1), prior_weight=PROFILE_PRIOR_WEIGHT,
                    relative=True)
        for sample in samples:
            model.observe(*sample)
        if model.num_samples:
            model.fit()
        return model

    @classmethod
    def from_dict(cls, data: dict) -> StepTimeModel:
        """The model `to_dict` wrote (a profile's fit): its coefficients, as the prior too."""
        coef = tuple(float(v) for v in data["coef_s"])
        if len(coef) not in (4, 5) or any(not math.isfinite(v) or v < 0 for v in coef):
            raise ValueError(f"coef_s: expected 4 or 5 finite coefficients >= 0 ({', '.join(FEATURES)}), "
                             f"got {data['coef_s']!r}")
        model = cls(prior=coef)  # 4 coefficients (an older profile): one intercept for both kinds
        model.error = float(data.get("error", model.error))
        return model

    def errors_by_region(self, samples: list[tuple[int, int, int, float]]) -> dict[str, dict]:
        """Relative RMS error of the fit over ``samples``, per region: prefill (no decodes),
        decode (no prompt tokens) and mixed steps."""
        regions: dict[str, list[float]] = {"prefill": [], "decode": [], "mixed": []}
        for prompt, seqs, context, seconds in samples:
            region = "decode" if prompt == 0 else "prefill" if seqs == 0 else "mixed"
            regions[region].append((self.step_s(prompt, seqs, context) - seconds) / seconds)
        return {name: {"num_samples": len(errs), "rms_rel_error": float(np.sqrt(np.mean(np.square(errs))))
                       if errs else None} for name, errs in regions.items()}

    def step_s(self, num_prefill_tokens: float, num_decode_seqs: float, num_context_tokens: float) -> float:
        """Predicted seconds of one step computing that much."""
        c = self.coef
        return float((c[4] if num_prefill_tokens > 0 else c[0]) + c[1] * num_prefill_tokens
                     + c[2] * num_decode_seqs + c[3] * num_context_tokens)

    def to_dict(self) -> dict:
        return {"coef_s": [float(v) for v in self.coef], "features": list(FEATURES),
                "error": self.error, "num_samples": self.num_samples}


@dataclass(frozen=True)
class InstanceView:
    """One instance as the decision sees it: its model and live load.

    Attributes:
        name: the instance's name.
        model: its `StepTimeModel`.
        chunk_tokens: its prompt-token budget per step (scheduler.max_num_batched_tokens).
        queued_prompt_tokens: prompt tokens placed on it and not yet computed.
        num_decoding: sequences decoding on it.
        context_tokens: the tokens those sequences attend to.
        free_pages: pages it can still give (None: unknown, assumed enough).
        page_size: tokens per page.
    """

    name: str
    model: StepTimeModel
    chunk_tokens: int
    queued_prompt_tokens: int = 0
    num_decoding: int = 0
    context_tokens: int = 0
    free_pages: int | None = None
    page_size: int = 16

    def fits(self, prompt_len: int) -> bool:
        return self.free_pages is None or self.free_pages >= math.ceil((prompt_len + 1) / self.page_size)

    def prefill_s(self, prompt_len: int) -> float:
        """Seconds until a prompt of ``prompt_len`` placed now is computed here: the queue ahead
        of it and then its own tokens, in chunks of ``chunk_tokens`` beside the decodes."""
        total = self.queued_prompt_tokens + prompt_len
        full, rest = divmod(total, self.chunk_tokens)
        step = self.model.step_s
        seconds = full * step(self.chunk_tokens, self.num_decoding, self.context_tokens)
        return seconds + (step(rest, self.num_decoding, self.context_tokens) if rest else 0.0)

    def decode_step_s(self, extra_seqs: int = 0, extra_context: int = 0, prompt_tokens: int = 0) -> float:
        """Seconds of one decode step here with that much more work in it."""
        return self.model.step_s(min(prompt_tokens, self.chunk_tokens), self.num_decoding + extra_seqs,
                                 self.context_tokens + extra_context)


@dataclass(frozen=True)
class Targets:
    """The SLOs the decision predicts against, seconds (None: none)."""

    ttft_s: float | None = None
    tpot_s: float | None = None

    @classmethod
    def from_ms(cls, ttft_ms: float | None, tpot_ms: float | None) -> Targets:
        return cls(None if ttft_ms is None else ttft_ms / 1e3, None if tpot_ms is None else tpot_ms / 1e3)


@dataclass(frozen=True)
class Prediction:
    """One candidate path with its predictions; ``admissible`` False says ``why``."""

    path: str
    prefill: str | None  # the instance that computes the prompt
    decode: str | None   # the instance that decodes it
    ttft_s: float
    tpot_s: float
    margin: float        # the relative error of the models behind it
    admissible: bool = True
    why: str = ""


@dataclass(frozen=True)
class Decision:
    """The chosen path (None: no instance has the pages; wait) and every prediction behind it."""

    chosen: Prediction | None
    predictions: tuple[Prediction, ...]

    @property
    def path(self) -> str | None:
        return None if self.chosen is None else self.chosen.path


def predict(prompt_len: int, prefills: list[InstanceView], decodes: list[InstanceView]) -> list[Prediction]:
    """Every candidate: remote via the fastest prefill instance to each decode instance, local on
    each decode instance, kept on each prefill instance (page fit not yet judged)."""
    out = []
    best_p = min(prefills, key=lambda p: p.prefill_s(prompt_len), default=None)
    for d in decodes:
        # A decode step of D with this request in it, beside D's own queued prompt chunks.
        step_d = d.decode_step_s(1, prompt_len, d.queued_prompt_tokens)
        if best_p is not None:
            out.append(Prediction("remote", best_p.name, d.name, best_p.prefill_s(prompt_len), step_d,
                                  max(best_p.model.error, d.model.error)))
        # Local: its chunks slow D's running decodes; afterwards it decodes like a remote one.
        during = d.decode_step_s(0, 0, d.queued_prompt_tokens + prompt_len) if d.num_decoding else 0.0
        out.append(Prediction("local", d.name, d.name, d.prefill_s(prompt_len), max(step_d, during),
                              d.model.error))
    for p in prefills:
        # Kept: P decodes it between the prompt chunks it keeps computing for others.
        step_p = p.decode_step_s(1, prompt_len, p.queued_prompt_tokens)
        during = p.decode_step_s(0, 0, p.queued_prompt_tokens + prompt_len) if p.num_decoding else 0.0
        out.append(Prediction("kept", p.name, p.name, p.prefill_s(prompt_len), max(step_p, during),
                              p.model.error))
    return out


def decide(prompt_len: int, prefills: list[InstanceView], decodes: list[InstanceView],
           targets: Targets = Targets()) -> Decision:
    """Choose a path for a prompt of ``prompt_len`` tokens (module docstring).

    Args:
        prompt_len: the prompt's tokens (>= 1).
        prefills, decodes: the live instances of each role.
        targets: the SLOs; without a TPOT target the bound is `TPOT_SLACK` x the remote step.

    Returns:
        The `Decision`; ``chosen`` is None when no instance has the pages for it.
    """
    views = {v.name: v for v in prefills + decodes}
    judged = []
    candidates = predict(prompt_len, prefills, decodes)
    remote_steps = [c.tpot_s for c in candidates if c.path == "remote" and views[c.decode].fits(prompt_len)]
    bound = targets.tpot_s
    if bound is None and remote_steps:
        bound = TPOT_SLACK * min(remote_steps)
    for cand in candidates:
        why = ""
        if not views[cand.decode].fits(prompt_len):
            why = f"{cand.decode} has {views[cand.decode].free_pages} free pages"
        elif targets.ttft_s is not None and cand.ttft_s > targets.ttft_s:
            why = f"TTFT {cand.ttft_s * 1e3:.1f} ms > target {targets.ttft_s * 1e3:.1f} ms"
        elif bound is not None and cand.tpot_s > bound and (targets.tpot_s is not None or cand.path != "remote"):
            why = f"TPOT {cand.tpot_s * 1e3:.2f} ms > bound {bound * 1e3:.2f} ms"
        judged.append(cand if not why else replace(cand, admissible=False, why=why))
    ok = [c for c in judged if c.admissible]
    if ok:
        best = min(c.ttft_s for c in ok)
        near = [c for c in ok if c.ttft_s <= best * (1.0 + c.margin)]
        return Decision(min(near, key=lambda c: (PREFERENCE.index(c.path), c.ttft_s)), tuple(judged))
    fitting = [c for c in judged if views[c.decode].fits(prompt_len)]
    if not fitting:
        return Decision(None, tuple(judged))
    return Decision(min(fitting, key=lambda c: _violation(c, targets, bound)), tuple(judged))


def _violation(cand: Prediction, targets: Targets, bound: float | None) -> float:
    """How far ``cand`` misses its targets, as the worst ratio of predicted over target."""
    ratios = [cand.tpot_s / bound if bound else 0.0]
    if targets.ttft_s is not None:
        ratios.append(cand.ttft_s / targets.ttft_s)
    return max(ratios) + 1e-9 * cand.ttft_s


class FleetModel:
    """The router's picture of its instances for `decide`: a `StepTimeModel` per instance fed
    from its step samples, its last reported load, and its live requests' prompt and decode work.

    Args:
        chunk_tokens: every engine's prompt-token budget per step (scheduler.max_num_batched_tokens).
        page_size: tokens per page.
    """

    def __init__(self, chunk_tokens: int, page_size: int) -> None:
        self.chunk_tokens, self.page_size = chunk_tokens, page_size
        self.models: dict[str, StepTimeModel] = {}
        self.loads: dict[str, object] = {}  # name -> `InstanceLoad` of its last batch

    def model_of(self, name: str) -> StepTimeModel:
        return self.models.setdefault(name, StepTimeModel())

    def observe(self, name: str, steps: list, load: object | None) -> None:
        """Feed one `OutputBatch`'s step samples and load of instance ``name``."""
        model = self.model_of(name)
        for sample in steps:
            model.observe(*sample)
        if load is not None:
            self.loads[name] = load

    def view(self, inst, requests: list) -> InstanceView:
        """``inst`` (an `Instance`) with the work of the router's live ``requests`` on it."""
        queued = decoding = context = 0
        for req in requests:
            if inst is req.colocated:  # local or kept: prompt here until its first token
                computing = req.num_output == 0
            elif inst is req.prefill and req.stage in ("reserving", "prefilling"):
                computing = True
            elif inst is req.decode and req.stage == "decoding":
                computing = False
            else:
                continue
            if computing:
                queued += req.prompt_len
            else:
                decoding += 1
                context += req.prompt_len + req.num_output
        load = self.loads.get(inst.name)
        return InstanceView(inst.name, self.model_of(inst.name), self.chunk_tokens, queued, decoding, context,
                            None if load is None else load.free_pages, self.page_size)

    def snapshot(self) -> dict:
        """Each instance's fitted model (coefficients, error, samples)."""
        return {name: model.to_dict() for name, model in self.models.items()}
