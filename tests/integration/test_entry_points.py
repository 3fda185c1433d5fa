"""Each tier's entry point (`python -m services.<tier>`), as a real process. Its event loop is
uvloop's unless set otherwise, asyncio's where uvloop cannot be imported (in a child interpreter:
uvloop stays out of the test process).
A SIGTERM that lands while it is still starting (importing, building its servers, before it
installs its draining handlers) ends it cleanly, status 0. Without a handler of its own, a
process that is PID 1 in its container ignores SIGTERM and goes on to serve, and elsewhere it
dies of the signal (the local stack counts that a failure)."""

from __future__ import annotations

import itertools
import json
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.event_loop import EVENT_LOOPS
from services.common.processes import Supervised
from services.gateway.config import GatewayConfig
from services.gateway.process_group import ProcessGroup
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


#: A Redis no test runs (nothing is connected to: the file is read first).
_NO_REDIS = ("--redis-url", "redis://127.0.0.1:1/0")


@pytest.mark.parametrize(
    ("tier", "args", "named"),
    [
        ("router", (*_NO_REDIS, "--redis-password-file", "{missing}"), "Redis password file"),
        (
            "jobs",
            (*_NO_REDIS, "--redis-password-file", "{missing}", "--gateway-address", "127.0.0.1:1"),
            "Redis password file",
        ),
        ("gateway", ("--api-keys-file", "{missing}", "--http-port", "-1"), "API keys file"),
        ("gateway", ("--api-keys-file", "{malformed}", "--http-port", "-1"), "API keys file"),
        (
            "gateway",
            ("--allow-unauthenticated", "--model-repository", "{missing}", "--http-port", "-1"),
            "model repository",
        ),
        (  # a file where the directory should be
            "gateway",
            ("--allow-unauthenticated", "--model-repository", "{empty}", "--http-port", "-1"),
            "model repository",
        ),
        (  # a group: its supervisor exits as its processes did
            "gateway",
            (*_NO_REDIS, "--api-keys-file", "{missing}", "--http-port", "-1", "--processes", "2"),
            "API keys file",
        ),
        (
            "jobs",
            (*_NO_REDIS, "--api-key-file", "{empty}", "--gateway-address", "127.0.0.1:1"),
            "API key file",
        ),
        (
            "router",
            ("--redis-url", "redis://u:p@127.0.0.1:1/0", "--redis-password-file", "{malformed}"),
            "not both",
        ),
    ],
)
def test_a_file_a_setting_names_that_cannot_be_used_exits_2_with_a_message(
    tmp_path: Path, tier: str, args: tuple[str, ...], named: str
) -> None:
    """A missing or malformed file that a setting names exits at start-up with status 2 and
    one line naming it, as a malformed flag does: before, a traceback and status 1."""
    malformed, empty = tmp_path / "malformed", tmp_path / "empty"
    malformed.write_text("[[keys]\n")
    empty.write_text("\n")
    paths = {"missing": tmp_path / "missing", "malformed": malformed, "empty": empty}
    argv = [a.format(**paths) for a in args]
    done = subprocess.run(
        [sys.executable, "-m", f"services.{tier}", "--metrics-port", "0", *argv],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert lines, done.stderr  # one line, one for each process of a group
    for line in lines:
        assert line.startswith(f"python -m services.{tier}: error: ") and named in line, line


@pytest.mark.parametrize(
    ("tier", "args"),
    [
        ("router", ()),
        ("gateway", ("--allow-unauthenticated", "--http-port", "-1", "--processes", "1")),
        (  # a group: before any of its processes starts
            "gateway",
            (*_NO_REDIS, "--allow-unauthenticated", "--http-port", "-1", "--processes", "2"),
        ),
        ("gpu_worker", ("--models", "minilm")),
    ],
)
def test_a_metrics_port_taken_exits_2_with_a_message(tier: str, args: tuple[str, ...]) -> None:
    """A metrics port another process holds: one line naming it and status 2. Before, a
    traceback and status 1, a gateway group's only once all its processes served."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        argv = ["--grpc-port", "0", "--metrics-port", str(port), *args]
        exits_2_naming(tier, argv, f"the metrics port {port}")


@pytest.mark.parametrize(
    ("tier", "flag", "named"),
    [
        ("router", "--grpc-port", "the gRPC address 127.0.0.1:{port}"),
        ("gateway", "--grpc-port", "the gRPC address 127.0.0.1:{port}"),
        ("gateway", "--http-port", "the HTTP port {port}"),
        ("router", "--health-port", "the gRPC address 127.0.0.1:{port}"),
    ],
)
def test_a_port_another_process_holds_exits_2_with_a_message(
    tier: str, flag: str, named: str
) -> None:
    """grpc binds with SO_REUSEPORT by default: a second router (or gateway, worker) started
    on a port another process held bound it too, silently, and the kernel split connections
    between the two (review finding). Only a supervisor's group shares its ports."""
    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)  # as grpc's listener does
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        ports = {"--grpc-port": "0", "--http-port": "0", flag: str(port)}
        if tier != "gateway":
            del ports["--http-port"]
        extra = ("--allow-unauthenticated", "--processes", "1") if tier == "gateway" else ()
        argv = ["--metrics-port", "0", *itertools.chain(*ports.items()), *extra]
        exits_2_naming(tier, argv, named.format(port=port))


