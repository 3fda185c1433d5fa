"""The canary controller end to end: `python -m services.rollout canary` steps a version's
share of live traffic through the whole stack, judges it from the workers' metrics, and
promotes a healthy canary or rolls a broken one back by itself."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from services.common.model_routing import ModelRouting
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from tests.support.fabric_load import predict_row_request
from tests.support.models import break_version, write_versioned_affine_model
from tests.support.stack import Stack, start_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e

REPO_ROOT = Path(__file__).resolve().parents[2]
#: The controller's latency rule (canary p99 against stable's) given slack no loaded machine
#: reaches: both versions here are the same model, so a p99 gap is noise (2.86x, 18 ms against
#: 6 ms, on 88 calls once rolled back the healthy canary while another test module had the
#: cores). The rule itself is tests/unit/test_rollout_policy.py's; here a canary is judged by
#: its errors, which are not noise.
P99_SLACK_S = 10.0


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repository = tmp_path_factory.mktemp("canary") / "repo"
    write_versioned_affine_model(repository, "good", versions=(1, 2))
    break_version(write_versioned_affine_model(repository, "bad", versions=(1, 2)), 2)
    return repository


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, repository: Path) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("stack"), model_repository=repository)
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def rollout(stack: Stack, repository: Path, *args: str) -> subprocess.CompletedProcess[str]:
    metrics = [f"--metrics-url=http://127.0.0.1:{w.metrics_port}/metrics" for w in stack.workers]
    command = [sys.executable, "-m", "services.rollout", "--redis-url", stack.redis_url,
               "--model-repository", str(repository), *args]  # fmt: skip
    if args[0] == "canary":
        command += metrics
    return subprocess.run(command, cwd=REPO_ROOT, capture_output=True, text=True, timeout=120)


def unversioned_request(model: str) -> api.PredictRequest:
    """A request naming no version: the gateway's routing picks one."""
    return predict_row_request(np.array([0.5, 1.0, 2.0, 3.0], dtype=np.float32), model=model)


async def traffic(address: str, model: str, stop: asyncio.Event) -> list[str]:
    """Requests naming no version, 4 at a time, until `stop`: the versions that answered."""
    request = unversioned_request(model)
    answered: list[str] = []
    async with grpc.aio.insecure_channel(address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)

        async def caller() -> None:
            while not stop.is_set():
                try:
                    answered.append((await stub.Predict(request, timeout=10)).model_version)
                except grpc.aio.AioRpcError:
                    answered.append("error")
                await asyncio.sleep(0.01)  # a paced sender: live traffic, not a flood

        await asyncio.gather(*(caller() for _ in range(4)))
    return answered


async def run_canary(
    stack: Stack, repository: Path, model: str
) -> subprocess.CompletedProcess[str]:
    set_stable = rollout(stack, repository, "routing", "set", model, "--label", "stable=1",
                         "--traffic", "stable=1")  # fmt: skip
    assert set_stable.returncode == 0, set_stable.stderr
    # Before, the newest version (2) served unversioned requests: an answer from version 1
    # shows the stack's one gateway routes by the new labels.
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)

        async def on_stable() -> bool:
            try:
                reply = await stub.Predict(unversioned_request(model), timeout=10)
            except grpc.aio.AioRpcError:
                return False  # the broken version 2 of `bad`, until the labels arrive
            return reply.model_version == "1"

        await eventually(on_stable, timeout_s=30.0, message=f"{model}: the gateway serves stable=1")
    stop = asyncio.Event()
    load = asyncio.create_task(traffic(stack.gateway.address, model, stop))
    try:
        result = await asyncio.to_thread(
            rollout, stack, repository, "canary", model, "--version", "2", "--steps", "20,100",
            "--hold-s", "2", "--check-period-s", "0.5", "--min-requests", "10",
            "--p99-slack-s", str(P99_SLACK_S),
        )  # fmt: skip
    finally:
        stop.set()
        await load
    return result


def routing_of(stack: Stack, repository: Path, model: str) -> ModelRouting:
    shown = rollout(stack, repository, "routing", "show")
    line = next(x for x in shown.stdout.splitlines() if x.startswith(f"{model}: "))
    return ModelRouting.loads(line.split(": ", 1)[1])


async def test_a_healthy_canary_is_promoted(stack: Stack, repository: Path) -> None:
    result = await run_canary(stack, repository, "good")

    assert result.returncode == 0, result.stderr
    assert "good: promote" in result.stdout
    # Through every step (the rollout CLI's own timeout bounds how long that may take).
    assert "canary version 2 at 20% of traffic" in result.stderr
    assert "canary version 2 at 100% of traffic" in result.stderr
    assert "promoted version 2 to stable" in result.stderr
    routing = routing_of(stack, repository, "good")
    assert dict(routing.labels) == {"stable": 2}


async def test_a_broken_canary_is_rolled_back(stack: Stack, repository: Path) -> None:
    result = await run_canary(stack, repository, "bad")

    assert result.returncode == 1, result.stdout + result.stderr
    assert "rollback: canary error rate" in result.stderr
    assert "canary version 2 at 100%" not in result.stderr, "rolled back at the first step"
    routing = routing_of(stack, repository, "bad")
    assert routing.labels["stable"] == 1
    assert routing.traffic == {"stable": 100.0, "canary": 0.0}
