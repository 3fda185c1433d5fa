"""The worker registry's records (services.common.registry_schema): what a reader takes from
JSON, and what it refuses as malformed (and skips, logged: registry_reader)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from typing import Any

import pytest

from services.common.errors import MALFORMED_RECORD_ERRORS
from services.common.registry_schema import FailedVersion, WorkerRecord
from tests.unit.test_routing import make_worker

pytestmark = pytest.mark.unit


def test_a_record_round_trips_through_its_json() -> None:
    record = make_worker(queued_rows=3, per_row_s=0.002)
    record = WorkerRecord(**{**record.__dict__, "failed": (FailedVersion("m", "2", "boom", 7),)})
    assert WorkerRecord.from_json(record.to_json()) == record


def test_a_models_applied_revision_round_trips_and_reads_as_minus_1_from_a_build_before() -> None:
    """`revision`: the model's desired-state revision the worker applied whole (0: none yet);
    a record written by a worker of a build before has none, read as -1, which routers tell no
    gateway (router catalog)."""
    record = make_worker()
    applied = WorkerRecord(
        **{**record.__dict__, "models": tuple(replace(m, revision=7) for m in record.models)}
    )
    (model,) = WorkerRecord.from_json(applied.to_json()).models
    assert model.revision == 7
    raw = json.loads(applied.to_json())
    del raw["models"][0]["revision"]
    (model,) = WorkerRecord.from_json(json.dumps(raw)).models
    assert model.revision == -1


def test_a_failure_from_a_record_before_revisions_reads_as_revision_0() -> None:
    raw = json.loads(make_worker().to_json())
    raw["failed"] = [{"name": "m", "version": "2", "error": "boom"}]
    del raw["failed_revisions"]
    (failure,) = WorkerRecord.from_json(json.dumps(raw)).failed
    assert failure == FailedVersion("m", "2", "boom", 0)


@dataclass(frozen=True)
class FailedVersionBefore:
    """FailedVersion as routers of the build before revisions read it (c667514)."""

    name: str
    version: str
    error: str


def test_a_record_with_revisions_reads_in_a_router_of_the_build_before() -> None:
    """Workers are upgraded first: an earlier router built each failure as
    `FailedVersion(**entry)`, so a field it does not know (the revision, had it been written
    there) made it skip the whole record, the worker's healthy versions too (a review
    finding). The revisions travel beside the failures, which keep their fields."""
    record = make_worker()
    record = WorkerRecord(**{**record.__dict__, "failed": (FailedVersion("m", "2", "boom", 7),)})
    raw = json.loads(record.to_json())
    assert [FailedVersionBefore(**entry) for entry in raw["failed"]] == [
        FailedVersionBefore("m", "2", "boom")
    ]
    assert raw["failed_revisions"] == [7]


def test_a_field_a_later_build_adds_is_left_out_not_refused() -> None:
    """A router reads the records of workers upgraded before it."""
    raw = json.loads(make_worker().to_json())
    raw["models"][0]["a_later_field"] = 1
    raw["failed"] = [{"name": "m", "version": "2", "error": "boom", "a_later_field": "x"}]
    raw["failed_revisions"] = [3]
    record = WorkerRecord.from_json(json.dumps(raw))
    assert record.models == make_worker().models
    assert record.failed == (FailedVersion("m", "2", "boom", 3),)


@pytest.mark.parametrize("revisions", [[1, 2], ["3"], [True], 5])
def test_failure_revisions_that_do_not_match_the_failures_make_the_record_malformed(
    revisions: Any,
) -> None:
    raw = json.loads(make_worker().to_json())
    raw["failed"] = [{"name": "m", "version": "2", "error": "boom"}]
    raw["failed_revisions"] = revisions
    with pytest.raises(MALFORMED_RECORD_ERRORS):
        WorkerRecord.from_json(json.dumps(raw))


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("queued_rows", "3"),  # a number as text: it raised TypeError in routing, every call
        ("queued_rows", True),
        ("queued_rows", 2.5),
        ("queued_rows", 10**400),  # past a float: routing's arithmetic overflowed, every call
        ("per_row_s", 10**400),
        ("per_row_s", float("nan")),
        ("per_row_s", float("inf")),
        ("per_row_s", None),
        ("is_ready", 1),
        ("fingerprint", 7),
        # Negative: priced below every other worker, it drew every call (review finding).
        ("per_row_s", -1.0),
        ("min_batch_s", -0.5),
        ("queued_rows", -3),
        ("kv_blocks_free", -1),
    ],
)
def test_a_model_field_of_the_wrong_json_type_makes_the_record_malformed(
    field: str, value: Any
) -> None:
    raw = json.loads(make_worker().to_json())
    raw["models"][0][field] = value
    with pytest.raises(MALFORMED_RECORD_ERRORS):
        WorkerRecord.from_json(json.dumps(raw))


def test_a_revision_of_minus_one_is_a_record_of_an_earlier_build_not_a_malformed_one() -> None:
    raw = json.loads(make_worker().to_json())
    raw["models"][0]["revision"] = -1
    (model,) = WorkerRecord.from_json(json.dumps(raw)).models
    assert model.revision == -1


def test_an_integer_does_for_a_float() -> None:
    raw = json.loads(make_worker().to_json())
    raw["models"][0]["per_row_s"] = 1
    (model,) = WorkerRecord.from_json(json.dumps(raw)).models
    assert model.per_row_s == 1


def test_a_failed_version_of_the_wrong_json_type_makes_the_record_malformed() -> None:
    raw = json.loads(make_worker().to_json())
    raw["failed"] = [{"name": "m", "version": 2, "error": "boom"}]
    with pytest.raises(MALFORMED_RECORD_ERRORS):
        WorkerRecord.from_json(json.dumps(raw))
