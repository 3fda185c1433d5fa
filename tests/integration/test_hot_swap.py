"""Hot load and unload: a real in-process worker on port 0 follows the desired model state in a
real redis-server (through its own ACL role), with real TorchScript models."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import shutil
import weakref
from collections.abc import AsyncIterator, Mapping
from contextlib import closing
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest
from prometheus_client import generate_latest
from redis.exceptions import NoPermissionError

from services.common import metric_names as names
from services.common.processes import reserve_port
from services.common.registry_schema import RegistryKeys, WorkerRecord, connect
from services.common.repository_state import DesiredState, ModelState, repository_key
from services.gpu_worker import hot_swap
from services.gpu_worker.batching.lane_changes import release_device_memory
from services.gpu_worker.config import HeartbeatConfig, WorkerConfig
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.repository_follower import RepositoryFollower, desired_at_start
from services.gpu_worker.server import Worker, create_worker
from services.pb.inference.v1 import worker_pb2 as pb
from services.pb.inference.v1 import worker_pb2_grpc as pb_grpc
from tests.support.in_process import start_lone_worker, swapper_for
from tests.support.metrics import samples, total
from tests.support.models import (
    release_stall,
    tiny_llama_version,
    write_affine_model,
    write_stalling_model,
    write_versioned_affine_model,
)
from tests.support.processes import REPO_ROOT
from tests.support.redis import RedisServer
from tests.support.waiting import eventually, thread_ends

pytestmark = pytest.mark.integration

#: Bound on the wait for a worker to follow a desired-state change. It reads the state every
#: second, then loads or drains (tiny-llama's load and warm-up take seconds on a busy machine):
#: generous, since that it follows is what is checked, not how fast.
CONVERGE_S = 30.0
#: A row starting with this holds the stalling model's call until its gate opens.
STALL = 77.0
#: Tokens of a stream: enough that its delivery (about 3 s) still runs when the worker starts
#: unloading its model.
MAX_TOKENS = 480


def request(model: str = "affine", version: str = "", *, first: float = 1.0) -> pb.InferRequest:
    data = np.array([first, 2, 3, 4], dtype=np.float32).tobytes()
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[4], raw_data=data)
    return pb.InferRequest(
        model_name=model, model_version=version, inputs=[pb.ModelInput(tensor=tensor)]
    )


def config(tmp_path: Path, redis_url: str) -> WorkerConfig:
    return WorkerConfig(
        model_repository=tmp_path / "repo",
        grpc_port=0,
        metrics_port=0,
        redis_url=redis_url,
        worker_id="w1",
        heartbeat=HeartbeatConfig(period_s=0.2),
    )


async def set_desired(redis_server: RedisServer, model: str, state: DesiredState) -> None:
    client = connect(redis_server.url)
    try:
        await client.hset(repository_key("fabric"), model, state.to_json())
    finally:
        await client.aclose()


async def registered(redis_server: RedisServer) -> WorkerRecord | None:
    client = connect(redis_server.url)
    try:
        raw = await client.get(RegistryKeys().worker("w1"))
    finally:
        await client.aclose()
    return WorkerRecord.from_json(raw) if raw is not None else None


async def registered_models(redis_server: RedisServer) -> set[tuple[str, str]]:
    record = await registered(redis_server)
    return {(m.name, m.version) for m in record.models} if record else set()


async def registered_failures(redis_server: RedisServer) -> list[tuple[str, str, int]]:
    """Each failure reported: model, version and the desired-state revision it followed."""
    record = await registered(redis_server)
    return [(f.name, f.version, f.revision) for f in record.failed] if record else []


async def listed(stub: pb_grpc.WorkerServiceStub) -> set[tuple[str, str]]:
    response = await stub.ListModels(pb.ListWorkerModelsRequest(), timeout=10)
    return {(v.model_name, v.model_version) for v in response.versions}


@pytest.fixture
async def worker(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Worker]:
    write_affine_model(tmp_path / "repo")
    write_affine_model(tmp_path / "repo", name="other")
    write_stalling_model(tmp_path / "repo", tmp_path / "gate")
    worker = await create_worker(config(tmp_path, redis_server.worker_url))
    await worker.load()
    yield worker
    await worker.stop()


async def test_unload_drains_in_flight_calls_then_load_serves_again(
    tmp_path: Path, worker: Worker, redis_server: RedisServer
) -> None:
    key, batching = ("stall", "1"), worker.batching
    assert batching is not None
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        # One call holds the executor until the gate opens; three more queue behind it.
        held = asyncio.ensure_future(stub.Infer(request("stall", first=STALL), timeout=60))
        await eventually(lambda: batching.is_executing, message="stalled call running")
        queued = [asyncio.ensure_future(stub.Infer(request("stall"), timeout=60)) for _ in "abc"]
        await eventually(lambda: batching.num_in_flight == 4, message="calls queued")
        await set_desired(redis_server, "stall", DesiredState(ModelState.UNLOADED, 1))
        await eventually(lambda: _lacks(stub, key), timeout_s=CONVERGE_S, message="unlisted")
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Infer(request("stall"), timeout=10)
        is_still_running = not held.done() and not any(call.done() for call in queued)
        release_stall(tmp_path / "gate")
        answers = await asyncio.gather(held, *queued)
        other = await stub.Infer(request("other"), timeout=10)
        await eventually(lambda: _unregistered(redis_server, key), message="left the registry")

        await set_desired(redis_server, "stall", DesiredState(ModelState.LOADED, 2))
        await eventually(lambda: _has(stub, key), timeout_s=CONVERGE_S, message="listed again")
        again = await stub.Infer(request("stall"), timeout=10)
        # Listed first, then published (the heartbeat's next turn, woken by the load).
        await eventually(lambda: _registered(redis_server, key), message="registered again")
        # With the revision it applied: a gateway's load waits for it (repository_control).
        await eventually(
            lambda: _applied(redis_server, "stall", 2), message="the load's revision told"
        )
        record = await registered(redis_server)
        assert record is not None and {m.name: m.revision for m in record.models} == {
            "affine": 0, "other": 0, "stall": 2  # no desired state: none to apply
        }  # fmt: skip
    assert is_still_running, "the calls were in flight when the version was unloaded"
    assert refused.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
    assert [a.model_name for a in answers] == ["stall"] * 4
    assert other.model_name == "other"
    assert again.model_name == "stall"


async def test_a_corrupt_new_version_fails_to_load_and_the_rest_keeps_serving(
    tmp_path: Path, worker: Worker, redis_server: RedisServer
) -> None:
    model_dir = tmp_path / "repo" / "affine"
    (model_dir / "2").mkdir()
    (model_dir / "2" / "model.pt").write_bytes(b"not a torchscript archive")
    await set_desired(redis_server, "affine", DesiredState(ModelState.LOADED, 1))
    failures = names.WORKER_MODEL_LOAD_FAILURES_TOTAL

    def load_failures() -> float:
        exported = generate_latest(worker.metrics.registry).decode()
        return total(exported, failures, model="affine", version="2")

    # Reported at the load's revision, which a gateway's load waits for: the follower may
    # have read the volume before the load was written, failed v2 at revision 0, and retried.
    reported = await eventually(
        lambda: _failed_at(redis_server, 1), timeout_s=CONVERGE_S, message="reported"
    )
    failed_loads = load_failures()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        served = await listed(stub)
        latest = await stub.Infer(request(), timeout=10)
        assert worker.models is not None
        failed = [(f.model, f.version) for f in worker.models.failed]

        # Fixed on the volume: the next load (a higher revision) retries it, once.
        write_versioned_affine_model(tmp_path / "fixed", versions=(2,))
        (model_dir / "2" / "model.pt").write_bytes(
            (tmp_path / "fixed" / "affine" / "2" / "model.pt").read_bytes()
        )
        await set_desired(redis_server, "affine", DesiredState(ModelState.LOADED, 2))
        await eventually(lambda: _has(stub, ("affine", "2")), timeout_s=CONVERGE_S)
        newest = await stub.Infer(request(), timeout=10)
    assert served == {("affine", "1"), ("other", "1"), ("stall", "1")}
    assert latest.model_version == "1"
    assert failed == [("affine", "2")]
    assert reported == [("affine", "2", 1)]
    assert failed_loads in (1, 2) and load_failures() == failed_loads  # the fix loaded at once
    assert newest.model_version == "2"
    assert worker.models.failed == ()
    assert await eventually(lambda: _no_failures(redis_server), message="failure cleared")


async def test_a_version_replaced_on_disk_serves_until_its_replacement_loads(
    tmp_path: Path, worker: Worker, redis_server: RedisServer
) -> None:
    """A swap as the repository API has it (no per-version control): v1 deleted, v2 added,
    a load written. The worker unloaded v1 first, then loaded v2: the model was served by no
    worker of the fleet meanwhile, and, v2 corrupt, for good (review finding; RELIABILITY.md:
    a new version that fails to load leaves the old one serving). v1 now serves until a v2
    does: through v2's failure, and until a fixed v2 loads, then it is retired."""
    model_dir = tmp_path / "repo" / "affine"
    (model_dir / "2").mkdir()
    (model_dir / "2" / "model.pt").write_bytes(b"not a torchscript archive")
    shutil.rmtree(model_dir / "1")
    await set_desired(redis_server, "affine", DesiredState(ModelState.LOADED, 1))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        await eventually(lambda: registered_failures(redis_server), timeout_s=CONVERGE_S)
        served = await listed(stub)
        during = await stub.Infer(request(), timeout=10)

        write_versioned_affine_model(tmp_path / "fixed", versions=(2,))
        (model_dir / "2" / "model.pt").write_bytes(
            (tmp_path / "fixed" / "affine" / "2" / "model.pt").read_bytes()
        )
        await set_desired(redis_server, "affine", DesiredState(ModelState.LOADED, 2))
        await eventually(lambda: _lacks(stub, ("affine", "1")), timeout_s=CONVERGE_S)
        swapped = await listed(stub)
        after = await stub.Infer(request(), timeout=10)
    assert ("affine", "1") in served
    assert during.model_version == "1"
    assert ("affine", "2") in swapped
    assert after.model_version == "2"


