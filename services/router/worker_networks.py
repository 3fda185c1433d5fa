"""Which worker addresses the router will dial: a registry record is only a claim, and a forged
one (anyone who can write the registry) would otherwise receive tenants' inputs.

A record is admitted when its address is `host:port` and the host is an IP inside one of the
allowed networks, or a hostname ending in one of the allowed suffixes (entries that start with
a dot, e.g. `.fabric.svc.cluster.local`). Pure: no I/O, no resolution of names.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from services.common.registry_schema import WorkerRecord

IPNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

#: Loopback and private ranges (RFC 1918, IPv6 unique-local): local stacks and the pod networks
#: of common clusters fall inside; public addresses and hostnames do not.
DEFAULT_WORKER_NETWORKS = "127.0.0.0/8,::1/128,10.0.0.0/8,172.16.0.0/12,192.168.0.0/16,fc00::/7"


@dataclass(frozen=True)
class WorkerNetworks:
    """The networks (and hostname suffixes) worker addresses must be in."""

    networks: tuple[IPNetwork, ...]
    #: Lower-case hostname suffixes, each starting with "."; empty admits no hostname.
    host_suffixes: tuple[str, ...] = ()

    @classmethod
    def parse(cls, text: str) -> WorkerNetworks:
        """Comma-separated CIDRs (`10.0.0.0/8`, `fd00::/8`, a bare IP is a /32 or /128) and
        hostname suffixes (`.svc.cluster.local`). Raises ValueError for anything else or for an
        empty list (`0.0.0.0/0,::/0` admits every IP, on purpose only)."""
        networks: list[IPNetwork] = []
        suffixes: list[str] = []
        for entry in filter(None, (part.strip() for part in text.split(","))):
            if entry.startswith("."):
                if len(entry) < 2 or not _is_hostname(entry[1:]):
                    raise ValueError(f"{entry!r} is not a hostname suffix")
                suffixes.append(entry.lower())
                continue
            try:
                networks.append(ipaddress.ip_network(entry, strict=True))
            except ValueError as error:
                raise ValueError(f"{entry!r} is not a network: {error}") from None
        if not networks and not suffixes:
            raise ValueError("no worker network given")
        return cls(tuple(networks), tuple(suffixes))

    def __str__(self) -> str:
        return ",".join([*(str(n) for n in self.networks), *self.host_suffixes])

    def admits(self, address: str) -> bool:
        """True when `address` is `host:port` with the host inside these networks."""
        host = address_host(address)
        if host is None:
            return False
        try:
            ip = ipaddress.ip_address(host)
        except ValueError:
            name = host.lower().rstrip(".")
            return _is_hostname(name) and any(name.endswith(s) for s in self.host_suffixes)
        return any(ip in network for network in self.networks)


def address_host(address: str) -> str | None:
    """The host of `host:port` or `[v6]:port`; None when the form or the port is wrong."""
    host, sep, port = address.rpartition(":")
    # At most 5 digits before int(): past 4,300, int() refuses them (CPython's guard).
    is_port = port.isascii() and port.isdigit() and len(port) <= 5
    if not sep or not is_port or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:
        return None  # a bare IPv6 address is ambiguous with its port
    return host or None


@dataclass(frozen=True)
class AdmittedRecords:
    """Records split by the allowlist."""

    admitted: list[tuple[WorkerRecord, float]]
    rejected: list[WorkerRecord]


def admit_records(
    records: Iterable[tuple[WorkerRecord, float]], networks: WorkerNetworks
) -> AdmittedRecords:
    """Splits (record, heartbeat) pairs into those whose address `networks` admits and the rest."""
    admitted: list[tuple[WorkerRecord, float]] = []
    rejected: list[WorkerRecord] = []
    for record, heartbeat_s in records:
        if networks.admits(record.address):
            admitted.append((record, heartbeat_s))
        else:
            rejected.append(record)
    return AdmittedRecords(admitted, rejected)


def _is_hostname(name: str) -> bool:
    labels = name.split(".")
    return all(
        0 < len(label) <= 63
        and all(c.isascii() and (c.isalnum() or c == "-") for c in label)
        and not label.startswith("-")
        and not label.endswith("-")
        for label in labels
    )
