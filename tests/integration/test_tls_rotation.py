"""A certificate rotated in place (as cert-manager rewrites a mounted Secret) is served to new
connections on the gateway's gRPC and HTTP ports without a restart; a half-rotated, mismatched
pair keeps the certificate served before. Real TLS on loopback, certificates made at test time
by two throwaway CAs: the port starts with one's certificate and is rotated to the other's."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import shutil
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest

from services.common.tls import CertificateFiles, ClientTls, ServerTls
from tests.integration.test_tls import health_code, start_gateway
from tests.support.pki import Authority, Issued
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration


def serve(issued: Issued, served: Issued) -> None:
    """Rotates `served`'s files to `issued`'s: each replaced whole, the key first."""
    for source, target in ((issued.key, served.key), (issued.cert, served.cert)):
        staged = target.with_suffix(".new")
        shutil.copyfile(source, staged)
        staged.replace(target)


def https_status(port: int, ca: Authority) -> int | str:
    """The status of GET /v2/health/live over TLS verified by `ca`, or the TLS failure."""
    context = ssl.create_default_context(cafile=str(ca.ca_file))
    try:
        with urllib.request.urlopen(
            f"https://127.0.0.1:{port}/v2/health/live", context=context, timeout=10
        ) as response:
            return int(response.status)
    except urllib.error.URLError as error:
        return type(error.reason).__name__


async def test_a_certificate_rotated_in_place_is_served_to_new_connections(
    tmp_path: Path,
) -> None:
    old_ca, new_ca = Authority(tmp_path / "old", "old"), Authority(tmp_path / "new", "new")
    old = old_ca.issue("gateway-old", ips=("127.0.0.1",))
    new = new_ca.issue("gateway-new", ips=("127.0.0.1",))
    served = Issued(tmp_path / "served.crt", tmp_path / "served.key")
    serve(old, served)
    gateway = await start_gateway(tmp_path, ServerTls(cert_file=served.cert, key_file=served.key))
    address = f"127.0.0.1:{gateway.port}"
    assert gateway.http is not None
    http_port = gateway.http.port
    trusts_old, trusts_new = ClientTls(ca_file=old_ca.ca_file), ClientTls(ca_file=new_ca.ca_file)
    try:
        assert await health_code(address, trusts_old) == grpc.StatusCode.OK
        assert await health_code(address, trusts_new) == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.to_thread(https_status, http_port, old_ca) == 200

        # Half rotated: the new key beside the old certificate. The old pair stays served.
        shutil.copyfile(new.key, served.key)
        assert await health_code(address, trusts_old) == grpc.StatusCode.OK
        assert await asyncio.to_thread(https_status, http_port, old_ca) == 200

        serve(new, served)

        async def serves_new() -> bool:
            return await health_code(address, trusts_new) == grpc.StatusCode.OK

        async def https_serves_new() -> bool:
            return await asyncio.to_thread(https_status, http_port, new_ca) == 200

        # Each port follows the files on its own: after the half-rotated pair failed to load,
        # each tries again a second after its own failure, so one may serve the new pair a
        # moment before the other.
        await eventually(serves_new, timeout_s=10, interval_s=0.1)
        await eventually(https_serves_new, timeout_s=10, interval_s=0.1)
        assert await health_code(address, trusts_old) == grpc.StatusCode.UNAVAILABLE
        assert await asyncio.to_thread(https_status, http_port, old_ca) == (
            "SSLCertVerificationError"
        )
    finally:
        await gateway.stop()


def test_handshakes_at_once_after_a_rotation_read_it_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """grpc's C-core threads ask for the port's certificate at each new connection, several at
    once: each that saw the files changed read them again (a read taking a while here, as a
    slow volume's), logging the rotation as often, and could set back what another served.
    One reads it; the others find it served."""
    ca = Authority(tmp_path / "ca", "ca")
    old, new = ca.issue("old", ips=("127.0.0.1",)), ca.issue("new", ips=("127.0.0.1",))
    served = Issued(tmp_path / "served.crt", tmp_path / "served.key")
    serve(old, served)
    tls = ServerTls(cert_file=served.cert, key_file=served.key)
    files = CertificateFiles(tls)
    read_checked = ServerTls.read_checked

    def slow_read(self: ServerTls) -> tuple[bytes, bytes, bytes | None]:
        time.sleep(0.05)
        return read_checked(self)

    monkeypatch.setattr(ServerTls, "read_checked", slow_read)
    serve(new, served)
    barrier = threading.Barrier(8)

    def handshake() -> bool:
        barrier.wait()
        return files.read_if_changed() is not None

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        reads = list(pool.map(lambda _: handshake(), range(8)))
    assert sum(reads) == 1, reads
    assert files.read_if_changed() is None  # served: nothing changed since


def test_each_broken_rotation_is_logged_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A rotation to a pair that does not fit is logged once while it lasts; a second, other
    broken one after it was never logged until one worked (review finding). A good rotation
    then serves."""
    monkeypatch.setattr(CertificateFiles, "RETRY_S", 0.0)
    ca = Authority(tmp_path / "ca", "ca")
    first, second, good = (ca.issue(n, ips=("127.0.0.1",)) for n in ("a", "b", "c"))
    served = Issued(tmp_path / "served.crt", tmp_path / "served.key")
    serve(first, served)
    files = CertificateFiles(ServerTls(cert_file=served.cert, key_file=served.key))
    with caplog.at_level(logging.WARNING, logger="services.common.tls"):
        for broken_key in (second.key, good.key):  # each a key of another certificate
            shutil.copyfile(broken_key, tmp_path / "served.key.new")
            (tmp_path / "served.key.new").replace(served.key)
            for _ in range(3):
                assert files.read_if_changed() is None
    warnings = [r for r in caplog.records if "not usable yet" in r.getMessage()]
    assert len(warnings) == 2, [r.getMessage() for r in warnings]
    serve(good, served)
    assert files.read_if_changed() is not None
