"""Which workers' load failures a RepositoryModelLoad answers (services.gateway.
repository_control.load_failures_to_answer): its own attempt's, never one an earlier revision
left reported while the workers try again."""

from __future__ import annotations

import pytest

from services.gateway.repository_control import load_failures_to_answer
from services.pb.inference.v1 import worker_pb2 as pb

pytestmark = pytest.mark.unit


def failure(version: str, revision: int, worker_id: str = "w0") -> pb.LoadFailure:
    return pb.LoadFailure(
        model_name="m", model_version=version, worker_id=worker_id, error="boom", revision=revision
    )


def test_a_failure_at_an_earlier_revision_is_not_answered_before_the_timeout() -> None:
    """v3 read half written by a re-read at revision 5, then moved in whole and a load written
    at 6. The worker reports its failure at 5 until it has tried again; the load answered it
    (FAILED_PRECONDITION) though the retry served (seen in make test)."""
    stale = [failure("3", 5)]
    assert load_failures_to_answer(stale, set(), revision=6, is_past=False) == []
    assert load_failures_to_answer(stale, set(), revision=6, is_past=True) == stale


def test_a_failure_at_the_loads_revision_or_later_is_answered_at_once() -> None:
    own, later = failure("3", 6), failure("3", 9, worker_id="w1")
    answered = load_failures_to_answer([failure("2", 5), own, later], set(), revision=6,
                                       is_past=False)  # fmt: skip
    assert answered == [own, later]


def test_a_failure_from_before_revisions_were_reported_waits_for_the_timeout() -> None:
    """A worker of an older build reports revision 0: its failure is answered at the load's
    timeout, as one reported before the load was."""
    old = [failure("3", 0)]
    assert load_failures_to_answer(old, set(), revision=1, is_past=False) == []
    assert load_failures_to_answer(old, set(), revision=1, is_past=True) == old


def test_a_version_some_worker_serves_is_not_answered_as_failed() -> None:
    failures = [failure("3", 6), failure("2", 6)]
    answered = load_failures_to_answer(failures, {"3"}, revision=6, is_past=True)
    assert [f.model_version for f in answered] == ["2"]
