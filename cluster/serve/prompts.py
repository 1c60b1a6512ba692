"""From a validated OpenAI request to what the cluster runs: prompt token ids and `SamplingParams`.

`prepare_completion` / `prepare_chat` tokenize the prompt (chat: through the tokenizer's chat
template), check it against the context limit, and translate OpenAI's sampling fields; every
refusal is an `APIError` (400, or 404 for an unknown model) naming the field. Text longer than
`ModelLimits.max_prompt_chars` is refused before it is tokenized: a token never covers more than
`MAX_CHARS_PER_TOKEN` characters, so such text cannot fit the context. `app.py` runs these in a
worker thread (tokenizing megabytes takes seconds and must not stall the event loop), before the
request reaches the cluster, so a refused request costs no page.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from disagg.cluster.serve.errors import APIError, bad_request
from disagg.cluster.serve.protocol import ChatCompletionRequest, CompletionRequest, SamplingFields
from disagg.sampling import SamplingParams

logger = logging.getLogger(__name__)

DEFAULT_TEMPERATURE = 1.0  # OpenAI's default when a request gives none
# Characters one token covers at most. Byte-level BPE and SentencePiece tokens of the served
# vocabularies are at most a few dozen characters (runs of spaces or '=' the longest); text
# averages ~4. Only normalizers that delete characters could break this bound, on garbage input.
MAX_CHARS_PER_TOKEN = 64


@dataclass
class PreparedRequest:
    """What one HTTP request asks the cluster to run.

    Attributes:
        prompt_token_ids: the prompt, tokenized.
        params: sampling and stopping rules (stop token ids included).
        stop_strings: strings that end the output, matched on its text by the server.
        text_stop_ids: token ids whose text is left out when they end the output (EOS, stop ids).
    """

    prompt_token_ids: list[int]
    params: SamplingParams
    stop_strings: tuple[str, ...] = ()
    text_stop_ids: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True)
class ModelLimits:
    """What the served model accepts: context length, vocabulary, tokenizer, default max_tokens."""

    name: str
    max_model_len: int
    tokenizer: Any | None
    vocab_size: int | None = None
    max_tokens_default: int = 256

    @property
    def max_prompt_chars(self) -> int:
        """Characters of text beyond which a prompt cannot fit the context, whatever it says."""
        return self.max_model_len * MAX_CHARS_PER_TOKEN


def prepare_completion(request: CompletionRequest, limits: ModelLimits) -> PreparedRequest:
    """Tokenize a /v1/completions prompt (text or token ids) and build its sampling params.

    Raises:
        APIError: 400 naming `prompt`, `stop`, `max_tokens` or a sampling field; 404 naming `model`.
    """
    _check_model(request, limits)
    if isinstance(request.prompt, str):
        if limits.tokenizer is None:
            raise bad_request(f"model '{limits.name}' has no tokenizer, so a text prompt cannot be "
                              "tokenized; send 'prompt' as a list of token ids", "prompt", "no_tokenizer")
        _check_text_length(len(request.prompt), limits, "prompt")
        prompt_ids = list(limits.tokenizer.encode(request.prompt))
    else:
        prompt_ids = list(request.prompt)
        _check_token_ids(prompt_ids, limits, "prompt")
    return _prepare(request, prompt_ids, request.max_tokens, limits, "prompt")


def prepare_chat(request: ChatCompletionRequest, limits: ModelLimits) -> PreparedRequest:
    """Render `messages` through the model's chat template, tokenize, build sampling params.

    Raises:
        APIError: 400 when the model has no tokenizer or no chat template, or a field is bad; 404
            naming `model`.
    """
    _check_model(request, limits)
    if limits.tokenizer is None:
        raise bad_request(f"model '{limits.name}' has no tokenizer, hence no chat template; use "
                          "/v1/completions with a prompt of token ids", "messages", "no_chat_template")
    messages = [{"role": m.role, "content": m.text()} | ({"name": m.name} if m.name else {})
                for m in request.messages]
    # The template copies every message's text into the prompt: their sum bounds it from below.
    _check_text_length(sum(len(m["content"]) for m in messages), limits, "messages")
    try:
        text = limits.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except Exception as err:  # ChatTemplateError, or the template's own jinja errors
        if type(err).__name__ == "ChatTemplateError" and not getattr(limits.tokenizer, "chat_template", None):
            raise bad_request(f"model '{limits.name}' has no chat template ({err}); use /v1/completions",
                              "messages", "no_chat_template") from None
        raise bad_request(f"the chat template of model '{limits.name}' failed on these messages: {err}",
                          "messages") from None
    prompt_ids = list(limits.tokenizer.encode(text, add_special_tokens=False))  # the template wrote BOS
    return _prepare(request, prompt_ids, request.requested_max_tokens(), limits, "messages")


def _check_model(request: SamplingFields, limits: ModelLimits) -> None:
    if request.model is not None and request.model != limits.name:
        raise APIError(404, f"the model '{request.model}' does not exist; this server serves "
                       f"'{limits.name}' (see /v1/models)", param="model", code="model_not_found")


def _check_text_length(num_chars: int, limits: ModelLimits, prompt_field: str) -> None:
    """Refuse text that cannot fit the context, before spending seconds tokenizing it."""
    if num_chars > limits.max_prompt_chars:
        raise bad_request(f"this model's maximum context length is {limits.max_model_len} tokens, but "
                          f"'{prompt_field}' has {num_chars} characters, more than the "
                          f"{limits.max_prompt_chars} ({MAX_CHARS_PER_TOKEN} per token) that could fit; "
                          f"shorten '{prompt_field}'", prompt_field, "context_length_exceeded")


def _prepare(request: SamplingFields, prompt_ids: list[int], max_tokens: int | None,
             limits: ModelLimits, prompt_field: str) -> PreparedRequest:
    if not prompt_ids:
        raise bad_request("the prompt tokenized to no tokens", prompt_field)
    room = limits.max_model_len - len(prompt_ids)
    if room < 1:
        raise bad_request(f"this model's maximum context length is {limits.max_model_len} tokens, but the "
                          f"prompt has {len(prompt_ids)} tokens (no room for one output token); shorten "
                          f"'{prompt_field}'", prompt_field, "context_length_exceeded")
    if max_tokens is None:
        max_tokens = min(limits.max_tokens_default, room)
    elif max_tokens > room:
        raise bad_request(f"this model's maximum context length is {limits.max_model_len} tokens; you "
                          f"requested {len(prompt_ids) + max_tokens} ({len(prompt_ids)} in the prompt, "
                          f"{max_tokens} in max_tokens); lower max_tokens to <= {room} or shorten "
                          f"'{prompt_field}'", "max_tokens", "context_length_exceeded")
    stop_strings, stop_ids = _split_stop(request, limits)
    params = _sampling_params(request, max_tokens, stop_ids, limits)
    text_stop_ids = set(stop_ids)
    if not request.ignore_eos and limits.tokenizer is not None:
        text_stop_ids.update(getattr(limits.tokenizer, "eos_token_ids", ()) or ())
    return PreparedRequest(prompt_ids, params, stop_strings, frozenset(text_stop_ids))


def _split_stop(request: SamplingFields, limits: ModelLimits) -> tuple[tuple[str, ...], tuple[int, ...]]:
    stop = request.stop
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    strings = tuple(s for s in stops if isinstance(s, str))
    ids = tuple(s for s in stops if isinstance(s, int)) + tuple(request.stop_token_ids or ())
    if strings and limits.tokenizer is None:
        raise bad_request(f"model '{limits.name}' has no tokenizer, so stop strings cannot be matched; "
                          "give 'stop' as token ids", "stop")
    _check_token_ids(list(ids), limits, "stop")
    return strings, ids


def _sampling_params(request: SamplingFields, max_tokens: int, stop_ids: tuple[int, ...],
                     limits: ModelLimits) -> SamplingParams:
    temperature = DEFAULT_TEMPERATURE if request.temperature is None else request.temperature
    params = SamplingParams(
        max_tokens=max_tokens, temperature=float(temperature), top_k=request.top_k or 0,
        top_p=1.0 if request.top_p is None else float(request.top_p),
        seed=request.seed, stop_token_ids=stop_ids, ignore_eos=request.ignore_eos)
    try:
        return params.validate(limits.vocab_size)
    except (TypeError, ValueError) as err:
        name = str(err).split(":", 1)[0]
        param = name if name in SamplingParams.field_names() else None
        raise bad_request(f"invalid sampling parameters: {err}", param) from None


def _check_token_ids(ids: list[int], limits: ModelLimits, param: str) -> None:
    bad = [t for t in ids if t < 0 or (limits.vocab_size is not None and t >= limits.vocab_size)]
    if bad:
        bound = f"[0, {limits.vocab_size})" if limits.vocab_size is not None else ">= 0"
        raise bad_request(f"'{param}' has token ids outside the vocabulary {bound}: {bad[:5]}", param)
