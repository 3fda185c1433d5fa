"""Durable batch jobs in tests: a gRPC Predict target that stands in for the gateway, the
gateway's JobService on its own server, and the job runner as a real process."""

from __future__ import annotations

import asyncio
import collections
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import numpy as np

from services.common.errors import (
    InvalidInput,
    Overloaded,
    ServingError,
    Unauthenticated,
    Unavailable,
)
from services.common.job_store import JobStore, connect_jobs_redis
from services.common.lifecycle import new_server
from services.common.model_repository import load_repository
from services.common.processes import start_and_wait
from services.common.redis_acl import GATEWAY, JOBS, password_file_name
from services.common.tensors import tensor_to_pb
from services.gateway.auth import Authentication, KeyStore
from services.gateway.catalog import ModelCatalog
from services.gateway.config import GatewayConfig
from services.gateway.jobs_api import JobsApiConfig, JobServicer
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import jobs_pb2_grpc as jobs_grpc
from services.pb.inference.v1 import types_pb2
from tests.support.processes import REPO_ROOT, ServiceProcess
from tests.support.redis import RedisServer

#: Texts starting with this fail with INVALID_ARGUMENT, as a malformed input does.
POISON = "poison"
#: A call with a text starting with this is answered one output short, as a broken gateway
#: might: an answer the runner cannot read.
GARBLED = "garbled"
#: A call with a text starting with this is refused UNAVAILABLE, every time (the fleet cannot
#: serve it: no item's fault).
UNSERVED = "unserved"
#: Texts whose output has WIDE_FLOATS floats (80 KB): 64 of them answered together are past an
#: answer limit of 4 MiB (`start_target`), each alone is not; a HUGE text's is past it alone.
WIDE, HUGE = "wide", "huge"
WIDE_FLOATS, HUGE_FLOATS = 20_000, 1_100_000


def expected_output(text: str) -> np.ndarray:
    """What the stub target answers for `text`."""
    output = np.array([len(text), sum(text.encode()) % 9973], dtype="<f4")
    if text.startswith((WIDE, HUGE)):
        return np.resize(output, WIDE_FLOATS if text.startswith(WIDE) else HUGE_FLOATS)
    return output


@dataclass
class PredictTarget(api_grpc.InferenceServiceServicer):
    """A Predict server: deterministic outputs per text, poison texts refused, optionally
    refusing its first calls (UNAUTHENTICATED, then UNAVAILABLE), or holding calls once some
    texts have run (so that a job is caught mid-way however fast the machine runs it)."""

    num_unavailable: int = 0
    #: How those first calls fail: UNAVAILABLE (a tier restarting), or CANCELLED (a gateway that
    #: dropped them unseen, past its --max-pending-calls).
    unavailable_code: grpc.StatusCode = grpc.StatusCode.UNAVAILABLE
    #: Calls refused for the runner's key first (not yet known, or its rights short of a job's
    #: priority), with `runner_refused_code`.
    num_unauthenticated: int = 0
    runner_refused_code: grpc.StatusCode = grpc.StatusCode.UNAUTHENTICATED
    #: How many times each text was run (at-least-once delivery shows here).
    runs: collections.Counter[str] = field(default_factory=collections.Counter)
    priorities: set[int] = field(default_factory=set)
    #: The request ids the calls carried (a gateway's sticky key for a version label).
    request_ids: set[str] = field(default_factory=set)
    num_calls: int = 0
    #: Once this many texts have run, calls wait for `release` (None: never held).
    hold_after_runs: int | None = None
    #: Calls that were held.
    num_held: int = 0
    #: Poison texts crash the call (INTERNAL, as a model that raises does) instead of being
    #: refused INVALID_ARGUMENT.
    poison_crashes: bool = False
    #: Calls refused first for load (RESOURCE_EXHAUSTED) with a retry hint of this many ms.
    num_overloaded: int = 0
    overload_hint_ms: int = 0
    #: When each call arrived (time.monotonic).
    call_times: list[float] = field(default_factory=list)
    #: Every call is refused with this status (None: none is), as a model gone would be.
    refuse_all: grpc.StatusCode | None = None
    #: A call with an UNSERVED or GARBLED text waits until this many texts have run (so that
    #: the items run beside it alone have finished before it fails the chunk).
    failing_waits_for_runs: int = 0
    #: A call with a poison text waits for `release` before it fails.
    poison_waits_for_release: bool = False
    _released: asyncio.Event = field(default_factory=asyncio.Event)

    def release(self) -> None:
        """Lets the held calls go on, and holds no more."""
        self.hold_after_runs = None
        self._released.set()

    async def Predict(
        self, request: api.PredictRequest, context: grpc.aio.ServicerContext
    ) -> api.PredictResponse:
        self.num_calls += 1
        self.call_times.append(time.monotonic())
        if self.num_overloaded > 0:
            self.num_overloaded -= 1
            raise Overloaded("over the tenant's rate", retry_after_s=self.overload_hint_ms / 1000)
        self.priorities.add(request.priority)
        self.request_ids.add(request.request_id)
        if self.num_unauthenticated > 0:
            self.num_unauthenticated -= 1
            if self.runner_refused_code is grpc.StatusCode.UNAUTHENTICATED:
                raise Unauthenticated("unknown API key")
            await context.abort(self.runner_refused_code, "the runner's tenant may not")
        if self.num_unavailable > 0:
            self.num_unavailable -= 1
            if self.unavailable_code is grpc.StatusCode.UNAVAILABLE:
                raise Unavailable("warming up")
            await context.abort(self.unavailable_code, "dropped unseen")
        if self.refuse_all is not None:
            await context.abort(self.refuse_all, "refused whatever the items")
        texts = [i.text for i in request.inputs]
        if any(t.startswith(POISON) for t in texts):
            if self.poison_waits_for_release:
                await self._released.wait()
            if self.poison_crashes:
                raise ServingError(f"the model crashed on a {POISON!r} text")
            raise InvalidInput(f"cannot embed {POISON!r} texts")
        if any(t.startswith((UNSERVED, GARBLED)) for t in texts):
            while self.runs.total() < self.failing_waits_for_runs:
                await asyncio.sleep(0.01)
        if any(t.startswith(UNSERVED) for t in texts):
            raise Unavailable("no worker serves it now")
        if self.hold_after_runs is not None and self.runs.total() >= self.hold_after_runs:
            self.num_held += 1
            await self._released.wait()
        self.runs.update(texts)
        short = any(t.startswith(GARBLED) for t in texts)
        return api.PredictResponse(
            model_name=request.model_name,
            model_version="1",
            outputs=[tensor_to_pb(expected_output(t)) for t in texts[short:]],
        )


