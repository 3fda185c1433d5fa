"""Runtime labels and traffic weights end to end: `python -m services.rollout routing` writes
Redis, every gateway follows without a restart, a request id sticks to one version, and
`reset` returns to the repository's routing. Whole stack as separate processes.

How soon a gateway follows is its catalog refresh period (about a second); the tests wait for
the new routing to be in force (bounded generously: the stack shares two cores with another
test module) and then check what it serves."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest

from bench.fabric.loadgen import retry_after_of
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from tests.support.fabric_load import predict_row_request
from tests.support.models import write_versioned_affine_model
from tests.support.stack import Stack, start_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e

#: Bound on waiting for a routing change to be in force at the gateway.
FOLLOW_TIMEOUT_S = 30.0

REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def repository(tmp_path_factory: pytest.TempPathFactory) -> Path:
    repository = tmp_path_factory.mktemp("rollout") / "repo"
    write_versioned_affine_model(repository, versions=(1, 2))
    return repository


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, repository: Path) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("stack"), model_repository=repository)
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def rollout(stack: Stack, repository: Path, *args: str) -> str:
    """Runs the rollout CLI as an operator would (user admin), returns its output."""
    result = subprocess.run(
        [sys.executable, "-m", "services.rollout", "--redis-url", stack.redis_url,
         "--model-repository", str(repository), "routing", *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    return result.stdout


#: Refusals (RESOURCE_EXHAUSTED with a retry hint) a caller retries before it fails.
REFUSALS_RETRIED = 5


async def version_served(stub: api_grpc.InferenceServiceStub, request_id: str = "") -> str:
    row = np.array([0.5, 1.0, 2.0, 3.0], dtype=np.float32)
    request = predict_row_request(row, request_id=request_id)
    # A caller as the fabric's contract asks: a refusal with a retry hint (the gateway's door
    # on a machine the parallel suite loads) is retried after the hint. The version a call is
    # served by is drawn when it is served, so retries leave the split unbiased.
    for attempt in range(REFUSALS_RETRIED + 1):
        try:
            reply = await stub.Predict(request, timeout=10)
        except grpc.aio.AioRpcError as error:
            hint_s = retry_after_of(error)
            is_refusal = error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            if not is_refusal or hint_s is None or attempt == REFUSALS_RETRIED:
                raise
            await asyncio.sleep(min(hint_s, 1.0))
        else:
            return reply.model_version
    raise AssertionError("unreachable: the last attempt returns or raises")


async def test_weights_set_at_runtime_reach_the_gateway_without_a_restart(
    stack: Stack, repository: Path
) -> None:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        assert await version_served(stub) == "2", "seed: the newest version"

        rollout(stack, repository, "set", "affine", "--label", "stable=1", "--label",
                "canary=2", "--traffic", "stable=1", "--traffic", "canary=0")  # fmt: skip

        async def on_stable() -> bool:
            return await version_served(stub) == "1"

        await eventually(
            on_stable, timeout_s=FOLLOW_TIMEOUT_S, message="the gateway serves stable=1"
        )
        served = {await version_served(stub) for _ in range(20)}
        assert served == {"1"}

        # Half and half: a request id keeps its version; across ids both are used.
        rollout(stack, repository, "set", "affine", "--traffic", "stable=1", "--traffic",
                "canary=1")  # fmt: skip

        # In force once distinct ids reach both versions (until then every one got version 1).
        async def on_both() -> bool:
            return {await version_served(stub, f"id-{i}") for i in range(40)} == {"1", "2"}

        await eventually(
            on_both, timeout_s=FOLLOW_TIMEOUT_S, message="request ids spread over both versions"
        )
        for request_id in ("alpha", "beta", "gamma"):
            picks = {await version_served(stub, request_id) for _ in range(5)}
            assert len(picks) == 1, (request_id, picks)

        rollout(stack, repository, "reset", "affine")

        async def on_seed() -> bool:
            return {await version_served(stub) for _ in range(5)} == {"2"}

        await eventually(
            on_seed, timeout_s=FOLLOW_TIMEOUT_S, message="back to the repository's version 2"
        )


async def test_a_ten_percent_canary_set_at_runtime_gets_ten_percent_of_requests(
    stack: Stack, repository: Path
) -> None:
    """stable=90, canary=10 written at runtime: once in force, 2,000 requests (no request id,
    so each draws its version) split about 90/10: version 2's share within 3 points of 10%
    (a draw, not a timing: 4.5 standard deviations of a binomial over 2,000)."""
    rollout(stack, repository, "set", "affine", "--label", "stable=1", "--label", "canary=2",
            "--traffic", "stable=90", "--traffic", "canary=10")  # fmt: skip
    try:
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            stub = api_grpc.InferenceServiceStub(channel)

            # Before, the repository's routing sent everything to version 2.
            async def on_stable() -> bool:
                return await version_served(stub) == "1"

            await eventually(
                on_stable, timeout_s=FOLLOW_TIMEOUT_S, message="the gateway serves stable=1"
            )

            async def caller(num_requests: int) -> list[str]:
                return [await version_served(stub) for _ in range(num_requests)]

            served = [
                v for vs in await asyncio.gather(*(caller(125) for _ in range(16))) for v in vs
            ]
    finally:
        rollout(stack, repository, "reset", "affine")
    assert len(served) == 2000 and set(served) == {"1", "2"}
    canary_share = served.count("2") / len(served)
    assert abs(canary_share - 0.10) <= 0.03, canary_share
