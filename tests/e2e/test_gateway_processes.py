"""Several gateway processes on one port (`--processes 2`, services/gateway/process_group.py),
as a user runs them: the local stack with its real Redis, router and worker, stock gRPC calls
over many connections, and the group's merged /metrics. One stack serves the module; the test
that kills the group's supervisor runs last."""

from __future__ import annotations

import asyncio
import os
import signal
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from services.common import metric_names as names
from services.common.procfs import read_stat
from services.gateway.config import parse_config
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from tests.support.metrics import samples, scrape, total
from tests.support.models import write_small_minilm_repository
from tests.support.stack import Stack, Tier, start_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e

GROUP_ARGS = ("--processes=2",)
#: grpc shares one connection among a process's channels to one address unless told not to.
OWN_CONNECTION = (("grpc.use_local_subchannel_pool", 1),)


@pytest.fixture(scope="module")
def group_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`tolerate_exits`: the last test kills the gateway's supervisor. SLO 30 s: these tests
    are about the group's processes, and 64 calls at once on two CPU cores shared with other
    tests could rightly be refused under the default 250 ms (a clean run once saw one)."""
    tmp_path = tmp_path_factory.mktemp("group")
    stack = start_stack(
        tmp_path,
        model_repository=write_small_minilm_repository(tmp_path / "repo"),
        extra_gateway_args=GROUP_ARGS,
        tolerate_exits=True,
    )
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def children_of(pid: int) -> list[int]:
    """Live processes whose parent is `pid`."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            stat = read_stat(int(entry))
            if stat is not None and stat.parent_pid == pid and stat.state != "Z":
                found.append(int(entry))
    return sorted(found)


async def predict_over_new_connections(address: str, num_connections: int) -> list[str]:
    """Two Predicts on each of `num_connections` fresh connections; their status names."""

    async def on_one_connection() -> list[str]:
        codes = []
        async with grpc.aio.insecure_channel(address, options=OWN_CONNECTION) as channel:
            stub = api_grpc.InferenceServiceStub(channel)
            for text in ("hello world", "a second, longer sentence to embed"):
                request = api.PredictRequest(
                    model_name="minilm", inputs=[api.PredictInput(text=text)]
                )
                try:
                    await stub.Predict(request, timeout=10)
                    codes.append("OK")
                except grpc.aio.AioRpcError as error:
                    codes.append(error.code().name)
        return codes

    results = await asyncio.gather(*(on_one_connection() for _ in range(num_connections)))
    return [code for codes in results for code in codes]


def served_by_process(metrics_text: str) -> dict[str, float]:
    """OK requests per gateway process, from the group's /metrics."""
    served: dict[str, float] = {}
    for labels, value in samples(metrics_text, names.GATEWAY_REQUESTS_TOTAL, code="OK"):
        process = labels["gateway_process"]
        served[process] = served.get(process, 0.0) + value
    return served


async def test_connections_spread_over_both_processes_and_metrics_tell_them_apart(
    group_stack: Stack,
) -> None:
    gateway = group_stack.gateway
    assert len(children_of(gateway.pid)) == 2
    before = served_by_process(scrape(gateway.metrics_port))
    codes = await predict_over_new_connections(f"127.0.0.1:{gateway.grpc_port}", 32)
    assert codes == ["OK"] * 64
    text = scrape(gateway.metrics_port)
    after = served_by_process(text)
    served = {p: after[p] - before.get(p, 0.0) for p in after}
    # The kernel hashes each connection to one listener: 32 connections reach both.
    assert set(served) == {"0", "1"} and all(n > 0 for n in served.values()), served
    assert sum(served.values()) == 64
    # One family per name, however many processes export it (the text format allows no more).
    type_lines = [line for line in text.splitlines() if line.startswith("# TYPE ")]
    assert [line.split()[2] for line in type_lines].count(names.GATEWAY_REQUESTS_TOTAL) == 1
    assert len(type_lines) == len({line.split()[2] for line in type_lines})
    # The HTTP port is shared the same way (a process that could not bind it would not start).
    for _ in range(8):
        ready = f"http://127.0.0.1:{gateway.http_port}/v2/health/ready"
        with urllib.request.urlopen(ready, timeout=10) as response:
            assert response.status == 200
    # Each process's own CPU is there too, told apart by the label.
    cpu = samples(text, names.PROCESS_CPU_SECONDS_TOTAL)
    assert sorted(labels["gateway_process"] for labels, _ in cpu) == ["0", "1"]


async def replaced_and_serving(gateway: Tier, restarts: float, gone: int, kept: int) -> None:
    """Waits until the group restarted process `gone` (one restart more than `restarts`) beside
    `kept`, and the replacement serves: its series back in the group's metrics, then 32 calls
    over 16 new connections all OK."""

    def replaced() -> bool:
        text = scrape(gateway.metrics_port)
        restarted = total(text, names.GATEWAY_PROCESS_RESTARTS_TOTAL) == restarts + 1
        pids = children_of(gateway.pid)
        return restarted and len(pids) == 2 and gone not in pids and kept in pids

    await eventually(replaced, timeout_s=60, message=f"process {gone} was replaced")
    await eventually(
        lambda: len(samples(scrape(gateway.metrics_port), names.PROCESS_CPU_SECONDS_TOTAL)) == 2,
        timeout_s=60,
        message="the replacement serves its metrics",
    )
    codes = await predict_over_new_connections(f"127.0.0.1:{gateway.grpc_port}", 16)
    assert codes == ["OK"] * 32


async def test_a_hung_process_is_killed_and_replaced(group_stack: Stack) -> None:
    """A process stopped (SIGSTOP: alive, its event loop hung, its share of the ports still
    drawing connections, whose calls hang) no longer beats (beats.beat_file): the supervisor
    kills it past beats.HUNG_S (15 s) and restarts it. Before, it lived on: the group watched
    only for exits (review finding)."""
    gateway = group_stack.gateway
    restarts = total(scrape(gateway.metrics_port), names.GATEWAY_PROCESS_RESTARTS_TOTAL)
    hung, other = children_of(gateway.pid)
    os.kill(hung, signal.SIGSTOP)
    try:
        await replaced_and_serving(gateway, restarts, hung, other)
    finally:
        if read_stat(hung) is not None:
            os.kill(hung, signal.SIGCONT)


async def test_a_killed_process_is_replaced_and_calls_keep_succeeding(
    group_stack: Stack,
) -> None:
    """Kills the group's supervisor at the end: last of the module's tests on the stack."""
    gateway = group_stack.gateway
    restarts = total(scrape(gateway.metrics_port), names.GATEWAY_PROCESS_RESTARTS_TOTAL)
    first, second = children_of(gateway.pid)
    os.kill(first, signal.SIGKILL)
    await replaced_and_serving(gateway, restarts, first, second)
    # Killing the supervisor takes its processes with it: nothing is left serving.
    survivors = children_of(gateway.pid)
    os.kill(gateway.pid, signal.SIGKILL)
    await eventually(
        lambda: not any(read_stat(pid) is not None and read_stat(pid).state != "Z"
                        for pid in survivors),
        timeout_s=30,
        message="the group's processes exited with their supervisor",
    )  # fmt: skip


def test_several_processes_without_redis_are_refused_with_the_reason(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["--model-repository", "models", "--allow-unauthenticated", "--processes", "2"]
    with pytest.raises(SystemExit) as exited:
        parse_config(argv, environ={})
    assert exited.value.code == 2
    assert "--redis-url" in capsys.readouterr().err
