"""Output text of one request, built token by token, with stop strings matched on the text.

`OutputText` turns the token ids a request streams back into text deltas: it decodes a short
window of ids (as vLLM's incremental detokenizer does) so each step costs O(window), holds back
a trailing U+FFFD (a multi-byte character split across tokens), and holds back the last
`len(longest stop string) - 1` characters until it knows they do not start a stop string. When a
stop string appears, the text is cut before it and the request is finished by the caller.
Pure Python; runs in the server's event loop.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, Sequence


class Decoder(Protocol):
    def decode(self, token_ids: list[int]) -> str: ...


@dataclass
class TextDelta:
    """What one batch of new token ids adds to the output.

    Attributes:
        text: characters safe to send now.
        stop: the stop string that ended the output, or None.
    """

    text: str
    stop: str | None = None


class OutputText:
    """The growing output text of one request.

    Args:
        decoder: the model's tokenizer, or None (then the text stays empty and stop strings are
            not allowed).
        stop_strings: strings that end the output; the output is truncated before the first one.
    """

    def __init__(self, decoder: Decoder | None, stop_strings: Sequence[str] = ()) -> None:
        if stop_strings and decoder is None:
            raise ValueError("stop strings need a tokenizer to match on text; got none")
        self._decoder = decoder
        self._stops = tuple(stop_strings)
        self._hold = max((len(s) for s in self._stops), default=1) - 1
        self._ids: list[int] = []
        # ids[prefix_offset:read_offset] is re-decoded as left context, so that tokenizers which
        # drop or merge a leading space decode a suffix the way they decode the whole text.
        self._prefix_offset = 0
        self._read_offset = 0  # ids before this are decoded into self.text
        self.text = ""  # all decoded text so far (stops applied)
        self._sent = 0  # characters of self.text already handed out
        self.stopped: str | None = None

    def add(self, token_ids: Sequence[int]) -> TextDelta:
        """Append new token ids; returns the text that can be sent now (nothing after a stop)."""
        if self._decoder is None or self.stopped is not None:
            return TextDelta("")
        self._ids.extend(token_ids)
        return self._append(self._decode_new(force=False))

    def flush(self) -> TextDelta:
        """At the end of the output: decode what was held back and hand out the rest of the text."""
        if self._decoder is None or self.stopped is not None:
            return TextDelta("")
        head = self._append(self._decode_new(force=True)).text
        rest = self.text[self._sent:]
        self._sent = len(self.text)
        return TextDelta(head + rest, self.stopped)

    def _append(self, new_text: str) -> TextDelta:
        if new_text:
            search_from = max(0, len(self.text) - self._hold)
            self.text += new_text
            for position, stop in self._find_stops(search_from):
                self.text = self.text[:position]
                self.stopped = stop
                break
        safe = len(self.text) if self.stopped else max(self._sent, len(self.text) - self._hold)
        delta = self.text[self._sent:safe]
        self._sent = safe
        return TextDelta(delta, self.stopped)

    def _decode_new(self, force: bool) -> str:
        context = self._decoder.decode(self._ids[self._prefix_offset:self._read_offset])
        full = self._decoder.decode(self._ids[self._prefix_offset:])
        if not force and (len(full) <= len(context) or full.endswith("\ufffd")):
            return ""  # an incomplete multi-byte character: wait for more ids
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return full[len(context):]

    def _find_stops(self, search_from: int) -> list[tuple[int, str]]:
        found = []
        for stop in self._stops:
            position = self.text.find(stop, search_from)
            if position >= 0:
                found.append((position, stop))
        return sorted(found)
