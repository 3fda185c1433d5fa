"""The worker's plan to match the fleet's desired model state (services.gpu_worker.reconcile)
and the desired state's Redis encoding (services.common.repository_state)."""

from __future__ import annotations

import pytest

from services.common.repository_state import (
    DesiredState,
    ModelState,
    parse_desired,
)
from services.gpu_worker.reconcile import Load, Retire, Unload, VersionKey, keeps_serving, plan

pytestmark = pytest.mark.unit

REPOSITORY = [("echo", "1"), ("echo", "2"), ("sentiment", "1")]


def loaded(revision: int) -> DesiredState:
    return DesiredState(ModelState.LOADED, revision)


def unloaded(revision: int) -> DesiredState:
    return DesiredState(ModelState.UNLOADED, revision)


def make_plan(
    *,
    desired: dict[str, DesiredState] | None = None,
    serving: list[VersionKey] | None = None,
    failed: dict[VersionKey, int] | None = None,
    pool: tuple[str, ...] = (),
    repository: list[VersionKey] | None = None,
) -> tuple[Load | Unload | Retire, ...]:
    return plan(
        desired=desired or {},
        loaded=REPOSITORY if serving is None else serving,
        failed=failed or {},
        pool=pool,
        repository=REPOSITORY if repository is None else repository,
    )


def test_no_entry_keeps_what_the_repository_and_pool_have() -> None:
    assert make_plan() == ()


def test_unloaded_model_unloads_every_version_and_nothing_else() -> None:
    assert make_plan(desired={"echo": unloaded(3)}) == (Unload("echo", "1"), Unload("echo", "2"))


def test_loaded_again_loads_every_version_in_the_repository() -> None:
    actions = make_plan(desired={"echo": loaded(4)}, serving=[("sentiment", "1")])
    assert actions == (Load("echo", "1"), Load("echo", "2"))


def test_no_entry_loads_a_version_missing_from_a_worker() -> None:
    assert make_plan(serving=[("echo", "1"), ("sentiment", "1")]) == (Load("echo", "2"),)


def test_the_pool_bounds_what_is_loaded_whatever_the_desired_state() -> None:
    actions = make_plan(desired={"sentiment": loaded(2)}, serving=[], pool=("echo",))
    assert actions == (Load("echo", "1"), Load("echo", "2"))


def test_a_model_outside_the_pool_is_unloaded() -> None:
    assert make_plan(pool=("echo",)) == (Unload("sentiment", "1"),)


def test_a_failed_version_is_not_retried_at_the_same_revision() -> None:
    actions = make_plan(
        desired={"echo": loaded(5)},
        serving=[("echo", "1"), ("sentiment", "1")],
        failed={("echo", "2"): 5},
    )
    assert actions == ()


def test_a_failed_version_is_retried_once_the_revision_grows() -> None:
    actions = make_plan(
        desired={"echo": loaded(6)},
        serving=[("echo", "1"), ("sentiment", "1")],
        failed={("echo", "2"): 5},
    )
    assert actions == (Load("echo", "2"),)


def test_a_failed_version_without_entry_is_not_retried() -> None:
    assert make_plan(serving=[("echo", "1"), ("sentiment", "1")], failed={("echo", "2"): 0}) == ()


def test_a_version_gone_from_the_repository_is_retired() -> None:
    actions = make_plan(repository=[("echo", "2"), ("sentiment", "1")])
    assert actions == (Retire("echo", "1"),)


def test_a_version_replaced_on_disk_is_retired_after_its_replacement_loads() -> None:
    """v1 deleted and v2 added: v2 loads first, then v1 is retired; unloaded first, the model
    was served by no worker for v2's load, and for good if it failed (review finding)."""
    actions = make_plan(
        serving=[("echo", "1"), ("sentiment", "1")],
        repository=[("echo", "2"), ("sentiment", "1")],
    )
    assert actions == (Load("echo", "2"), Retire("echo", "1"))


def test_a_retired_version_serves_on_while_its_replacement_failed() -> None:
    retire, desired, on_disk = Retire("echo", "1"), {"echo": loaded(3)}, {("echo", "2")}

    def keeps(
        loaded: list[VersionKey], failed: dict[VersionKey, int], disk: set[VersionKey] = on_disk
    ) -> bool:
        return keeps_serving(retire, desired=desired, loaded=loaded, failed=failed, repository=disk)

    # v2 failed at the model's revision, and nothing else of echo serves: v1 stays.
    assert keeps([("echo", "1")], {("echo", "2"): 3})
    # Failed at an older revision (a load since retries it), v2 serving, or nothing failed.
    assert not keeps([("echo", "1")], {("echo", "2"): 2})
    assert not keeps([("echo", "1"), ("echo", "2")], {})
    assert not keeps([("echo", "1")], {})
    # The whole model left the repository, its failed v2 too: v1 is retired.
    assert not keeps([("echo", "1")], {("echo", "2"): 3}, disk=set())


def test_unloads_come_before_loads_in_version_order() -> None:
    actions = make_plan(
        desired={"echo": unloaded(2), "sentiment": loaded(2)},
        serving=[("echo", "2"), ("echo", "1")],
    )
    assert actions == (Unload("echo", "1"), Unload("echo", "2"), Load("sentiment", "1"))


def test_desired_state_round_trips_through_its_json() -> None:
    state = unloaded(7)
    assert parse_desired({b"echo": state.to_json().encode()}) == {"echo": state}


def test_malformed_entries_are_left_out() -> None:
    fields = {
        "a": "not json",
        "b": '{"state": "gone", "revision": 1}',
        "c": '{"state": "loaded"}',
        "d": '{"state": "unloaded", "revision": 2}',
        "e": '{"state": "loaded", "revision": 1e999}',  # int(inf): OverflowError
        b"\xe9": '{"state": "loaded", "revision": 1}',  # a name that is not UTF-8
    }
    assert parse_desired(fields) == {"d": unloaded(2)}
