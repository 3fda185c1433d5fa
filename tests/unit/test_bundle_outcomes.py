"""How a worker answers a bundle none of whose slices succeeded (services.gpu_worker.bundles.
fails_whole): UNAVAILABLE as a whole, for the router to eject the worker and retry
elsewhere, where none succeeded and the worker is failing; otherwise each slice its own
status."""

from __future__ import annotations

import pytest

from services.gpu_worker.bundles import fails_whole

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("codes", "is_whole"),
    [
        ({"UNAVAILABLE": 3}, True),
        ({"UNAVAILABLE": 1, "CANCELLED": 1, "DEADLINE_EXCEEDED": 1}, True),
        ({"UNAVAILABLE": 1, "RESOURCE_EXHAUSTED": 2}, True),
        # A wedged worker's UNAVAILABLE (not marked not started) beside a slice that failed
        # otherwise: the router must see the worker fail, eject it and retry elsewhere.
        ({"UNAVAILABLE": 1, "INTERNAL": 1}, True),
        ({"UNAVAILABLE": 1, "INVALID_ARGUMENT": 1}, True),
        ({"RESOURCE_EXHAUSTED": 2}, False),  # the worker is not failing: each its own status
        ({"INTERNAL": 1, "INVALID_ARGUMENT": 1}, False),
        ({"OK": 1, "UNAVAILABLE": 1}, False),  # a slice served: the rest answered alone
    ],
)
def test_a_bundle_fails_whole_where_none_succeeded_on_a_failing_worker(
    codes: dict[str, int], is_whole: bool
) -> None:
    assert fails_whole(codes) is is_whole
