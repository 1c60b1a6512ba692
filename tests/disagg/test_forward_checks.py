"""The plan builder never clips: a token outside its sequence's page table is a loud error."""

from __future__ import annotations

import numpy as np
import pytest

from disagg import forward
from disagg.errors import CacheIntegrityError

I32 = np.int32


def test_a_token_past_its_page_table_raises_instead_of_reading_a_clipped_page() -> None:
    # Row 0 appends positions 4..8 with page_size 4 but holds 2 pages (room for 8 tokens).
    args = (np.array([0, 5, 6], I32), np.array([5, 1]), np.array([4, 0]),
            np.array([0, 2, 3], I32), np.array([7, 3, 5], I32), 4)
    with pytest.raises(CacheIntegrityError, match="batch row 0 appends positions up to 8 but its page table holds 2 pages of 4"):
        forward.append_slots(*args)
    # The same row as a sliding window: fix_windowed rewrites its slots; out-of-table ones are -1.
    slots, positions = forward.append_slots(*args, windowed_rows=[0])
    assert slots.tolist() == [12, 13, 14, 15, -1, 20]
    assert positions.tolist() == [4, 5, 6, 7, 8, 0]


def test_decode_rows_inside_their_tables() -> None:
    slots, positions = forward.append_slots(np.array([0, 1, 2], I32), np.array([1, 1]), np.array([3, 4]),
                                            np.array([0, 1, 3], I32), np.array([6, 2, 9], I32), 4)
    assert slots.tolist() == [27, 36] and positions.tolist() == [3, 4]
    with pytest.raises(CacheIntegrityError, match="batch row 1"):
        forward.append_slots(np.array([0, 1, 2], I32), np.array([1, 1]), np.array([3, 8]),
                             np.array([0, 1, 3], I32), np.array([6, 2, 9], I32), 4)