def exits_2_naming(tier: str, argv: list[str], named: str) -> None:
    """`python -m services.<tier> --host 127.0.0.1 <argv>` exits 2 with one line saying that
    `named` cannot be used, and no traceback."""
    done = subprocess.run(
        [sys.executable, "-m", f"services.{tier}", "--host", "127.0.0.1", *argv],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert f"{named} cannot be used" in done.stderr, done.stderr


#: A gateway process that has read a setting it cannot use and exits 2 as its SIGTERM comes (its
#: own exit and the stop at once, as the supervisor sees it).
_EXITS_2_AT_ITS_STOP = (
    "import os, signal, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: os._exit(2))\n"
    "print('handler set', flush=True)\n"
    "time.sleep(60)\n"
)


@pytest.mark.parametrize(
    ("status", "is_ready", "expected"),
    [(2, False, 2), (0, False, 1), (2, True, 1)],
    ids=["failing-start", "normal-stop", "failing-start-member-ready"],
)
def test_a_group_stopping_takes_a_process_exiting_2_for_its_start_up_failure_only(
    tmp_path: Path, status: int, is_ready: bool, expected: int
) -> None:
    """A gateway group stopping because a process exited 2 at start-up (`status` 2) also
    stops the others: one not yet ready that exits 2 itself as its stop comes met the same
    setting, and the group exits 2 (it exited 1: seen once in a `make test`, both processes
    naming the missing keys file within 3 ms). In a normal stop (0), or from a process that
    was ready (its ready file written, though the supervisor had not read it yet), an exit 2
    is a stop that was not clean: 1."""
    config = GatewayConfig(model_repository=tmp_path, allow_unauthenticated=True)
    group = ProcessGroup(config, [], 1)
    ready_file = tmp_path / "ready.json"
    if is_ready:
        ready_file.write_text(json.dumps({"grpc_port": 1, "metrics_port": 1234}))
    with subprocess.Popen(
        [sys.executable, "-c", _EXITS_2_AT_ITS_STOP], stdout=subprocess.PIPE
    ) as child:
        try:
            assert child.stdout is not None and child.stdout.readline() == b"handler set\n"
            group._members[0] = Supervised(0, child, ready_file, time.monotonic())
            assert group._stop_all(status=status) == expected
            assert child.returncode == 2
        finally:
            child.kill()
            shutil.rmtree(group._state_dir, ignore_errors=True)
