"""Runtime model routing: the record's rules, sticky weighted choice, and how the gateway's
catalog applies records (newer revisions only, known versions only, reset to the seed)."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest

from services.common.errors import NotFound, Unavailable
from services.common.model_repository import load_repository
from services.common.model_routing import ModelRouting
from services.gateway.catalog import ModelCatalog
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.models import write_versioned_affine_model

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("labels", "traffic", "message"),
    [
        ({"Stable": 1}, {}, "lower-case"),
        ({"stable": 0}, {}, "positive integer"),
        ({"stable": 1}, {"canary": 1.0}, "not a label"),
        ({"stable": 1}, {"stable": float("nan")}, "finite"),
        ({"stable": 1}, {"stable": -1.0}, ">= 0"),
    ],
)
def test_malformed_routing_is_refused(
    labels: dict[str, int], traffic: dict[str, float], message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        ModelRouting(labels, traffic)


def test_a_record_survives_a_round_trip_and_garbage_is_refused() -> None:
    routing = ModelRouting({"stable": 1, "canary": 2}, {"stable": 9.0, "canary": 1.0}, 7)
    assert ModelRouting.loads(routing.dumps()) == routing
    for garbage in (b"", b"[]", b'{"labels": {}}', b'{"revision": 1, "labels": 3}'):
        with pytest.raises(ValueError):
            ModelRouting.loads(garbage)


@pytest.mark.parametrize(
    "garbage",
    [
        b'{"revision": 1e400, "labels": {"stable": 1}}',  # OverflowError in int()
        b'{"revision": 1, "labels": {"stable": Infinity}}',
        b'{"revision": 1, "labels": {"stable": 2.5}}',  # not version 2
        b'{"revision": 1, "labels": {"stable": true}}',
        b'{"revision": 1, "labels": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",  # nested
    ],
)
def test_a_record_of_numbers_no_version_is_refused_as_malformed(garbage: bytes) -> None:
    """Readers skip a record that raises ValueError; an OverflowError or a RecursionError
    escaped them and ended the gateway's routing sync round, so every model after the bad
    one in the catalog lost its routing changes."""
    with pytest.raises(ValueError, match="not a model routing record"):
        ModelRouting.loads(garbage)


def test_weights_that_add_up_past_a_float_are_refused() -> None:
    """Each finite, their sum infinite: every call went to the last label, the canary's
    share 0 of a 50:50 split (review finding)."""
    with pytest.raises(ValueError, match="finite number"):
        ModelRouting({"stable": 1, "canary": 2}, {"stable": 1e308, "canary": 1e308}, 1)
    with pytest.raises(ValueError):
        ModelRouting.loads(
            '{"revision": 1, "labels": {"stable": 1, "canary": 2},'
            ' "traffic": {"stable": 1e308, "canary": 1e308}}'
        )


def test_a_sticky_choice_moves_only_when_the_split_changes() -> None:
    """Hashed with the record's revision, half of a 50:50 split's ids moved to the other
    version at every write that left the weights as they were: a label added, a promotion
    written again (review finding)."""
    rng = random.Random(0)
    before = ModelRouting({"stable": 1, "canary": 2}, {"stable": 1.0, "canary": 1.0}, 1)
    relabelled = ModelRouting(
        {"stable": 1, "canary": 2, "prod": 2}, {"stable": 1.0, "canary": 1.0}, 2
    )
    ids = [f"r{i}" for i in range(1000)]
    picks = [before.weighted_label("m", i, rng) for i in ids]
    assert [relabelled.weighted_label("m", i, rng) for i in ids] == picks
    # A new split (the canary's version, or its weight) draws again.
    moved = ModelRouting({"stable": 1, "canary": 3}, {"stable": 1.0, "canary": 1.0}, 3)
    assert [moved.weighted_label("m", i, rng) for i in ids] != picks


def test_sticky_choice_is_stable_per_id_and_weighted_across_ids() -> None:
    routing = ModelRouting({"stable": 1, "canary": 2}, {"stable": 3.0, "canary": 1.0}, 1)
    rng = random.Random(0)
    picks = [routing.weighted_label("m", f"request-{i}", rng) for i in range(4000)]
    again = [routing.weighted_label("m", f"request-{i}", rng) for i in range(4000)]

    assert picks == again
    assert Counter(picks)["canary"] / len(picks) == pytest.approx(0.25, abs=0.03)
    unweighted = ModelRouting({"stable": 1}, {"stable": 0.0})
    assert unweighted.weighted_label("m", "x", rng) is None


@pytest.fixture
def catalog(tmp_path: Path) -> ModelCatalog:
    write_versioned_affine_model(tmp_path / "repo", versions=(1, 2))
    catalog = ModelCatalog(load_repository(tmp_path / "repo"), rng=random.Random(0))
    catalog.update_served(
        [
            pb.ModelVersionInfo(
                model_name="affine", model_version=v, kind=pb.MODEL_KIND_TORCHSCRIPT, is_ready=True
            )
            for v in ("1", "2")
        ]
    )
    return catalog


def test_the_catalog_applies_only_newer_routing_of_known_versions(catalog: ModelCatalog) -> None:
    assert catalog.resolve("affine", "").version == "2", "seed: no labels, the newest version"
    canary = ModelRouting({"stable": 1, "canary": 2}, {"stable": 0.0, "canary": 1.0}, 2)

    assert catalog.set_routing("affine", canary)
    assert catalog.resolve("affine", "canary").version == "2"
    assert catalog.resolve("affine", "stable").version == "1"
    assert {catalog.resolve("affine", "").version for _ in range(20)} == {"2"}
    stale = ModelRouting({"stable": 2}, {}, 1)
    assert not catalog.set_routing("affine", stale), "an older revision never wins"
    with pytest.raises(ValueError, match="do not exist"):
        catalog.set_routing("affine", ModelRouting({"stable": 3}, {}, 5))
    assert catalog.routing("affine") == canary


def test_the_newest_default_follows_what_workers_serve(catalog: ModelCatalog) -> None:
    """Without labels the default is the newest version served, kept between calls: each
    change of what workers serve moves it (it fails if a stale answer is kept)."""

    def serve(*versions: str) -> None:
        catalog.update_served([pb.ModelVersionInfo(model_name="affine", model_version=v,
                               kind=pb.MODEL_KIND_TORCHSCRIPT, is_ready=True)
                               for v in versions])  # fmt: skip

    assert catalog.resolve("affine", "").version == "2"
    serve("1")
    assert catalog.resolve("affine", "").version == "1"
    serve()
    with pytest.raises(Unavailable, match="no ready worker serves model 'affine'"):
        catalog.resolve("affine", "")
    serve("1", "2")
    assert catalog.resolve("affine", "").version == "2"
    # A version this gateway no longer reads is no default, served or not.
    serve("1")
    assert catalog.forget_versions({("affine", "1")}) == ["affine/2"]
    serve("1", "2")
    assert catalog.resolve("affine", "").version == "1"


def test_a_labelled_version_no_worker_serves_passes_its_share_on(catalog: ModelCatalog) -> None:
    """Before, the default traffic a canary's weight drew to a version that failed to load
    everywhere failed UNAVAILABLE (review finding). It goes to stable, else the newest
    served; a call naming the label still gets the label's version, or its refusal."""
    catalog.set_routing(
        "affine", ModelRouting({"stable": 1, "canary": 2}, {"stable": 0.0, "canary": 1.0}, 2)
    )
    only_one = [
        pb.ModelVersionInfo(
            model_name="affine", model_version="1", kind=pb.MODEL_KIND_TORCHSCRIPT, is_ready=True
        )
    ]
    catalog.update_served(only_one)
    assert {catalog.resolve("affine", "").version for _ in range(20)} == {"1"}
    with pytest.raises(Unavailable, match="affine/2"):
        catalog.resolve("affine", "canary")
    # A version no label with weight routes to is no default, newest or not: version 2,
    # a canary held at weight 0, while stable's is not served (review finding).
    catalog.set_routing(
        "affine", ModelRouting({"stable": 1, "canary": 2}, {"stable": 1.0, "canary": 0.0}, 3)
    )
    only_two = [pb.ModelVersionInfo(model_name="affine", model_version="2",
                                    kind=pb.MODEL_KIND_TORCHSCRIPT, is_ready=True)]  # fmt: skip
    catalog.update_served(only_two)
    with pytest.raises(Unavailable, match="no ready worker serves model 'affine'"):
        catalog.resolve("affine", "")
    # Labels with no weights at all (a `prod` label only): the newest served is the default.
    catalog.set_routing("affine", ModelRouting({"prod": 1}, {}, 4))
    assert catalog.resolve("affine", "").version == "2"
    catalog.update_served([])
    with pytest.raises(Unavailable, match="no ready worker serves model 'affine'"):
        catalog.resolve("affine", "")


