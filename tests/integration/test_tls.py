"""TLS at the gateway and mTLS between tiers (issue 16), with certificates made at test time.

A throwaway CA issues every certificate (a second CA plays the stranger). The gateway's public
port serves TLS, with client certificates optional or required; the router and worker require
certificates from the fabric's CA. The end-to-end test runs redis, worker, router and gateway as
separate processes configured only through their settings, and sends a real request through
both mTLS hops. Workers are dialled by IP with a certificate that carries only a DNS name, as in
Kubernetes: `--worker-tls-server-name` is what makes that verify.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc

from services.common.metric_names import ROUTER_LIVE_WORKERS
from services.common.processes import start_and_wait
from services.common.tls import ClientTls, ServerTls, open_channel
from services.gateway.config import parse_config as parse_gateway_config
from services.gateway.server import Gateway
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as pb
from services.router.config import parse_config as parse_router_config
from services.router.server import SERVICE_NAME as WORKER_SERVICE
from tests.support.in_process import start_lone_gateway
from tests.support.metrics import samples, scrape
from tests.support.models import affine_reference, write_affine_model
from tests.support.pki import Authority, Issued
from tests.support.processes import REPO_ROOT, ServiceProcess
from tests.support.redis import RedisServer, start_redis
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

SERVING = health_pb2.HealthCheckResponse.SERVING
#: The only name in the workers' certificate; routers dial workers by IP and expect this.
WORKER_NAME = "gpu-worker.fabric.test"


@pytest.fixture(scope="module")
def fabric_ca(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority(tmp_path_factory.mktemp("pki"), "fabric")


@pytest.fixture(scope="module")
def stranger_ca(tmp_path_factory: pytest.TempPathFactory) -> Authority:
    return Authority(tmp_path_factory.mktemp("pki-stranger"), "stranger")


def client_tls(ca: Authority, client: Issued | None = None, server_name: str = "") -> ClientTls:
    return ClientTls(
        ca_file=ca.ca_file,
        cert_file=client.cert if client else None,
        key_file=client.key if client else None,
        server_name=server_name,
    )


async def health_code(address: str, tls: ClientTls, service: str = "") -> grpc.StatusCode:
    """OK if the server answered a health check over this channel, else the call's status."""
    async with open_channel(address, tls) as channel:
        try:
            await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=5
            )
        except grpc.aio.AioRpcError as error:
            return error.code()
    return grpc.StatusCode.OK


# -- the gateway's public port -------------------------------------------------------------------


async def start_gateway(tmp_path: Path, tls: ServerTls) -> Gateway:
    repository = tmp_path / "repo"
    write_affine_model(repository)
    return await start_lone_gateway(repository, allow_unauthenticated=True, tls=tls)


@pytest.fixture
async def tls_gateway(tmp_path: Path, fabric_ca: Authority) -> AsyncIterator[Gateway]:
    served = fabric_ca.issue("gateway-public", dns=("gateway.fabric.test",), ips=("127.0.0.1",))
    gateway = await start_gateway(tmp_path, ServerTls(cert_file=served.cert, key_file=served.key))
    yield gateway
    await gateway.stop()


async def test_tls_gateway_answers_tls_clients_and_refuses_plaintext(
    tls_gateway: Gateway, fabric_ca: Authority, stranger_ca: Authority
) -> None:
    address = f"127.0.0.1:{tls_gateway.port}"
    assert await health_code(address, client_tls(fabric_ca)) == grpc.StatusCode.OK
    # The certificate names the host dialled (IP SAN) and another name; a third is refused.
    by_name = client_tls(fabric_ca, server_name="gateway.fabric.test")
    assert await health_code(address, by_name) == grpc.StatusCode.OK
    wrong_name = client_tls(fabric_ca, server_name="elsewhere.test")
    assert await health_code(address, wrong_name) == grpc.StatusCode.UNAVAILABLE
    assert await health_code(address, ClientTls()) == grpc.StatusCode.UNAVAILABLE, "plaintext"
    # A client that trusts another CA does not accept the gateway's certificate.
    assert await health_code(address, client_tls(stranger_ca)) == grpc.StatusCode.UNAVAILABLE


