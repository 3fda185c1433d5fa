"""How a worker answers a bundle none of whose slices succeeded (services.gpu_worker.bundles.
fails_whole): UNAVAILABLE as a whole, for the router to retry elsewhere, only where none of
it ran here and the worker is failing; otherwise each slice its own status."""

from __future__ import annotations

import pytest

from services.gpu_worker.bundles import fails_whole

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("codes", "is_whole"),
    [
        ({"UNAVAILABLE": 3}, True),
        ({"UNAVAILABLE": 1, "CANCELLED": 1, "DEADLINE_EXCEEDED": 1}, True),
        ({"UNAVAILABLE": 1, "RESOURCE_EXHAUSTED": 2}, True),  # refused for load: not run
        ({"RESOURCE_EXHAUSTED": 2}, False),  # the worker is not failing: its own status
        ({"OK": 1, "UNAVAILABLE": 1}, False),  # a slice served: the rest sent again alone
        # A slice that ran and failed, or was refused for its input, keeps its status: sent
        # elsewhere it would run again, and its caller could end UNAVAILABLE. Before, the
        # whole bundle failed UNAVAILABLE.
        ({"UNAVAILABLE": 1, "INTERNAL": 1}, False),
        ({"UNAVAILABLE": 1, "INVALID_ARGUMENT": 1}, False),
    ],
)
def test_a_bundle_fails_whole_only_where_none_of_it_ran_on_a_failing_worker(
    codes: dict[str, int], is_whole: bool
) -> None:
    assert fails_whole(codes) is is_whole
