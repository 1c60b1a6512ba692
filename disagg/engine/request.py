"""A request inside an engine, what a step hands back, and what a decode reservation returns.

`Request` is the engine-side state of one generation (tokens, how many of them have KV in the
cache, sampling and stopping rules, its `RequestState` in the pipeline and the transitions
between them). `TokenOutput` is one token of one request in a step's
output list. `check_new_request` is the `add`-time validation every engine runs before touching a
page (`check_dest`, `check_reserve`: a pushed request's destination, a decode reservation).
`RecvDest` (what `DecodeEngine.reserve` returns and `PrefillEngine.add` takes: where the prompt's
KV must land) and `PushState` (what `PrefillEngine.abort` says about the aborted request's pushes)
are the KV connector's (`disagg.transfer.connector`), importable from here. Used by every engine
process.

The token life of a request (vLLM v1's "num_computed_tokens" view, no prefill/decode flag):

    token_ids:  [ prompt ............................ | output ........ ]
                  <- num_computed (KV in the cache) -> <- to compute ->

A forward computes ``token_ids[num_computed : num_computed + n]``; when that reaches the end of
``token_ids`` the last logits row is sampled and the token appended. A decode is simply "one
token to compute". Preemption resets ``num_computed`` to 0 (recompute prompt + output).
"""

from __future__ import annotations

import enum
import itertools
import random
from dataclasses import dataclass
from typing import Hashable, NamedTuple

from disagg import posmap
from disagg.errors import InvalidArgument, InvalidArgumentType
from disagg.sampling import SamplingParams
from disagg.transfer.connector import PushState, RecvDest  # the connector's; re-exported here

__all__ = ["FINISH_REASONS", "PushState", "RecvDest", "Request", "RequestFactory", "RequestState", "TokenOutput", "check_dest",
           "check_fits", "check_new_id", "check_new_request", "check_reserve", "pages_for"]

FINISH_REASONS = (None, "stop", "length", "abort", "error")


class TokenOutput(NamedTuple):
    """One token (or the end) of one request, in a step's output list.

    Attributes:
        request_id: the caller's id.
        token_id: the sampled token; None when the request ended without one (abort, error).
        finished: True on the request's last output.
        finish_reason: None while running, else "stop", "length", "abort" or "error".
        error: the message when finish_reason is "error".
    """

    request_id: Hashable
    token_id: int | None
    finished: bool
    finish_reason: str | None
    error: str | None = None


class RequestState(enum.Enum):
    """Where a request is in its engine's pipeline; `Request`'s transitions move it.

        WAITING --enter_cache--> PREFILLING --start_decoding--> DECODING
                                      |                            |
                                start_sending                leave_cache (preempted or ended)
                                      v                            v
                                   PUSHING                      WAITING
        (new, reserve) --receive--> RECEIVING --start_decoding--> DECODING

    WAITING: queued with no pages (new, or preempted: recomputed once it enters again).
    PREFILLING: in the cache, its prompt (or, after a preemption, prompt and output) computed in
    chunks. PUSHING: a pushed request in the cache whose send map is marked: its chunks' KV go
    to its ``dest``; it leaves after its first token. RECEIVING: a received request, pages
    reserved for a sender's push; it decodes once its KV landed, its first token came and a
    batch slot is free. DECODING: in the running batch, one token per step. Any state in the
    cache returns to WAITING when its pages are freed (`leave_cache`: preempted, or ended).
    """

    WAITING = "waiting"
    PREFILLING = "prefilling"
    PUSHING = "pushing"
    RECEIVING = "receiving"
    DECODING = "decoding"


_IN_CACHE = frozenset({RequestState.PREFILLING, RequestState.PUSHING, RequestState.RECEIVING,
                       RequestState.DECODING})


