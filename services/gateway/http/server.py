"""The gateway's HTTP listener: KServe v2 REST, the OpenAI-compatible API and TEI's embedding
routes on one aiohttp app, behind the same authentication and tenant admission as the gRPC port
(services.gateway.auth, services.gateway.admission)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from aiohttp import web
from aiohttp.typedefs import Middleware

from services.common.door import Door
from services.common.errors import InvalidInput, NotFound, Overloaded
from services.common.grpc_errors import is_bug
from services.common.processes import shares_ports
from services.common.settings import unusable_port
from services.common.tls import CertificateFiles, ServerTls
from services.gateway.admission import TenantAdmission
from services.gateway.auth import KeyStore, acting_as, principal_for
from services.gateway.http.codec import header_request_id
from services.gateway.http.embeddings_api import EmbeddingsApi
from services.gateway.http.errors import AnsweredInBand, HttpError, http_error
from services.gateway.http.kserve_rest import KServeRest
from services.gateway.http.openai_api import OpenAiApi
from services.gateway.kserve_api import KServeServicer
from services.gateway.metrics import GatewayMetrics
from services.gateway.predictor import Predictor
from services.gateway.repository_control import RepositoryControl

log = logging.getLogger(__name__)

#: Paths anyone may call: liveness and readiness probes (KServe's, and TEI's `/health`).
OPEN_PATHS = frozenset({"/v2/health/live", "/v2/health/ready", "/health"})
#: Path endings of the calls that run models, which tenant quotas count.
INFERENCE_SUFFIXES = ("/infer", "/generate", "/generate_stream", "/completions", "/embeddings",
                      "/embed")  # fmt: skip
#: Path endings of the model calls under the door's limit (services.common.door), and of those
#: it only sheds (generation, whose streams are too long-lived for a limit): as on the gRPC port.
DOOR_SUFFIXES = ("/infer", "/embeddings", "/embed")
DOOR_SHED_ONLY_SUFFIXES = ("/generate", "/generate_stream", "/completions")
#: The door's `method` label for the calls it refuses here.
DOOR_LABEL = "http"
#: text-embeddings-inference's routes, whose errors are TEI's bodies ("/" embeds, as TEI's
#: does: Hugging Face's InferenceClient posts to the server's URL itself).
TEI_PATHS = frozenset({"/", "/embed", "/info", "/health"})
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
#: Longest a model call's body may take to arrive once the call holds its place at the door
#: and in its tenant's quota (a caller that sends its headers and then a trickle, or nothing,
#: must not hold them for good): past it, 408.
BODY_TIMEOUT_S = 30.0


#: Bytes of request bodies a gateway process holds at once, each from before it is read until
#: its call ends (a body of unknown length counted at the size limit): past it, 429. The
#: 4 MiB a body may take times connections without bound passed a gateway pod's memory, one
#: tenant's bodies sent to their last byte and then held (review finding).
MAX_BODIES_HELD_BYTES = 256 * 1024 * 1024


class _BodyTimedOut(Exception):
    pass


class HeldBodies:
    """The bytes of the request bodies held, within MAX_BODIES_HELD_BYTES."""

    def __init__(self, max_body_bytes: int) -> None:
        self.max_body_bytes, self.num_bytes = max_body_bytes, 0

    @contextlib.asynccontextmanager
    async def read(self, request: web.Request) -> AsyncIterator[None]:
        """Reads `request`'s body now (`_read_body`), counted from before it is read until the
        call ends: at its declared length while it arrives (at most the size limit, past
        which aiohttp answers 413; the limit when it is not declared, or compressed: aiohttp
        holds it decompressed, up to the limit), then at its own."""
        size = 0
        if request.body_exists:
            declared = request.content_length or self.max_body_bytes
            if request.headers.get("Content-Encoding", "identity").lower() != "identity":
                declared = self.max_body_bytes  # 4 KB of gzip held 4 MiB (review finding)
            size = min(declared, self.max_body_bytes)
        if size and self.num_bytes + size > MAX_BODIES_HELD_BYTES:
            raise Overloaded("the gateway holds as many request bodies as it may; retry soon",
                             retry_after_s=1.0)  # fmt: skip
        self.num_bytes += size
        try:
            await _read_body(request)
            if size:
                read = len(await request.read())  # kept by aiohttp: no second read
                self.num_bytes += read - size
                size = read
            yield
        finally:
            self.num_bytes -= size


def _answer(request: web.Request, error: HttpError) -> web.Response:
    """An error in the body shape of the API the path belongs to (OpenAI, TEI or KServe)."""
    if request.path.startswith("/v1/"):
        body = error.openai_body()
    elif request.path in TEI_PATHS:
        body = error.tei_body()
    else:
        body = error.kserve_body()
    return web.Response(body=body, status=error.status, headers=error.headers,
                        content_type="application/json")  # fmt: skip


def _is_model_call(request: web.Request, suffixes: tuple[str, ...]) -> bool:
    """Whether `request` runs a model: a POST to a path ending in one of `suffixes`, or to
    TEI's root, that a route serves (a GET of a model named like an ending, /v1/models/embed,
    runs nothing, nor does a POST there, answered 405, or to /anything/infer, 404)."""
    if request.method != "POST" or request.match_info.http_exception is not None:
        return False
    return request.path.endswith(suffixes) or request.path == "/"


async def _read_body(request: web.Request) -> None:
    """Reads the body whole now (aiohttp keeps it for the handler), within BODY_TIMEOUT_S."""
    if not request.body_exists:
        return
    try:
        async with asyncio.timeout(BODY_TIMEOUT_S):
            await request.read()
    except TimeoutError:
        raise _BodyTimedOut from None


def auth_middleware(
    keys: KeyStore | None, admission: TenantAdmission, door: Door | None, bodies: HeldBodies
) -> Middleware:
    """Passes model calls through the process's door (as the gRPC port's, before anything
    else), authenticates every call but the health probes, admits inference calls against the
    tenant's quotas before the body is read, then reads it within BODY_TIMEOUT_S (408 past
    it), and answers errors as KServe (or, under /v1, OpenAI) error bodies with the mapped
    HTTP status. `bodies`: the process's bound on the bodies it holds."""

    async def authenticated(
        request: web.Request, handler: Handler, headers: dict[str, str]
    ) -> web.StreamResponse:
        principal = principal_for(keys, headers)
        if not _is_model_call(request, INFERENCE_SUFFIXES):
            # Within the bound too: a repository load's body that never came held its
            # handler and connection for good, any key's (review finding).
            async with acting_as(principal), bodies.read(request):
                return await handler(request)
        refusal = admission.acquire(principal.policy)
        if refusal is not None:
            raise refusal
        async with acting_as(principal, admission), bodies.read(request):
            return await handler(request)

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        try:
            if request.path in OPEN_PATHS:
                return await handler(request)
            headers = {k.lower(): v for k, v in request.headers.items()}
            is_generation = (  # not TEI's "/"
                _is_model_call(request, DOOR_SHED_ONLY_SUFFIXES) and request.path != "/"
            )
            if door is not None and is_generation:
                if (refusal := door.shed(tuple(headers.items()), DOOR_LABEL)) is not None:
                    raise refusal
                return await authenticated(request, handler, headers)
            if door is None or not _is_model_call(request, DOOR_SUFFIXES):
                return await authenticated(request, handler, headers)
            refusal = door.enter(tuple(headers.items()), DOOR_LABEL)
            if refusal is not None:
                raise refusal
            try:
                return await authenticated(request, handler, headers)
            finally:
                door.leave()
        except AnsweredInBand as answered:  # counted; its stream has ended: nothing more
            return answered.response
        except _BodyTimedOut:
            message = f"the request body did not arrive within {BODY_TIMEOUT_S:.0f}s"
            timed_out = _answer(request, HttpError(408, message, {}))
            # Not kept alive: aiohttp reads what of the body comes within its lingering time
            # (10 s), then closes the connection.
            timed_out.force_close()
            return timed_out
        except web.RequestPayloadError as error:  # a body its Content-Encoding does not decode
            message = f"the request body could not be read: {error}"
            return _answer(request, http_error(InvalidInput(message)))
        except web.HTTPException as error:
            if error.status == 404:
                return _answer(request, http_error(NotFound(f"no route {request.path}")))
            # 405 names the methods the path takes (RFC 9110: Allow is required on it).
            allow = {"Allow": error.headers["Allow"]} if "Allow" in error.headers else {}
            # A 413's text names the limit ("Maximum request body size N exceeded."); the
            # others' say no more than their reason.
            message = error.text if error.status == 413 and error.text else error.reason
            return _answer(request, HttpError(error.status, message, allow))
        except Exception as error:
            if is_bug(error):
                log.exception("HTTP %s %r failed", request.method, request.path)
            return _answer(request, http_error(error))

    return middleware


