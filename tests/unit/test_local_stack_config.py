"""The launcher's `--cpus TIERS=CPUS` pinning: parsed into one CPU set per tier, refused with a
message naming the entry at fault."""

from __future__ import annotations

import errno
import io
import re
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from services.local_stack import __main__ as stack
from services.local_stack.__main__ import keep_or_remove_state
from services.local_stack.children import Interrupted
from services.local_stack.config import parse_config, parse_cpus

pytestmark = pytest.mark.unit

FOUR = frozenset(range(4))


def test_tiers_and_cpu_ranges_become_one_set_per_tier() -> None:
    pinned = parse_cpus(["worker=2-3", "gateway, router,redis=0", "jobs=0,1"], available=FOUR)
    assert pinned == {
        "worker": frozenset({2, 3}),
        "gateway": frozenset({0}),
        "router": frozenset({0}),
        "redis": frozenset({0}),
        "jobs": frozenset({0, 1}),
    }
    assert parse_cpus([], available=FOUR) == {}


@pytest.mark.parametrize(
    ("specs", "message"),
    [
        (["worker=4"], "CPUs [4] are not available"),
        (["gpu=1"], "unknown tier 'gpu'"),
        (["worker=1", "worker=2"], "pinned twice"),
        (["worker"], "expected TIERS=CPUS"),
        (["worker=one"], "expected TIERS=CPUS"),
        (["worker=3-1"], "not a CPU range"),
    ],
)
def test_a_bad_entry_is_refused_by_name(specs: list[str], message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as error:
        parse_cpus(specs, available=FOUR)
    assert repr(specs[-1]) in str(error.value)


def test_routers_are_counted_and_bounded(tmp_path: Path) -> None:
    assert parse_config(["--state-dir", str(tmp_path)]).num_routers == 1
    assert parse_config(["--num-routers", "3", "--state-dir", str(tmp_path)]).num_routers == 3
    for count in ("0", "10"):
        with pytest.raises(SystemExit):
            parse_config(["--num-routers", count, "--state-dir", str(tmp_path)])


@pytest.mark.parametrize("value", ["nan", "inf", "-1"])
@pytest.mark.parametrize("flag", ["--ready-timeout-s", "--stop-timeout-s"])
def test_a_timeout_that_is_no_duration_is_refused(
    flag: str, value: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each was taken, and is no wait a tier's start or stop can be given (the last note's
    open item, `--ready-timeout-s nan`)."""
    with pytest.raises(SystemExit) as exited:
        parse_config([flag, value, "--state-dir", str(tmp_path)])
    assert exited.value.code == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize("is_clean", [True, False])
def test_a_tmp_state_dir_made_for_the_run_goes_at_a_clean_stop_and_is_kept_after_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, is_clean: bool
) -> None:
    """Each `make run` made a tmp dir of logs and Redis files that nothing removed (review
    finding). One named with --state-dir is the caller's, kept either way."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = parse_config([])
    assert made.is_state_temporary and made.state_dir.parent == tmp_path.resolve()
    (made.state_dir / "gateway.log").write_text("served")
    keep_or_remove_state(made, is_clean=is_clean)
    assert made.state_dir.exists() is not is_clean
    named = parse_config(["--state-dir", str(tmp_path / "mine")])
    named.state_dir.mkdir()
    keep_or_remove_state(named, is_clean=is_clean)
    assert not named.is_state_temporary and named.state_dir.exists()


class _HungUp(io.StringIO):
    """A terminal that hung up: every write fails EIO."""

    def write(self, text: str) -> int:
        raise OSError(errno.EIO, "Input/output error")


@pytest.fixture
def stack_main(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[str]]:
    """`main` with its start and stop stubbed (no tier runs): each test sets `start`'s end; the
    signal mask main blocks is restored after. Yields the stop calls' record."""
    stopped: list[str] = []
    monkeypatch.setattr(stack, "stop_all", lambda config, children: stopped.append("stop") or [])
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, [])
    try:
        yield stopped
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def test_a_hung_up_terminal_still_stops_the_stack_and_removes_its_state(
    stack_main: list[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGHUP stops the stack; a print to the terminal gone then raised EIO past the stop's
    clean-up, its tmp state dir left and the exit 1 (review finding)."""
    made: list[Path] = []

    def hung_up(config: Any, children: list[Any]) -> None:
        made.append(config.state_dir)
        monkeypatch.setattr(sys, "stdout", _HungUp())
        monkeypatch.setattr(sys, "stderr", _HungUp())
        raise Interrupted("SIGHUP")

    monkeypatch.setattr(stack, "start", hung_up)
    with pytest.raises(SystemExit) as exited:
        stack.main([])
    assert exited.value.code == 0 and stack_main == ["stop"]
    assert not made[0].exists()


def test_an_unexpected_error_is_said_the_stack_stopped_and_its_logs_kept(
    stack_main: list[str], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A --ready-file in a folder that does not exist failed the announcement after every tier
    started: a traceback, its stop's report and the kept logs never said (review finding)."""
    monkeypatch.setenv("GATEWAY_API_KEYS_FILE", "/etc/keys.toml")
    monkeypatch.setattr(stack, "start", lambda config, children: None)

    def unwritable(config: Any, children: list[Any]) -> None:
        raise FileNotFoundError(2, "No such file or directory", "out/ready.json")

    monkeypatch.setattr(stack, "announce", unwritable)
    with pytest.raises(SystemExit) as exited:
        stack.main([])
    assert exited.value.code == 1 and stack_main == ["stop"]
    out, err = capsys.readouterr()
    assert "GATEWAY_API_KEYS_FILE" in out  # a setting the tiers read from the shell is said
    assert "out/ready.json" in err and "logs kept in" in err
    state_dir = Path(err.split("logs kept in ")[1].strip())
    assert state_dir.is_dir()
    shutil.rmtree(state_dir)
