"""Recording helpers shared by every tier's metrics (business code only records values)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Protocol

from services.common.errors import status_name


class _LabelledCounter(Protocol):
    def labels(self, *values: str) -> _Incrementable: ...


class _Incrementable(Protocol):
    def inc(self, amount: float = 1) -> None: ...


@contextlib.contextmanager
def count_outcome(counter: _LabelledCounter, *labels: str) -> Iterator[None]:
    """Counts the enclosed call under `labels` plus the gRPC status it ends with (OK, or the
    status its error maps to; CANCELLED when the caller went away)."""
    code = "OK"
    try:
        yield
    except BaseException as error:
        code = status_name(error)
        raise
    finally:
        counter.labels(*labels, code).inc()
