"""Unit tests of the HTTP layer's pure parts: request validation messages, output text and stop
strings, SSE rendering. No server, no cluster."""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from disagg.cluster.serve.detokenize import OutputText
from disagg.cluster.serve.errors import validation_message
from disagg.cluster.serve.generation import Chunk
from disagg.cluster.serve.protocol import ChatCompletionRequest, CompletionRequest
from disagg.cluster.serve.streaming import DONE, ResponseFormat

pytestmark = pytest.mark.timeout(30)


def _error(cls, body: dict) -> tuple[str, str | None]:
    with pytest.raises(ValidationError) as info:
        cls.model_validate_json(json.dumps(body))
    return validation_message(info.value.errors())


@pytest.mark.parametrize("body, param, words", [
    ({"prompt": "x", "foo": 1}, "foo", "unknown field 'foo'"),
    ({"prompt": "x", "max_tokens": "3"}, "max_tokens", "valid integer"),
    ({"prompt": "x", "max_tokens": 0}, "max_tokens", "greater than or equal to 1"),
    ({"prompt": "x", "temperature": True}, "temperature", "valid number"),
    ({"prompt": "x", "n": 2}, "n", "only n=1"),
    ({"prompt": "x", "best_of": 3}, "best_of", "best_of is not supported"),
    ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty", "penalty is not supported"),
    ({"prompt": ["a", "b"]}, "prompt", "one prompt per request"),
    ({"prompt": ""}, "prompt", "prompt is empty"),
    ({"prompt": [1, "a"]}, "prompt", "valid"),
    ({}, "prompt", "missing required field 'prompt'"),
    ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options", "stream=true"),
    ({"prompt": "x", "stream": True, "stream_options": {"include_usage": True, "x": 1}},
     "stream_options.x", "unknown field"),
    ({"prompt": "x", "stop": [""]}, "stop", "non-empty"),
])
def test_completion_validation_names_the_field(body, param, words):
    message, got_param = _error(CompletionRequest, body)
    assert got_param == param
    assert words in message


@pytest.mark.parametrize("body, param", [
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "bot", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "u"}]}]},
     "messages[0].content"),
    ({"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]}, "tools"),
    ({"messages": [{"role": "user", "content": "x"}], "logprobs": True}, "logprobs"),
])
def test_chat_validation_names_the_field(body, param):
    assert _error(ChatCompletionRequest, body)[1] == param


def test_valid_requests_parse():
    req = CompletionRequest.model_validate({"prompt": [[5, 6]], "stop": [7], "stream": True,
                                            "stream_options": {"include_usage": True}})
    assert req.prompt == [5, 6] and req.include_usage()
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}], "max_completion_tokens": 4})
    assert chat.messages[0].text() == "ab" and chat.requested_max_tokens() == 4


class Chars:
    def decode(self, ids):
        return "".join(chr(i) for i in ids)


class Utf8Bytes:
    """One token per UTF-8 byte: a character may be split across tokens."""

    def decode(self, ids):
        return bytes(ids).decode("utf-8", errors="replace")


def _feed(text: OutputText, pieces: list[str]) -> list[str]:
    out = []
    for piece in pieces:
        out.append(text.add([ord(c) for c in piece]).text)
    return out


def test_output_text_holds_back_a_possible_stop_string_then_cuts_before_it():
    text = OutputText(Chars(), ["END"])
    deltas = _feed(text, ["ab", "cE", "N", "Dxyz"])
    assert deltas == ["", "ab", "c", ""] and text.stopped == "END"  # 2 chars held: could start 'END'
    assert text.add([ord("q")]).text == ""  # nothing after a stop


def test_output_text_releases_held_text_when_no_stop_follows():
    text = OutputText(Chars(), ["STOP"])
    deltas = _feed(text, ["ab", "cS", "TO"])
    tail = text.flush()
    assert "".join(deltas) + tail.text == "abcSTO" and tail.stop is None


def test_output_text_earliest_of_several_stops_wins():
    text = OutputText(Chars(), ["zz", "b"])
    assert "".join(_feed(text, ["aazzb"])) == "aa" and text.stopped == "zz"


def test_output_text_never_emits_half_a_character():
    text = OutputText(Utf8Bytes())
    deltas = [text.add([b]).text for b in "é€x".encode()]
    assert "\ufffd" not in "".join(deltas)
    assert "".join(deltas) + text.flush().text == "é€x"


def test_output_text_flushes_undecodable_bytes_at_the_end():
    text = OutputText(Utf8Bytes())
    assert [text.add([0xE2]).text, text.add([0x82]).text] == ["", ""]  # half of a 3-byte character
    assert text.flush().text == "\ufffd"  # what a full decode gives: nothing is lost


def test_output_text_without_tokenizer_is_empty_and_refuses_stop_strings():
    assert OutputText(None).add([1, 2]).text == ""
    with pytest.raises(ValueError, match="tokenizer"):
        OutputText(None, ["x"])


def test_sse_chunk_and_usage_shapes():
    fmt = ResponseFormat(kind="chat", response_id="chatcmpl-1", model="m", prompt_token_ids=[1, 2],
                         include_usage=True, return_token_ids=True)
    first = fmt.chunk_payload(Chunk("hi", [5]), first=True)
    assert first["object"] == "chat.completion.chunk" and first["usage"] is None
    assert first["choices"][0]["delta"] == {"role": "assistant", "content": "hi"}
    assert first["choices"][0]["finish_reason"] is None and first["prompt_token_ids"] == [1, 2]
    last = fmt.chunk_payload(Chunk("", [6], "length"), first=False)
    assert last["choices"][0]["finish_reason"] == "length" and "role" not in last["choices"][0]["delta"]
    usage = fmt.usage_payload(2)
    assert usage["choices"] == [] and usage["usage"] == {"prompt_tokens": 2, "completion_tokens": 2,
                                                         "total_tokens": 4}
    assert DONE == "data: [DONE]\n\n"


def test_full_completion_joins_chunks():
    fmt = ResponseFormat(kind="completion", response_id="cmpl-1", model="m", prompt_token_ids=[1])
    body = fmt.full_response([Chunk("a", [1]), Chunk("b", [2, 3], "stop", "x")])
    choice = body["choices"][0]
    assert choice["text"] == "ab" and choice["finish_reason"] == "stop" and choice["stop_reason"] == "x"
    assert "token_ids" not in choice and body["usage"]["completion_tokens"] == 3
