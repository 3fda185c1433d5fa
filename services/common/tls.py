"""TLS on the tiers' gRPC: server credentials, client credentials and channels from PEM files.

Every tier's gRPC port serves TLS once it has a certificate and key (`--tls-cert-file`,
`--tls-key-file`); with `--tls-client-ca-file` as well, a caller must present a certificate that
CA signed (mTLS), and one without is refused during the handshake. The tiers that call another
(gateway -> router, router -> worker) dial over TLS once they have the CA that signed the
callee's certificate (`--<peer>-tls-ca-file`), presenting their own certificate with
`--<peer>-tls-cert-file` and `--<peer>-tls-key-file`. Nothing set: plaintext, as before.

Names in certificates: a client checks the callee's certificate against the host it dials. The
gateway dials the router's Service by DNS name, which the router's certificate carries. Routers
dial workers at the pod IPs workers advertise, which change with every pod; rather than a
certificate per IP, `--worker-tls-server-name` names what routers expect instead (gRPC's
`grpc.ssl_target_name_override`), and the workers' certificate carries that DNS name. Without a
server name the dialled host itself (an IP: an IP SAN) must be in the certificate.

Kubelet's gRPC probes cannot speak TLS, let alone present a client certificate: `--health-port`
opens a second, plaintext listener that serves only grpc.health.v1 (status, no data) for them.
A port's own certificate, key and client CA are read again when their files change
(`CertificateFiles`: checked at each new connection's handshake), so a certificate rotated in
place, as cert-manager rewrites a mounted Secret, is served to new connections without a
restart; a half-written or mismatched pair keeps the one served before. The certificates a tier
presents as a client (`--<peer>-tls-*`) and the CAs it verifies peers with are read at start-up
only: after rotating those, the pods must be restarted (a rollout, or a reloader watching the
Secret); nothing here restarts them.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2_grpc

from services.common.channel_options import CHANNEL_OPTIONS
from services.common.processes import shares_ports
from services.common.settings import Setting, StartupError

log = logging.getLogger(__name__)

_PEM_MARKER = b"-----BEGIN "


def read_pem(path: Path, what: str) -> bytes:
    """The file's bytes; ValueError naming `what` and the path if it is unreadable or not PEM."""
    try:
        data = path.read_bytes()
    except OSError as error:
        raise ValueError(f"{what} {path} cannot be read: {error.strerror or error}") from None
    if _PEM_MARKER not in data:
        raise ValueError(f"{what} {path} is not PEM (no '-----BEGIN' line)")
    return data


def _check_pair(cert_file: Path | None, key_file: Path | None, whose: str) -> None:
    if key_file is not None and cert_file is None:
        raise ValueError(f"{whose} TLS key {key_file} is given without its certificate file")
    if cert_file is not None and key_file is None:
        raise ValueError(f"{whose} TLS certificate {cert_file} is given without its key file")


def _check_fits(cert_file: Path | None, key_file: Path | None) -> None:
    """ValueError unless the key is the certificate's: a pair that does not fit fails every
    handshake."""
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
            str(cert_file), str(key_file)
        )
    except (OSError, ssl.SSLError) as error:
        raise ValueError(f"TLS key {key_file} does not fit {cert_file}: {error}") from None


@dataclass(frozen=True)
class ServerTls:
    """How a tier's gRPC port is secured. All None: plaintext. Files are checked when the
    config is built (a bad one exits with status 2) and read again by `credentials`."""

    #: PEM certificate chain the port presents; with `key_file`, the port serves TLS only.
    cert_file: Path | None = None
    #: PEM private key of `cert_file`.
    key_file: Path | None = None
    #: PEM CA bundle; when set, callers must present a certificate it signed (mTLS).
    client_ca_file: Path | None = None
    #: Port of a plaintext listener serving only grpc.health.v1, for kubelet probes; None: none.
    health_port: int | None = None

    def __post_init__(self) -> None:
        _check_pair(self.cert_file, self.key_file, "server")
        if self.client_ca_file is not None and self.cert_file is None:
            raise ValueError(
                f"client CA {self.client_ca_file} needs the server's own TLS certificate and key"
            )
        if self.health_port is not None and not 0 <= self.health_port <= 65535:
            raise ValueError(f"health port {self.health_port} is not a port number")
        if self.cert_file is not None and self.key_file is not None:
            # The pair checked too: one that does not fit passed here, the port served, its
            # health said SERVING, and every handshake failed (review finding).
            self.read_checked()

    @property
    def is_enabled(self) -> bool:
        return self.cert_file is not None

    @property
    def requires_client_cert(self) -> bool:
        return self.client_ca_file is not None

    def _read(self) -> tuple[bytes, bytes, bytes | None]:
        if self.cert_file is None or self.key_file is None:
            raise ValueError("no TLS certificate and key configured")
        cert = read_pem(self.cert_file, "TLS certificate")
        key = read_pem(self.key_file, "TLS key")
        ca = None
        if self.client_ca_file is not None:
            ca = read_pem(self.client_ca_file, "TLS client CA")
        return cert, key, ca

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(p for p in (self.cert_file, self.key_file, self.client_ca_file) if p)

    def read_checked(self) -> tuple[bytes, bytes, bytes | None]:
        """(certificate, key, client CA) as the files hold them now; ValueError where one is
        unreadable or not PEM, or the key is not the certificate's."""
        cert, key, ca = self._read()
        _check_fits(self.cert_file, self.key_file)
        return cert, key, ca

    def credentials(self) -> grpc.ServerCredentials:
        """The port's credentials, read again when the files change (at a new connection)."""
        files = CertificateFiles(self)
        cert, key, ca = self._read()

        def current() -> grpc.ServerCertificateConfiguration | None:
            read = files.read_if_changed()
            if read is None:
                return None
            cert, key, ca = read
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

        return grpc.dynamic_ssl_server_credentials(
            grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca),
            current,  # type: ignore[arg-type]  # grpc's docs: None keeps the one served
            require_client_authentication=ca is not None,
        )


