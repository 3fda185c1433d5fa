"""The unit tier's promise, enforced: a unit test starts no process and opens no network socket.

Such a test belongs in tests/integration (real servers, real processes). The guard fails the
test at the call, naming what it tried, so the tier stays fast and runnable anywhere.
"""

from __future__ import annotations

import multiprocessing.process
import socket
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest

#: Address families whose connect or bind is network use (a local socketpair, as asyncio's
#: event loop makes for itself, is not).
NETWORK_FAMILIES = (socket.AF_INET, socket.AF_INET6)


class UnitTierViolation(Exception):
    """A unit test tried to start a process or use the network."""


def _refuse(what: str) -> Any:
    def refuse(*args: object, **kwargs: object) -> None:
        raise UnitTierViolation(f"a unit test may not {what}: move it to tests/integration")

    return refuse


@pytest.fixture(autouse=True)
def no_processes_or_network(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setattr(subprocess.Popen, "__init__", _refuse("start a process (subprocess)"))
    monkeypatch.setattr(
        multiprocessing.process.BaseProcess, "start", _refuse("start a process (multiprocessing)")
    )
    for method in ("connect", "connect_ex", "bind"):
        original = getattr(socket.socket, method)

        def guarded(
            self: socket.socket, *args: Any, _original: Any = original, _name: str = method
        ) -> Any:
            if self.family in NETWORK_FAMILIES:
                raise UnitTierViolation(
                    f"a unit test may not use the network (socket.{_name}): move it to "
                    "tests/integration"
                )
            return _original(self, *args)

        monkeypatch.setattr(socket.socket, method, guarded)
    yield
