"""The whole fabric as `python -m services.local_stack` runs it, on free ports, for e2e tests."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from services.common.processes import ChildProcess, start_and_wait
from services.common.redis_acl import read_password
from tests.support.processes import REPO_ROOT


@dataclass(frozen=True)
class Tier:
    """One gRPC tier's process as the launcher reported it."""

    grpc_port: int
    metrics_port: int
    pid: int
    #: The gateway's KServe v2 REST / OpenAI port (-1 for the other tiers).
    http_port: int = -1

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    @property
    def http_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@dataclass(frozen=True)
class WorkerTier(Tier):
    worker_id: str = ""


#: How long the launcher may take to stop every tier after SIGTERM, seconds.
STOP_TIMEOUT_S = 120.0


@dataclass
class Stack:
    #: The launcher, `python -m services.local_stack`; its log is its stdout and stderr.
    launcher: ChildProcess
    #: The launcher's --state-dir: every child's `<name>.log` is here.
    state_dir: Path
    gateway: Tier
    router: Tier
    workers: list[WorkerTier]
    redis_port: int
    redis_pid: int
    #: The Redis admin's password (services.common.redis_acl), from the launcher's state dir.
    redis_admin_password: str
    #: The job runner (`python -m services.jobs`; its grpc_port is 0: it serves only metrics).
    jobs: Tier | None = None

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.launcher.process

    @property
    def redis_url(self) -> str:
        """The Redis admin's URL."""
        return f"redis://admin:{self.redis_admin_password}@127.0.0.1:{self.redis_port}/0"

    def pids(self) -> dict[str, int]:
        """Every child's pid by name (gateway, router, worker-0..., redis, jobs)."""
        return {
            "gateway": self.gateway.pid,
            "router": self.router.pid,
            **{w.worker_id: w.pid for w in self.workers},
            "redis": self.redis_pid,
            **({"jobs": self.jobs.pid} if self.jobs is not None else {}),
        }

    def log(self, name: str) -> str:
        """A child's log (`gateway`, `router`, `worker-0`, `redis`), or `launcher`'s own."""
        if name == "launcher":
            return self.launcher.log()
        return (self.state_dir / f"{name}.log").read_text(errors="replace")

    def stop_report(self, tail_lines: int = 60) -> str:
        """The launcher's log, then the last lines of each tier's log that it names as not
        having stopped cleanly (a hung stop dumps its threads' stacks there)."""
        launcher = self.log("launcher")
        parts = [launcher]
        for line in launcher.splitlines():
            if " killed after " in line or " exited with code " in line:
                name = line.split()[1] if line.startswith("error:") else line.split()[0]
                path = self.state_dir / f"{name}.log"
                if path.exists():
                    tail = path.read_text(errors="replace").splitlines()[-tail_lines:]
                    parts.append(f"--- {name}.log (last {tail_lines} lines) ---")
                    parts.extend(tail)
        return "\n".join(parts)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int:
        """SIGTERM the launcher (it stops every tier in order), wait, return its exit code."""
        code = self.launcher.terminate(timeout_s)
        if code is None:
            raise subprocess.TimeoutExpired(self.process.args, timeout_s)
        return code

    def kill(self) -> None:
        """SIGKILL the launcher: its children are left to notice on their own."""
        self.process.kill()
        self.process.wait()


def start_stack(
    tmp_path: Path,
    *,
    num_workers: int = 1,
    model_repository: Path | None = None,
    extra_worker_args: tuple[str, ...] = (),
    extra_gateway_args: tuple[str, ...] = (),
    tolerate_exits: bool = False,
    ready_timeout_s: float = 300.0,
    launcher_args: tuple[str, ...] = (),
) -> Stack:
    """Runs `python -m services.local_stack --ephemeral-ports` and waits until every tier is up.

    `tolerate_exits`: the launcher keeps the other tiers running when one exits after startup
    (for tests that kill a worker or Redis on purpose); `stop()` then still returns 0.
    `launcher_args`: more of the launcher's own flags (`--cpus worker=1`).
    """
    state_dir = tmp_path / "stack"
    args = [
        sys.executable, "-m", "services.local_stack", "--ephemeral-ports",
        "--num-workers", str(num_workers),
        "--model-repository", str(model_repository or REPO_ROOT / "models"),
        "--state-dir", str(state_dir),
        *(f"--worker-arg={arg}" for arg in extra_worker_args),
        *(f"--gateway-arg={arg}" for arg in extra_gateway_args),
        *(["--tolerate-exits"] if tolerate_exits else []),
        *launcher_args,
    ]  # fmt: skip
    # The launcher renames its ready file into place whole once every tier is up.
    launcher, ready = start_and_wait(
        "local_stack",
        args,
        log_path=tmp_path / "launcher.log",
        ready_file=tmp_path / "stack-ready.json",
        timeout_s=ready_timeout_s,
        cwd=REPO_ROOT,
    )
    try:
        return Stack(
            launcher=launcher,
            state_dir=state_dir,
            gateway=Tier(**ready["gateway"]),
            router=Tier(**ready["router"]),
            workers=[WorkerTier(**worker) for worker in ready["workers"]],
            redis_port=ready["redis"]["port"],
            redis_pid=ready["redis"]["pid"],
            redis_admin_password=read_password(Path(ready["redis"]["acl_dir"]) / "admin-password"),
            jobs=Tier(**ready["jobs"]) if "jobs" in ready else None,
        )
    except Exception:
        # A ready file this harness cannot read: stop the stack it describes rather than leave
        # its tiers running after the test (the fixture never gets a Stack to stop).
        launcher.terminate(STOP_TIMEOUT_S)
        raise
