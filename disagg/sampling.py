"""`SamplingParams`: how one request picks its tokens and when it stops.

Pure Python (no torch): the router, the CLI and the engines all build or read it. Engines call
`SamplingParams.validate` in `add`/`reserve`, so a bad value is a `ValueError` naming the field,
what was expected and what came, before the request touches a page; nothing is checked inside a
step. The sampler that applies these values on the device is `disagg.engine.sampler`.

Decisions: ``temperature == 0`` is greedy (top-k/top-p/seed ignored); ``top_k == 0`` and
``top_p == 1.0`` mean "no cut"; ``seed=None`` lets the engine draw one per request (the request
still samples the same way whatever batch it lands in); EOS ids come from the model
(`ModelConfig.eos_token_ids`) unless ``ignore_eos``; the token that stops a request is emitted;
``draw_offset`` numbers the first draw as if that many tokens had been drawn before it (a request
continued elsewhere with its streamed tokens in its prompt, `disagg.cluster.routing.migration`,
draws on exactly as an uninterrupted seeded run would).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

MAX_SEED = 2**63 - 1


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling and stopping rules.

    Attributes:
        max_tokens: tokens to generate at most (>= 1), the first one included.
        temperature: 0.0 is greedy; > 0 samples from softmax(logits / temperature).
        top_k: keep the k most likely tokens (0: all).
        top_p: keep the smallest set of tokens whose probability sums to >= top_p (1.0: all).
        seed: per-request seed in [0, 2**63); same seed, same tokens whatever the batch.
        stop_token_ids: token ids that end the request (emitted, finish_reason "stop").
        ignore_eos: do not stop at the model's EOS ids.
        draw_offset: tokens this request already generated before its prompt's end (>= 0): its
            first token is draw number ``draw_offset`` of its seed, not draw 0. Set by migration;
            callers leave it 0. Greedy rows ignore it.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    draw_offset: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int | None = None) -> SamplingParams:
        """Check every field; return self.

        Args:
            vocab_size: the model's vocabulary size; when given, stop ids must be below it and
                top_k at most it (callers that know the model pass it: the engines' `add` and
                `reserve`, the HTTP front end).

        Raises:
            ValueError / TypeError: naming the field, what was expected and what was given.
        """
        _check_int("max_tokens", self.max_tokens, 1)
        _check_float("temperature", self.temperature, 0.0, math.inf, "a finite float >= 0")
        _check_int("top_k", self.top_k, 0)
        if vocab_size is not None and self.top_k > vocab_size:
            raise ValueError(f"top_k: expected at most the model's vocabulary size ({vocab_size} tokens; "
                             f"0 keeps them all), got {self.top_k}")
        _check_float("top_p", self.top_p, 0.0, 1.0, "a float in (0, 1]")
        if self.top_p == 0.0:
            raise ValueError("top_p: expected a float in (0, 1], got 0.0")
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        if not isinstance(self.stop_token_ids, (tuple, list)):
            raise TypeError(f"stop_token_ids: expected a tuple of ints, got "
                            f"{type(self.stop_token_ids).__name__}")
        for token in self.stop_token_ids:
            _check_int("stop_token_ids", token, 0, None if vocab_size is None else vocab_size - 1)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos: expected a bool, got {type(self.ignore_eos).__name__}")
        _check_int("draw_offset", self.draw_offset, 0)
        return self

    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in fields(cls))


def _check_int(name: str, value: object, lo: int, hi: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
    if value < lo or (hi is not None and value > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise ValueError(f"{name}: expected an int {bound}, got {value}")


def _check_float(name: str, value: object, lo: float, hi: float, expected: str) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected {expected}, got {type(value).__name__} {value!r}")
    if not (math.isfinite(value) and lo <= value <= hi):
        raise ValueError(f"{name}: expected {expected}, got {value}")