async def echo_request_id(request: web.Request, response: web.StreamResponse) -> None:
    """Answers carry the caller's `X-Request-Id` back (errors and streams too), as proxies
    do, so that a client's logs and the fabric's meet (`header_request_id`: one too long, or
    not printable ASCII, is not)."""
    if request_id := header_request_id(request.headers):
        response.headers.setdefault("X-Request-Id", request_id)


def ssl_context(tls: ServerTls) -> ssl.SSLContext | None:
    """The HTTP port's TLS: the gRPC port's certificate and, when set, its client CA (mTLS),
    read again when their files change (at a new connection's hello, as on the gRPC port:
    services.common.tls.CertificateFiles), the connection then handed the new context."""
    if tls.cert_file is None or tls.key_file is None:
        return None

    def build() -> ssl.SSLContext:
        context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        context.load_cert_chain(tls.cert_file, tls.key_file)  # type: ignore[arg-type]
        if tls.client_ca_file is not None:
            context.verify_mode = ssl.CERT_REQUIRED
            context.load_verify_locations(tls.client_ca_file)
        return context

    files, first = CertificateFiles(tls), build()
    serving = [first]

    def on_hello(connection: ssl.SSLObject, server_name: str | None, _: ssl.SSLContext) -> None:
        if files.read_if_changed() is not None:
            try:
                serving[0] = build()
            except (OSError, ssl.SSLError) as error:  # changed again while read: the old stays
                log.warning("TLS: the HTTP port keeps its certificate: %s", error)
        if serving[0] is not first:
            connection.context = serving[0]

    first.sni_callback = on_hello
    return first