def test_removing_the_record_returns_to_the_repository(catalog: ModelCatalog) -> None:
    catalog.set_routing("affine", ModelRouting({"stable": 1}, {}, 4))
    assert catalog.resolve("affine", "").version == "1"

    assert catalog.set_routing("affine", None)
    assert catalog.resolve("affine", "").version == "2"
    with pytest.raises(NotFound, match="no version label"):
        catalog.resolve("affine", "stable")


def test_ready_versions_count_what_ready_workers_serve_for_every_repository_model(
    tmp_path: Path,
) -> None:
    """The gauge an alert reads (FabricModelUnserved): per model of the repository, the
    versions a ready live worker serves; 0 for one served by no ready worker (a pool down);
    models and versions of the fleet view this gateway has not read are left out (its calls
    to them fail here)."""
    write_versioned_affine_model(tmp_path / "repo", versions=(1, 2))
    catalog = ModelCatalog(load_repository(tmp_path / "repo"), rng=random.Random(0))
    assert catalog.ready_versions() == {"affine": 0}, "before any listing"

    def listed(version: str, *, is_ready: bool, name: str = "affine") -> pb.ModelVersionInfo:
        return pb.ModelVersionInfo(model_name=name, model_version=version, is_ready=is_ready)

    catalog.update_served([listed("1", is_ready=True), listed("2", is_ready=False),
                           listed("3", is_ready=True),
                           listed("1", is_ready=True, name="elsewhere")])  # fmt: skip
    assert catalog.ready_versions() == {"affine": 1}
    catalog.update_served([listed("2", is_ready=False)])
    assert catalog.ready_versions() == {"affine": 0}
