"""The OpenAI wire format: request and response models of /v1/completions, /v1/chat/completions, /v1/models.

Field names and shapes follow OpenAI's API (and vLLM's server, `vllm/entrypoints/openai/protocol.py`,
where OpenAI leaves a detail open). Requests reject unknown fields (`extra="forbid"`), so a typo
gets a 400 naming the field instead of being ignored; fields that OpenAI defines but this server
cannot honour are accepted at their neutral value and refused otherwise, naming the field. Two
vLLM extensions are accepted: `top_k`, `ignore_eos`, and `return_token_ids` (the response then
carries `prompt_token_ids` and each choice's `token_ids`). Every text field must be valid Unicode:
a lone UTF-16 surrogate (JSON allows "\\ud800" alone; no tokenizer can encode it) is a 400 naming
the field. Built by `app.py`; pure pydantic.
"""

from __future__ import annotations

import re
import time
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

MAX_STOP_SEQUENCES = 16
_SURROGATE = re.compile("[\ud800-\udfff]")


def _whole_unicode(text: str) -> str:
    """`text` unchanged, or ValueError when it holds a surrogate code point (not encodable as UTF-8).

    json.loads joins a valid surrogate pair into one character, so any surrogate left is lone.
    """
    found = _SURROGATE.search(text)
    if found is not None:
        raise ValueError(f"text must be valid Unicode; got a lone UTF-16 surrogate U+{ord(found.group()):04X} "
                         f"at character {found.start()} (send a character outside the BMP as a surrogate "
                         "pair, or as UTF-8)")
    return text


Text = Annotated[str, AfterValidator(_whole_unicode)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    """`stream_options`: with `include_usage`, the last chunk before `[DONE]` carries the usage."""

    include_usage: bool = False
    continuous_usage_stats: bool = False


def _refuse_unless(value: Any, neutral: tuple, what: str) -> Any:
    if value not in neutral:
        raise ValueError(f"{what} is not supported by this server; expected {neutral[0]!r} or absent, got {value!r}")
    return value


class SamplingFields(_Request):
    """Fields shared by completions and chat: what to sample and when to stop."""

    model: Text | None = Field(None, description="served model name; None: the only model")
    temperature: float | None = Field(None, ge=0.0, le=2.0, description="0 = greedy; default 1.0 as OpenAI")
    top_p: float | None = Field(None, gt=0.0, le=1.0, description="nucleus mass; default 1.0")
    top_k: int | None = Field(None, ge=0, description="vLLM extension; 0 or absent = off")
    seed: int | None = Field(None, description="per-request sampling seed")
    stop: Text | list[Text] | list[int] | None = Field(None, description="stop strings, or stop token ids")
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension: more stop token ids")
    ignore_eos: bool = Field(False, description="vLLM extension: keep generating past EOS")
    n: int = Field(1, description="choices per prompt; only 1")
    stream: bool = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool = Field(False, description="vLLM extension: token ids in the response")
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = Field(None, description="accepted and ignored, as end-user tag")

    @field_validator("n")
    @classmethod
    def _only_one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported (one choice per request); got n={n}")
        return n

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float | None) -> float | None:
        return _refuse_unless(value, (0.0, None), "a non-zero penalty")

    @field_validator("logit_bias")
    @classmethod
    def _no_logit_bias(cls, value: dict | None) -> dict | None:
        return _refuse_unless(value or None, (None,), "logit_bias")

    @field_validator("stop")
    @classmethod
    def _stop_shape(cls, stop: str | list | None) -> str | list | None:
        stops = [stop] if isinstance(stop, str) else (stop or [])
        if len(stops) > MAX_STOP_SEQUENCES:
            raise ValueError(f"at most {MAX_STOP_SEQUENCES} stop sequences; got {len(stops)}")
        if any(isinstance(s, str) and not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        return stop

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, options: StreamOptions | None, info) -> StreamOptions | None:
        if options is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed with stream=true")
        return options

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    """POST /v1/completions. `prompt`: one text, or one list of token ids."""

    prompt: Text | list[int] | list[Text] | list[list[int]]
    max_tokens: int | None = Field(None, ge=1, description="None: serve.max_tokens_default, within the context")
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise ValueError(f"one prompt per request; got a batch of {len(prompt)}")
            prompt = prompt[0]
        if len(prompt) == 0:
            raise ValueError("prompt is empty")
        return prompt

    @field_validator("echo")
    @classmethod
    def _no_echo(cls, value: bool) -> bool:
        return _refuse_unless(value, (False,), "echo")

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: int | None) -> int | None:
        return _refuse_unless(value, (None, 0), "logprobs")

    @field_validator("best_of")
    @classmethod
    def _no_best_of(cls, value: int | None) -> int | None:
        return _refuse_unless(value, (None, 1), "best_of")

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, value: str | None) -> str | None:
        return _refuse_unless(value, (None,), "suffix")


class TextPart(_Request):
    """One `{"type": "text", "text": ...}` part of a message's content."""

    type: Literal["text"]
    text: Text


class ChatMessage(_Request):
    """One message of `messages`. Only text content; tool calls are not supported."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(part.text for part in self.content)
        return self.content or ""


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. Rendered through the tokenizer's chat template."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="None: up to the context limit")
    max_completion_tokens: int | None = Field(None, ge=1, description="OpenAI's newer name of max_tokens")
    logprobs: bool | None = None
    top_logprobs: int | None = None
    response_format: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        return _refuse_unless(value, (False, None), "logprobs")

    @field_validator("top_logprobs")
    @classmethod
    def _no_top_logprobs(cls, value: int | None) -> int | None:
        return _refuse_unless(value, (None, 0), "top_logprobs")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: dict | None) -> dict | None:
        if value is not None and value.get("type") != "text":
            raise ValueError(f"only response_format type 'text' is supported; got {value.get('type')!r}")
        return value

    @field_validator("tools")
    @classmethod
    def _no_tools(cls, value: list | None) -> list | None:
        return _refuse_unless(value or None, (None,), "tools")

    @field_validator("tool_choice")
    @classmethod
    def _no_tool_choice(cls, value: Any) -> Any:
        return _refuse_unless(value, (None, "none", "auto"), "tool_choice")

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---- responses --------------------------------------------------------------------------------


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(_Response):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str


class ChatChoice(_Response):
    index: int = 0
    message: AssistantMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(_Response):
    index: int = 0
    delta: DeltaMessage
    logprobs: None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "disagg"
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]