@dataclass
class HttpListener:
    runner: web.AppRunner
    port: int

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_http(
    *,
    host: str,
    port: int,
    tls: ServerTls,
    keys: KeyStore | None,
    predictor: Predictor,
    metrics: GatewayMetrics,
    max_inputs: int,
    max_body_bytes: int,
    repository: RepositoryControl | None = None,
    tei_model: str = "",
    drain_grace_s: float = 60.0,
    door: Door | None = None,
) -> HttpListener:
    """Serves the HTTP APIs on host:port (0: a free port); returns the bound port.
    `repository` serves Triton's repository routes (None without Redis: they refuse);
    `tei_model` is the model TEI's routes serve (services.gateway.http.embeddings_api); `door`,
    the gRPC port's, also limits this port's model calls. Its `stop` waits at most
    `drain_grace_s` for requests in progress, then closes them."""
    app = web.Application(
        middlewares=[auth_middleware(keys, predictor.admission, door, HeldBodies(max_body_bytes))],
        client_max_size=max_body_bytes,
    )
    app.on_response_prepare.append(echo_request_id)
    servicer = KServeServicer(predictor, metrics, max_inputs=max_inputs, repository=repository)
    app.add_routes(KServeRest(servicer, predictor, metrics).routes())
    app.add_routes(OpenAiApi(predictor, metrics).routes())
    app.add_routes(EmbeddingsApi(predictor, metrics, tei_model).routes())
    # A client that hangs up cancels its handler, and so the work it asked for (aiohttp's
    # default since 3.8 lets the handler run on, generating for nobody).
    runner = web.AppRunner(
        app,
        access_log=None,
        handle_signals=False,
        handler_cancellation=True,
        shutdown_timeout=drain_grace_s,
    )
    await runner.setup()
    # reuse_port: the processes of a gateway group (process_group.py) share the port.
    site = web.TCPSite(runner, host, port, ssl_context=ssl_context(tls), reuse_port=shares_ports())
    try:
        await site.start()
    except OSError as error:  # taken by another process: status 2, one line (startup_errors)
        await runner.cleanup()
        raise unusable_port("the HTTP port", port, error) from None
    return HttpListener(runner, int(runner.addresses[0][1]))
