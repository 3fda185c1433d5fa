"""The canary pool's readiness rule and metrics endpoints (pure), and the conversion of the
`kubernetes` client's own objects into them: no API server, no network."""

from __future__ import annotations

import datetime

import pytest
from kubernetes.client import (
    V1Container,
    V1ContainerPort,
    V1LabelSelector,
    V1LabelSelectorRequirement,
    V1ObjectMeta,
    V1Pod,
    V1PodCondition,
    V1PodSpec,
    V1PodStatus,
)

from services.rollout.__main__ import parse_args, pool_config_from
from services.rollout.cluster import label_selector, pod_state
from services.rollout.pool import (
    ClusterError,
    PodState,
    PoolReady,
    PoolTimedOut,
    PoolWait,
    judge_pool,
    metrics_url,
)

pytestmark = pytest.mark.unit


def make_pod(
    name: str = "w-0",
    *,
    ip: str | None = "10.0.0.7",
    is_ready: bool = True,
    is_terminating: bool = False,
    metrics_port: int | None = 8202,
) -> PodState:
    return PodState(name, ip, is_ready, is_terminating, metrics_port)


def test_the_pool_is_ready_once_enough_pods_are_ready_and_not_terminating() -> None:
    pods = [make_pod("w-0"), make_pod("w-1", is_ready=False), make_pod("w-2", is_terminating=True)]
    decision = judge_pool(pods, num_wanted=1, waited_s=0.0, timeout_s=10.0)
    assert decision == PoolReady((pods[0],))


def test_a_pool_short_of_ready_pods_waits_then_times_out_naming_them() -> None:
    pods = [make_pod("w-0"), make_pod("w-1", is_ready=False), make_pod("w-2", is_terminating=True)]
    waiting = judge_pool(pods, num_wanted=2, waited_s=9.9, timeout_s=10.0)
    assert waiting == PoolWait(1, "1 of 2 pods Ready (not Ready: w-1)")
    timed_out = judge_pool(pods, num_wanted=2, waited_s=10.0, timeout_s=10.0)
    assert timed_out == PoolTimedOut(1, "1 of 2 pods Ready (not Ready: w-1) after 10s")


@pytest.mark.parametrize(
    ("ip", "url"),
    [("10.1.2.3", "http://10.1.2.3:8202/metrics"), ("fd00::5", "http://[fd00::5]:8202/metrics")],
)
def test_the_metrics_url_is_the_pod_ip_and_its_metrics_port(ip: str, url: str) -> None:
    assert metrics_url(make_pod(ip=ip)) == url


def test_a_pod_without_a_metrics_port_is_a_cluster_error() -> None:
    with pytest.raises(ClusterError, match="no container port named 'metrics'"):
        metrics_url(make_pod(metrics_port=None))


def test_a_pod_of_the_api_becomes_its_pod_state() -> None:
    pod = V1Pod(
        metadata=V1ObjectMeta(name="w-0", deletion_timestamp=datetime.datetime.now(datetime.UTC)),
        spec=V1PodSpec(
            containers=[
                V1Container(name="side", ports=[V1ContainerPort(container_port=9000)]),
                V1Container(name="w", ports=[V1ContainerPort(name="metrics", container_port=8202)]),
            ]
        ),
        status=V1PodStatus(
            pod_ip="10.0.0.9",
            conditions=[
                V1PodCondition(type="PodScheduled", status="True"),
                V1PodCondition(type="Ready", status="True"),
            ],
        ),
    )
    assert pod_state(pod) == make_pod("w-0", ip="10.0.0.9", is_terminating=True)
    assert pod_state(V1Pod(metadata=V1ObjectMeta(name="new"))) == make_pod(
        "new", ip=None, is_ready=False, metrics_port=None
    )


def test_a_deployment_selector_becomes_a_label_selector_query() -> None:
    selector = V1LabelSelector(
        match_labels={"pool": "canary", "app": "fabric"},
        match_expressions=[
            V1LabelSelectorRequirement(key="tier", operator="In", values=["a", "b"]),
            V1LabelSelectorRequirement(key="legacy", operator="DoesNotExist"),
        ],
    )
    assert label_selector(selector) == "app=fabric,pool=canary,tier in (a,b),!legacy"
    with pytest.raises(ClusterError, match="empty selector"):
        label_selector(V1LabelSelector())


def test_pool_flags_without_a_canary_deployment_are_refused() -> None:
    args = parse_args(["canary", "m", "--version", "2", "--stable-deployment", "w"])
    with pytest.raises(ValueError, match="--stable-deployment: needs --canary-deployment"):
        pool_config_from(args)
    assert pool_config_from(parse_args(["canary", "m", "--version", "2"])) is None


@pytest.mark.parametrize("flag", ["--ready-timeout-s", "--pool-poll-s"])
@pytest.mark.parametrize("value", ["nan", "inf"])
def test_a_pool_wait_that_is_no_finite_number_is_refused(flag: str, value: str) -> None:
    """NaN passed every comparison: an endless wait for the pool, or sleep(nan) (review)."""
    args = parse_args(["canary", "m", "--version", "2", "--canary-deployment", "w", flag, value])
    with pytest.raises(ValueError, match="finite"):
        pool_config_from(args)
