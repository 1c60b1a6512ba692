"""A stand-in for `disagg.cluster.Cluster` with the streaming contract, for the HTTP layer's tests.

It is NOT the cluster: it echoes the prompt's token ids cyclically (output token k is
prompt[k % len(prompt)]), one token per `step_s`, honours max_tokens and stop/EOS ids, and
keeps a set of active requests whose "pages" it frees when a stream finishes or is closed, so
tests can check that the server closes every stream. The real cluster is tested in
test_serve_cluster.py. `CharTokenizer` maps each character to its code point.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

from disagg.errors import InstanceDied


class ChatTemplateError(Exception):
    """Same name as the model package's error: the server recognises it by name."""


class CharTokenizer:
    eos_token_ids = (3,)

    def __init__(self, chat_template: bool = True) -> None:
        self.chat_template = chat_template

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise ChatTemplateError("the tokenizer directory has no chat_template")
        text = "".join(f"<{m['role']}>{m['content']}" for m in messages)
        return text + ("<assistant>" if add_generation_prompt else "")


@dataclass
class StreamDelta:
    request_id: str
    token_ids: list[int]
    emit_times: list[float]
    finished: bool
    finish_reason: str | None
    error: str | None = None
    cause: BaseException | None = None
    metrics: SimpleNamespace | None = None  # the last delta: RequestMetrics' fields, as Cluster.stream


@dataclass
class FakeCluster:
    tokenizer: CharTokenizer | None = None
    model_name: str = "fake"
    max_model_len: int = 256
    vocab_size: int = 1 << 20
    step_s: float = 0.0
    healthy: bool = True
    pages_per_request: int = 2
    total_pages: int = 1024
    fail_with: BaseException | None = None
    error_after: int | None = None
    error_cause: BaseException | None = field(default_factory=lambda: InstanceDied(
        "decode instance 0 died", instance="decode0", reason="its actor exited"))
    active: dict = field(default_factory=dict)
    started: list = field(default_factory=list)
    params_of: dict = field(default_factory=dict)  # request id -> the SamplingParams it came with
    streams: list = field(default_factory=list)
    config: SimpleNamespace = field(default_factory=lambda: SimpleNamespace(
        serve=SimpleNamespace(host="127.0.0.1", port=0, api_key=None, served_model_name=None,
                              max_tokens_default=32)))

    def stream(self, prompt, params, request_id=None):
        """Like the router's, the fake keeps each stream referenced until it ends (so only closing it,
        not garbage collection, releases an unfinished request)."""
        gen = self._stream(prompt, params, request_id)
        self.streams.append(gen)
        return gen

    async def _stream(self, prompt, params, request_id):
        if self.fail_with is not None:
            raise self.fail_with
        self.active[request_id] = self.pages_per_request
        self.started.append(request_id)
        self.params_of[request_id] = params
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else {3})
        metrics = SimpleNamespace(arrival_time=time.time(), dispatch_time=time.time(), first_token_time=None,
                                  token_times=[])
        try:
            for k in range(params.max_tokens):
                await asyncio.sleep(self.step_s)
                if self.error_after is not None and k >= self.error_after:
                    text = None if self.error_cause is None else str(self.error_cause)
                    yield StreamDelta(request_id, [], [], True, "error", text or "failed", self.error_cause)
                    return
                token = prompt[k % len(prompt)]
                reason = "stop" if token in stops else "length" if k + 1 == params.max_tokens else None
                now = time.time()
                metrics.first_token_time = metrics.first_token_time or now
                metrics.token_times.append(now)
                yield StreamDelta(request_id, [token], [now], reason is not None, reason,
                                  metrics=metrics if reason is not None else None)
                if reason is not None:
                    return
        finally:
            self.active.pop(request_id, None)

    shut_down: bool = False

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.shut_down = True

    def reset_prefix_cache(self) -> dict:
        return {"prefill0": 0, "decode0": 0}

    def stats(self) -> dict:
        used = sum(self.active.values())
        inst = lambda name, role: {"name": name, "role": role, "free_pages": self.total_pages - used,
                                   "total_pages": self.total_pages, "running": len(self.active), "waiting": 0,
                                   "alive": True}
        return {"instances": [inst("prefill0", "prefill"), inst("decode0", "decode")],
                "router": {"queued": 0, "live": len(self.active), "counts": {"submitted": len(self.started)}}}
