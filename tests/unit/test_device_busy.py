"""The device time of a batch (services.gpu_worker.device_busy), on a CPU: the model call's
wall time, summed over the calls of one batch (a failing batch is bisected)."""

from __future__ import annotations

import time
from collections.abc import Sequence

import numpy as np
import pytest
import torch

from services.gpu_worker.backends.base import PreparedRow
from services.gpu_worker.device_busy import DeviceBusy
from services.gpu_worker.execution import run_isolated

pytestmark = pytest.mark.unit

CALL_S = 0.02


def _rows(count: int) -> list[PreparedRow]:
    return [PreparedRow(bucket=1, num_tokens=1, data=np.full(1, i)) for i in range(count)]


def _slow_run(rows: Sequence[PreparedRow]) -> list[np.ndarray]:
    time.sleep(CALL_S)
    if any(int(row.data[0]) == 3 for row in rows):
        raise ValueError("row 3 is poison")
    return [row.data for row in rows]


def test_a_batchs_device_time_adds_up_over_its_calls_failed_ones_included() -> None:
    busy = DeviceBusy(_slow_run, torch.device("cpu"))
    outputs = run_isolated(busy, _rows(4))
    assert [isinstance(o, Exception) for o in outputs] == [False, False, False, True]
    # 4 rows with one poison: the whole (fails), halves [0,1] (ok) and [2,3] (fails), then
    # rows 2 and 3 alone: 5 calls, each at least CALL_S.
    assert busy.seconds >= 5 * CALL_S
    assert busy.seconds < 5 * CALL_S + 5.0  # wall time of calls, not of the process
