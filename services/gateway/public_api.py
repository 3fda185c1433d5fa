"""`inference.v1.InferenceService`: the project's own API, protobuf <-> domain in one place."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from services.common.errors import InvalidInput, NotFound, PermissionDenied
from services.common.priority import PriorityClass
from services.common.tensors import tensor_from_pb, tensor_to_pb
from services.gateway.auth import Principal, current_principal
from services.gateway.kserve_generate import check_request_id
from services.gateway.metrics import GatewayMetrics
from services.gateway.model_inputs import check_num_inputs
from services.gateway.predictor import GenerateCall, PredictCall, Predictor, PredictValue
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as pb


def _value(predict_input: api.PredictInput) -> PredictValue:
    which = predict_input.WhichOneof("payload")
    if which == "text":
        return predict_input.text
    if which == "tensor":
        return tensor_from_pb(predict_input.tensor)
    raise InvalidInput("an input has no payload (text or tensor)")


def _priority(value: int) -> PriorityClass | None:
    try:
        return PriorityClass.from_proto(value)
    except ValueError as error:
        raise InvalidInput(str(error)) from None


def _check_before_decoding(
    predictor: Predictor, request: api.PredictRequest, principal: Principal
) -> None:
    """What KServe's ModelInfer checks before any input is decoded (kserve_infer.infer_one):
    the model (NOT_FOUND), the caller's right to it (PERMISSION_DENIED), the row cap and the
    request id; a caller may not spend the gateway's loop decoding what it would refuse."""
    config = predictor.catalog.config(request.model_name)
    principal.check_model(config.name)
    check_num_inputs(len(request.inputs), predictor.max_inputs)
    check_request_id(request.request_id)


class InferenceServicer(api_grpc.InferenceServiceServicer):
    def __init__(self, predictor: Predictor, metrics: GatewayMetrics) -> None:
        self._predictor = predictor
        self._metrics = metrics

    async def Predict(
        self, request: api.PredictRequest, context: grpc.aio.ServicerContext
    ) -> api.PredictResponse:
        label = self._predictor.catalog.label_for(request.model_name)
        with self._metrics.observe_request("v1", label, context.time_remaining()):
            principal = current_principal()
            _check_before_decoding(self._predictor, request, principal)
            result = await self._predictor.predict(
                PredictCall(
                    model_name=request.model_name,
                    version_spec=request.model_version,
                    inputs=[_value(i) for i in request.inputs],
                    principal=principal,
                    request_id=request.request_id,
                    timeout_s=context.time_remaining(),
                    priority=_priority(request.priority),
                )
            )
            return api.PredictResponse(
                model_name=result.model_name,
                model_version=result.model_version,
                outputs=[tensor_to_pb(o) for o in result.outputs],
                request_id=result.request_id,
            )

    async def Generate(
        self, request: api.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.GenerateResponse]:
        label = self._predictor.catalog.label_for(request.model_name)
        with self._metrics.observe_request("v1_generate", label, context.time_remaining()):
            check_request_id(request.request_id)
            call = GenerateCall(
                model_name=request.model_name,
                version_spec=request.model_version,
                prompt=request.prompt,
                sampling=request.sampling,
                principal=current_principal(),
                request_id=request.request_id,
                timeout_s=context.time_remaining(),
                priority=_priority(request.priority),
            )
            async with contextlib.aclosing(self._predictor.generate(call)) as messages:
                async for message in messages:
                    yield message

    def _model_info(self, name: str) -> api.ModelInfo:
        catalog = self._predictor.catalog
        config = catalog.config(name)
        return api.ModelInfo(
            name=config.name,
            versions=catalog.served_versions(config.name),
            labels={label: str(v) for label, v in catalog.routing(config.name).labels.items()},
        )

    async def ListModels(
        self, request: api.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> api.ListModelsResponse:
        principal = current_principal()
        names = [
            n
            for n in self._predictor.catalog.model_names()
            if principal.models is None or n in principal.models
        ]
        return api.ListModelsResponse(models=[self._model_info(n) for n in names])

    async def GetModel(
        self, request: api.GetModelRequest, context: grpc.aio.ServicerContext
    ) -> api.ModelInfo:
        try:
            current_principal().check_model(request.model_name)
        except PermissionDenied:
            # Do not reveal which models exist to callers who may not use them.
            raise NotFound(f"model {request.model_name!r} not found") from None
        return self._model_info(request.model_name)
