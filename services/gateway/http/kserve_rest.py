"""KServe v2 REST (Triton's HTTP API): health, metadata, config, statistics, infer (JSON and
binary tensors) and Triton's generate extension. Every call goes through the gRPC servicer's
own methods (services.gateway.kserve_api) or its generation path
(services.gateway.kserve_generate), so both transports validate, route and count alike."""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import AsyncGenerator
from typing import Any, cast

import grpc
from aiohttp import web
from google.protobuf import json_format
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from google.protobuf.message import Message

from services.common.errors import InvalidInput, ServingError
from services.common.grpc_errors import is_bug
from services.gateway.auth import current_principal
from services.gateway.http.codec import (
    HEADER_LENGTH,
    bytes_elements,
    check_rows_named,
    client_strings,
    decode_bytes_elements,
    infer_body,
    infer_parameters,
    infer_response_body,
    json_object,
    parse_json_object,
    request_id_of,
    split_body,
    utf8,
)
from services.gateway.http.errors import http_error
from services.gateway.http.sse import SSE_CONTENT_TYPE, EventWriter, sse_event
from services.gateway.kserve_api import KSERVE_API, KServeServicer
from services.gateway.kserve_generate import generate_one
from services.gateway.metrics import GatewayMetrics
from services.gateway.predictor import Predictor
from services.pb.inference import grpc_service_pb2 as kserve

#: Parameters of a generate request that are not sampling parameters.
_CONTROL_PARAMETERS = ("priority", "timeout")
#: A generate body's own fields; any other is one of the model's parameters.
_BODY_FIELDS = frozenset({"text_input", "parameters", "id"})
#: The field types protobuf's JSON writes as strings.
_INT64_TYPES = frozenset({
    FieldDescriptor.TYPE_INT64, FieldDescriptor.TYPE_UINT64, FieldDescriptor.TYPE_SINT64,
    FieldDescriptor.TYPE_FIXED64, FieldDescriptor.TYPE_SFIXED64,
})  # fmt: skip

log = logging.getLogger(__name__)


class _NoDeadline:
    """The servicer's view of an HTTP call: HTTP carries no deadline (Triton's `timeout`
    parameter can set one)."""

    def time_remaining(self) -> float | None:
        return None


_CONTEXT = cast(grpc.aio.ServicerContext, _NoDeadline())


def _json(payload: Any, status: int = 200) -> web.Response:
    return web.Response(body=json.dumps(payload).encode(), status=status,
                        content_type="application/json")  # fmt: skip


def _tensor_metadata(tensors: Any) -> list[dict[str, Any]]:
    return [{"name": t.name, "datatype": t.datatype, "shape": list(t.shape)} for t in tensors]


def _as_json(message: Message) -> dict[str, Any]:
    """`message` as protobuf's JSON writes it, but with its 64-bit integers as numbers, as
    Triton writes them: protobuf writes them as strings, and a client's
    `np.zeros(config["output"][0]["dims"])` refuses ["384"]. Fields at their zero value are
    written too, as Triton writes them: a fresh model's statistics have a `fail` count of 0,
    not an empty `fail` a client's `stats["fail"]["count"]` raises KeyError on."""
    as_dict = json_format.MessageToDict(
        message, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
    )
    return _with_numbers(cast(Descriptor, message.DESCRIPTOR), as_dict)


def _with_numbers(descriptor: Descriptor, value: dict[str, Any]) -> dict[str, Any]:
    """`value` (a message of `descriptor` as JSON) with its 64-bit integer fields as ints."""
    for name, item in value.items():
        field = descriptor.fields_by_name.get(name)
        if field is None:
            continue
        kind = field.message_type
        if kind is not None and kind.GetOptions().map_entry:
            value[name] = {
                k: _field_value(kind.fields_by_name["value"], v) for k, v in item.items()
            }
        elif isinstance(item, list):
            value[name] = [_field_value(field, v) for v in item]
        else:
            value[name] = _field_value(field, item)
    return value


def _field_value(field: FieldDescriptor, item: Any) -> Any:
    if field.message_type is not None and isinstance(item, dict):
        return _with_numbers(field.message_type, item)
    if field.type in _INT64_TYPES and isinstance(item, str):
        return int(item)
    return item


