"""The event loop a tier runs on (services.common.event_loop): the setting's values, and that
each kind runs its coroutine on a loop of that kind."""

from __future__ import annotations

import asyncio

import pytest
import uvloop

from services.common.event_loop import EVENT_LOOPS, parse_event_loop, run

pytestmark = pytest.mark.unit


async def _loop_type() -> type:
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop())


def test_the_default_is_uvloop_and_each_kind_runs_on_its_own_loop() -> None:
    assert EVENT_LOOPS[0] == "uvloop"
    assert run(_loop_type()) is uvloop.Loop
    assert run(_loop_type(), "uvloop") is uvloop.Loop
    loop_type = run(_loop_type(), "asyncio")
    assert loop_type is not uvloop.Loop
    assert issubclass(loop_type, asyncio.BaseEventLoop)


def test_the_setting_takes_either_kind_in_any_case_and_refuses_others() -> None:
    assert parse_event_loop(" UVLoop ") == "uvloop"
    assert parse_event_loop("asyncio") == "asyncio"
    with pytest.raises(ValueError, match="uvloop, asyncio"):
        parse_event_loop("trio")
