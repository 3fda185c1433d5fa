"""Tiers started beside a test's stack, from the command line of one of its own: a second
router, a gateway over several routers (tests/e2e/test_router_rollout.py, test_scale_out.py)."""

from __future__ import annotations

import time
from pathlib import Path

from services.common.processes import start_and_wait
from tests.support.processes import REPO_ROOT, ServiceProcess


def command_line(pid: int) -> list[str]:
    """The command line a running tier was started with (by the stack's launcher)."""
    return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]


def with_flags(argv: list[str], **flags: str) -> list[str]:
    """`argv` with each `--flag value` in `flags` replaced and the launcher's `--ready-file`
    dropped (start_and_wait adds its own)."""
    replaced: dict[str, str | None] = {f"--{k.replace('_', '-')}": v for k, v in flags.items()}
    replaced["--ready-file"] = None
    result: list[str] = []
    i = 0
    while i < len(argv):
        if argv[i] in replaced:
            value = replaced[argv[i]]
            result += [] if value is None else [argv[i], value]
            i += 2
        else:
            result.append(argv[i])
            i += 1
    return result


def start_tier(tmp_path: Path, name: str, argv: list[str]) -> ServiceProcess:
    ready_file = tmp_path / f"{name}-{time.monotonic_ns()}.ready.json"
    child, ports = start_and_wait(
        name,
        argv,
        log_path=ready_file.with_suffix(".log"),
        ready_file=ready_file,
        timeout_s=120.0,
        cwd=REPO_ROOT,
    )
    return ServiceProcess(child, ports["grpc_port"], ports["metrics_port"])
