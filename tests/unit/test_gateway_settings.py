"""The gateway's settings: a setting that cannot work exits at parsing (status 2), naming it."""

from __future__ import annotations

import pytest

from services.gateway.config import parse_config
from services.jobs.config import parse_config as jobs_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("args", "named"),
    [
        # Every inference call was refused INVALID_ARGUMENT, blaming its caller.
        (["--max-inputs-per-request", "0"], "max_inputs_per_request must be >= 1"),
        # A single process served no HTTP; a process group's supervisor failed reserving it.
        (["--http-port", "-2"], "http_port must be a port in [-1, 65535]"),
        (["--metrics-port", "70000"], "metrics_port must be a port in [-1, 65535]"),
    ],
)
def test_a_setting_that_cannot_work_exits_at_parsing(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config(["--allow-unauthenticated", *args])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_the_job_runner_refuses_a_port_out_of_range(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        jobs_config(["--metrics-port", "70000"])
    assert exited.value.code == 2
    assert "metrics_port must be a port in [-1, 65535]" in capsys.readouterr().err
