"""The event loop setting's values (services.common.event_loop); that each kind runs on a loop
of that kind is tests/integration/test_entry_points.py's (in a child interpreter, as a tier)."""

from __future__ import annotations

import pytest

from services.common.event_loop import parse_event_loop

pytestmark = pytest.mark.unit


def test_the_setting_takes_either_kind_in_any_case_and_refuses_others() -> None:
    assert parse_event_loop(" UVLoop ") == "uvloop"
    assert parse_event_loop("asyncio") == "asyncio"
    with pytest.raises(ValueError, match="uvloop, asyncio"):
        parse_event_loop("trio")
