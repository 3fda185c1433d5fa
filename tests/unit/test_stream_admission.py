"""Admission of the requests one ModelStreamInfer stream carries (StreamRequests), against
real quotas with a fake clock: the stream's own admission covers its first request and one
running request at a time; every other request is admitted as a call of its own."""

from __future__ import annotations

import contextlib

import pytest
from prometheus_client import CollectorRegistry

from services.common.errors import Overloaded
from services.gateway.admission import StreamRequests, TenantAdmission
from services.gateway.metrics import GatewayMetrics
from services.gateway.tenants import TenantLabels, TenantPolicy

pytestmark = pytest.mark.unit


def _admitted_stream(policy: TenantPolicy) -> tuple[TenantAdmission, StreamRequests]:
    """A tenant's admission with one stream admitted as a call, as the gateway's
    Authentication stage does (a token, then a place in flight while the stream lives)."""
    admission = TenantAdmission(
        GatewayMetrics(CollectorRegistry()), TenantLabels({policy.name: policy}), clock=lambda: 0.0
    )
    assert admission.acquire(policy) is None
    admission.enter(policy)
    return admission, StreamRequests(admission, policy.name)


def test_requests_beyond_the_first_running_one_take_places_of_their_own() -> None:
    policy = TenantPolicy(name="t", max_concurrency=3)
    admission, stream = _admitted_stream(policy)
    with contextlib.ExitStack() as running:
        running.enter_context(stream.admitted(policy))  # rides on the stream's place
        assert admission.quotas.in_flight("t") == 1
        running.enter_context(stream.admitted(policy))
        running.enter_context(stream.admitted(policy))
        assert admission.quotas.in_flight("t") == 3
        with pytest.raises(Overloaded, match="max_concurrency"), stream.admitted(policy):
            pass
        # A second stream of the tenant is refused too: its places are all taken.
        assert admission.acquire(policy) is not None
    assert admission.quotas.in_flight("t") == 1  # the stream's own place, held until it ends
    # Every request has ended: the next one rides on the stream's place again, at the limit.
    admission.enter(policy)
    admission.enter(policy)
    with stream.admitted(policy):
        assert admission.quotas.in_flight("t") == 3


def test_the_first_request_rides_on_the_streams_token_and_the_others_take_their_own() -> None:
    policy = TenantPolicy(name="t", requests_per_s=3.0, burst_s=1.0)  # a bucket of 3 tokens
    _, stream = _admitted_stream(policy)  # the stream took the first token
    for _ in range(3):  # one after the other: each rides on the stream's place
        with stream.admitted(policy):
            pass
    with pytest.raises(Overloaded, match="requests_per_s"), stream.admitted(policy):
        pass


def test_a_token_bucket_refusal_never_hints_a_retry_before_the_bucket_has_refilled() -> None:
    """The hint of a rate quota's refusal is the least wait that can succeed: jittered by
    +-25% as other hints are, half the callers that waited exactly the hint were refused
    again, each time spending a request token. It is spread upward only. The hint of a
    limit on calls in flight (no such least wait) keeps the spread both ways."""
    policy = TenantPolicy(name="search", rows_per_s=10.0, burst_s=1.0, max_concurrency=1)
    admission = TenantAdmission(
        GatewayMetrics(CollectorRegistry()), TenantLabels({policy.name: policy}), clock=lambda: 0.0
    )
    admission.charge_rows(policy, 10)  # the whole burst: the next rows wait a second
    waits_ms = []
    for _ in range(200):
        with pytest.raises(Overloaded) as raised:
            admission.charge_rows(policy, 10)
        ((key, value),) = raised.value.trailers()
        assert key == "retry-after-ms"
        waits_ms.append(int(value))
    assert min(waits_ms) >= 1000, min(waits_ms)
    assert max(waits_ms) > min(waits_ms), "still spread"
    assert admission.acquire(policy) is None
    admission.quotas.enter(policy.name)
    in_flight = [admission.acquire(policy) for _ in range(200)]
    hints = [int(dict(r.trailers())["retry-after-ms"]) for r in in_flight if r is not None]
    assert len(hints) == 200 and min(hints) < 50 < max(hints)


def test_a_tenant_without_a_label_of_its_own_sets_no_share() -> None:
    """Past the labelled tenants, everyone is `other`: a share gauge set for each of them read
    as whichever tenant was set last, meaning nothing. Labelled tenants keep theirs."""
    registry = CollectorRegistry()
    labelled = TenantPolicy(name="t")
    admission = TenantAdmission(GatewayMetrics(registry), TenantLabels({"t": labelled}))
    admission.set_share_gauge("t", 0.25)
    admission.set_share_gauge("unlabelled", 0.75)
    share = "inference_gateway_tenant_quota_share"
    assert registry.get_sample_value(share, {"tenant": "t"}) == 0.25
    assert registry.get_sample_value(share, {"tenant": "other"}) is None


def test_a_request_of_another_tenant_rides_on_nothing_of_the_streams() -> None:
    """The stream's key moved to tenant `u` by a keys file reloaded while it is open: `u`'s
    requests take tokens and places of `u`'s own, never the stream's (tenant `t`'s), and `t`
    is not charged for them (a review finding: `u` ran past its own limits on `t`'s)."""
    streams = TenantPolicy(name="t", max_concurrency=2)
    other = TenantPolicy(name="u", max_concurrency=1)
    admission = TenantAdmission(
        GatewayMetrics(CollectorRegistry()),
        TenantLabels({"t": streams, "u": other}),
        clock=lambda: 0.0,
    )
    assert admission.acquire(streams) is None
    admission.enter(streams)
    stream = StreamRequests(admission, "t")
    with stream.admitted(other):
        assert (admission.quotas.in_flight("t"), admission.quotas.in_flight("u")) == (1, 1)
        with pytest.raises(Overloaded, match="max_concurrency"), stream.admitted(other):
            pass
        with stream.admitted(streams):  # the stream's own tenant still rides on its place
            assert admission.quotas.in_flight("t") == 1
    assert (admission.quotas.in_flight("t"), admission.quotas.in_flight("u")) == (1, 0)