@dataclass
class Request:
    """Engine-side state of one request; see the module docstring for the token layout.

    ``state`` (`RequestState`) changes only through the transitions below; ``in_cache``,
    ``decoding`` and ``sending`` are read from it. ``dest`` (pushed) and ``received`` say what
    kind of request it is, fixed when it is made (``received`` by `receive`).
    """

    request_id: Hashable
    seq_id: int
    token_ids: list[int]
    num_prompt_tokens: int
    params: SamplingParams
    seed: int
    stop_ids: frozenset[int]
    num_computed: int = 0
    finish_reason: str | None = None
    state: RequestState = RequestState.WAITING
    dest: RecvDest | None = None  # pushed: its prompt's KV goes to this reservation, then it leaves
    received: bool = False  # its prompt's KV arrives from a sender into pages reserved here
    committed_pages: int = 0  # pages promised for its whole stay here (pushed, received); 0: none
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache when it entered the cache
    num_preemptions: int = 0  # times its pages were freed for it to recompute (vLLM's Request.num_preemptions)
    prompt_known: bool = True  # False: a reservation made without the prompt's ids (placeholders)

    # ------------------------------------------------------------------ read from the state
    @property
    def in_cache(self) -> bool:
        """Its sequence is in the cache (pages held)."""
        return self.state in _IN_CACHE

    @property
    def decoding(self) -> bool:
        """In the running batch."""
        return self.state is RequestState.DECODING

    @property
    def sending(self) -> bool:
        """Pushed, and its send map is marked in the cache."""
        return self.state is RequestState.PUSHING

    # ------------------------------------------------------------------ transitions
    def _move(self, allowed: frozenset[RequestState], to: RequestState) -> None:
        assert self.state in allowed, f"request {self.request_id!r}: {self.state.name} -> {to.name} is no transition"
        self.state = to

    def enter_cache(self, num_cached_tokens: int) -> None:
        """WAITING -> PREFILLING: its sequence entered the cache, its first ``num_cached_tokens``
        found there (they count as computed)."""
        self._move(_FROM_WAITING, RequestState.PREFILLING)
        self.num_computed = self.num_cached_tokens = num_cached_tokens

    def start_sending(self) -> None:
        """PREFILLING -> PUSHING: a pushed request's send map is marked (its first forward)."""
        assert self.dest is not None, f"request {self.request_id!r}: only a pushed request sends"
        self._move(_FROM_PREFILLING, RequestState.PUSHING)

    def receive(self, num_computed: int, num_cached_tokens: int, committed_pages: int, prompt_known: bool) -> None:
        """WAITING -> RECEIVING: pages reserved here for a sender's push of its prompt."""
        self._move(_FROM_WAITING, RequestState.RECEIVING)
        self.received, self.committed_pages, self.prompt_known = True, committed_pages, prompt_known
        self.num_computed, self.num_cached_tokens = num_computed, num_cached_tokens

    def start_decoding(self) -> None:
        """PREFILLING or RECEIVING -> DECODING: it joins the running batch."""
        self._move(_TO_DECODING, RequestState.DECODING)

    def leave_cache(self) -> None:
        """Any state -> WAITING: its pages are freed (preempted: it recomputes from token 0; or ended)."""
        self.state = RequestState.WAITING
        self.num_computed = 0

    @property
    def preemptible(self) -> bool:
        """Only a request computed and decoded here can be preempted (freed and recomputed): a
        received one has no prompt ids to recompute, a pushed one has a sender's promise to keep."""
        return self.dest is None and not self.received

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def num_to_compute(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    def append(self, token_id: int, max_model_len: int) -> TokenOutput:
        """Append a sampled token, decide whether the request is done, and report it."""
        token_ids = self.token_ids
        token_ids.append(token_id)
        num_tokens = len(token_ids)
        if token_id in self.stop_ids:
            self.finish_reason = "stop"
        elif num_tokens - self.num_prompt_tokens >= self.params.max_tokens or num_tokens >= max_model_len:
            self.finish_reason = "length"
        return TokenOutput(self.request_id, token_id, self.finish_reason is not None, self.finish_reason)


_FROM_WAITING = frozenset({RequestState.WAITING})
_FROM_PREFILLING = frozenset({RequestState.PREFILLING})
_TO_DECODING = frozenset({RequestState.PREFILLING, RequestState.RECEIVING})


class RequestFactory:
    """Gives requests cache sequence ids (ints, never reused) and seeds (when params have none)."""

    def __init__(self, eos_token_ids: tuple[int, ...], seed: int = 0) -> None:
        self._eos = frozenset(int(t) for t in eos_token_ids)
        self._seq_ids = itertools.count()
        self._rng = random.Random(seed)

    def new(self, request_id: Hashable, token_ids: list[int], params: SamplingParams,
            num_prompt_tokens: int | None = None) -> Request:
        stop = frozenset(params.stop_token_ids) | (frozenset() if params.ignore_eos else self._eos)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(62)
        return Request(request_id, next(self._seq_ids), list(token_ids),
                       len(token_ids) if num_prompt_tokens is None else num_prompt_tokens,
                       params, seed, stop)


def check_new_id(request_id: Hashable, known: object) -> None:
    """``request_id`` is hashable and not among ``known`` (an `add` or a `reserve`).

    Raises:
        TypeError: an unhashable id. ValueError: an id the engine already has.
    """
    try:
        duplicate = request_id in known  # type: ignore[operator]
    except TypeError:
        raise InvalidArgumentType(f"request_id: expected a hashable id, got {type(request_id).__name__}",
                                  argument="request_id") from None
    if duplicate:
        raise InvalidArgument(f"request_id: {request_id!r} is already in this engine; expected a new id",
                              argument="request_id")


def check_new_request(request_id: Hashable, prompt_token_ids: object, params: object, *,
                      known: object, vocab_size: int, max_model_len: int) -> list[int]:
    """Validate an `add` before anything changes; return the prompt as a list of ints.

    Raises:
        ValueError / TypeError: duplicate or unhashable id, empty prompt or bad token ids,
            prompt not shorter than the model's context, bad sampling values.
    """
    check_new_id(request_id, known)
    if not isinstance(params, SamplingParams):
        raise InvalidArgumentType(f"params: expected SamplingParams, got {type(params).__name__}", argument="params")
    params.validate(vocab_size)
    try:
        prompt = [int(t) for t in prompt_token_ids]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise InvalidArgumentType(f"prompt_token_ids: expected a sequence of ints, got "
                                  f"{type(prompt_token_ids).__name__}", argument="prompt_token_ids") from None
    if not prompt:
        raise InvalidArgument(f"prompt_token_ids: request {request_id!r}: expected at least 1 token, got 0",
                              argument="prompt_token_ids")
    bad = [t for t in prompt if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(f"prompt_token_ids: request {request_id!r}: expected ids in [0, {vocab_size}), "
                              f"got {bad[:4]}", argument="prompt_token_ids")
    if len(prompt) >= max_model_len:
        raise InvalidArgument(f"prompt_token_ids: request {request_id!r} has {len(prompt)} tokens; the model's "
                              f"context is {max_model_len}, so expected at most {max_model_len - 1}",
                              argument="prompt_token_ids")
    return prompt


def pages_for(num_tokens: int, page_size: int) -> int:
    """Pages that hold ``num_tokens`` tokens."""
    return -(-num_tokens // page_size)


def check_fits(request_id: Hashable, num_prompt_tokens: int, params: SamplingParams, *,
               max_model_len: int, num_pages: int, page_size: int) -> None:
    """Refuse a request that could never fit the cache alone (prompt plus every output token).

    Raises:
        ValueError: naming max_tokens / the prompt length and the pages it would need.
    """
    longest = min(num_prompt_tokens + params.max_tokens, max_model_len)
    need = pages_for(longest, page_size)
    if need > num_pages:
        raise InvalidArgument(f"max_tokens: request {request_id!r} ({num_prompt_tokens} prompt tokens + "
                              f"max_tokens={params.max_tokens}) needs {need} pages of {page_size} tokens; "
                              f"expected at most the cache's {num_pages}", argument="max_tokens")


def check_dest(request_id: Hashable, prompt_len: int, dest: object, connector) -> None:
    """A pushed request's ``dest`` against this engine's KV connector and the prompt's length.

    Raises:
        ValueError / TypeError: no connector, not a RecvDest, another request's, a receiver the
            connector cannot send to (`KVConnector.check_dest`; as many receiver ranks as this
            instance has: `KVConnector.local_dest`), a cached length outside
            ``[0, prompt_len)``, or a map not of ``prompt_len - num_cached_tokens`` slots.
    """
    if connector is None:
        raise InvalidArgument(f"dest: request {request_id!r}: this engine has no symmetric heap, so it cannot "
                              f"push KV; expected dest=None", argument="dest")
    if not isinstance(dest, RecvDest):
        raise InvalidArgumentType(f"dest: expected the RecvDest from DecodeEngine.reserve, got "
                                  f"{type(dest).__name__}", argument="dest")
    if dest.request_id != request_id:
        raise InvalidArgument(f"dest: reserved for request {dest.request_id!r}, got request {request_id!r}",
                              argument="dest")
    connector.check_dest(request_id, connector.local_dest(dest))
    cached = dest.num_cached_tokens
    if isinstance(cached, bool) or not isinstance(cached, int) or not 0 <= cached < prompt_len:
        raise InvalidArgument(f"dest.num_cached_tokens: request {request_id!r} has {prompt_len} prompt "
                              f"tokens; expected an int in [0, {prompt_len}), got {cached!r}",
                              argument="dest.num_cached_tokens")
    num_slots = len(posmap.decompress(dest.cmap))
    if num_slots != prompt_len - cached:
        raise InvalidArgument(f"dest.cmap: request {request_id!r} has {prompt_len} prompt tokens, "
                              f"{cached} of them cached on the receiver; expected a map of "
                              f"{prompt_len - cached} slots, got {num_slots}", argument="dest.cmap")


def check_reserve(request_id: Hashable, prompt_len: object, params: object, prompt_token_ids: object, *,
                  known: object, vocab_size: int, max_model_len: int, num_pages: int, page_size: int) -> None:
    """A decode reservation's arguments (`DecodeEngine.reserve`), before anything changes.

    Raises:
        ValueError / TypeError: duplicate or unhashable id, a length outside the context, bad
            params, more pages than the cache holds, or prompt ids that are not ``prompt_len``
            ints. The ids' values are the sender's to check (`check_new_request` on the prefill
            side): here they are only matched against the cache, where no bad id is ever held.
    """
    check_new_id(request_id, known)
    if isinstance(prompt_len, bool) or not isinstance(prompt_len, int):
        raise InvalidArgumentType(f"prompt_len: expected an int, got {type(prompt_len).__name__}",
                                  argument="prompt_len")
    if not 1 <= prompt_len < max_model_len:
        raise InvalidArgument(f"prompt_len: request {request_id!r}: expected 1..{max_model_len - 1} "
                              f"(the model's context is {max_model_len}), got {prompt_len}", argument="prompt_len")
    if not isinstance(params, SamplingParams):
        raise InvalidArgumentType(f"params: expected SamplingParams, got {type(params).__name__}", argument="params")
    params.validate(vocab_size)
    need = pages_for(min(prompt_len + params.max_tokens, max_model_len), page_size)
    if need > num_pages:
        raise InvalidArgument(f"max_tokens: request {request_id!r} (prompt {prompt_len} + max_tokens "
                              f"{params.max_tokens}) needs {need} pages; expected at most the cache's "
                              f"{num_pages}", argument="max_tokens")
    if prompt_token_ids is None:
        return
    try:
        prompt = [int(t) for t in prompt_token_ids]  # type: ignore[union-attr]
    except (TypeError, ValueError):
        raise InvalidArgumentType(f"prompt_token_ids: expected a sequence of ints, got "
                                  f"{type(prompt_token_ids).__name__}", argument="prompt_token_ids") from None
    if len(prompt) != prompt_len:
        raise InvalidArgument(f"prompt_token_ids: request {request_id!r}: expected {prompt_len} ids (prompt_len), "
                              f"got {len(prompt)}", argument="prompt_token_ids")
