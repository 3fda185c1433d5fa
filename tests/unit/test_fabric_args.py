"""bench.fabric's command line: the stand-in's fixed flood rate."""

from __future__ import annotations

import pytest

from bench.fabric.__main__ import parse_args

pytestmark = pytest.mark.unit


def test_the_flood_rate_is_taken_as_given_and_absent_by_default() -> None:
    args, _ = parse_args(["--stand-in-only", "--no-peer", "--flood-rate", "2600"])
    assert args.flood_rate == 2600.0
    args, _ = parse_args(["--stand-in-only", "--no-peer"])
    assert args.flood_rate is None


@pytest.mark.parametrize("rate", ["0", "-5", "inf", "nan"])
def test_a_flood_rate_that_is_not_a_positive_number_is_refused(
    rate: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--stand-in-only", "--flood-rate", rate])
    assert "--flood-rate must be a positive number" in capsys.readouterr().err