class CertificateFiles:
    """A server's PEM files, read again once one of them changes (its modification or change
    time, size, inode or device: a file rewritten, or a Secret volume's symlink swapped)."""

    #: Seconds between tries of files that changed but could not be used yet.
    RETRY_S = 1.0

    def __init__(self, tls: ServerTls) -> None:
        self._tls = tls
        #: grpc's C-core threads handshake concurrently, each asking: one read at a time, so
        #: a rotation is read and logged once, and no thread sets back what another served.
        self._lock = threading.Lock()
        #: The stamp of the files last served.
        self._served = self._stamp()
        #: When files that changed last failed to read (they are tried again after RETRY_S,
        #: even if they look unchanged since: a write may keep the stamp the failed read saw).
        self._failed_at_s: float | None = None
        #: The stamp of the files that last failed: logged once each (a second, different
        #: broken rotation after the first went unsaid until one worked: review finding).
        self._failed_stamp: tuple[tuple[int, ...], ...] | None = None

    def _stamp(self) -> tuple[tuple[int, ...], ...]:
        try:
            stats = [os.stat(p) for p in self._tls.files]
        except OSError:
            return ()  # mid-rotation: read when they are back
        return tuple((s.st_mtime_ns, s.st_ctime_ns, s.st_size, s.st_ino, s.st_dev) for s in stats)

    def read_if_changed(self) -> tuple[bytes, bytes, bytes | None] | None:
        """The files' contents if they changed since the ones served, and hold a matching
        pair; else None (unchanged, or not usable yet: the certificate served stays)."""
        with self._lock:
            return self._read_if_changed()

    def _read_if_changed(self) -> tuple[bytes, bytes, bytes | None] | None:
        stamp = self._stamp()
        if stamp == self._served or not stamp:
            return None
        now_s = time.monotonic()
        if self._failed_at_s is not None and now_s - self._failed_at_s < self.RETRY_S:
            return None
        try:
            read = self._tls.read_checked()
        except ValueError as error:
            if stamp != self._failed_stamp:
                log.warning("TLS: the rotated files are not usable yet, serving the old: %s", error)
            self._failed_at_s, self._failed_stamp = now_s, stamp
            return None
        self._served, self._failed_at_s, self._failed_stamp = stamp, None, None
        log.info("TLS: serving the certificate rotated in %s", self._tls.cert_file)
        return read


@dataclass(frozen=True)
class ClientTls:
    """How a tier dials its peer. All unset: plaintext."""

    #: PEM CA bundle that verifies the peer's certificate; setting it dials over TLS.
    ca_file: Path | None = None
    #: PEM certificate presented to the peer (mTLS), with `key_file`.
    cert_file: Path | None = None
    #: PEM private key of `cert_file`.
    key_file: Path | None = None
    #: Name expected in the peer's certificate instead of the dialled host; "" checks the host.
    server_name: str = ""

    def __post_init__(self) -> None:
        _check_pair(self.cert_file, self.key_file, "client")
        if self.cert_file is not None and self.ca_file is None:
            raise ValueError(
                f"client certificate {self.cert_file} is given without the CA file that "
                "verifies the server"
            )
        if self.server_name and self.ca_file is None:
            raise ValueError(f"TLS server name {self.server_name!r} is given without a CA file")
        if self.ca_file is not None:
            self._read()
            if self.cert_file is not None:  # else every call to the peer failed its handshake
                _check_fits(self.cert_file, self.key_file)

    @property
    def is_enabled(self) -> bool:
        return self.ca_file is not None

    def _read(self) -> tuple[bytes, bytes | None, bytes | None]:
        if self.ca_file is None:
            raise ValueError("no TLS CA configured")
        ca = read_pem(self.ca_file, "TLS CA")
        if self.cert_file is None or self.key_file is None:
            return ca, None, None
        cert = read_pem(self.cert_file, "TLS client certificate")
        return ca, read_pem(self.key_file, "TLS client key"), cert

    def credentials(self) -> grpc.ChannelCredentials:
        ca, key, cert = self._read()
        return grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )


