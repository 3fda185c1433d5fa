"""The processes a fabric benchmark measures: the stack (via `services.local_stack`) and the
bare echo server, plus the throw-away model repositories they serve.

The stack is started exactly as `make run` and the e2e tests start it (`python -m
services.local_stack --ephemeral-ports`), so the benchmark measures the product, not a harness.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from services.common.processes import ChildProcess, start_and_wait

REPO_ROOT = Path(__file__).resolve().parents[2]
HOST = "127.0.0.1"


@dataclass
class Processes:
    """A launcher process and what its ready file said (ports and pids of its children)."""

    child: ChildProcess
    ready: dict

    @property
    def process(self) -> subprocess.Popen[bytes]:
        return self.child.process

    def stop(self, timeout_s: float = 120.0) -> int:
        """SIGTERM the launcher (the stack's launcher stops its tiers in order) and wait."""
        code = self.child.terminate(timeout_s)
        return self.process.returncode if code is None else code


@dataclass
class BenchStack(Processes):
    @property
    def gateway_address(self) -> str:
        return f"{HOST}:{self.ready['gateway']['grpc_port']}"

    def pids(self) -> dict[str, int]:
        """Every process of the stack by name, the launcher included: "gateway", "router"
        ("router-0", ... with several), workers by id, "redis", "launcher"."""
        return {
            "gateway": self.ready["gateway"]["pid"],
            **{r["name"]: r["pid"] for r in self.ready["routers"]},
            **{w["worker_id"]: w["pid"] for w in self.ready["workers"]},
            "redis": self.ready["redis"]["pid"],
            "launcher": self.process.pid,
        }

    def metrics_ports(self) -> dict[str, int]:
        """Prometheus ports by process name: "gateway", "router" ("router-0", ... with several),
        workers by id."""
        return {
            "gateway": self.ready["gateway"]["metrics_port"],
            **{r["name"]: r["metrics_port"] for r in self.ready["routers"]},
            **{w["worker_id"]: w["metrics_port"] for w in self.ready["workers"]},
        }


def _launch(argv: list[str], state_dir: Path, ready_file: Path, timeout_s: float) -> Processes:
    """Starts `argv` with its output in `<state_dir>/launcher.log` and waits for `ready_file`."""
    state_dir.mkdir(parents=True, exist_ok=True)
    child, ready = start_and_wait(
        argv[2],
        argv,
        log_path=state_dir / "launcher.log",
        ready_file=ready_file,
        timeout_s=timeout_s,
        cwd=REPO_ROOT,
    )
    return Processes(child, ready)


def start_stack(
    repository: Path,
    state_dir: Path,
    *,
    extra_worker_args: tuple[str, ...] = (),
    extra_gateway_args: tuple[str, ...] = (),
    ready_timeout_s: float = 600.0,
    launcher_args: tuple[str, ...] = (),
) -> BenchStack:
    """Redis, router, one worker and a gateway on free ports, serving `repository`;
    `launcher_args`: more of the launcher's own flags (`--cpus worker=1`)."""
    ready_file = state_dir / "stack-ready.json"
    argv = [
        sys.executable, "-m", "services.local_stack", "--ephemeral-ports",
        "--model-repository", str(repository),
        "--state-dir", str(state_dir / "tiers"),
        *(f"--worker-arg={arg}" for arg in extra_worker_args),
        *(f"--gateway-arg={arg}" for arg in extra_gateway_args),
        *launcher_args,
    ]  # fmt: skip
    launched = _launch(argv, state_dir, ready_file, ready_timeout_s)
    return BenchStack(launched.child, launched.ready)


def start_echo(state_dir: Path) -> Processes:
    """The bare grpc.aio echo server (bench.fabric.echo_server) in its own process, like a tier."""
    ready_file = state_dir / "echo-ready.json"
    argv = [sys.executable, "-m", "bench.fabric.echo_server"]
    return _launch(argv, state_dir, ready_file, timeout_s=60.0)


# -- model repositories -----------------------------------------------------------------------


def write_minilm_repository(
    root: Path,
    *,
    max_batch_size: int | None = None,
    length_buckets: tuple[int, ...] | None = None,
    shed_past_slo: bool | None = None,
    source: Path = REPO_ROOT / "models" / "minilm",
) -> Path:
    """`<root>/minilm/`: the default repository's minilm (same SLO, same weights package) with
    another batch limit and, optionally, other length buckets or shedding. Returns the config
    path."""
    model_dir = root / "minilm"
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    text = (source / "config.toml").read_text()
    if max_batch_size is not None:
        text = re.sub(r"(?m)^max_batch_size = .*$", f"max_batch_size = {max_batch_size}", text)
    if length_buckets is not None:
        buckets = ", ".join(map(str, length_buckets))
        text = re.sub(r"(?m)^length_buckets = .*$", f"length_buckets = [{buckets}]", text)
    if shed_past_slo is not None:
        flag = "true" if shed_past_slo else "false"
        text, count = re.subn(r"(?m)^shed_past_slo = .*$", f"shed_past_slo = {flag}", text)
        if count == 0:
            text = f"shed_past_slo = {flag}\n{text}"
    (model_dir / "config.toml").write_text(text)
    (model_dir / "1" / "version.toml").write_text((source / "1" / "version.toml").read_text())
    return model_dir / "config.toml"


class _Identity(torch.nn.Module):
    """y = x: the model costs nothing, so what is measured is the serving path."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


#: The identity model's row: FP32 [IDENTITY_DIMS], the smallest payload a tensor call carries.
IDENTITY_DIMS = 4


def write_identity_model(
    root: Path, *, name: str = "identity", slo_p99_ms: int = 250, max_batch_size: int = 64
) -> Path:
    """`<root>/<name>/`: a TorchScript identity model, FP32 [4] -> FP32 [4]."""
    model_dir = root / name
    (model_dir / "1").mkdir(parents=True, exist_ok=True)
    (model_dir / "config.toml").write_text(
        f"""kind = "torchscript"
slo_p99_ms = {slo_p99_ms}
max_batch_size = {max_batch_size}
max_queue_size = 2048

[inputs.x]
dtype = "FP32"
dims = [{IDENTITY_DIMS}]

[outputs.y]
dtype = "FP32"
dims = [{IDENTITY_DIMS}]
"""
    )
    with warnings.catch_warnings():
        # torch 2.13 marks TorchScript deprecated; it is still what the torchscript backend loads.
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.jit.script(_Identity()).save(str(model_dir / "1" / "model.pt"))
    return model_dir