async def follow_once(
    worker: Worker,
    client: Any,
    repository: Path,
    start_state: Mapping[str, DesiredState] | None = None,
) -> None:
    """One follow of the desired state by a follower of `worker`'s (one started without Redis,
    so without a follower of its own), reading it with `client`."""
    assert worker.models is not None
    follower = RepositoryFollower(
        client=client,
        registry_prefix="fabric",
        repository_dir=repository,
        pool=(),
        models=worker.models,
        swapper=swapper_for(worker),
        start_state=start_state,
    )
    await follower.follow_once()


async def test_a_served_model_that_does_not_read_at_the_first_follow_stays_served(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """A model loaded at start whose config is being rewritten when the follower first reads
    the repository: it is kept as loaded, not unloaded as gone from the volume (there is no
    earlier read to keep: what the worker loaded stands for it)."""
    write_affine_model(tmp_path / "repo")
    write_affine_model(tmp_path / "repo", name="other")
    worker = await create_worker(
        dataclasses.replace(config(tmp_path, redis_server.worker_url), redis_url=None)
    )
    await worker.load()  # without Redis: no follower of its own
    client = connect(redis_server.worker_url)
    try:
        assert worker.models is not None and worker.batching is not None
        (tmp_path / "repo" / "other" / "config.toml").write_bytes(b'kind = "torchscr')
        await follow_once(worker, client, tmp_path / "repo")
        served = {(m.config.name, m.version.version) for m in worker.models.all}
        assert served == {("affine", "1"), ("other", "1")}
    finally:
        await client.aclose()
        await worker.stop()


async def test_a_follow_that_cannot_read_the_repository_tells_no_new_revision_applied(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """The revision a worker tells applied (a gateway's reload waits for it) is one it acted
    on with the repository as it then was: a follow whose read of the whole repository fails
    (its volume away) plans from the last read and tells nothing new (diff review)."""
    write_affine_model(tmp_path / "repo")
    worker = await create_worker(
        dataclasses.replace(config(tmp_path, redis_server.worker_url), redis_url=None)
    )
    await worker.load()  # without Redis: no follower of its own
    client = connect(redis_server.worker_url)
    try:
        assert worker.models is not None
        follower = RepositoryFollower(
            client=client, registry_prefix="fabric", repository_dir=tmp_path / "repo", pool=(),
            models=worker.models, swapper=swapper_for(worker),
        )  # fmt: skip
        await set_desired(redis_server, "affine", DesiredState(ModelState.LOADED, 1))
        await follower.follow_once()
        assert worker.models.applied_revisions == {"affine": 1}
        (tmp_path / "repo").rename(tmp_path / "away")
        await set_desired(redis_server, "affine", DesiredState(ModelState.LOADED, 2))
        await follower.follow_once()
        assert worker.models.applied_revisions == {"affine": 1}
        (tmp_path / "away").rename(tmp_path / "repo")
        await follower.follow_once()
        assert worker.models.applied_revisions == {"affine": 2}
    finally:
        await client.aclose()
        await worker.stop()


async def test_a_version_that_failed_at_start_is_retried_by_a_load_written_while_starting(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """affine/2 fails at start (its files half-staged); while the worker still loads, the
    files are completed and a load of affine written (revision 1). The start-up failure was
    counted as an attempt at the revision the follower first read, 1, so the worker never
    loaded the version every other worker loads, until another load. It counts at the
    revision the start-up load saw (none here: 0), and the load of revision 1 retries it."""
    write_affine_model(tmp_path / "repo")
    (tmp_path / "repo" / "affine" / "2").mkdir()
    (tmp_path / "repo" / "affine" / "2" / "model.pt").write_bytes(b"half a torchscript archive")
    worker = await create_worker(
        dataclasses.replace(config(tmp_path, redis_server.worker_url), redis_url=None)
    )
    await worker.load()  # without Redis: no follower of its own; the desired state was {}
    client = connect(redis_server.worker_url)
    try:
        assert worker.models is not None and worker.batching is not None
        assert [(f.model, f.version) for f in worker.models.failed] == [("affine", "2")]
        write_versioned_affine_model(tmp_path / "fixed", versions=(2,))
        (tmp_path / "repo" / "affine" / "2" / "model.pt").write_bytes(
            (tmp_path / "fixed" / "affine" / "2" / "model.pt").read_bytes()
        )
        await set_desired(redis_server, "affine", DesiredState(ModelState.LOADED, 1))
        await follow_once(worker, client, tmp_path / "repo", start_state={})
        served = {(m.config.name, m.version.version) for m in worker.models.all}
        assert served == {("affine", "1"), ("affine", "2")}
        assert worker.models.failed == ()
    finally:
        await client.aclose()
        await worker.stop()


async def test_a_desired_state_unreadable_at_start_is_none_not_an_empty_one(
    tmp_path: Path,
) -> None:
    """Redis unreachable at start: the desired state was {}, as with no entries, so each
    start-up failure counted as tried at revision 0, and the first read (revision N) loaded
    every failed version again with no load written. None says it was not read."""
    # Bound, never listening, and held through the read: connections are refused, and no
    # other process (another xdist worker's Redis) can take the port meanwhile.
    with closing(reserve_port("127.0.0.1", 0)) as closed:
        port = closed.getsockname()[1]
        unreachable = config(tmp_path, f"redis://127.0.0.1:{port}")  # nothing listens there
        assert await desired_at_start(unreachable) is None
    assert await desired_at_start(dataclasses.replace(unreachable, redis_url=None)) == {}


async def test_a_failed_version_deleted_from_the_volume_is_no_longer_reported(
    tmp_path: Path, worker: Worker, redis_server: RedisServer
) -> None:
    """A version that failed to load is reported (registry, RepositoryIndex) while it is on
    the volume and wanted; deleted, it is reported no more (before, for the worker's life)."""
    version_dir = tmp_path / "repo" / "affine" / "2"
    version_dir.mkdir()
    (version_dir / "model.pt").write_bytes(b"not a torchscript archive")
    await set_desired(redis_server, "affine", DesiredState(ModelState.LOADED, 1))
    # At the load's revision (the follower may have failed it at 0 first: _failed_at).
    assert await eventually(lambda: _failed_at(redis_server, 1), timeout_s=CONVERGE_S) == [
        ("affine", "2", 1)
    ]
    shutil.rmtree(version_dir)
    await set_desired(redis_server, "affine", DesiredState(ModelState.LOADED, 2))
    await eventually(lambda: _no_failures(redis_server), timeout_s=CONVERGE_S)
    assert worker.models is not None and worker.models.failed == ()


async def test_a_model_being_staged_neither_stops_the_follower_nor_hides_the_rest(
    tmp_path: Path, worker: Worker, redis_server: RedisServer
) -> None:
    """A model whose files are still being copied when a load is written (its config not yet
    UTF-8, then a field of the wrong shape) is logged and left out: the load of another
    model's new version goes ahead, and the staged model is picked up once its files are
    complete, with no new load written. Before, such a config raised out of the follower,
    which stopped following for good (and a failed read was never retried)."""
    write_versioned_affine_model(tmp_path / "v2", versions=(2,))
    shutil.copytree(tmp_path / "v2" / "affine" / "2", tmp_path / "repo" / "affine" / "2")
    staged = tmp_path / "repo" / "staged"
    staged.mkdir()
    (staged / "config.toml").write_bytes(b'kind = "\xe9"\n')
    await set_desired(redis_server, "affine", DesiredState(ModelState.LOADED, 1))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        await eventually(lambda: _has(stub, ("affine", "2")), timeout_s=CONVERGE_S)
        # Its load applied and told, though another model does not read: a gateway's reload
        # of it waited out its timeout while any model was half copied (diff review).
        await eventually(lambda: _applied(redis_server, "affine", 1), timeout_s=CONVERGE_S)
        complete = write_affine_model(tmp_path / "staging", name="staged")
        config_text = (complete / "config.toml").read_text()
        (staged / "config.toml").write_text(config_text + "length_buckets = 5\n")
        await asyncio.sleep(2.5)  # two periods of the follower on the second half-written form
        assert ("staged", "1") not in await listed(stub)
        shutil.copytree(complete, staged, dirs_exist_ok=True)
        await eventually(lambda: _has(stub, ("staged", "1")), timeout_s=CONVERGE_S)


async def test_an_unloaded_version_is_unreferenced_when_its_memory_is_released(
    worker: Worker, redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The release after an unload (gc, then the GPU allocator's cache emptied) runs once
    nothing references the version any more. Before, the unload's own frames still held it:
    on a GPU its tensors went back to the allocator's cache, which the next load's memory
    check counts as used, so replacing a version by one of its size was refused."""
    assert worker.models is not None
    version = weakref.ref(worker.models.fixed_cost_backend("other", "1"))
    freed: list[bool] = []

    def release() -> None:
        gc.collect()
        freed.append(version() is None)
        release_device_memory()

    monkeypatch.setattr(hot_swap, "release_device_memory", release)
    await set_desired(redis_server, "other", DesiredState(ModelState.UNLOADED, 1))
    await eventually(lambda: bool(freed), timeout_s=CONVERGE_S, message="released")
    assert freed == [True]


async def test_a_version_larger_than_free_memory_is_refused_before_it_loads(
    tmp_path: Path, worker: Worker, redis_server: RedisServer
) -> None:
    """A version whose files (a sparse 1 TiB file beside a good model.pt: its apparent size is
    what loading would read) cannot fit in the machine's memory is refused with the figures,
    never read; the served versions keep answering."""
    version_dir = tmp_path / "repo" / "affine" / "2"
    write_versioned_affine_model(tmp_path / "good", versions=(2,))
    version_dir.mkdir()
    shutil.copy(tmp_path / "good" / "affine" / "2" / "model.pt", version_dir / "model.pt")
    with open(version_dir / "padding.bin", "wb") as padding:
        padding.truncate(1 << 40)
    await set_desired(redis_server, "affine", DesiredState(ModelState.LOADED, 1))
    reported = await eventually(  # at the load's revision (see _failed_at)
        lambda: _failed_at(redis_server, 1), timeout_s=CONVERGE_S, message="reported"
    )
    assert worker.models is not None
    (failure,) = worker.models.failed
    async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
        stub = pb_grpc.WorkerServiceStub(channel)
        served = await listed(stub)
        answer = await stub.Infer(request(), timeout=10)
    assert reported == [("affine", "2", 1)]
    assert "not enough memory on cpu" in failure.error
    assert "1048576 MiB of weights" in failure.error
    assert ("affine", "2") not in served and answer.model_version == "1"


async def _failed_at(redis_server: RedisServer, revision: int) -> list[tuple[str, str, int]]:
    """The failures reported, once one is at `revision` (empty before). A test writes a new
    version, then a load: the follower may read the volume between the two and fail it at the
    revision before the load's, then again at the load's."""
    failures = await registered_failures(redis_server)
    return failures if any(at == revision for _, _, at in failures) else []


async def _no_failures(redis_server: RedisServer) -> bool:
    return await registered_failures(redis_server) == []


#: A long generation of tiny-llama: still streaming when its version starts unloading.
LONG_GENERATION = pb.WorkerGenerateRequest(
    model_name="tiny-llama",
    text="once upon a time",
    sampling=pb.SamplingParameters(max_tokens=MAX_TOKENS, ignore_eos=True),
)


async def _tiny_llama_worker(tmp_path: Path, redis_server: RedisServer) -> Worker:
    """A worker (not loaded yet) whose repository holds tiny-llama, beside the fixture's."""
    shutil.copytree(REPO_ROOT / "models" / "tiny-llama", tmp_path / "repo" / "tiny-llama")
    return await create_worker(config(tmp_path, redis_server.worker_url))


async def test_a_generation_model_unloads_after_its_streams_finish_and_loads_again(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    worker = await _tiny_llama_worker(tmp_path, redis_server)
    try:
        await worker.load()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            stream = stub.Generate(LONG_GENERATION, timeout=60)
            first = await stream.read()
            await set_desired(redis_server, "tiny-llama", DesiredState(ModelState.UNLOADED, 1))
            key = ("tiny-llama", "1")
            await eventually(lambda: _lacks(stub, key), timeout_s=CONVERGE_S, message="unlisted")
            rest = []
            while (message := await stream.read()) is not grpc.aio.EOF:
                rest.append(message)
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await anext(aiter(stub.Generate(LONG_GENERATION, timeout=60)))
            await set_desired(redis_server, "tiny-llama", DesiredState(ModelState.LOADED, 2))
            await eventually(lambda: _has(stub, key), timeout_s=CONVERGE_S, message="listed")
            again = [message async for message in stub.Generate(LONG_GENERATION, timeout=60)]
    finally:
        await worker.stop()
    tokens = [t for m in (first, *rest) for t in m.token_ids]
    assert len(tokens) == MAX_TOKENS and rest[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert refused.value.code() in (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.UNAVAILABLE)
    assert sum(len(m.token_ids) for m in again) == MAX_TOKENS


async def test_a_stop_during_a_generation_unload_lets_its_streams_finish(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    """SIGTERM (the worker's stop) while a generation version unloads, its stream still
    running: the stream finishes within the stop's grace. Before, the stop cancelled the
    unload, which cancelled the engine's loop, and the stream was cut UNAVAILABLE."""
    worker = await _tiny_llama_worker(tmp_path, redis_server)
    stopping: asyncio.Task[None] | None = None
    try:
        await worker.load()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            stream = stub.Generate(LONG_GENERATION, timeout=60)
            messages = [await stream.read()]
            await set_desired(redis_server, "tiny-llama", DesiredState(ModelState.UNLOADED, 1))
            key = ("tiny-llama", "1")
            await eventually(lambda: _lacks(stub, key), timeout_s=CONVERGE_S, message="unlisted")
            stopping = asyncio.create_task(worker.stop())
            while (message := await stream.read()) is not grpc.aio.EOF:
                messages.append(message)
    finally:
        await (stopping if stopping is not None else worker.stop())
    assert sum(len(m.token_ids) for m in messages) == MAX_TOKENS
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH


async def test_a_worker_started_after_an_unload_does_not_load_the_model(
    tmp_path: Path, redis_server: RedisServer
) -> None:
    write_affine_model(tmp_path / "repo")
    write_affine_model(tmp_path / "repo", name="other")
    await set_desired(redis_server, "other", DesiredState(ModelState.UNLOADED, 1))
    worker = await create_worker(config(tmp_path, redis_server.worker_url))
    try:
        await worker.load()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{worker.port}") as channel:
            stub = pb_grpc.WorkerServiceStub(channel)
            at_start = await listed(stub)
            first_record = await eventually(lambda: registered_models(redis_server))
            await set_desired(redis_server, "other", DesiredState(ModelState.LOADED, 2))
            await eventually(lambda: _has(stub, ("other", "1")), timeout_s=CONVERGE_S)
    finally:
        await worker.stop()
    assert at_start == {("affine", "1")}
    assert first_record == {("affine", "1")}


async def test_workers_read_the_desired_state_and_gateways_write_it(
    redis_server: RedisServer,
) -> None:
    key, entry = repository_key("fabric"), DesiredState(ModelState.UNLOADED, 1).to_json()
    worker = connect(redis_server.worker_url)
    gateway = connect(redis_server.role_url("gateway"))
    try:
        await gateway.hset(key, "affine", entry)
        assert await gateway.hgetall(key) == {b"affine": entry.encode()}
        assert await worker.hgetall(key) == {b"affine": entry.encode()}
        for call in (
            lambda: worker.hset(key, "affine", "{}"),
            lambda: worker.hgetall("fabric:rollout"),
            lambda: gateway.hgetall(RegistryKeys().worker("w1")),
        ):
            with pytest.raises(NoPermissionError):
                await call()
    finally:
        await worker.aclose()
        await gateway.aclose()


async def _lacks(stub: pb_grpc.WorkerServiceStub, key: tuple[str, str]) -> bool:
    return key not in await listed(stub)


async def _has(stub: pb_grpc.WorkerServiceStub, key: tuple[str, str]) -> bool:
    return key in await listed(stub)


async def _unregistered(redis_server: RedisServer, key: tuple[str, str]) -> bool:
    return key not in await registered_models(redis_server)


async def _registered(redis_server: RedisServer, key: tuple[str, str]) -> bool:
    return key in await registered_models(redis_server)


async def _applied(redis_server: RedisServer, model: str, revision: int) -> bool:
    """Whether the worker's record tells `model` served at `revision` applied."""
    record = await registered(redis_server)
    return record is not None and any(
        m.name == model and m.revision == revision for m in record.models
    )


#: Gauges of what a generation version's engine holds, gone with the version.
ENGINE_GAUGES = (
    names.GENERATION_KV_BLOCKS_FREE,
    names.GENERATION_KV_BLOCKS_USED,
    names.GENERATION_RUNNING_SEQUENCES,
    names.GENERATION_WAITING_SEQUENCES,
    names.GENERATION_PREFIX_CACHE_BLOCKS,
    names.GENERATION_CUDA_GRAPHS,
    names.GENERATION_ATTENTION_BACKENDS,
)


async def test_a_generation_version_failed_past_its_engine_lets_its_thread_go_and_exports_no_gauge(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A version whose load failed after its engine was made (its warm-up here, at start or
    while serving) lets its step thread go, and exports no standing gauge (whose function
    reads its scheduler); neither does one unloaded. Before, a warm-up that failed at start
    left its step thread running for good, and every failed load left a series reading its
    dead engine; an unload left one at 0, and its engine's other gauges (free KV blocks, ...)
    as they were."""
    repo = tmp_path / "repo" / "tiny-llama"
    shutil.copytree(REPO_ROOT / "models" / "tiny-llama", repo)
    shutil.copytree(repo / "1", repo / "2")
    third = tiny_llama_version(tmp_path / "more", "3")
    warm_up = GenerationBackend.warm_up

    def failing_warm_up(backend: GenerationBackend) -> None:
        if backend.version.version != "1":
            raise RuntimeError("the warm-up failed")
        warm_up(backend)

    monkeypatch.setattr(GenerationBackend, "warm_up", failing_warm_up)
    worker = await start_lone_worker(tmp_path / "repo", watchdog_s=30.0)
    swapper = swapper_for(worker)

    def standing(version: str) -> list[float]:
        exported = generate_latest(worker.metrics.registry).decode()
        found = samples(exported, names.GENERATION_QUEUE_STANDING, model="tiny-llama")
        return [value for labels, value in found if labels["version"] == version]

    def gauges(version: str) -> set[str]:
        """The version's engine gauges exported (KV blocks, sequences, kernels, graphs)."""
        exported = generate_latest(worker.metrics.registry).decode()
        return {
            name
            for name in ENGINE_GAUGES
            for labels, _ in samples(exported, name, model="tiny-llama")
            if labels["version"] == version
        }

    try:
        assert worker.models is not None
        assert {(f.model, f.version) for f in worker.models.failed} == {("tiny-llama", "2")}
        assert standing("1") == [0.0]  # served, nothing waits
        assert standing("2") == []  # failed at start
        await thread_ends("generation-tiny-llama/2", timeout_s=CONVERGE_S)
        assert await swapper.load(third) is False
        assert standing("3") == []  # failed while serving
        await thread_ends("generation-tiny-llama/3", timeout_s=CONVERGE_S)
        assert gauges("1") == set(ENGINE_GAUGES)
        await swapper.unload("tiny-llama", "1")
        assert standing("1") == []
        assert gauges("1") == set()  # a gone engine's free blocks would count in a fleet's sum
    finally:
        await worker.stop()