async def test_client_ca_admits_only_clients_with_a_certificate_it_signed(
    tmp_path: Path, fabric_ca: Authority, stranger_ca: Authority
) -> None:
    served = fabric_ca.issue("gateway-mtls", ips=("127.0.0.1",))
    tls = ServerTls(cert_file=served.cert, key_file=served.key, client_ca_file=fabric_ca.ca_file)
    gateway = await start_gateway(tmp_path, tls)
    address = f"127.0.0.1:{gateway.port}"
    try:
        assert await health_code(address, client_tls(fabric_ca)) == grpc.StatusCode.UNAVAILABLE
        foreign = stranger_ca.issue("intruder")
        refused = await health_code(address, client_tls(fabric_ca, foreign))
        assert refused == grpc.StatusCode.UNAVAILABLE
        member = fabric_ca.issue("partner")
        assert await health_code(address, client_tls(fabric_ca, member)) == grpc.StatusCode.OK
    finally:
        await gateway.stop()


# -- settings ------------------------------------------------------------------------------------


def test_bad_tls_settings_exit_with_status_2(
    tmp_path: Path, fabric_ca: Authority, capsys: pytest.CaptureFixture[str]
) -> None:
    issued = fabric_ca.issue("settings-check")
    other = fabric_ca.issue("another")  # its key fits no certificate but its own
    not_pem = tmp_path / "not-pem.crt"
    not_pem.write_text("hello")
    base = ["--allow-unauthenticated"]
    cases = {
        "without its certificate": ["--tls-key-file", str(issued.key)],
        "cannot be read": [
            "--tls-cert-file", str(tmp_path / "missing.crt"), "--tls-key-file", str(issued.key),
        ],
        "is not PEM": ["--tls-cert-file", str(not_pem), "--tls-key-file", str(issued.key)],
        "does not fit": ["--tls-cert-file", str(issued.cert), "--tls-key-file", str(other.key)],
        "does not fit ": [
            "--router-tls-ca-file", str(fabric_ca.ca_file), "--router-tls-cert-file",
            str(issued.cert), "--router-tls-key-file", str(other.key),
        ],
        "without a CA file": ["--router-tls-server-name", "router.fabric.test"],
        "needs the server's own": ["--tls-client-ca-file", str(fabric_ca.ca_file)],
    }  # fmt: skip
    for message, argv in cases.items():
        with pytest.raises(SystemExit) as exit_info:
            parse_gateway_config([*base, *argv], environ={})
        assert exit_info.value.code == 2, argv
        assert message in capsys.readouterr().err, argv
    # The same rules hold for settings taken from the environment.
    with pytest.raises(SystemExit) as exit_info:
        parse_router_config([], environ={"ROUTER_WORKER_TLS_CERT_FILE": str(issued.cert)})
    assert exit_info.value.code == 2
    assert "without its key file" in capsys.readouterr().err
    # And a complete set is accepted.
    config = parse_gateway_config(
        [*base, "--tls-cert-file", str(issued.cert), "--tls-key-file", str(issued.key)],
        environ={"GATEWAY_ROUTER_TLS_CA_FILE": str(fabric_ca.ca_file)},
    )
    assert config.tls.is_enabled and config.router_tls.is_enabled
    assert not config.tls.requires_client_cert


# -- gateway -> router -> worker, mTLS on both internal hops, as processes -----------------------


@dataclass
class Fabric:
    redis: RedisServer
    worker: ServiceProcess
    router: ServiceProcess
    gateway: ServiceProcess
    #: Plaintext health-only port of the worker (for probes).
    worker_health_port: int
    #: The router's and the gateway's, by tier.
    health_ports: dict[str, int]
    #: What a gateway presents to routers.
    gateway_client: Issued


def start_tier(tmp_path: Path, name: str, args: list[str]) -> ServiceProcess:
    return start_tier_with_ports(tmp_path, name, args)[0]


def start_tier_with_ports(
    tmp_path: Path, name: str, args: list[str]
) -> tuple[ServiceProcess, dict[str, int]]:
    """The tier's process and its ready file's ports."""
    child, ports = start_and_wait(
        name,
        [sys.executable, "-m", f"services.{name}", "--grpc-port", "0", "--metrics-port", "0",
         *args],
        log_path=tmp_path / f"{name}.log",
        ready_file=tmp_path / f"{name}.ready.json",
        timeout_s=180.0,
        cwd=REPO_ROOT,
    )  # fmt: skip
    return ServiceProcess(child, ports["grpc_port"], ports["metrics_port"]), ports


