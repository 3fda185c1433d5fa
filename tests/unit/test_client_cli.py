"""The slim client's command line on bad input: one line and exit status 2, never a traceback;
and a results file written before is kept when fetching new results fails."""

from __future__ import annotations

from pathlib import Path

import pytest
from inference_fabric_client import Client, cli

pytestmark = pytest.mark.unit

#: Nothing listens here: a call fails UNAVAILABLE at once.
NOWHERE = ("--address", "127.0.0.1:1", "--timeout-s", "2")


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("--ca-file", "/no/such/ca.pem", "models"), "/no/such/ca.pem"),
        (("--timeout-s", "0", "models"), "timeout_s must be a finite number"),
        (("job", "submit", "/no/such/texts.jsonl"), "/no/such/texts.jsonl"),
        (("job", "submit", "--items-per-message", "0", "{texts}"), "items_per_message"),
        (("job", "submit", "{bad_json}"), "bad_json.jsonl:2: not JSON"),
        (("job", "submit", "{no_text}"), 'no_text.jsonl:1: an object needs "text"'),
        (("job", "submit", "{not_text}"), "not_text.jsonl:2: not a JSON string or an object"),
        (("job", "submit", "{number}"), "number.jsonl:1: not a JSON string or an object"),
    ],
)
def test_bad_input_is_one_line_and_status_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: tuple[str, ...], message: str
) -> None:
    # Before, each raised past main: a traceback, and exit status 1 as for a refused call.
    files = {"texts": '"a"\n"b"\n', "bad_json": '"a"\n{"text": \n', "no_text": '{"txt": "a"}\n',
             "not_text": '"a"\nnull\n', "number": '123\n"b"\n'}  # fmt: skip
    paths = {}
    for name, text in files.items():
        path = tmp_path / f"{name}.jsonl"
        path.write_text(text)
        paths[name] = str(path)
    status = cli.main([*NOWHERE, *(a.format(**paths) for a in args)])
    assert status == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and "Traceback" not in err


def test_a_results_file_written_before_is_kept_when_the_fetch_fails(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Before, the file was emptied before the first call: a mistyped job id or a gateway out
    # of reach left a good results file truncated.
    out = tmp_path / "results.jsonl"
    out.write_text('{"index": 0, "status": "ok"}\n')
    status = cli.main([*NOWHERE, "job", "results", "no-such-job", "--out", str(out)])
    assert status == 1
    assert "UNAVAILABLE" in capsys.readouterr().err
    assert out.read_text() == '{"index": 0, "status": "ok"}\n'
    assert [p.name for p in tmp_path.iterdir()] == ["results.jsonl"]


@pytest.mark.parametrize("timeout_s", [0.0, -1.0, float("nan"), float("inf")])
def test_a_client_refuses_a_default_timeout_that_is_never_or_always_due(timeout_s: float) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        Client("127.0.0.1:1", timeout_s=timeout_s)


@pytest.mark.parametrize("value", ["maybe", "2"])
def test_a_yes_no_setting_it_cannot_read_exits_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], value: str
) -> None:
    """FABRIC_TLS=maybe exited 1, the status of a call the gateway refused, where a setting
    that does not read is 2 (review finding)."""
    monkeypatch.setenv("FABRIC_TLS", value)
    with pytest.raises(SystemExit) as raised:
        cli.main([*NOWHERE, "models"])
    assert raised.value.code == 2
    assert "FABRIC_TLS must be one of" in capsys.readouterr().err
