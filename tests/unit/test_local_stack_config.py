"""The launcher's `--cpus TIERS=CPUS` pinning: parsed into one CPU set per tier, refused with a
message naming the entry at fault."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

from services.local_stack.__main__ import keep_or_remove_state
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
