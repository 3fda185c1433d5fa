"""Tenants end to end: quotas at the gateway from the keys file (and its reload), priority
classes granted per tenant, per-tenant metrics; the whole stack as separate processes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from services.common import metric_names as names
from services.common.errors import RETRY_AFTER_MS_KEY
from services.gateway.auth import hash_key
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import types_pb2
from tests.support.fabric_load import TIMEOUT_S, predict_request
from tests.support.metrics import scrape, total
from tests.support.models import write_small_minilm_repository
from tests.support.stack import Stack, start_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e

KEYS = {"flood": "key-flood", "victim": "key-victim", "tight": "key-tight"}
#: Times the victim sends one call that grpc keeps dropping unseen (the flood's burst of 400
#: is past --max-pending-calls while it waits to be picked up).
VICTIM_SENDS = 10


def keys_file(tight_requests_per_s: float) -> str:
    entries = "\n".join(
        f'[[keys]]\ntenant = "{tenant}"\nsha256 = "{hash_key(key)}"\n'
        for tenant, key in KEYS.items()
    )
    return f"""{entries}
[tenants.flood]
requests_per_s = 20
burst_s = 0.5
[tenants.victim]
requests_per_s = 20
priorities = ["critical"]
[tenants.tight]
requests_per_s = {tight_requests_per_s}
burst_s = 1.0
"""


@pytest.fixture(scope="module")
def keys_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("keys") / "api-keys.toml"
    path.write_text(keys_file(tight_requests_per_s=1000))
    return path


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, keys_path: Path) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("tenants")
    repository = write_small_minilm_repository(tmp / "repo")
    # No door (services.common.door): on a busy machine it may shed the whole flood before the
    # quota sees enough of it to refuse any, and shed the victim's calls as over their share once
    # the flood has passed; the module would then test the door, not quotas. The door against a
    # flood is e2e/test_tenant_flood.py's and integration/test_door.py's.
    stack = start_stack(
        tmp,
        model_repository=repository,
        extra_gateway_args=(f"--api-keys-file={keys_path}", "--no-door"),
    )
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def auth(tenant: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {KEYS[tenant]}"),)


async def predict(
    stub: api_grpc.InferenceServiceStub, tenant: str, text: str, **fields: object
) -> grpc.aio.AioRpcError | None:
    request = predict_request(text)
    for name, value in fields.items():
        setattr(request, name, value)
    try:
        await stub.Predict(request, metadata=auth(tenant), timeout=TIMEOUT_S)
    except grpc.aio.AioRpcError as error:
        return error
    return None


async def test_a_flooding_tenant_is_refused_by_its_quota_while_the_other_is_served(
    stack: Stack,
) -> None:
    """400 calls at once against a quota of 20/s with a 0.5 s burst: the bucket admits its
    burst (10) plus what refills while the flood arrives, and refuses the rest. Should the
    gateway bound the calls waiting to be picked up below 400 (--max-pending-calls, off by
    default; GATEWAY_MAX_PENDING_CALLS), grpc drops some unseen (CANCELLED) before the quota
    sees them, and may drop another tenant's call meanwhile: the victim, paced at half its own
    quota, sends a dropped call again (as the slim client does), and is never refused. The gateway
    runs without its door here (the fixture): every refusal is the quota's."""
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        resent = 0

        async def victim() -> list[grpc.aio.AioRpcError | None]:
            nonlocal resent
            outcomes = []
            for i in range(20):  # 10/s, half its quota
                for _ in range(VICTIM_SENDS):
                    outcome = await predict(stub, "victim", f"victim text {i}")
                    if outcome is None or outcome.code() != grpc.StatusCode.CANCELLED:
                        break
                    resent += 1  # dropped unseen while the flood's burst waited
                    await asyncio.sleep(0.05)
                outcomes.append(outcome)
                await asyncio.sleep(0.1)  # the scenario: a paced sender
            return outcomes

        async def flood() -> tuple[list[grpc.aio.AioRpcError | None], float]:
            started_s = time.monotonic()
            outcomes = await asyncio.gather(
                *(predict(stub, "flood", f"flood text {i}") for i in range(400))
            )
            return outcomes, time.monotonic() - started_s

        victim_outcomes, (flood_outcomes, flood_s) = await asyncio.gather(victim(), flood())
    assert victim_outcomes == [None] * 20, (victim_outcomes, resent)
    failed = [e for e in flood_outcomes if e is not None]
    dropped = [e for e in failed if e.code() == grpc.StatusCode.CANCELLED]
    refused = [e for e in failed if e.code() != grpc.StatusCode.CANCELLED]
    # Admitted: at most the burst plus the refill over the flood's whole span (the calls reach
    # the gateway over that span, slower on a busy machine), and never all of them.
    admitted = len(flood_outcomes) - len(failed)
    assert admitted <= 20 * 0.5 + 20 * flood_s + 1, (admitted, flood_s, len(dropped))
    over_quota = [e for e in refused if "tenant 'flood' is over its quota" in e.details()]
    assert len(over_quota) >= 1, [e.details() for e in refused]
    assert len(over_quota) == len(refused), [e.details() for e in refused]
    for error in refused:
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        trailers = dict(error.trailing_metadata() or ())
        assert int(trailers[RETRY_AFTER_MS_KEY]) > 0
    for error in over_quota:
        assert "tenant 'flood' is over its quota of 20 requests/s" in error.details()
    metrics = scrape(stack.gateway.metrics_port)
    refusals = total(
        metrics, names.GATEWAY_TENANT_REFUSED_TOTAL, tenant="flood", reason="requests_per_s"
    )
    assert refusals == len(over_quota)
    assert names.DOOR_REFUSED_TOTAL not in metrics  # no door: nothing else refused
    victim_ok = total(metrics, names.GATEWAY_TENANT_REQUESTS_TOTAL, tenant="victim", code="OK")
    assert victim_ok == 20


