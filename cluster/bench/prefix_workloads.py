"""Seeded workloads whose prompts share prefixes, for prefix caching (`disagg.cluster.bench.workloads`).

shared-prefix  SGLang's ``generated-shared-prefix`` shape (``bench_serving.py``: groups of
               requests that share one long system prompt, each with its own question): groups
               of PROMPTS_PER_GROUP requests; the system prompt is ``input_len`` tokens (default
               2048), each question QUESTION_LEN (128) tokens, outputs ``output_len`` (default
               128) within the range ratio. Requests of all groups are shuffled together (seeded),
               so a cache must hold several system prompts at once.
multi-turn     conversations of TURNS turns; turn k's prompt resends the conversation so far:
               every earlier user message (``input_len`` tokens each, default 256, within the
               range ratio) and a stand-in for every earlier answer (``output_len`` tokens, the
               length the server is held to), then the new message. The stand-in answers are
               drawn tokens, not what the server generated (the workload is fixed before the
               run), so a cache can hit the previous turn's prompt and the drawn answers it
               already saw, never the server's own output. Turn k of every conversation comes
               before turn k + 1 of any, so turns of one conversation arrive apart in time.

Every prompt is clipped to fit ``max_model_len`` with its output, like the other datasets (a
clipped prompt keeps its shared prefix: clipping cuts the end). Pure Python + numpy.
"""

from __future__ import annotations

import math

import numpy as np

PROMPTS_PER_GROUP = 16  # SGLang's --gsp-prompts-per-group default
QUESTION_LEN = 128  # SGLang's --gsp-question-len default
TURNS = 4


def _lengths(rng: np.random.Generator, mean: int, ratio: float, n: int) -> list[int]:
    """vLLM's uniform bounds around ``mean`` (as `workloads._uniform_around`), at least 1."""
    low = max(1, math.floor(mean * (1.0 - ratio)))
    high = max(low, math.ceil(mean * (1.0 + ratio)))
    return rng.integers(low, high + 1, size=n).tolist()


def shared_prefix(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
                  rng: np.random.Generator, allowed: np.ndarray) -> list[tuple[list[int], int]]:
    """``(prompt, output_len)`` per request: groups sharing a system prompt, shuffled together.

    Args:
        num_prompts: requests (the last group may be smaller).
        input_len: tokens of each group's system prompt.
        output_len, range_ratio: output lengths, uniform within the ratio.
        rng: the workload's generator. allowed: ``[V]`` token ids a prompt may hold.
    """
    num_groups = -(-num_prompts // PROMPTS_PER_GROUP)
    systems = [allowed[rng.integers(0, len(allowed), size=input_len)].tolist() for _ in range(num_groups)]
    outputs = _lengths(rng, output_len, range_ratio, num_prompts)
    out = []
    for index in range(num_prompts):
        question = allowed[rng.integers(0, len(allowed), size=QUESTION_LEN)].tolist()
        out.append((systems[index // PROMPTS_PER_GROUP] + question, outputs[index]))
    order = rng.permutation(num_prompts).tolist()
    return [out[i] for i in order]


def multi_turn(num_prompts: int, input_len: int, output_len: int, range_ratio: float,
               rng: np.random.Generator, allowed: np.ndarray) -> list[tuple[list[int], int]]:
    """``(prompt, output_len)`` per request: turn after turn of conversations that resend themselves.

    Args: as `shared_prefix` (``input_len``: tokens per user message).
    """
    num_convs = -(-num_prompts // TURNS)
    history: list[list[int]] = [[] for _ in range(num_convs)]
    out = []
    for _turn in range(TURNS):
        messages = _lengths(rng, input_len, range_ratio, num_convs)
        answers = _lengths(rng, output_len, range_ratio, num_convs)
        for conv in range(num_convs):
            if len(out) == num_prompts:
                return out
            history[conv] += allowed[rng.integers(0, len(allowed), size=messages[conv])].tolist()
            out.append((list(history[conv]), answers[conv]))
            history[conv] += allowed[rng.integers(0, len(allowed), size=answers[conv])].tolist()
    return out
