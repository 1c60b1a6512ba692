"""`DecodeProgress`: how far each decode on one instance is, as arrays the placement reads whole.

Per decode whose first token the router has seen: the seconds since that token, its tokens so
far and its max_tokens. `tally` collects them as rows, the `Ledger` keeps them in a
`ProgressTable` per instance (one row written per move, none rebuilt per decision); either way
`FleetModel.views` hands each `InstanceView` a `DecodeProgress`, from which `fleet_tpot_slacks_s`
(every instance's decodes at once) and `InstanceView.seat_wait_s` compute. Element-wise float64
arithmetic is IEEE's, as Python's floats are: a slack computed over the arrays is the one
computed decode by decode, bit for bit. Pure, no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import numpy as np


class DecodeProgress:
    """The decodes' progress on one instance (module docstring): its arrays are its own (the
    `ProgressTable`'s snapshot copies them), never written after it is made.

    Iterates, compares and hashes as the tuple of its rows ``(seconds since the first token,
    tokens so far, max_tokens)``, in the order they were given (the placement's results do not
    depend on it: it takes minima, counts and order statistics).

    Attributes:
        elapsed_s: ``[num_decodes]`` float64, seconds since each first token.
        num_output: ``[num_decodes]`` int64, tokens so far.
        max_tokens: ``[num_decodes]`` int64.
    """

    __slots__ = ("elapsed_s", "num_output", "max_tokens")

    def __init__(self, elapsed_s: np.ndarray, num_output: np.ndarray, max_tokens: np.ndarray) -> None:
        if not len(elapsed_s) == len(num_output) == len(max_tokens):
            raise ValueError(f"DecodeProgress: expected arrays of one length, got {len(elapsed_s)}, "
                             f"{len(num_output)} and {len(max_tokens)}")
        self.elapsed_s, self.num_output, self.max_tokens = elapsed_s, num_output, max_tokens

    @classmethod
    def of(cls, rows: Iterable[tuple[float, int, int]]) -> DecodeProgress:
        """The progress of ``rows``, each ``(seconds since the first token, tokens so far,
        max_tokens)``."""
        rows = list(rows)
        if not rows:
            return NO_PROGRESS
        elapsed, num_output, max_tokens = zip(*rows)
        return cls(np.array(elapsed, dtype=np.float64), np.array(num_output, dtype=np.int64),
                   np.array(max_tokens, dtype=np.int64))

    def __len__(self) -> int:
        return len(self.elapsed_s)

    def __iter__(self) -> Iterator[tuple[float, int, int]]:
        return zip(self.elapsed_s.tolist(), self.num_output.tolist(), self.max_tokens.tolist())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, DecodeProgress | tuple | list):
            return tuple(self) == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))

    def __repr__(self) -> str:
        return f"DecodeProgress({list(self)!r})"


NO_PROGRESS = DecodeProgress(np.empty(0), np.empty(0, dtype=np.int64), np.empty(0, dtype=np.int64))


class ProgressTable:
    """The `Ledger`'s rows of one instance's decodes, kept as they move: ``add`` when a decode's
    first token is counted, ``set_output`` as its tokens come, ``remove`` when it ends or moves
    (the last row takes its place). ``snapshot`` is a decision's `DecodeProgress`, O(rows) in
    numpy."""

    def __init__(self, capacity: int = 64) -> None:
        self.request_ids: list[str] = []  # row -> request id
        self.rows: dict[str, int] = {}  # request id -> row
        self.first_token_at = np.empty(capacity)
        self.num_output = np.empty(capacity, dtype=np.int64)
        self.max_tokens = np.empty(capacity, dtype=np.int64)

    def __len__(self) -> int:
        return len(self.request_ids)

    def add(self, request_id: str, first_token_at: float, num_output: int, max_tokens: int) -> None:
        """Count ``request_id``'s decode (not counted yet)."""
        assert request_id not in self.rows, f"ProgressTable: {request_id!r} is counted once"
        row = len(self.request_ids)
        if row == len(self.first_token_at):
            self._grow()
        self.first_token_at[row], self.num_output[row], self.max_tokens[row] = first_token_at, num_output, max_tokens
        self.rows[request_id] = row
        self.request_ids.append(request_id)

    def set_output(self, request_id: str, num_output: int) -> None:
        """``request_id``'s decode has ``num_output`` tokens now (a no-op for one not counted)."""
        row = self.rows.get(request_id)
        if row is not None:
            self.num_output[row] = num_output

    def remove(self, request_id: str) -> None:
        """``request_id``'s decode is no longer counted (a no-op for one not counted)."""
        row = self.rows.pop(request_id, None)
        if row is None:
            return
        last_id = self.request_ids.pop()
        if last_id != request_id:  # the last row moves into the hole
            last = len(self.request_ids)
            self.first_token_at[row], self.num_output[row], self.max_tokens[row] = (
                self.first_token_at[last], self.num_output[last], self.max_tokens[last])
            self.request_ids[row] = last_id
            self.rows[last_id] = row

    def snapshot(self, now: float) -> DecodeProgress:
        """The rows as a `DecodeProgress` at ``now`` (the clock of their first tokens)."""
        size = len(self.request_ids)
        if not size:
            return NO_PROGRESS
        return DecodeProgress(now - self.first_token_at[:size], self.num_output[:size].copy(),
                              self.max_tokens[:size].copy())

    def audit(self) -> str | None:
        """What is wrong with the rows' index (a row not where its request id says), as a
        sentence; None when nothing is. Their values are the `Ledger`'s audit's."""
        for row, request_id in enumerate(self.request_ids):
            if self.rows.get(request_id) != row:
                return f"progress row {row} is {request_id!r}, indexed at {self.rows.get(request_id)}"
        if len(self.rows) != len(self.request_ids):
            return f"progress has {len(self.rows)} rows indexed, {len(self.request_ids)} held"
        return None

    def _grow(self) -> None:
        capacity = 2 * len(self.first_token_at)
        for name in ("first_token_at", "num_output", "max_tokens"):
            old = getattr(self, name)
            new = np.empty(capacity, dtype=old.dtype)
            new[:len(old)] = old
            setattr(self, name, new)
