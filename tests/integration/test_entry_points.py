"""Each tier's entry point (`python -m services.<tier>`), as a real process: a SIGTERM that
lands while it is still starting (importing, building its servers, before it installs its
draining handlers) ends it cleanly, status 0. Without a handler of its own, a process that is
PID 1 in its container ignores SIGTERM and goes on to serve, and elsewhere it dies of the
signal (the local stack counts that a failure)."""

from __future__ import annotations

import subprocess
import sys

import pytest

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
