"""Each tier's entry point (`python -m services.<tier>`), as a real process. Its event loop is
uvloop's unless set otherwise, asyncio's where uvloop cannot be imported (in a child interpreter:
uvloop stays out of the test process).
A SIGTERM that lands while it is still starting (importing, building its servers, before it
installs its draining handlers) ends it cleanly, status 0. Without a handler of its own, a
process that is PID 1 in its container ignores SIGTERM and goes on to serve, and elsewhere it
dies of the signal (the local stack counts that a failure)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from services.common.event_loop import EVENT_LOOPS
from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.integration

#: What the entry point has done by the time it is imported: everything before serving.
SIGTERM_ONCE_IMPORTED = (
    "import importlib, os, signal, sys, time; "
    "importlib.import_module(sys.argv[1]); "
    "os.kill(os.getpid(), signal.SIGTERM); time.sleep(30)"
)


@pytest.mark.parametrize(
    "entry_point",
    [
        "services.gateway.__main__",
        "services.router.__main__",
        "services.gpu_worker.__main__",
        "services.jobs.__main__",
    ],
)
def test_a_sigterm_before_serving_ends_the_process_cleanly(entry_point: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SIGTERM_ONCE_IMPORTED, entry_point],
        cwd=REPO_ROOT,
        capture_output=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr.decode()


#: Prints the type of the loop `event_loop.run` runs a coroutine on, for each argument given.
_LOOP_TYPES = """
import asyncio, sys
from services.common import event_loop

async def loop_type():
    await asyncio.sleep(0)
    return type(asyncio.get_running_loop())

for kind in sys.argv[1:]:
    run = event_loop.run(loop_type()) if kind == "default" else event_loop.run(loop_type(), kind)
    print(run.__module__, run.__name__, issubclass(run, asyncio.BaseEventLoop))
"""


def _loop_types(*kinds: str, before: str = "") -> subprocess.CompletedProcess[str]:
    """Runs _LOOP_TYPES for `kinds` in a child interpreter, `before` run first."""
    done = subprocess.run(
        [sys.executable, "-c", before + _LOOP_TYPES, *kinds],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    return done


def test_the_default_is_uvloop_and_each_kind_runs_on_its_own_loop() -> None:
    assert EVENT_LOOPS[0] == "uvloop"
    default, uvloop, asyncio = _loop_types("default", "uvloop", "asyncio").stdout.splitlines()
    assert default == uvloop == "uvloop Loop False"  # libuv's loop, not asyncio's
    assert asyncio.split()[0].startswith("asyncio.") and asyncio.endswith(" True")


def test_where_uvloop_cannot_be_imported_the_process_runs_asyncios_loop_and_says_so() -> None:
    """The default asked for on a machine without uvloop (its import blocked in the child):
    asyncio's loop runs the coroutine, and a warning names the import's failure."""
    blocked = "import logging, sys; sys.modules['uvloop'] = None; logging.basicConfig()\n"
    done = _loop_types("default", before=blocked)
    (loop,) = done.stdout.splitlines()
    assert loop.split()[0].startswith("asyncio.") and loop.endswith(" True")
    assert "uvloop cannot be imported" in done.stderr