async def start_target(
    target: PredictTarget,
    max_message_bytes: int = GatewayConfig.max_message_bytes,
    *,
    max_answer_bytes: int | None = None,
) -> tuple[grpc.aio.Server, str]:
    """`target` served as a gateway would (`max_message_bytes`: the gateway's default), its
    answers past `max_answer_bytes` (when given) failed by grpc as past the runner's receive
    limit (MAX_MESSAGE_BYTES) would be, without carrying 64 MiB answers."""
    if max_answer_bytes is None:
        server = new_server(max_message_bytes=max_message_bytes)
    else:
        server = grpc.aio.server(options=[("grpc.max_send_message_length", max_answer_bytes)])
    api_grpc.add_InferenceServiceServicer_to_server(target, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def start_job_service(
    redis: RedisServer,
    repository: Path,
    keys: KeyStore | None,
    *,
    chunk_size: int = 8,
    max_bytes: int = JobsApiConfig.max_bytes,
    max_chunk_bytes: int = JobsApiConfig.max_chunk_bytes,
    max_bytes_held: int = JobsApiConfig.max_bytes_held,
) -> tuple[grpc.aio.Server, str, JobStore, JobServicer]:
    """The gateway's JobService (as Redis user `gateway`) behind its authentication stage, with
    the gateway's default message limit (4 MiB)."""
    client = connect_jobs_redis(redis.role_url(GATEWAY), timeout_s=5.0)
    store = JobStore(client)
    catalog = ModelCatalog(load_repository(repository))
    server = new_server([Authentication(keys)], max_message_bytes=GatewayConfig.max_message_bytes)
    config = JobsApiConfig(
        chunk_size=chunk_size,
        max_bytes=max_bytes,
        max_chunk_bytes=max_chunk_bytes,
        max_bytes_held=max_bytes_held,
    )
    servicer = JobServicer(store, catalog, config)
    jobs_grpc.add_JobServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}", store, servicer


def start_runner(
    tmp_path: Path, redis: RedisServer, gateway_address: str, name: str, *extra: str
) -> ServiceProcess:
    """`python -m services.jobs` as Redis user `jobs`, fast retries and a short claim timeout."""
    password_file = tmp_path / f"{name}-{password_file_name(JOBS)}"
    password_file.write_text(redis.passwords[JOBS])
    argv = [
        sys.executable, "-m", "services.jobs", "--metrics-port", "0",
        "--redis-url", f"redis://127.0.0.1:{redis.port}/0",
        "--redis-password-file", str(password_file),
        "--gateway-address", gateway_address, "--consumer", name,
        "--claim-timeout-s", "3", "--call-timeout-s", "2", "--max-attempts", "3",
        "--retry-base-delay-s", "0.01", "--retry-max-delay-s", "0.05",
        "--log-format", "text", *extra,
    ]  # fmt: skip
    child, ready = start_and_wait(
        name, argv, log_path=tmp_path / f"{name}.log",
        ready_file=tmp_path / f"{name}.ready.json", timeout_s=60.0, cwd=REPO_ROOT,
    )  # fmt: skip
    return ServiceProcess(child, ready["grpc_port"], ready["metrics_port"])


def text_items(texts: list[str]) -> list[api.PredictInput]:
    return [api.PredictInput(text=t) for t in texts]


#: The priority the runner must send items at.
BATCH = types_pb2.PRIORITY_BATCH
