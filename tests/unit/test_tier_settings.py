"""Each tier's settings: a setting that cannot work exits at parsing (status 2), naming it,
before anything starts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import pytest

from services.gateway.config import parse_config as gateway
from services.gpu_worker.config import parse_config as worker
from services.jobs.config import parse_config as jobs
from services.router.config import parse_config as router

pytestmark = pytest.mark.unit

WORKER = (worker, ["--model-repository", "models"])
GATEWAY = (gateway, ["--allow-unauthenticated"])


@pytest.mark.parametrize(
    ("tier", "args", "named"),
    [
        # torch.set_num_threads(-1) raised at start, a traceback past the settings' checks.
        (WORKER, ["--torch-threads", "-1"], "torch_threads must be >= 0"),
        # Both failed only when the server was built.
        (WORKER, ["--max-concurrent-rpcs", "-1"], "max_concurrent_rpcs must be >= 0"),
        (WORKER, ["--max-message-bytes", "10"], "max_message_bytes must be in"),
        # grpc takes it as a C int: past one, a traceback when the server was built (review).
        (WORKER, ["--max-message-bytes", str(2**31)], "max_message_bytes must be in"),
        # Below 1 a healthy fleet's calls count as excess: refusals climbed to the cap.
        (GATEWAY, ["--throttle-accepts-multiplier", "0.5"], "accepts_multiplier must be 0"),
        # A peer's stream message past it ended the whole stream, every call on it failed.
        (WORKER, ["--max-message-bytes", str(8 << 20)], "at least 67108864 on an internal tier"),
        ((router, []), ["--max-message-bytes", str(8 << 20)], "at least 67108864 on an internal"),
        (WORKER, ["--heartbeat-period-s", "5"], "must exceed its period"),
        # Every inference call was refused INVALID_ARGUMENT, blaming its caller.
        (GATEWAY, ["--max-inputs-per-request", "0"], "max_inputs_per_request must be >= 1"),
        # A single process served no HTTP; a process group's supervisor failed reserving it.
        (GATEWAY, ["--http-port", "-2"], "http_port must be a port in [-1, 65535]"),
        (GATEWAY, ["--metrics-port", "70000"], "metrics_port must be a port in [-1, 65535]"),
        ((jobs, []), ["--metrics-port", "70000"], "metrics_port must be a port in [-1, 65535]"),
    ],
)
def test_a_setting_that_cannot_work_exits_at_parsing(
    tier: tuple[Callable[[Sequence[str]], Any], list[str]],
    args: list[str],
    named: str,
    capsys: pytest.CaptureFixture[str],
) -> None:
    parse, required = tier
    with pytest.raises(SystemExit) as exited:
        parse([*required, *args])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err
