"""What the job store (services/common/job_store.py) reads and writes, as values: a job as
stored, a job to submit, a claimed chunk, an item's outcome, a place in a tenant's list."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from services.common.job_policy import ItemCounts, ItemStatus


@dataclass(frozen=True)
class JobCursor:
    """A job's place in its tenant's list: newest first, then by id."""

    created_s: float
    job_id: str

    def token(self) -> str:
        return f"{self.created_s!r}/{self.job_id}"

    @staticmethod
    def parse(token: str) -> JobCursor:
        """Raises ValueError for a token no cursor made."""
        created, _, job_id = token.partition("/")
        cursor = JobCursor(float(created), job_id)
        if not (math.isfinite(cursor.created_s) and is_job_id(job_id)):
            raise ValueError(token)
        return cursor


def is_job_id(text: str) -> bool:
    """Whether `text` has the shape of a job id (32 lowercase hex digits)."""
    return len(text) == 32 and all(c in "0123456789abcdef" for c in text)


@dataclass(frozen=True)
class JobRecord:
    """A job as stored (the state is derived: services.common.job_policy.job_state)."""

    job_id: str
    tenant: str
    model_name: str
    model_version: str
    #: Priority class name ("batch").
    priority: str
    num_items: int
    counts: ItemCounts
    created_s: float
    #: When a runner first claimed one of its chunks; 0 before.
    started_s: float
    #: Items not started by then are not run; 0: no deadline.
    complete_by_s: float
    idempotency_key: str
    is_cancelled: bool

    @classmethod
    def from_hash(cls, job_id: str, raw: dict[bytes, bytes]) -> JobRecord:
        text = {k.decode(): v.decode() for k, v in raw.items()}
        counts = ItemCounts(
            num_ok=int(text.get("num_ok", 0)),
            num_failed=int(text.get("num_failed", 0)),
            num_cancelled=int(text.get("num_cancelled", 0)),
        )
        return cls(
            job_id=job_id,
            tenant=text["tenant"],
            model_name=text["model"],
            model_version=text.get("version", ""),
            priority=text.get("priority", "batch"),
            num_items=int(text["num_items"]),
            counts=counts,
            created_s=float(text.get("created_s", 0)),
            started_s=float(text.get("started_s", 0)),
            complete_by_s=float(text.get("complete_by_s", 0)),
            idempotency_key=text.get("idempotency_key", ""),
            is_cancelled=text.get("cancelled") == "1",
        )


@dataclass(frozen=True)
class NewJob:
    """What SubmitJob persists."""

    tenant: str
    model_name: str
    model_version: str
    priority: str
    #: Serialized `PredictInput`s, in order.
    items: Sequence[bytes]
    idempotency_key: str
    complete_by_s: float
    #: Bytes its results are expected to take in the store (reserved while it runs).
    result_bytes: int = 0


@dataclass(frozen=True)
class QueueEntry:
    """One claimed chunk: items [start, end) of `job_id`, stream entry `entry_id`."""

    entry_id: str
    job_id: str
    start: int
    end: int


@dataclass(frozen=True)
class ItemOutcome:
    """One item's finished result, ready to record."""

    index: int
    status: ItemStatus
    #: Serialized `JobItemResult`.
    payload: bytes
    #: A failed item's gRPC status code name and message, dead-lettered with its result.
    code: str = ""
    message: str = ""
