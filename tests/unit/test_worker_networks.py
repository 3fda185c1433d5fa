"""The router's worker address allowlist: which registry records it will ever dial."""

from __future__ import annotations

import pytest

from services.common.registry_schema import WorkerRecord
from services.router.config import RouterConfig, parse_config
from services.router.worker_networks import (
    DEFAULT_WORKER_NETWORKS,
    WorkerNetworks,
    address_host,
    admit_records,
)

pytestmark = pytest.mark.unit


def make_record(*, worker_id: str = "w0", address: str = "127.0.0.1:8201") -> WorkerRecord:
    return WorkerRecord(
        worker_id=worker_id, address=address, is_draining=False, sent_at_ms=0, models=()
    )


@pytest.mark.parametrize(
    ("address", "is_admitted"),
    [
        ("127.0.0.1:8201", True),
        ("127.9.9.9:1", True),
        ("10.255.0.1:8201", False),
        ("192.168.1.5:8201", False),
        ("[::1]:8201", False),
        ("localhost:8201", False),
        ("127.0.0.1", False),
        ("127.0.0.1:0", False),
        ("127.0.0.1:65536", False),
        ("127.0.0.1:port", False),
        (":8201", False),
        ("", False),
    ],
)
def test_loopback_only(address: str, is_admitted: bool) -> None:
    assert WorkerNetworks.parse("127.0.0.0/8").admits(address) is is_admitted


def test_default_admits_loopback_and_private_ranges_only() -> None:
    networks = WorkerNetworks.parse(DEFAULT_WORKER_NETWORKS)
    for address in ("127.0.0.1:1", "10.244.3.7:8201", "172.31.0.9:1", "192.168.0.2:1",
                    "[::1]:1", "[fd12::5]:8201"):  # fmt: skip
        assert networks.admits(address), address
    for address in ("8.8.8.8:8201", "172.32.0.1:1", "[2001:db8::1]:1", "evil.example.com:1",
                    "0.0.0.0:8201", "169.254.169.254:80"):  # fmt: skip
        assert not networks.admits(address), address


def test_hostnames_only_under_a_listed_suffix() -> None:
    networks = WorkerNetworks.parse("10.0.0.0/8, .fabric.svc.cluster.local")
    assert networks.admits("gpu-worker-0.fabric.svc.cluster.local:8201")
    assert networks.admits("GPU-WORKER-0.Fabric.svc.cluster.local.:8201")
    assert not networks.admits("evilfabric.svc.cluster.local:8201")
    assert not networks.admits("fabric.svc.cluster.local.evil.com:8201")
    assert not networks.admits("bad_name.fabric.svc.cluster.local:8201")
    assert not WorkerNetworks.parse("10.0.0.0/8").admits("worker.fabric.svc.cluster.local:1")


@pytest.mark.parametrize(
    "text", ["", " , ", "10.0.0.0/33", "10.0.0.1/8", "not-a-network", ".", ".bad_suffix"]
)
def test_parse_refuses_what_is_not_a_network(text: str) -> None:
    with pytest.raises(ValueError):
        WorkerNetworks.parse(text)


def test_parse_round_trips_through_its_text() -> None:
    networks = WorkerNetworks.parse("10.1.0.0/16,fd00::/8,.svc.cluster.local,192.168.7.7")
    assert str(networks) == "10.1.0.0/16,fd00::/8,192.168.7.7/32,.svc.cluster.local"
    assert WorkerNetworks.parse(str(networks)) == networks


def test_address_host_forms() -> None:
    assert address_host("10.0.0.1:80") == "10.0.0.1"
    assert address_host("[fd00::1]:80") == "fd00::1"
    assert address_host("fd00::1:80") is None  # a bare IPv6 address: the port is ambiguous
    assert address_host("worker:80") == "worker"


def test_admit_records_keeps_heartbeats_and_reports_the_rest() -> None:
    good, forged = make_record(), make_record(worker_id="forged", address="10.255.0.1:8201")
    split = admit_records([(good, 1.5), (forged, 2.5)], WorkerNetworks.parse("127.0.0.0/8"))
    assert split.admitted == [(good, 1.5)]
    assert split.rejected == [forged]


def test_router_setting_parses_and_rejects_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    config = parse_config(["--worker-networks", "127.0.0.0/8,10.244.0.0/16"], {})
    assert config.worker_networks == WorkerNetworks.parse("127.0.0.0/8,10.244.0.0/16")
    assert RouterConfig(redis_url="redis://x").worker_networks == WorkerNetworks.parse(
        DEFAULT_WORKER_NETWORKS
    )
    with pytest.raises(SystemExit) as exit_info:
        parse_config(["--worker-networks", "10.0.0.0/33"], {})
    assert exit_info.value.code == 2
    assert "worker-networks" in capsys.readouterr().err


def test_a_port_of_non_ascii_digits_is_no_port() -> None:
    """ "²".isdigit() is True and int("²") raises: such a port was a ValueError out of the
    router's registry refresh."""
    assert address_host("10.0.0.1:²") is None
    assert address_host("10.0.0.1:٨٠") is None  # Arabic-Indic digits


def test_a_port_of_thousands_of_digits_is_no_port() -> None:
    """int() refuses more than 4,300 digits: such a forged record raised out of the router's
    registry refresh, which then kept its old snapshot until every call was refused."""
    assert address_host("10.0.0.1:" + "1" * 5_000) is None
    assert address_host("10.0.0.1:000080") is None  # six digits: no port either
    assert address_host("10.0.0.1:08080") == "10.0.0.1"
