"""The worker registry's records (services.common.registry_schema): what a reader takes from
JSON, and what it refuses as malformed (and skips, logged: registry_reader)."""

from __future__ import annotations

import json
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


def test_a_failure_from_a_record_before_revisions_reads_as_revision_0() -> None:
    raw = json.loads(make_worker().to_json())
    raw["failed"] = [{"name": "m", "version": "2", "error": "boom"}]
    (failure,) = WorkerRecord.from_json(json.dumps(raw)).failed
    assert failure == FailedVersion("m", "2", "boom", 0)


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
    ],
)
def test_a_model_field_of_the_wrong_json_type_makes_the_record_malformed(
    field: str, value: Any
) -> None:
    raw = json.loads(make_worker().to_json())
    raw["models"][0][field] = value
    with pytest.raises(MALFORMED_RECORD_ERRORS):
        WorkerRecord.from_json(json.dumps(raw))


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
