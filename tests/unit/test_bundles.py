"""The packed columns and the slice bookkeeping bundles share (services.common.bundles)."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.bundles import (
    SliceCancels,
    pack_token_rows,
    slice_time_left_s,
    split_at,
    unpack_token_rows,
)
from services.common.errors import InvalidInput

pytestmark = pytest.mark.unit


def test_packed_token_rows_round_trip_and_refuse_what_does_not_add_up() -> None:
    rows = [np.array([101, 7, 102]), np.array([101, 102]), np.array([5])]
    ids, lengths = pack_token_rows(rows)
    back = unpack_token_rows(ids, lengths, 3)
    assert [r.tolist() for r in back] == [r.tolist() for r in rows]
    with pytest.raises(InvalidInput, match="2 row lengths for 3 rows"):
        unpack_token_rows(ids, pack_token_rows(rows[:2])[1], 3)
    with pytest.raises(InvalidInput, match="add up to"):
        unpack_token_rows(ids[:-4], lengths, 3)
    with pytest.raises(InvalidInput, match="at least one token"):
        unpack_token_rows(b"", np.zeros(1, "<i4").tobytes(), 1)
    with pytest.raises(InvalidInput, match="add up to 0, not 3 ids"):  # ids and no row
        unpack_token_rows(ids[:12], b"", 0)


def test_split_at_cuts_rows_as_numpy_split_does() -> None:
    flat = np.arange(10)
    ends = [3, 3, 7, 10]
    assert [r.tolist() for r in split_at(flat, ends)] == [
        r.tolist() for r in np.split(flat, ends[:-1])
    ]
    assert split_at(flat, []) == []


def test_a_slices_time_left_is_the_calls_less_its_margin() -> None:
    assert slice_time_left_s(2.0, 500_000) == pytest.approx(1.5)
    assert slice_time_left_s(2.0, 0) == 2.0
    assert slice_time_left_s(0.2, 500_000) == 0.0  # already past: nothing left, not negative
    assert slice_time_left_s(None, 500_000) is None


def test_a_listener_hears_of_past_and_later_cancels_once_each_until_it_stops() -> None:
    cancels = SliceCancels()
    cancels.cancel(3)
    heard: list[int] = []
    stop = cancels.listen(heard.append)
    cancels.cancel(1)
    cancels.cancel(1)  # once only
    stop()
    cancels.cancel(0)
    assert heard == [3, 1]
    assert cancels.cancelled == {0, 1, 3}