async def test_priority_classes_are_granted_per_tenant(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        critical = types_pb2.PRIORITY_CRITICAL
        assert await predict(stub, "victim", "urgent", priority=critical) is None
        denied = await predict(stub, "tight", "urgent", priority=critical)
        assert await predict(stub, "tight", "later", priority=types_pb2.PRIORITY_BATCH) is None
    assert denied is not None and denied.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "may not use priority 'critical'" in denied.details()
    metrics = scrape(stack.gateway.metrics_port)
    assert (
        total(metrics, names.GATEWAY_TENANT_REQUESTS_TOTAL, tenant="victim", priority="critical")
        >= 1
    )
    assert (
        total(metrics, names.GATEWAY_TENANT_REQUESTS_TOTAL, tenant="tight", priority="batch") >= 1
    )


async def test_a_tightened_quota_takes_effect_without_a_restart(
    stack: Stack, keys_path: Path
) -> None:
    """The keys file is reloaded while the gateway runs (it checks about every second; the wait
    is bounded generously, as the stack shares two cores with another test module): a quota
    cut from 1,000/s to 2/s refuses most of a burst of 10."""
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        outcomes = await asyncio.gather(*(predict(stub, "tight", f"t {i}") for i in range(20)))
        assert outcomes == [None] * 20
        keys_path.write_text(keys_file(tight_requests_per_s=2))

        errors: list[grpc.aio.AioRpcError] = []

        async def refused() -> bool:
            burst = await asyncio.gather(*(predict(stub, "tight", f"u {i}") for i in range(10)))
            errors[:] = [e for e in burst if e is not None]
            return len(errors) >= 7

        await eventually(refused, timeout_s=30.0, message="the tightened quota refused a burst")
    # One of the refusals themselves: a later single call may find a token refilled (2/s).
    error = errors[0]
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "quota of 2 requests/s" in error.details()
