"""A tier's stop is bounded: `bound_stop` ends a process whose stop hangs, with every thread's
stack in its stderr; `exit_stopped` exits with the given code even while a non-daemon thread
would keep the interpreter alive."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.integration


def run_python(code: str, timeout_s: float = 30.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
    )


def test_a_hung_stop_dumps_stacks_and_exits() -> None:
    done = run_python(
        """
        import time
        from services.common import lifecycle
        lifecycle.STOP_OVERRUN_S = 0.0
        lifecycle.bound_stop(0.5)
        def stuck_in_teardown():
            time.sleep(60)
        stuck_in_teardown()
        """
    )
    assert done.returncode == 1
    assert "stuck_in_teardown" in done.stderr  # the hung frame is named in the dump


def test_a_stop_awaiting_forever_names_the_task_before_exiting() -> None:
    done = run_python(
        """
        import asyncio
        from services.common import lifecycle
        lifecycle.STOP_OVERRUN_S = 0.0
        lifecycle.TASK_DUMP_LEAD_S = 2.75  # the tasks written at 0.25 s, the process ended at 3 s
        async def close_that_never_returns():
            await asyncio.Event().wait()
        async def main():
            lifecycle.bound_stop(3.0)
            await asyncio.create_task(close_that_never_returns(), name="closing-streams")
        asyncio.run(main())
        """
    )
    assert done.returncode == 1
    tasks = done.stderr.split("stop overran: the event loop's tasks", 1)[1]
    assert "closing-streams" in tasks
    assert "close_that_never_returns" in tasks
    assert "most recent call first" in tasks  # then faulthandler's dump of the threads


def test_exit_stopped_does_not_wait_for_threads() -> None:
    done = run_python(
        """
        import threading, time
        from services.common import lifecycle
        threading.Thread(target=time.sleep, args=(60,)).start()  # non-daemon: joined at exit
        lifecycle.bound_stop(20.0)
        lifecycle.exit_stopped(0)
        """
    )
    assert done.returncode == 0
