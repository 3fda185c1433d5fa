"""The worker's settings: a setting that cannot work exits at parsing (status 2), naming it,
before anything starts."""

from __future__ import annotations

import pytest

from services.gpu_worker.config import parse_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("args", "named"),
    [
        # torch.set_num_threads(-1) raised at start, a traceback past the settings' checks.
        (["--torch-threads", "-1"], "torch_threads must be >= 0"),
        # Both failed only when the server was built.
        (["--max-concurrent-rpcs", "-1"], "max_concurrent_rpcs must be >= 0"),
        (["--max-message-bytes", "10"], "max_message_bytes must be at least 1024"),
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
