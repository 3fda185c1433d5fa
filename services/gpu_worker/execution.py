"""Running one batch on the executor thread, so that a bad row fails only its own request."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from services.gpu_worker.backends.base import PreparedRow


def run_isolated(
    run: Callable[[Sequence[PreparedRow]], list[np.ndarray]], rows: Sequence[PreparedRow]
) -> list[np.ndarray | Exception]:
    """Runs a batch; if it raises, bisects so that only the failing rows fail."""
    try:
        outputs = run(rows)
        if len(outputs) != len(rows):
            raise RuntimeError(f"backend returned {len(outputs)} outputs for {len(rows)} rows")
        return list(outputs)
    except Exception as error:
        if len(rows) == 1:
            return [error]
        middle = len(rows) // 2
        return run_isolated(run, rows[:middle]) + run_isolated(run, rows[middle:])


def describe_failure(error: Exception) -> str:
    """One line for the client; TorchScript errors carry a multi-line traceback."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return f"model failed on this input: {lines[-1] if lines else type(error).__name__}"
