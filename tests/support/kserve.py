"""Runs the stock Triton gRPC client (tests/support/kserve_client.py) against a server.

The client runs in its own interpreter, `.venv-triton` (built by `make install`), because
tritonclient registers its own `inference.*` protobuf types, which clash with ours in one process.
"""

from __future__ import annotations

import json
import subprocess

from tests.support.processes import REPO_ROOT

TRITON_PYTHON = REPO_ROOT / ".venv-triton" / "bin" / "python"
KSERVE_CLIENT = REPO_ROOT / "tests" / "support" / "kserve_client.py"


def run_kserve_client(url: str, *args: str, timeout_s: float = 120) -> dict:
    """Runs the client script against `url` (host:port) with `args` and returns its JSON report.

    `args` are the script's own arguments, for example `"--model", "minilm", "hello"`. Raises
    RuntimeError (with the client's stderr) if it exits non-zero or prints no JSON.
    """
    if not TRITON_PYTHON.exists():
        raise FileNotFoundError(f"{TRITON_PYTHON} is missing: run `make install` first")
    completed = subprocess.run(
        [str(TRITON_PYTHON), str(KSERVE_CLIENT), "--url", url, *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=REPO_ROOT,
        check=False,
    )
    if completed.returncode != 0:
        raise RuntimeError(
            f"kserve_client exited {completed.returncode}\n"
            f"stdout:\n{completed.stdout}\nstderr:\n{completed.stderr}"
        )
    try:
        return json.loads(completed.stdout)
    except json.JSONDecodeError as error:
        raise RuntimeError(
            f"kserve_client printed no JSON ({error})\n"
            f"stdout:\n{completed.stdout}\nstderr:\n{completed.stderr}"
        ) from error