def add_port(server: grpc.aio.Server, address: str, tls: ServerTls) -> int:
    """Binds `address` (host:port) with TLS when configured, plaintext otherwise; the bound
    port. One another process holds is a StartupError (status 2, one line)."""
    try:
        if not tls.is_enabled:
            return server.add_insecure_port(address)
        return server.add_secure_port(address, tls.credentials())
    except RuntimeError as error:  # grpc's "Failed to bind": taken, or not an address here
        raise StartupError(f"the gRPC address {address} cannot be used: {error}") from None


def open_channel(
    address: str, tls: ClientTls, options: Sequence[tuple[str, Any]] = CHANNEL_OPTIONS
) -> grpc.aio.Channel:
    """A channel to `address`: secure when `tls` is configured, else plaintext; `options` as
    for any of the tiers' channels (channel_options.CHANNEL_OPTIONS)."""
    if not tls.is_enabled:
        return grpc.aio.insecure_channel(address, options=options)
    if tls.server_name:
        options = (*options, ("grpc.ssl_target_name_override", tls.server_name))
    return grpc.aio.secure_channel(address, tls.credentials(), options=options)


def check_distinct_ports(**ports: int | None) -> None:
    """Raises ValueError when two of a tier's listeners are given one fixed port: in a group's
    process every listener sets SO_REUSEPORT, so both would bind, and the kernel would split
    connections between them at random (a health-only listener answering real calls
    UNIMPLEMENTED); elsewhere the second would fail to bind. Ports 0 (a free one), negative
    (off) and None (not set) are never alike."""
    taken: dict[int, str] = {}
    for name, port in ports.items():
        if port is not None and not -1 <= port <= 65535:  # -1: off (where it may be)
            raise ValueError(f"{name} must be a port in [-1, 65535], got {port}")
        if port is None or port <= 0:
            continue
        if port in taken:
            raise ValueError(f"{taken[port]} and {name} are both port {port}")
        taken[port] = name


@dataclass(frozen=True)
class HealthListener:
    """A tier's plaintext health-only server and the port it bound (`--health-port 0`: a
    free one, which the tier writes to its ready file as `health_port`)."""

    server: grpc.aio.Server
    port: int

    async def stop(self, grace: float | None) -> None:
        await self.server.stop(grace=grace)


async def start_health_listener(
    servicer: health.aio.HealthServicer, host: str, tls: ServerTls, beside: grpc.aio.Server
) -> HealthListener | None:
    """With `tls.health_port` set, a started plaintext server on it that serves only
    `servicer` (the tier's own health statuses); None otherwise. Its port taken, `beside`
    (the tier's started server) is stopped before the StartupError is raised."""
    if tls.health_port is None:
        return None
    server = grpc.aio.server(options=[("grpc.so_reuseport", int(shares_ports()))])
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    try:
        port = add_port(server, f"{host}:{tls.health_port}", ServerTls())  # plaintext
    except StartupError:
        await beside.stop(None)
        raise
    await server.start()
    return HealthListener(server, port)


def health_port_field(health: HealthListener | int | None) -> dict[str, int]:
    """The ready file's `health_port` field: the port of a tier's health listener, or the
    one its children serve (a worker's fronts); none without one."""
    port = health.port if isinstance(health, HealthListener) else health
    return {} if port is None else {"health_port": port}


def server_tls_settings(field: str = "tls") -> tuple[Setting, ...]:
    """The settings of a tier's gRPC port security, into its config's ServerTls `field`."""
    return (
        Setting(
            "tls_cert_file",
            Path,
            None,
            "PEM certificate chain the gRPC port presents; with --tls-key-file the port serves "
            "TLS only (unset: plaintext)",
            field=f"{field}.cert_file",
        ),
        Setting(
            "tls_key_file", Path, None, "PEM key of --tls-cert-file", field=f"{field}.key_file"
        ),
        Setting(
            "tls_client_ca_file",
            Path,
            None,
            "PEM CA bundle: callers must present a certificate it signed (mTLS)",
            field=f"{field}.client_ca_file",
        ),
        Setting(
            "health_port",
            int,
            None,
            "plaintext port serving only grpc.health.v1, for probes that cannot speak TLS "
            "(unset: none; 0: a free one, written to the ready file)",
            "port",
            field=f"{field}.health_port",
        ),
    )


def client_tls_settings(peer: str, field: str) -> tuple[Setting, ...]:
    """The settings of how a tier dials `peer` (router, worker), into its ClientTls `field`."""
    return (
        Setting(
            f"{peer}_tls_ca_file",
            Path,
            None,
            f"PEM CA bundle that verifies the {peer}s' certificates; setting it dials {peer}s "
            "over TLS (unset: plaintext)",
            field=f"{field}.ca_file",
        ),
        Setting(
            f"{peer}_tls_cert_file",
            Path,
            None,
            f"PEM client certificate presented to {peer}s (mTLS)",
            field=f"{field}.cert_file",
        ),
        Setting(
            f"{peer}_tls_key_file",
            Path,
            None,
            f"PEM key of --{peer}-tls-cert-file",
            field=f"{field}.key_file",
        ),
        Setting(
            f"{peer}_tls_server_name",
            str,
            "",
            f"name the {peer}s' certificates carry, checked instead of the dialled host "
            "(unset: the host)",
            field=f"{field}.server_name",
        ),
    )
