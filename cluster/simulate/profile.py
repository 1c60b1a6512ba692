"""`disagg profile CONFIG --out profile.json`: time one instance's real engine over a grid of step
shapes and fit the router's step-time model to it.

The instance of CONFIG (its model, dtype, page size, budgets, CUDA graphs and async scheduling as
served) is built in this process as a colocated engine, which runs every kind of step, and driven
through three scenarios, each step timed at the host (`engine.step()`, which returns once the
step's tokens are read, then a device synchronize, since a prompt chunk that samples nothing
returns before its forward ends; async scheduling is off while profiling, so one call is one
forward and the host overlap it buys a served decode step is not credited) and recorded with the
shape the engine reports (`last_step_shape`):

    prefill  one prompt computed in chunks of T tokens (the chunk budget set to T), so chunk k
             runs over a prefix of k*T tokens: T x prefix (the chunk's attention pairs)
    decode   B sequences of C prompt tokens decoding together: B x C (B grows by adding
             sequences; their prompt chunks beside the running decodes are the mixed steps)
    mixed    those steps with prompt chunks and decodes in one forward, and at each B x C one
             short prompt of each of ``side_prompts`` tokens (one output token: it leaves at
             once) beside the B decodes: a request arriving at a busy instance

The samples fit `disagg.cluster.simulate.step_model.StepTimeModel` (the one model the adaptive router
uses; `StepTimeModel.from_samples`), and profile.json keeps the raw samples, the fit, its error
per region, the engine's sizes (pages, KV bytes per token for push times) and where it was
measured (device, dtype, model, commit). `disagg simulate` and `disagg plan` read it
(docs/ARCHITECTURE.md §11). Runs in the CLI process; no Ray, no heap.

Version 1 profiles (a model without the attention-pair, mixed-step, eager-context and knee
terms) still load: their 5 coefficients predict what they did (`StepTimeModel.from_dict`), and `disagg
profile --refit OLD.json --out NEW.json` refits them on the CPU from their own samples, whose
attention pairs `replayed_prompt_pairs` derives by replaying the grid's prompts (`refit_profile`).

A profile of an instance not timed (another TP, another model's shapes, the whole model from its
first N layers: `disagg profile --derive`, `--num-layers N`) is `disagg.cluster.simulate.derive`'s;
it carries ``derived`` (what was measured, what derived), and is not refitted.
"""

from __future__ import annotations

import collections
import json
import logging
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Sequence

from disagg.cluster.simulate.step_model import OUTLIER_RATIO, StepTimeModel
from disagg.config import Config

logger = logging.getLogger(__name__)

PROFILE_KIND = "disagg-profile"
PROFILE_VERSION = 2  # 2: samples carry prompt_pairs, the grid side prompts; the fit has `FEATURES`' 9 terms
SAMPLE_FIELDS = ["prompt_tokens", "decode_seqs", "context_tokens", "prompt_pairs", "seconds", "scenario"]


@dataclass(frozen=True)
class Grid:
    """The shapes timed.

    Attributes:
        chunk_tokens: prefill chunk sizes T (those above the config's token budget are skipped).
        chunks_per_prompt: chunks of each profiled prompt (its contexts: 0, T, ..., (k-1)T).
        contexts: decode context per sequence C (prompt tokens of each decoding sequence).
        batches: decode batch sizes B (above max_num_seqs skipped).
        decode_steps: timed decode steps per (B, C).
        max_tokens_per_context: B x C above this is skipped (prefilling it costs the most).
        side_prompts: the short prompts computed beside each B x C's decodes (version 2).
    """

    chunk_tokens: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192)
    chunks_per_prompt: int = 4
    contexts: tuple[int, ...] = (128, 512, 1024, 2048, 4096)
    batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32, 64, 128, 256)
    decode_steps: int = 8
    max_tokens_per_context: int = 256 * 1024
    side_prompts: tuple[int, ...] = (16, 128, 512)