def server_args(issued: Issued, client_ca: Path | None) -> list[str]:
    args = ["--tls-cert-file", str(issued.cert), "--tls-key-file", str(issued.key)]
    return [*args, "--tls-client-ca-file", str(client_ca)] if client_ca else args


def live_workers(router: ServiceProcess) -> float:
    found = samples(scrape(router.metrics_port), ROUTER_LIVE_WORKERS)
    return found[0][1] if found else 0.0


@pytest.fixture(scope="module")
def fabric(tmp_path_factory: pytest.TempPathFactory, fabric_ca: Authority) -> Iterator[Fabric]:
    tmp = tmp_path_factory.mktemp("tls-fabric")
    repository = tmp / "repo"
    write_affine_model(repository, slo_p99_ms=30_000)
    ca = str(fabric_ca.ca_file)
    worker_cert = fabric_ca.issue("gpu-worker", dns=(WORKER_NAME,))  # no IP: dialled by name
    router_cert = fabric_ca.issue("router", ips=("127.0.0.1",))
    gateway_cert = fabric_ca.issue("gateway", ips=("127.0.0.1",))
    router_client = fabric_ca.issue("router-client")
    gateway_client = fabric_ca.issue("gateway-client")
    redis = start_redis(tmp)
    started: list[ServiceProcess] = []
    try:
        # Port 0: the worker binds a free one and reports it (a port picked here first could
        # be taken by the worker's own gRPC port 0 before its health listener binds it).
        worker, ports = start_tier_with_ports(tmp, "gpu_worker", [
            "--model-repository", str(repository), "--redis-url", redis.worker_url,
            "--worker-id", "tls-worker", "--heartbeat-period-s", "0.1",
            "--health-port", "0", *server_args(worker_cert, fabric_ca.ca_file),
        ])  # fmt: skip
        started.append(worker)  # stopped whatever its ready file says
        health_port = ports["health_port"]
        assert health_port > 0
        router, router_ports = start_tier_with_ports(tmp, "router", [
            "--redis-url", redis.router_url, "--refresh-period-s", "0.1", "--health-port", "0",
            *server_args(router_cert, fabric_ca.ca_file),
            "--worker-tls-ca-file", ca, "--worker-tls-cert-file", str(router_client.cert),
            "--worker-tls-key-file", str(router_client.key),
            "--worker-tls-server-name", WORKER_NAME,
        ])  # fmt: skip
        started.append(router)
        gateway, gateway_ports = start_tier_with_ports(tmp, "gateway", [
            "--model-repository", str(repository), "--allow-unauthenticated", "--health-port", "0",
            "--router-address", router.address, "--catalog-refresh-s", "0.1", "--http-port", "0",
            *server_args(gateway_cert, None),
            "--router-tls-ca-file", ca, "--router-tls-cert-file", str(gateway_client.cert),
            "--router-tls-key-file", str(gateway_client.key),
        ])  # fmt: skip
        started.append(gateway)
        health_ports = {
            "router": router_ports["health_port"],
            "gateway": gateway_ports["health_port"],
        }
        yield Fabric(redis, worker, router, gateway, health_port, health_ports, gateway_client)
    finally:
        for service in reversed(started):
            code = service.terminate()
            assert code == 0, f"exit {code}:\n{service.log()}"
        redis.stop()


