"""Triton's repository extension end to end: the stock tritonclient unloads and loads a model
through the gateway with an admin key, the fleet follows within seconds, a non-admin key is
refused. The whole stack as separate processes, with API keys."""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.gateway.auth import hash_key
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as worker_grpc
from tests.support.kserve import run_kserve_client
from tests.support.models import write_affine_model, write_versioned_affine_model
from tests.support.stack import Stack, start_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e

ADMIN_KEY = "repository-admin-key"
USER_KEY = "repository-user-key"
#: An admin key limited to the `other` model.
OTHER_ADMIN_KEY = "repository-other-admin-key"
#: Workers read the desired state every second; the gateway's catalog follows the router's: a
#: few seconds; the bound only turns "never" into a failure on a loaded machine.
CONVERGE_S = 30.0


@pytest.fixture(scope="module")
def repo(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repo = tmp_path_factory.mktemp("repository") / "repo"
    write_versioned_affine_model(repo, versions=(1,))
    write_affine_model(repo, name="other")
    return repo


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, repo: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("stack")
    keys = tmp / "api-keys.toml"
    keys.write_text(
        f'[[keys]]\ntenant = "ops"\nsha256 = "{hash_key(ADMIN_KEY)}"\nadmin = true\n'
        f'[[keys]]\ntenant = "search"\nsha256 = "{hash_key(USER_KEY)}"\n'
        f'[[keys]]\ntenant = "other-ops"\nsha256 = "{hash_key(OTHER_ADMIN_KEY)}"\n'
        'admin = true\nmodels = ["other"]\n'
    )
    stack = start_stack(tmp, model_repository=repo, extra_gateway_args=(f"--api-keys-file={keys}",))
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def repository(stack: Stack, action: str, key: str, model: str = "affine") -> dict:
    """The stock client's repository call (`index`, `load`, `unload`) with `key`."""
    return run_kserve_client(
        stack.gateway.address, "--model", model, "--api-key", key, "--repository", action
    )


def auth(key: str) -> tuple[tuple[str, str]]:
    return (("authorization", f"Bearer {key}"),)


async def is_ready(stack: Stack, model: str = "affine") -> bool:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        reply = await stub.ModelReady(
            kserve.ModelReadyRequest(name=model), metadata=auth(USER_KEY), timeout=10
        )
    return reply.ready


def infer_request() -> kserve.ModelInferRequest:
    tensor = kserve.ModelInferRequest.InferInputTensor(name="x", datatype="FP32", shape=[1, 4])
    return kserve.ModelInferRequest(
        model_name="affine",
        inputs=[tensor],
        raw_input_contents=[np.array([[1, 2, 3, 4]], dtype=np.float32).tobytes()],
    )


async def infer(stack: Stack) -> kserve.ModelInferResponse:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        return await stub.ModelInfer(infer_request(), metadata=auth(USER_KEY), timeout=30)


def test_a_key_that_is_not_admin_is_refused(stack: Stack) -> None:
    for action in ("unload", "load", "index"):
        report = repository(stack, action, USER_KEY)
        assert report["status"] == "StatusCode.PERMISSION_DENIED", report
        assert "admin" in report["message"]


def test_an_admin_key_limited_to_some_models_changes_and_lists_only_those(stack: Stack) -> None:
    """It loaded and unloaded every model, and the index listed them all with their load
    failures (review finding): the models it may not use are refused PERMISSION_DENIED."""
    for action in ("unload", "load"):
        report = repository(stack, action, OTHER_ADMIN_KEY)
        assert report["status"] == "StatusCode.PERMISSION_DENIED", report
    index = repository(stack, "index", OTHER_ADMIN_KEY)["index"]
    assert {m["name"] for m in index} == {"other"}


async def test_unload_then_load_through_the_stock_client(stack: Stack) -> None:
    assert await is_ready(stack)
    index = repository(stack, "index", ADMIN_KEY)["index"]
    assert {(m["name"], m["version"], m["state"]) for m in index} == {
        ("affine", "1", "READY"),
        ("other", "1", "READY"),
    }

    assert repository(stack, "unload", ADMIN_KEY)["status"] == "OK"
    await eventually(
        lambda: _not(is_ready(stack)), timeout_s=CONVERGE_S, message="affine still ready"
    )
    assert await is_ready(stack, "other"), "the other model keeps serving"
    index = repository(stack, "index", ADMIN_KEY)["index"]
    states = {m["name"]: (m["state"], m["reason"]) for m in index}
    assert states["affine"][0] == "UNAVAILABLE" and "unloaded" in states["affine"][1]
    # Unloaded on purpose: NOT_FOUND, as Triton answers; UNAVAILABLE was retried by clients,
    # and waited on by job runners for 30 minutes (review finding).
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await infer(stack)
    assert refused.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unloaded" in (refused.value.details() or "")

    assert repository(stack, "load", ADMIN_KEY)["status"] == "OK"
    await eventually(lambda: is_ready(stack), timeout_s=CONVERGE_S, message="affine not ready")
    reply = await infer(stack)
    assert reply.model_name == "affine" and reply.model_version == "1"


async def worker_serves(stack: Stack, model: str = "affine") -> bool:
    """Whether the worker itself lists `model` (the fleet view follows a while later)."""
    async with grpc.aio.insecure_channel(stack.workers[0].address) as channel:
        listing = await worker_grpc.WorkerServiceStub(channel).ListModels(
            pb.ListWorkerModelsRequest(), timeout=10
        )
    return any(v.model_name == model for v in listing.versions)


async def test_a_reload_answers_once_the_model_serves_again(stack: Stack) -> None:
    """Unload, then load as soon as the worker has dropped the model: the fleet view still
    listed it, a heartbeat and two refreshes behind, so the load answered OK at once, and the
    calls that followed failed until the worker loaded it again (KServe review). The load now
    answers once a worker applied it, and a call right after it is served."""
    assert await is_ready(stack)
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        await stub.RepositoryModelUnload(
            kserve.RepositoryModelUnloadRequest(model_name="affine"),
            metadata=auth(ADMIN_KEY), timeout=30,
        )  # fmt: skip
        await eventually(
            lambda: _not(worker_serves(stack)), timeout_s=CONVERGE_S, message="still served"
        )
        await stub.RepositoryModelLoad(
            kserve.RepositoryModelLoadRequest(model_name="affine"),
            metadata=auth(ADMIN_KEY), timeout=30,
        )  # fmt: skip
        reply = await stub.ModelInfer(infer_request(), metadata=auth(USER_KEY), timeout=10)
    assert reply.model_name == "affine"


def post(stack: Stack, path: str, key: str, body: bytes = b"") -> tuple[int, object]:
    """(status, JSON body) of one REST call."""
    request = urllib.request.Request(stack.gateway.http_url + path, data=body, method="POST")
    request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def test_rest_repository_routes_answer_admins_only(stack: Stack) -> None:
    status, index = post(stack, "/v2/repository/index", ADMIN_KEY)
    assert status == 200
    assert {"name": "other", "version": "1", "state": "READY"}.items() <= index[-1].items()
    assert post(stack, "/v2/repository/index", USER_KEY)[0] == 403
    assert post(stack, "/v2/repository/models/affine/unload", USER_KEY)[0] == 403
    assert post(stack, "/v2/repository/models/affine/load", ADMIN_KEY) == (200, {})
    assert post(stack, "/v2/repository/models/nope/load", ADMIN_KEY)[0] == 404


async def test_a_load_with_a_config_override_or_files_is_refused_not_ignored(
    stack: Stack,
) -> None:
    """Triton's load parameters (a config override, model files), which the fabric does not
    take: refused INVALID_ARGUMENT (HTTP 400) on both ports. Before, the load answered OK with
    the repository's config in force, its caller believing its override was (HTTP review)."""
    override = json.dumps({"parameters": {"config": json.dumps({"max_batch_size": 4})}})
    status, body = post(stack, "/v2/repository/models/affine/load", ADMIN_KEY, override.encode())
    assert status == 400 and "config" in str(body), body
    empty = json.dumps({"parameters": {}}).encode()
    assert post(stack, "/v2/repository/models/affine/load", ADMIN_KEY, empty) == (200, {})
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        files = kserve.RepositoryModelLoadRequest(
            model_name="affine",
            parameters={"file:1/model.pt": kserve.ModelRepositoryParameter(bytes_param=b"x")},
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.RepositoryModelLoad(
                files, metadata=(("authorization", f"Bearer {ADMIN_KEY}"),)
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "file:1/model.pt" in (refused.value.details() or "")


class Traffic:
    """`num_callers` loops of ModelInfer on affine until stopped: each answer's version, and
    every failure."""

    def __init__(self, stack: Stack, num_callers: int = 4) -> None:
        self.versions: list[str] = []
        self.failures: list[BaseException] = []
        self._stack = stack
        self._stop = asyncio.Event()
        self._callers = [asyncio.ensure_future(self._loop()) for _ in range(num_callers)]

    async def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.versions.append((await infer(self._stack)).model_version)
            except grpc.aio.AioRpcError as error:
                self.failures.append(error)

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._callers)


async def test_a_new_version_loads_while_traffic_runs_without_a_failed_request(
    stack: Stack, repo: Path
) -> None:
    """The issue's scenario: serve v1; put v2 on the volume; RepositoryModelLoad with the
    stock client while concurrent traffic runs: the load answers once v2 serves, no request
    fails, the index shows both."""
    assert (await infer(stack)).model_version == "1"
    traffic = Traffic(stack)
    write_versioned_affine_model(repo, versions=(1, 2))  # v1 as it was; v2 is new
    loaded = await asyncio.to_thread(repository, stack, "load", ADMIN_KEY)
    index = repository(stack, "index", ADMIN_KEY)["index"]
    await eventually(
        lambda: traffic.versions[-4:] == ["2"] * 4, timeout_s=CONVERGE_S, message="v2 serving"
    )
    await traffic.stop()
    assert loaded["status"] == "OK", loaded
    # The load answered once the fleet served v2: the index says so at once.
    assert {(m["name"], m["version"], m["state"]) for m in index} >= {
        ("affine", "1", "READY"),
        ("affine", "2", "READY"),
    }
    assert not traffic.failures, traffic.failures[:3]
    assert {"1", "2"} <= set(traffic.versions) and len(traffic.versions) >= 20


async def test_a_corrupt_version_fails_its_load_clearly_and_the_served_ones_keep_serving(
    stack: Stack, repo: Path
) -> None:
    """A version whose weights do not load: RepositoryModelLoad (stock client) answers
    FAILED_PRECONDITION naming the version, the worker and the loader's error; traffic to
    the served versions sees no error; the index reports the failure as the reason."""
    write_versioned_affine_model(repo, versions=(1, 2))
    assert repository(stack, "load", ADMIN_KEY)["status"] == "OK"
    traffic = Traffic(stack)
    corrupt = repo / "affine" / "3"
    corrupt.mkdir(exist_ok=True)
    (corrupt / "model.pt").write_bytes(b"these are not TorchScript weights")
    try:
        refused = await asyncio.to_thread(repository, stack, "load", ADMIN_KEY)
        for _ in range(20):  # the served versions keep answering after the refusal too
            await infer(stack)
        index = repository(stack, "index", ADMIN_KEY)["index"]
    finally:
        await traffic.stop()
        (corrupt / "model.pt").unlink()
        corrupt.rmdir()
    assert refused["status"] == "StatusCode.FAILED_PRECONDITION", refused
    assert "version 3 failed to load on worker-0" in refused["message"], refused
    assert not traffic.failures, traffic.failures[:3]
    assert set(traffic.versions) <= {"1", "2"} and traffic.versions
    states = {(m["name"], m["version"]): m for m in index}
    assert states["affine", "3"]["state"] == "UNAVAILABLE"
    assert "failed to load on worker-0" in states["affine", "3"]["reason"]
    assert states["affine", "2"]["state"] == "READY"


async def _not(ready: object) -> bool:
    return not await ready  # type: ignore[misc]


async def test_a_version_replaced_on_the_volume_serves_until_its_successor_does(
    stack: Stack, repo: Path
) -> None:
    """A swap as the repository extension has it: a served version deleted from the volume, a
    new one written, a load (stock client) while traffic runs. The workers unloaded the old
    version before the new one served, and the load waited for the deleted version (kept by
    the gateway while a worker served it) until its timeout: UNAVAILABLE (review findings).
    The load answers OK once the new version serves, no call fails, and the deleted version
    leaves the index."""
    write_versioned_affine_model(repo, versions=(1, 2))
    assert repository(stack, "load", ADMIN_KEY)["status"] == "OK"
    traffic = Traffic(stack)
    try:
        shutil.rmtree(repo / "affine" / "1")
        # The new version moved in whole: written in place, its file could be read half
        # written by a re-read of the repository (one follows the deleted version's removal),
        # its load then failing and not tried again by the load that followed.
        staged = write_versioned_affine_model(repo.parent / "staged", versions=(3,))
        (staged / "3").rename(repo / "affine" / "3")
        loaded = await asyncio.to_thread(repository, stack, "load", ADMIN_KEY)

        async def v1_gone() -> bool:
            index = await asyncio.to_thread(repository, stack, "index", ADMIN_KEY)
            return ("affine", "1") not in {(m["name"], m["version"]) for m in index["index"]}

        # A condition wait: generous, it costs nothing when the index follows at once.
        await eventually(v1_gone, timeout_s=30.0, message="v1 left the index")
    finally:
        await traffic.stop()
    assert loaded["status"] == "OK", loaded
    assert not traffic.failures, traffic.failures[:3]
    assert "3" in traffic.versions


def test_a_model_copied_into_the_repository_is_loaded_by_an_admin_key(
    stack: Stack, repo: Path
) -> None:
    """A load reads the repository first, finding a model new to the gateway; checking the
    key's models against the catalog before it refused every such load NOT_FOUND (diff
    review). A key limited to other models is refused it."""
    write_affine_model(repo, name="third")
    refused = repository(stack, "load", OTHER_ADMIN_KEY, model="third")
    assert refused["status"] == "StatusCode.PERMISSION_DENIED", refused
    loaded = repository(stack, "load", ADMIN_KEY, model="third")
    assert loaded["status"] == "OK", loaded