SMALL_GRID = Grid(chunk_tokens=(16, 32), chunks_per_prompt=2, contexts=(16,), batches=(1, 2),
                  decode_steps=2, max_tokens_per_context=4096, side_prompts=(8,))


def build_engine(config: Config, tp: Any = None) -> tuple[Any, dict]:
    """The colocated engine of CONFIG's instance in this process, warmed up as served: with ``tp``
    (a `disagg.parallel.TPGroup`, every rank calling this) this rank's replica, its shard of the
    weights and the pages every rank can hold (the fewest any rank's memory gives, as the
    launcher sizes them).

    Returns:
        (engine, description): the engine and `disagg.cluster.launch.engines.describe`'s dict.
    """
    import torch

    from disagg.cluster.launch import engines

    device = config.instances.device
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    model = engines.load(config, device, tp=tp)
    info = engines.describe(model, config, device)
    num_pages = max(1, info["kv_budget_bytes"] // info["page_bytes"])
    if tp is not None:
        num_pages = min(tp.all_gather_object(int(num_pages)))
    engine = engines.make_engine("colocated", model, None, int(num_pages), config)
    engines.warm_up(engine, "colocated", config)
    return engine, info


class StepRecorder:
    """Runs engine steps, timing each and keeping a sample as `SAMPLE_FIELDS`."""

    def __init__(self, engine: Any, clock: Callable[[], float] = time.perf_counter) -> None:
        self.engine, self.clock = engine, clock
        self.sync = _synchronizer(engine)
        self.samples: list[list] = []
        self._ids = 0

    def step(self, scenario: str) -> None:
        start = self.clock()
        self.engine.step()
        self.sync()  # a chunk that samples nothing returns before its forward ends
        seconds = self.clock() - start
        shape = self.engine.last_step_shape
        if shape is not None and seconds > 0:
            self.samples.append([shape.num_prefill_tokens, shape.num_decode_seqs, shape.num_context_tokens,
                                 shape.num_prompt_pairs, seconds, scenario])

    def add(self, prompt_len: int, max_tokens: int) -> str:
        from disagg.sampling import SamplingParams

        self._ids += 1
        request_id = f"profile-{self._ids}"
        vocab = self.engine.model.config.vocab_size
        prompt = [(7 * i + self._ids) % vocab for i in range(prompt_len)]
        self.engine.add(request_id, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        return request_id

    def drain(self) -> None:
        """Abort every request and step until the engine is idle (its pages all free again)."""
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
        while self.engine.has_work():
            self.engine.step()


def _synchronizer(engine: Any) -> Callable[[], None]:
    """Waits for the engine's device (a no-op on the CPU, where forwards run inline)."""
    device = getattr(engine.model, "device", None)
    if getattr(device, "type", "cpu") != "cuda":
        return lambda: None
    import torch

    return lambda: torch.cuda.synchronize(device)


def profile_prefill(rec: StepRecorder, grid: Grid, budget: int, max_len: int) -> None:
    """Prompts in chunks of T: samples of T prompt tokens over a growing prefix."""
    scheduler = rec.engine.scheduler
    for chunk in [t for t in grid.chunk_tokens if t <= budget]:
        prompt_len = min(chunk * grid.chunks_per_prompt, max_len - 2)
        if prompt_len < chunk:
            continue
        scheduler.max_num_batched_tokens = chunk
        try:
            rec.add(prompt_len, 1)
            while rec.engine.has_work():
                rec.step("prefill")
        finally:
            scheduler.max_num_batched_tokens = budget


def profile_decode(rec: StepRecorder, grid: Grid, max_seqs: int, max_len: int) -> None:
    """Per context C, B sequences decoding for B in the grid (sequences added as B grows: their
    prompt chunks beside the running decodes are mixed steps), then the side prompts beside them."""
    engine = rec.engine
    capacity = engine.cache.num_pages * engine.cache.page_size
    per_batch = grid.decode_steps + 4 + len(grid.side_prompts)
    for context in [c for c in grid.contexts if c + 64 < max_len]:
        batches = [b for b in grid.batches if b <= max_seqs and b * context <= grid.max_tokens_per_context]
        max_tokens = min(max_len - context - 1, 4 * len(batches) * per_batch + 64)
        running = 0
        for batch in batches:
            if batch * (context + max_tokens) + max(grid.side_prompts, default=0) + 16 > capacity:
                break  # (+16: a side prompt's page rounding) no preemption while profiling
            for _ in range(batch - running):
                rec.add(context, max_tokens)
            running = batch
            while engine.scheduler.waiting:
                rec.step("mixed")
            for _ in range(grid.decode_steps):
                rec.step("decode")
            for prompt_len in [n for n in grid.side_prompts if n + 1 < max_len and batch < max_seqs]:
                rec.add(prompt_len, 1)  # its first token ends it: B decodes again after
                while engine.scheduler.waiting:
                    rec.step("mixed")
        rec.drain()


def run_profile(config: Config, grid: Grid = Grid(), engine_and_info: tuple[Any, dict] | None = None) -> dict:
    """Profile CONFIG's instance over ``grid`` and fit the step-time model.

    Args:
        config: the deployment (its instance: model, dtype, cache, scheduler budgets, device).
        grid: the shapes to time (`SMALL_GRID` for a quick CPU run).
        engine_and_info: an engine already built (`build_engine`), else built here.

    Returns:
        The profile (module docstring; `save_profile` writes it).
    """
    from disagg.cluster.bench.report import device_info, git_commit

    started = time.perf_counter()
    engine, info = engine_and_info or build_engine(config)
    budget, max_seqs = engine.scheduler.max_num_batched_tokens, engine.max_num_seqs
    max_len = min(config.model.max_model_len or engine.max_model_len, engine.max_model_len)
    served_async, engine.async_scheduling = engine.async_scheduling, False  # one step(): one forward
    rec = StepRecorder(engine)
    profile_prefill(rec, grid, budget, max_len)
    profile_decode(rec, grid, max_seqs, max_len)
    samples = [tuple(s[:5]) for s in rec.samples]
    model = StepTimeModel.from_samples(samples)
    device = dict(device_info(), torch_device=str(engine.model.device))
    tp = getattr(engine.model, "tp", None)
    tensor_parallel, tp_backend = (1, None) if tp is None or tp.size == 1 else (tp.size, tp.backend)
    return {
        "kind": PROFILE_KIND, "version": PROFILE_VERSION,
        "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S"),
        "config_path": config.path, "model": config.model.source, "model_name": info.get("model_name"),
        "tensor_parallel": tensor_parallel, "tp_backend": tp_backend,
        "dtype": str(engine.model.dtype).removeprefix("torch."), "kv_dtype": info["geometry"]["kv_dtype"],
        "device": device, "commit": git_commit(),
        "engine": {"num_pages": engine.cache.num_pages, "page_size": engine.cache.page_size,
                   "max_num_seqs": max_seqs, "max_num_batched_tokens": budget, "max_model_len": max_len,
                   "kv_bytes_per_token": int(engine.token_bytes), "vocab_size": int(info["vocab_size"]),
                   "eos_token_ids": info["eos_token_ids"],
                   "async_scheduling": bool(served_async), "cuda_graphs": config.scheduler.cuda_graphs,
                   "num_layers": config.model.num_layers,  # these two: `disagg plan`'s YAML, as profiled
                   "kv_pages_from": _pages_sized_from(config, str(engine.model.device))},
        "grid": asdict(grid),
        "sample_fields": SAMPLE_FIELDS,
        "samples": rec.samples,
        "fit": model.to_dict(),
        "errors": model.errors_by_region(samples),
        "wall_s": time.perf_counter() - started,
    }


def _pages_sized_from(config: Config, device: str) -> str:
    """How the instance's pages were sized (`engines.describe`): by its config's ``cache.num_pages``
    or ``cache.kv_bytes``, by the GPU's memory left after the weights and activations, or the
    CPU's fixed budget; `derive` keeps the first, the bytes of the second and fourth, and
    rescales the third."""
    if config.cache.num_pages is not None:
        return "num_pages"
    if config.cache.kv_bytes is not None:
        return "kv_bytes"
    return "gpu_memory" if device.startswith("cuda") else "cpu_default"


def save_profile(profile: dict, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile, indent=1) + "\n")
    return path


