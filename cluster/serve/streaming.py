"""Responses from a `Generation`: server-sent events (`data: {...}` ... `data: [DONE]`) or one JSON body.

The SSE layout is OpenAI's (and vLLM's): one `text_completion` / `chat.completion.chunk` object
per cluster delta; chat opens with `delta.role = "assistant"`; the chunk that ends the choice
carries `finish_reason`; with `stream_options.include_usage` every chunk has `"usage": null`
and one more chunk with `choices: []` and the usage comes last; then `data: [DONE]`. An error
after the stream began is sent as `data: {"error": {...}}` before `[DONE]` (the status is
already 200). `ResponseFormat` holds what differs between completions and chat.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import AsyncIterator, Callable

from disagg.cluster.serve.generation import Chunk
from disagg.cluster.serve.protocol import (
    AssistantMessage, ChatChoice, ChatChunkChoice, ChatCompletionChunk, ChatCompletionResponse,
    CompletionChoice, CompletionResponse, DeltaMessage, Usage)

DONE = "data: [DONE]\n\n"


def sse(payload: dict) -> str:
    """One server-sent event carrying `payload` as compact JSON."""
    return f"data: {json.dumps(payload, separators=(',', ':'), ensure_ascii=False)}\n\n"


@dataclass
class ResponseFormat:
    """How one request's chunks are rendered.

    Attributes:
        kind: "completion" or "chat".
        response_id: `cmpl-...` or `chatcmpl-...`.
        model: the served model name.
        prompt_token_ids: the prompt, for `usage` and `return_token_ids`.
        include_usage: stream_options.include_usage.
        return_token_ids: the vLLM extension: token ids in each choice.
    """

    kind: str
    response_id: str
    model: str
    prompt_token_ids: list[int]
    include_usage: bool = False
    return_token_ids: bool = False
    created: int = 0

    def __post_init__(self) -> None:
        self.created = self.created or int(time.time())

    def usage(self, num_output_tokens: int) -> Usage:
        num_prompt = len(self.prompt_token_ids)
        return Usage(prompt_tokens=num_prompt, completion_tokens=num_output_tokens,
                     total_tokens=num_prompt + num_output_tokens)

    def chunk_payload(self, chunk: Chunk, first: bool) -> dict:
        ids = chunk.token_ids if self.return_token_ids else None
        if self.kind == "completion":
            choice = CompletionChoice(text=chunk.text, finish_reason=chunk.finish_reason,
                                      stop_reason=chunk.stop_reason, token_ids=ids,
                                      prompt_token_ids=self.prompt_token_ids if self.return_token_ids and first else None)
            body = CompletionResponse(id=self.response_id, created=self.created, model=self.model, choices=[choice])
        else:
            delta = DeltaMessage(role="assistant" if first else None, content=chunk.text)
            choice = ChatChunkChoice(delta=delta, finish_reason=chunk.finish_reason,
                                     stop_reason=chunk.stop_reason, token_ids=ids)
            body = ChatCompletionChunk(id=self.response_id, created=self.created, model=self.model, choices=[choice],
                                       prompt_token_ids=self.prompt_token_ids if self.return_token_ids and first else None)
        payload = body.model_dump(exclude_none=True)
        payload["choices"][0].setdefault("finish_reason", None)
        if self.include_usage:
            payload["usage"] = None
        return payload

    def usage_payload(self, num_output_tokens: int) -> dict:
        obj = "text_completion" if self.kind == "completion" else "chat.completion.chunk"
        return {"id": self.response_id, "object": obj, "created": self.created, "model": self.model,
                "choices": [], "usage": self.usage(num_output_tokens).model_dump()}

    def full_response(self, chunks: list[Chunk]) -> dict:
        """The non-streaming body: every chunk's text and ids joined into one choice."""
        text = "".join(c.text for c in chunks)
        ids = [t for c in chunks for t in c.token_ids]
        last = chunks[-1]
        usage = self.usage(len(ids))
        token_ids = ids if self.return_token_ids else None
        if self.kind == "completion":
            choice = CompletionChoice(text=text, finish_reason=last.finish_reason, stop_reason=last.stop_reason,
                                      token_ids=token_ids,
                                      prompt_token_ids=self.prompt_token_ids if self.return_token_ids else None)
            body = CompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                      choices=[choice], usage=usage)
        else:
            choice = ChatChoice(message=AssistantMessage(content=text), finish_reason=last.finish_reason,
                                stop_reason=last.stop_reason, token_ids=token_ids)
            body = ChatCompletionResponse(id=self.response_id, created=self.created, model=self.model,
                                          choices=[choice], usage=usage,
                                          prompt_token_ids=self.prompt_token_ids if self.return_token_ids else None)
        payload = body.model_dump(exclude_none=True)
        payload["choices"][0].setdefault("logprobs", None)
        payload["choices"][0].setdefault("stop_reason", None)
        return payload


async def sse_events(first: Chunk | None, rest: AsyncIterator[Chunk], fmt: ResponseFormat,
                     error_body: Callable[[BaseException], dict]) -> AsyncIterator[str]:
    """Render a generation as server-sent events.

    Args:
        first: the chunk already taken from the generation (taken before the 200 was sent, so
            that queue-full or no-instance errors still get their own status), or None when the
            generation ended before producing one.
        rest: the remaining chunks.
        fmt: how to render them.
        error_body: maps an exception raised mid-stream to OpenAI's error JSON.

    Yields:
        `data: ...\\n\\n` strings, ending with `data: [DONE]\\n\\n`.
    """
    num_output_tokens = 0
    try:
        if first is not None:
            num_output_tokens += len(first.token_ids)
            yield sse(fmt.chunk_payload(first, first=True))
        async for chunk in rest:
            num_output_tokens += len(chunk.token_ids)
            yield sse(fmt.chunk_payload(chunk, first=False))
    except Exception as err:  # the status is already 200: tell the client in-band, as vLLM does
        yield sse(error_body(err))
        yield DONE
        return
    if fmt.include_usage:
        yield sse(fmt.usage_payload(num_output_tokens))
    yield DONE
