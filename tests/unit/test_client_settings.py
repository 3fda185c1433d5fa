"""The slim client's channel settings (inference_fabric_client.Client, its command line): TLS
settings never leave a channel plaintext."""

from __future__ import annotations

import pytest
from inference_fabric_client import Client, FabricError, cli

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "setting",
    [
        {"root_certificates": b"-----BEGIN CERTIFICATE-----"},
        {"client_certificate": b"x", "client_key": b"y"},
        {"server_name": "gateway"},
    ],
)
def test_tls_settings_without_tls_are_refused(setting: dict) -> None:
    """Before, they were ignored: a plaintext channel, the API key sent in clear."""
    with pytest.raises(ValueError, match="tls=True"):
        Client("127.0.0.1:1", api_key="secret", **setting)
    Client("127.0.0.1:1", api_key="secret", tls=True, **setting).close()  # with TLS: taken


class Recorded(Exception):
    """Raised by `recorded_clients`' stand-in for the Client, once it noted its settings."""


def recorded_clients(monkeypatch: pytest.MonkeyPatch) -> list[dict]:
    """The settings the command line makes each Client with (none is made: Recorded)."""
    made: list[dict] = []

    def record(address: str, **settings: object) -> None:
        made.append(settings)
        raise Recorded

    monkeypatch.setattr(cli, "Client", record)
    return made


def test_the_command_lines_ca_file_turns_tls_on(monkeypatch: pytest.MonkeyPatch) -> None:
    made = recorded_clients(monkeypatch)
    with pytest.raises(Recorded):
        cli.main(["--address", "127.0.0.1:1", "--ca-file", "ca.pem", "models"])
    assert made[0]["tls"] is True and made[0]["root_certificates"] == "ca.pem"
    with pytest.raises(Recorded):
        cli.main(["--address", "127.0.0.1:1", "--server-name", "gateway", "models"])
    assert made[1]["tls"] is True and made[1]["server_name"] == "gateway"


def test_a_closed_client_refuses_calls_as_cancelled() -> None:
    """Before, grpc's ValueError ("Cannot invoke RPC on closed channel!") came out."""
    client = Client("127.0.0.1:1", throttle=None)
    client.close()
    for call in (
        lambda: client.predict("m", ["x"]),
        lambda: list(client.generate("m", "x")),
        lambda: client.models(),
    ):
        with pytest.raises(FabricError) as refused:
            call()
        assert refused.value.code == "CANCELLED"


@pytest.mark.parametrize("timeout_s", [float("nan"), float("inf")])
def test_a_call_timeout_that_is_no_number_of_seconds_is_refused(timeout_s: float) -> None:
    """The client's own timeout was checked, a call's was not: NaN went out as no time at
    all (DEADLINE_EXCEEDED, or grpc's error on a stream), infinity as no deadline, retries
    then bounded by their count alone (review finding)."""
    with Client("127.0.0.1:1", throttle=None) as client:
        for call in (
            lambda: client.predict("m", ["x"], timeout_s=timeout_s),
            lambda: list(client.generate("m", "x", timeout_s=timeout_s)),
        ):
            with pytest.raises(ValueError, match="finite number of seconds"):
                call()


def test_a_client_closed_by_another_thread_as_a_call_starts_refuses_it_as_cancelled() -> None:
    """Closed between the call's check and its send (another thread's `close`), grpc raises
    ValueError ("Cannot invoke RPC on closed channel!"): the caller gets CANCELLED, as for a
    call made after the close (review finding)."""
    client = Client("127.0.0.1:1", throttle=None)
    send = client._channel.unary_unary("/inference.v1.InferenceService/Predict")

    def closed_as_sent(request: bytes, **settings: object) -> object:
        client.close()  # as another thread would, just after the check
        return send(request, **settings)

    with pytest.raises(FabricError) as refused:
        client._attempts(closed_as_sent, b"", 1.0)
    assert refused.value.code == "CANCELLED"


def test_generate_checks_its_arguments_at_the_call_not_at_the_first_next() -> None:
    """A generator function checked nothing until its first `next`: a bad priority, a closed
    client or no time left surfaced wherever the stream was first read (review finding)."""
    with Client("127.0.0.1:1", throttle=None) as client:
        with pytest.raises(ValueError, match="priority must be one of"):
            client.generate("m", "x", priority="urgent")
        with pytest.raises(FabricError) as late:
            client.generate("m", "x", timeout_s=0.0)
        assert late.value.code == "DEADLINE_EXCEEDED"
    with pytest.raises(FabricError) as closed:
        client.generate("m", "x")
    assert closed.value.code == "CANCELLED"


@pytest.mark.parametrize(
    ("value", "tls"), [("true", True), ("YES", True), ("1", True), ("off", False), ("", False)]
)
def test_fabric_tls_reads_the_usual_spellings_of_yes_and_no(
    monkeypatch: pytest.MonkeyPatch, value: str, tls: bool
) -> None:
    """FABRIC_TLS=true, read as not "1", made the channel plaintext and sent the API key in
    clear (review finding)."""
    made = recorded_clients(monkeypatch)
    monkeypatch.setenv("FABRIC_TLS", value)
    with pytest.raises(Recorded):
        cli.main(["--address", "127.0.0.1:1", "models"])
    assert made[0]["tls"] is tls


@pytest.mark.parametrize("one_text", ["hello world", b"hello world"])
def test_a_lone_string_is_refused_not_sent_as_one_input_a_character(one_text: str) -> None:
    """Iterated, "hello world" was 11 one-character inputs, answered 11 x 384 (review
    finding): a TypeError now, nothing sent (the client's address has no server)."""
    with Client("127.0.0.1:1", throttle=None) as client:
        with pytest.raises(TypeError, match="wrap one text"):
            client.embed(one_text)  # type: ignore[arg-type]
        with pytest.raises(TypeError, match="wrap one text"):
            client.predict("minilm", one_text)  # type: ignore[arg-type]
