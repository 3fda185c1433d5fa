"""The worker's settings: a setting that cannot work exits at parsing (status 2), naming it,
before anything starts."""

from __future__ import annotations

import pytest

from services.gpu_worker.config import parse_config
from services.router.config import parse_config as router_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("args", "named"),
    [
        # torch.set_num_threads(-1) raised at start, a traceback past the settings' checks.
        (["--torch-threads", "-1"], "torch_threads must be >= 0"),
        # Both failed only when the server was built.
        (["--max-concurrent-rpcs", "-1"], "max_concurrent_rpcs must be >= 0"),
        (["--max-message-bytes", "10"], "max_message_bytes must be at least 1024"),
        # A router's stream message past it ended the whole stream, every call on it failed.
        (["--max-message-bytes", str(8 << 20)], "must be at least 67108864 on an internal tier"),
        (["--heartbeat-period-s", "5"], "must exceed its period"),
    ],
)
def test_a_setting_that_cannot_work_exits_at_parsing(
    args: list[str], named: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_config(["--model-repository", "models", *args])
    assert exited.value.code == 2
    assert named in capsys.readouterr().err


def test_a_router_refuses_a_message_limit_its_workers_streams_would_pass(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exited:
        router_config(["--max-message-bytes", str(8 << 20)])
    assert exited.value.code == 2
    assert "must be at least 67108864 on an internal tier" in capsys.readouterr().err