def load_profile(path: str | Path, warn_older: bool = True, base_only: bool = False) -> dict:
    """Read a profile written by `disagg profile` (an older version's: with a warning naming
    `--refit`, unless ``warn_older`` is False). One without pages (a model scaled past its GPU by
    `--num-layers`) only with ``base_only`` (what `--derive` reads).

    Raises:
        ValueError: not a readable JSON profile (the message names the file and what is wrong).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ValueError(f"--profile: cannot read {str(path)!r} as JSON ({err})") from None
    if not isinstance(data, dict) or data.get("kind") != PROFILE_KIND:
        raise ValueError(f"--profile: expected a profile written by `disagg profile` (kind {PROFILE_KIND!r}), "
                         f"got {str(path)!r} with kind {data.get('kind') if isinstance(data, dict) else None!r}")
    for key in ("fit", "engine"):
        if key not in data:
            raise ValueError(f"--profile: {str(path)!r} has no {key!r} section")
    StepTimeModel.from_dict(data["fit"])  # raises naming a bad coefficient
    tp = data.get("tensor_parallel", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"--profile: {str(path)!r} has tensor_parallel {tp!r}, expected an integer >= 1 "
                         "(the ranks of the profiled instance)")
    if not base_only and int(data["engine"].get("num_pages", 1)) < 1:
        raise ValueError(f"--profile: {str(path)!r} holds no pages ({data.get('model')} does not fit its GPU at "
                         f"TP {tp}): derive a TP that fits, `disagg profile --derive {path} --tensor-parallel K`")
    if warn_older and data.get("version", 1) < PROFILE_VERSION:
        logger.warning("%s: a version %s profile; its fit lacks the attention-pair, mixed-step and "
                       "knee terms (prompt and mixed steps ~25%% off): `disagg profile --refit %s --out NEW.json` refits "
                       "it from its samples", path, data.get("version", 1), path)
    return data


def profile_tensor_parallel(profile: dict) -> int:
    """The ranks of the instance ``profile`` timed (a profile without the field timed one)."""
    return int(profile.get("tensor_parallel", 1))


def instance_tensor_parallel(config: Config) -> int:
    """The ranks of each of CONFIG's instances (`InstancesSection.tensor_parallel_of` of the roles
    it runs): what `disagg profile` times and a profile must match.

    Raises:
        ValueError: the roles run at different TPs (one profile is one TP: profile each).
    """
    inst = config.instances
    degrees = {role: inst.tensor_parallel_of(role) for role in ("prefill", "decode", "colocated")
               if getattr(inst, role)}
    if len(set(degrees.values())) > 1:
        raise ValueError(f"instances.tensor_parallel: a profile times one TP, this config runs "
                         f"{', '.join(f'{role} at TP {tp}' for role, tp in degrees.items())}: profile each "
                         f"TP apart (--set instances.tensor_parallel=N)")
    return next(iter(degrees.values()), 1)


def check_profile_tensor_parallel(profile: dict, config: Config) -> None:
    """Refuse a profile timed at another TP than CONFIG's instances run: its step times are
    another instance's (a TP-k step all-reduces over k ranks, on a k-th of the heads).

    Raises:
        ValueError: the TPs differ (the message names both and how to get a matching profile).
    """
    want, got = instance_tensor_parallel(config), profile_tensor_parallel(profile)
    if want != got:
        raise ValueError(f"--profile: the profile timed an instance of tensor_parallel {got}, the config's "
                         f"instances run at tensor_parallel {want}: profile the config's instance "
                         f"(`disagg profile CONFIG`) or give a profile of TP {want}")


def replayed_prompt_pairs(profile: dict) -> list[int]:
    """The attention pairs (`prompt_pairs`) of each sample of ``profile`` from its prompt tokens
    alone (a version 1 profile kept no pairs): its prompts replayed in the order `profile_prefill`
    and `profile_decode` added them, the scheduler's chunks taken first come, first served. A
    prefill prompt is ``chunks_per_prompt`` x its first chunk (at most max_model_len - 2); a
    decode context's prompts are as long as its first step's prompt tokens; after each B x C's
    decode steps come the grid's side prompts (none in a version 1 grid), which end at once.

    Raises:
        ValueError: the samples are not such a replay (a prompt's end does not add a decoding
            sequence to the next step); re-run `disagg profile`.
    """
    from disagg.engine.steps import prompt_pairs

    grid, engine = profile.get("grid") or {}, profile["engine"]
    per_prompt, max_len = grid.get("chunks_per_prompt", Grid.chunks_per_prompt), engine["max_model_len"]
    queue: collections.deque[list[int]] = collections.deque()
    out, context_len, expected_seqs, sides = [], 0, None, []
    for prompt, seqs, _, _, scenario in profile["samples"]:
        if scenario == "mixed" and seqs == 0 and not queue:
            context_len = prompt  # a new decode context: its first prompt in one chunk
        elif expected_seqs is not None and scenario != "prefill" and seqs not in (0, expected_seqs):
            raise ValueError(f"a profile whose samples do not replay (a step of {seqs} decoding sequences, "
                             f"{expected_seqs} expected): re-run `disagg profile`")
        if scenario == "decode":
            sides = [n for n in grid.get("side_prompts", ()) if n + 1 < max_len and seqs < engine["max_num_seqs"]]
        pairs, left, ended = 0, prompt, 0
        while left > 0:
            if not queue:  # the next prompt added: [length, computed, decodes after]
                queue.append([min(per_prompt * prompt, max_len - 2), 0, 0] if scenario == "prefill"
                             else [sides.pop(0), 0, 0] if sides else [context_len, 0, 1])
            head = queue[0]
            n = min(head[0] - head[1], left)
            pairs, head[1], left = pairs + prompt_pairs(head[1], n), head[1] + n, left - n
            if head[1] == head[0]:
                ended += queue.popleft()[2]
        expected_seqs = None if scenario == "prefill" else seqs + ended
        out.append(pairs)
    return out


def refit_profile(profile: dict, served: Sequence[list] = (), served_from: str | None = None) -> dict:
    """``profile`` with the current model fitted to its samples (a version 1 profile's samples
    gain their `replayed_prompt_pairs`) and to ``served`` samples (`served_samples`: steps a
    serving fleet ran, scenario "served"); the fit and errors it had are kept under ``refit``."""
    if profile.get("derived"):
        raise ValueError(f"a derived profile ({profile['derived']['how']}): its samples are the base's steps, "
                         f"not its own; refit the base profile ({profile['derived']['from']['profile']}) and "
                         f"derive again")
    samples = profile["samples"]
    if profile.get("version", 1) < 2:
        samples = [s[:3] + [pairs] + s[3:] for s, pairs in zip(samples, replayed_prompt_pairs(profile))]
    samples = list(samples) + [list(s) for s in served]
    fitted = [tuple(s[:5]) for s in samples]
    model = StepTimeModel.from_samples(fitted)
    refit = {"version": profile.get("version", 1), "fit": profile["fit"], "errors": profile["errors"],
             "date": datetime.now(timezone.utc).strftime("%Y%m%d-%H%M%S")}
    if served:
        refit.update(served_steps=len(served), served_from=served_from)
    return dict(profile, version=PROFILE_VERSION, sample_fields=SAMPLE_FIELDS, samples=samples,
                fit=model.to_dict(), errors=model.errors_by_region(fitted), refit=refit)


def served_samples(trace_dir: str, instances: Sequence[str] | None = None) -> list[list]:
    """The steps a serving fleet ran, from the "step" records of a `DISAGG_TRACE_DIR`
    (`disagg.trace`; every instance's, or those named): profile samples of scenario "served",
    timed by the step loop as served (async scheduling, CUDA graphs, the router's calls between
    steps), where the grid times an idle engine one forward at a time. A record written before
    records carried ``num_prompt_pairs`` counts each of its prompts as one chunk from position 0
    (``n x (p/n)^2 / 2``): a lower bound where a chunk continued a prompt.

    Raises:
        ValueError: the directory holds no step record (of the instances named).
    """
    from disagg import trace
    from disagg.engine.steps import prompt_pairs

    out = []
    if not Path(trace_dir).is_dir():
        raise ValueError(f"--served-steps: expected a DISAGG_TRACE_DIR directory, got {trace_dir} (not one)")
    for r in trace.read_records(trace_dir, "step"):
        if instances and r.get("instance") not in instances:
            continue
        prompt, n = int(r["num_prefill_tokens"]), max(1, int(r.get("num_prompts") or 1))
        pairs = r.get("num_prompt_pairs")
        if pairs is None:
            pairs = n * prompt_pairs(0, prompt // n)
        seconds = float(r["t_end"]) - float(r["t_start"])
        if seconds > 0:
            out.append([prompt, int(r["num_decode_seqs"]), int(r["num_context_tokens"]), float(pairs), seconds,
                        "served"])
    if not out:
        raise ValueError(f"--served-steps: no step records{' of ' + ', '.join(instances) if instances else ''} in "
                         f"{trace_dir} (write them with DISAGG_TRACE_DIR set while serving)")
    return out


def summary_lines(profile: dict) -> list[str]:
    """What `disagg profile` prints: the fit and its error per region."""
    model = StepTimeModel.from_dict(profile["fit"])
    coef, knee = model.coef, model.knee_tokens
    tp = profile_tensor_parallel(profile)
    at = f" at tensor_parallel {tp} ({profile.get('tp_backend')})" if tp > 1 else ""
    record = profile.get("derived")
    if record and profile.get("num_layers_timed"):  # `disagg profile --num-layers N`: timed here, scaled
        head = (f"{profile['model']} ({profile['dtype']}){at} on {profile['device'].get('torch_device')}: "
                f"{len(profile['samples'])} steps timed in {profile['wall_s']:.1f} s, {record['how']}")
    elif record:
        head = (f"{profile['model']} ({profile['dtype']}) at tensor_parallel {tp}: derived from "
                f"{record['from']['model']} at TP {record['from']['tensor_parallel']} ({record['from']['profile']})")
    else:
        head = (f"{profile['model']} ({profile['dtype']}){at} on {profile['device'].get('torch_device')}: "
                f"{len(profile['samples'])} steps timed in {profile['wall_s']:.1f} s")
    lines = [head,
             f"step_s = ({coef[4]:.3e} with prompt tokens, else {coef[0]:.3e}) + {coef[1]:.3e} * prompt_tokens "
             f"+ {coef[8]:.3e} * max(prompt_tokens - {knee}, 0) + {coef[5]:.3e} * prompt_pairs "
             f"+ {coef[2]:.3e} * decode_seqs + {coef[3]:.3e} * context_tokens "
             f"+ (with prompt tokens: {coef[6]:.3e} if decodes + {coef[7]:.3e} * context_tokens)"]
    for region, err in profile["errors"].items():
        rms = "-" if err["rms_rel_error"] is None else f"{100 * err['rms_rel_error']:.1f}%"
        line = f"  {region:8s} {err['num_samples']:5d} steps, relative RMS error {rms}"
        if err.get("num_outliers"):
            rest = err["rms_rel_error_without_outliers"]
            line += (f" ({'-' if rest is None else f'{100 * rest:.1f}%'} without the {err['num_outliers']} "
                     f"outside 1/{OUTLIER_RATIO:g}-{OUTLIER_RATIO:g}x the fit, not fitted)")
        lines.append(line)
    if record:
        from disagg.cluster.simulate.derive import provenance_lines

        lines += ["  (those errors: of the fit as timed, before it was derived)"] + provenance_lines(profile)
    return lines