async def test_a_request_crosses_both_mtls_hops_end_to_end(
    fabric: Fabric, fabric_ca: Authority
) -> None:
    await eventually(lambda: live_workers(fabric.router) >= 1, timeout_s=30.0,
                     message="router never saw the worker")  # fmt: skip
    gateway_tls = client_tls(fabric_ca)

    async def gateway_ready() -> bool:
        async with open_channel(fabric.gateway.address, gateway_tls) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        return reply.status == SERVING  # the router answered ListModels over mTLS

    await eventually(gateway_ready, timeout_s=30.0, message=fabric.gateway.log())
    row = np.arange(4, dtype=np.float32)
    tensor = pb.Tensor(dtype=pb.DATA_TYPE_FP32, shape=[4], raw_data=row.tobytes())
    request = api.PredictRequest(model_name="affine", inputs=[api.PredictInput(tensor=tensor)])

    async def predict() -> api.PredictResponse | None:
        async with open_channel(fabric.gateway.address, gateway_tls) as channel:
            try:
                return await api_grpc.InferenceServiceStub(channel).Predict(request, timeout=10)
            except grpc.aio.AioRpcError as error:
                # Only while the gateway's catalog catches up with the worker's model.
                assert error.code() == grpc.StatusCode.NOT_FOUND, error
                return None

    reply = await eventually(predict, timeout_s=30.0, message=fabric.router.log())
    (output,) = reply.outputs
    values = np.frombuffer(output.raw_data, dtype=np.float32)
    expected = affine_reference(torch.from_numpy(row[None, :])).numpy()[0]
    np.testing.assert_allclose(values, expected, rtol=1e-5)


async def test_the_slim_client_predicts_over_tls_and_fails_plaintext(
    fabric: Fabric, fabric_ca: Authority
) -> None:
    """`inference_fabric_client.Client(tls=True, root_certificates=CA)` gets the same answer
    over the gateway's TLS port; the same client without TLS is refused (UNAVAILABLE)."""
    from inference_fabric_client import Client, FabricError

    await eventually(lambda: live_workers(fabric.router) >= 1, timeout_s=30.0,
                     message="router never saw the worker")  # fmt: skip
    row = np.arange(4, dtype=np.float32)

    def predict_tls() -> list[float] | None:
        with Client(
            fabric.gateway.address, tls=True, root_certificates=fabric_ca.ca_file, timeout_s=10
        ) as client:
            try:
                (output,) = client.predict("affine", [row]).outputs
            except FabricError as error:
                # Only while the gateway's catalog catches up with the worker's model.
                assert error.code in ("NOT_FOUND", "UNAVAILABLE"), error
                return None
            return [float(x) for x in np.asarray(output).reshape(-1)]

    async def predicted() -> list[float] | None:
        return await asyncio.to_thread(predict_tls)

    output = await eventually(predicted, timeout_s=30.0, message=fabric.gateway.log())
    expected = affine_reference(torch.from_numpy(row[None, :])).numpy()[0]
    np.testing.assert_allclose(output, expected, rtol=1e-5)

    def predict_plaintext() -> str:
        with Client(fabric.gateway.address, timeout_s=5) as client:
            try:
                client.predict("affine", [row])
            except FabricError as error:
                return error.code
        return "OK"

    assert await asyncio.to_thread(predict_plaintext) == "UNAVAILABLE"


async def test_internal_tiers_refuse_callers_without_a_fabric_certificate(
    fabric: Fabric, fabric_ca: Authority, stranger_ca: Authority
) -> None:
    intruder = stranger_ca.issue("intruder-client")
    for tier in (fabric.router, fabric.worker):
        name = WORKER_NAME if tier is fabric.worker else ""
        code = await health_code(tier.address, client_tls(fabric_ca, intruder, name))
        assert code == grpc.StatusCode.UNAVAILABLE, "a certificate from another CA"
        code = await health_code(tier.address, client_tls(fabric_ca, server_name=name))
        assert code == grpc.StatusCode.UNAVAILABLE, "no client certificate"
        assert await health_code(tier.address, ClientTls()) == grpc.StatusCode.UNAVAILABLE
    member = client_tls(fabric_ca, fabric.gateway_client)
    assert await health_code(fabric.router.address, member, WORKER_SERVICE) == grpc.StatusCode.OK


async def test_health_port_answers_plaintext_probes_and_nothing_else(fabric: Fabric) -> None:
    address = f"127.0.0.1:{fabric.worker_health_port}"
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=WORKER_SERVICE), timeout=5
        )
        assert reply.status == SERVING
        infer = channel.unary_unary(
            "/inference.v1.WorkerService/Infer",
            request_serializer=pb.InferRequest.SerializeToString,
            response_deserializer=pb.InferResponse.FromString,
        )
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await infer(pb.InferRequest(model_name="affine"), timeout=5)
        assert error.value.code() == grpc.StatusCode.UNIMPLEMENTED
    # The router's and the gateway's, bound at port 0 too, each reported in its ready file.
    for tier, port in fabric.health_ports.items():
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert reply.status == SERVING, tier