@client_strings
def generate_request(name: str, version: str, body: dict[str, Any]) -> kserve.ModelInferRequest:
    """A generate-extension body ({"text_input", "parameters": {...}}) as the decoupled model's
    ModelInferRequest: sampling keys go in `sampling_parameters`, `priority`/`timeout` stay
    request parameters, `stream` and `exclude_input_in_output` become BOOL inputs."""
    text = body.get("text_input")
    if not isinstance(text, str):
        raise InvalidInput("text_input (a string) is required")
    options = dict(json_object(body.get("parameters"), "parameters"))
    # Triton maps a body's other fields to the model's inputs (TensorRT-LLM's example sends
    # max_tokens so): here, to its parameters. One the model does not take is refused by name
    # (kserve_generate's sampling keys), never dropped without a word.
    for key, value in body.items():
        if key in _BODY_FIELDS:
            continue
        if key in options:
            raise InvalidInput(f"{key} is given both in the body and in its parameters")
        options[key] = value
    control = {k: options.pop(k) for k in _CONTROL_PARAMETERS if k in options}
    flags = {k: options.pop(k, False) for k in ("stream", "exclude_input_in_output")}
    for flag, value in flags.items():
        if not isinstance(value, bool):  # bool("false") is True
            raise InvalidInput(f"parameters.{flag} must be true or false, got {value!r}")
    request = kserve.ModelInferRequest(
        model_name=name, model_version=version, id=request_id_of(body),
        parameters=infer_parameters(control),
    )  # fmt: skip
    request.inputs.add(name="text_input", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(bytes_elements([utf8(text, "text_input")]))
    request.inputs.add(name="sampling_parameters", datatype="BYTES", shape=[1])
    request.raw_input_contents.append(bytes_elements([json.dumps(options).encode()]))
    for flag, value in flags.items():
        request.inputs.add(name=flag, datatype="BOOL", shape=[1])
        request.raw_input_contents.append(b"\x01" if value else b"\x00")
    return request


def generate_json(response: kserve.ModelStreamInferResponse) -> dict[str, Any]:
    """One generate response as Triton's generate extension writes it: model, version,
    `text_output`, and on the last one finish_reason and token counts."""
    infer = response.infer_response
    (text,) = decode_bytes_elements(infer.raw_output_contents[0])
    payload: dict[str, Any] = {
        "model_name": infer.model_name,
        "model_version": infer.model_version,
        "text_output": text.decode("utf-8", errors="replace"),
    }
    for key, parameter in infer.parameters.items():
        if key != "triton_final_response":
            payload[key] = getattr(parameter, parameter.WhichOneof("parameter_choice") or "")
    return payload


class KServeRest:
    """The /v2 routes, answered by `servicer` (the gRPC KServe servicer) and `predictor`."""

    def __init__(self, servicer: KServeServicer, predictor: Predictor, metrics: GatewayMetrics):
        self._servicer = servicer
        self._predictor = predictor
        self._metrics = metrics

    def routes(self) -> list[web.RouteDef]:
        """Every /v2 route; `inference` names the ones tenant quotas count."""
        model = "/v2/models/{name}"
        versioned = "/v2/models/{name}/versions/{version}"
        routes = [
            web.get("/v2/health/live", self.live),
            web.get("/v2/health/ready", self.ready),
            web.get("/v2", self.server_metadata),
            web.get("/v2/models/stats", self.stats),
            web.post("/v2/repository/index", self.repository_index),
            web.post("/v2/repository/models/{name}/load", self.repository_load),
            web.post("/v2/repository/models/{name}/unload", self.repository_unload),
        ]
        for prefix in (model, versioned):
            routes += [
                web.get(prefix, self.model_metadata),
                web.get(prefix + "/ready", self.model_ready),
                web.get(prefix + "/config", self.config),
                web.get(prefix + "/stats", self.stats),
                web.post(prefix + "/infer", self.infer),
                web.post(prefix + "/generate", self.generate),
                web.post(prefix + "/generate_stream", self.generate_stream),
            ]
        return routes

    async def live(self, request: web.Request) -> web.Response:
        return _json({"live": True})

    async def ready(self, request: web.Request) -> web.Response:
        answer = await self._servicer.ServerReady(kserve.ServerReadyRequest(), _CONTEXT)
        return _json({"ready": answer.ready}, 200 if answer.ready else 503)

    async def server_metadata(self, request: web.Request) -> web.Response:
        answer = await self._servicer.ServerMetadata(kserve.ServerMetadataRequest(), _CONTEXT)
        return _json(
            {"name": answer.name, "version": answer.version, "extensions": list(answer.extensions)}
        )

    async def model_metadata(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        answer = await self._servicer.ModelMetadata(
            kserve.ModelMetadataRequest(name=name, version=version), _CONTEXT
        )
        return _json({"name": answer.name, "versions": list(answer.versions),
                      "platform": answer.platform, "inputs": _tensor_metadata(answer.inputs),
                      "outputs": _tensor_metadata(answer.outputs)})  # fmt: skip

    async def model_ready(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        answer = await self._servicer.ModelReady(
            kserve.ModelReadyRequest(name=name, version=version), _CONTEXT
        )
        # Triton answers 200 when ready and 400 when not; clients read the status only.
        return _json({"name": name, "ready": answer.ready}, 200 if answer.ready else 400)

    async def config(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        answer = await self._servicer.ModelConfig(
            kserve.ModelConfigRequest(name=name, version=version), _CONTEXT
        )
        return _json(_as_json(answer.config))

    async def stats(self, request: web.Request) -> web.Response:
        name, version = request.match_info.get("name", ""), request.match_info.get("version", "")
        answer = await self._servicer.ModelStatistics(
            kserve.ModelStatisticsRequest(name=name, version=version), _CONTEXT
        )
        as_dict = _as_json(answer)
        as_dict.setdefault("model_stats", [])
        return _json(as_dict)

    async def repository_index(self, request: web.Request) -> web.Response:
        """Triton's `POST /v2/repository/index` (body `{"ready": true}` optional): a JSON array
        of {name, version, state, reason}."""
        raw = await request.read()
        body = parse_json_object(raw) if raw.strip() else {}
        answer = await self._servicer.RepositoryIndex(
            kserve.RepositoryIndexRequest(ready=body.get("ready") is True), _CONTEXT
        )
        return _json(
            [json_format.MessageToDict(m, preserving_proto_field_name=True) for m in answer.models]
        )

    async def repository_load(self, request: web.Request) -> web.Response:
        """Triton's `POST /v2/repository/models/{name}/load`; a body's `parameters` (a config
        override, model files) are refused, as over gRPC."""
        raw = await request.read()
        body = parse_json_object(raw) if raw.strip() else {}
        parameters = body.get("parameters") or {}
        named = parameters if isinstance(parameters, dict) else {"parameters": None}
        load = kserve.RepositoryModelLoadRequest(
            model_name=request.match_info["name"],
            parameters={str(name): kserve.ModelRepositoryParameter() for name in named},
        )
        await self._servicer.RepositoryModelLoad(load, _CONTEXT)
        return _json({})

    async def repository_unload(self, request: web.Request) -> web.Response:
        """Triton's `POST /v2/repository/models/{name}/unload`."""
        await self._servicer.RepositoryModelUnload(
            kserve.RepositoryModelUnloadRequest(model_name=request.match_info["name"]), _CONTEXT
        )
        return _json({})

    async def infer(self, request: web.Request) -> web.Response:
        name, version = _model(request)
        try:  # counted as ModelInfer counts a call (kserve_v2), which counts from here on
            # As ModelInfer on gRPC (kserve_infer.infer_one): the caller's right to the model
            # and the row cap before any element is decoded.
            current_principal().check_model(self._predictor.catalog.config(name).name)
            body, binary = split_body(await request.read(), request.headers.get(HEADER_LENGTH))
            check_rows_named(body, self._predictor.max_inputs)
            parsed = infer_body(name, version, body, binary)
        except ServingError as error:  # a 400, 403 or 404 the gRPC door counts was not
            label = (KSERVE_API, self._predictor.catalog.label_for(name), error.code.name)
            self._metrics.requests_total_of[label].inc()
            raise
        answer = await self._servicer.ModelInfer(parsed.request, _CONTEXT)
        payload, header_length = infer_response_body(answer, parsed)
        if header_length is None:
            return web.Response(body=payload, content_type="application/json")
        return web.Response(body=payload, content_type="application/octet-stream",
                            headers={HEADER_LENGTH: str(header_length)})  # fmt: skip

    def _responses(self, request: web.Request, body: dict[str, Any], *, stream: bool
                   ) -> AsyncGenerator[kserve.ModelStreamInferResponse, None]:  # fmt: skip
        name, version = _model(request)
        if body.get("parameters") is None:  # absent or null: the endpoint's own
            body["parameters"] = {}
        if isinstance(body["parameters"], dict):
            body["parameters"]["stream"] = stream  # the endpoint's, whatever the body says
            body.pop("stream", None)
        message = generate_request(name, version, body)
        return generate_one(self._predictor, message, current_principal(), None)

    async def generate(self, request: web.Request) -> web.Response:
        body = parse_json_object(await request.read())
        label = self._predictor.catalog.label_for(request.match_info["name"])
        with self._metrics.observe_request("rest_generate", label):
            final: dict[str, Any] = {}
            async for response in self._responses(request, body, stream=False):
                final = generate_json(response)
        return _json(final)

    async def generate_stream(self, request: web.Request) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        label = self._predictor.catalog.label_for(request.match_info["name"])
        with self._metrics.observe_request("rest_generate", label):
            # Closed however the stream ends (its client gone): the generation is cancelled now.
            streamed = self._responses(request, body, stream=True)
            async with contextlib.aclosing(streamed) as responses:
                # The first event before the headers: a refused request gets its HTTP status.
                first = await anext(responses)
                answer = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
                await answer.prepare(request)
                events = EventWriter(request, answer)
                try:
                    await events.send(sse_event(generate_json(first)))
                    async for response in responses:
                        await events.send(sse_event(generate_json(response)))
                    await events.end()
                except Exception as error:  # the status is sent: the error goes in-band
                    if is_bug(error):
                        log.exception("generate stream of %r failed", request.path)
                    error_event = sse_event({"error": http_error(error).message})
                    await events.end_in_band((error_event,), error)
                return answer


def _model(request: web.Request) -> tuple[str, str]:
    return request.match_info["name"], request.match_info.get("version", "")
