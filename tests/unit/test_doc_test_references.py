"""The docs' references to tests (`integration/test_x.py::test_name`, and `::test_other`
continuing the last path) name tests that exist: a test renamed, moved or deleted left a row
of docs/reliability.md pointing at nothing, and one inserted mid-chain of `::` references
sent the rest to the wrong file (found by a read-only check)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

REPO_ROOT = Path(__file__).resolve().parents[2]
DOCS = ("docs/reliability.md", "docs/architecture.md", "docs/benchmarks.md", "README.md")
_PATH = re.compile(r"^(?:tests/)?((?:unit|integration|e2e|deploy)/[\w/]+\.py)(?:::(\w+))?$")
_NAME = re.compile(r"^::(\w+)$")


def references(text: str) -> list[tuple[int, str, str | None]]:
    """(line, test file under tests/, test name or None) for each backticked reference."""
    found: list[tuple[int, str, str | None]] = []
    for number, line in enumerate(text.splitlines(), start=1):
        path = None
        for ref in re.findall(r"`([^`]+)`", line):
            if match := _PATH.match(ref):
                path = match[1]
                found.append((number, path, match[2]))
            elif (match := _NAME.match(ref)) and path is not None:
                found.append((number, path, match[1]))
    return found


def test_the_reference_reader_follows_chains() -> None:
    text = "`e2e/a.py::one`, `::two` and `unit/b.py`, `::three`\n`::orphan`"
    assert references(text) == [
        (1, "e2e/a.py", "one"), (1, "e2e/a.py", "two"), (1, "unit/b.py", None),
        (1, "unit/b.py", "three"),
    ]  # fmt: skip


@pytest.mark.parametrize("doc", DOCS)
def test_every_test_a_doc_names_exists(doc: str) -> None:
    dangling = []
    for number, path, name in references((REPO_ROOT / doc).read_text()):
        test_file = REPO_ROOT / "tests" / path
        if not test_file.is_file():
            dangling.append(f"{doc}:{number}: {path}")
        elif name and not re.search(
            rf"^\s*(?:async )?(?:def|class) {name}\b", test_file.read_text(), re.M
        ):
            dangling.append(f"{doc}:{number}: {path}::{name}")
    assert not dangling, dangling
