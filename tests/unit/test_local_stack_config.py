"""The local stack's share-out of the machine's cores between the workers and the CPU tiers."""

from __future__ import annotations

import pytest

from services.local_stack.config import worker_torch_threads

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("num_workers", "num_cores", "threads"),
    [(1, 2, 1), (1, 1, 1), (1, 16, 8), (2, 16, 4), (3, 16, 2), (4, 2, 1)],
)
def test_workers_get_half_the_cores_at_least_one_thread_each(
    num_workers: int, num_cores: int, threads: int
) -> None:
    assert worker_torch_threads(num_workers, num_cores) == threads
