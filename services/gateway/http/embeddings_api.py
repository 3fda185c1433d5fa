"""The embedding APIs people already call: OpenAI's `POST /v1/embeddings` and
text-embeddings-inference's `POST /embed` (and `POST /`, as TEI serves it) and `GET /info`.
Each call is one Predict caller (services.gateway.predictor): the same tokenizer and checks,
tenant admission and quotas, priorities, routing, batching, tracing and metrics as KServe and
the project's own API."""

from __future__ import annotations

import numpy as np
from aiohttp import web

from services.common.errors import InvalidInput
from services.common.model_repository import ModelConfig, ModelKind
from services.gateway.auth import current_principal
from services.gateway.http.codec import finite_json, header_request_id, parse_json_object
from services.gateway.http.embeddings_codec import (
    EmbeddingRequest,
    openai_embedding_request,
    openai_embedding_response,
    shaped_vectors,
    tei_embed_request,
)
from services.gateway.kserve_api import SERVER_VERSION
from services.gateway.metrics import GatewayMetrics
from services.gateway.predictor import PredictCall, Predictor, PredictResult

#: TEI's names for the output dtypes a text embedding model may declare.
_TEI_DTYPES = {"FP32": "float32", "FP16": "float16"}


class EmbeddingsApi:
    """The embedding routes over `predictor`; `tei_model` is the model TEI's routes serve
    (empty: the repository's only text embedding model)."""

    def __init__(self, predictor: Predictor, metrics: GatewayMetrics, tei_model: str) -> None:
        self._predictor = predictor
        self._metrics = metrics
        self._tei_model = tei_model

    def routes(self) -> list[web.RouteDef]:
        return [
            web.post("/v1/embeddings", self.openai_embeddings),
            web.post("/embed", self.tei_embed),
            web.post("/", self.tei_embed),
            web.get("/info", self.tei_info),
            web.get("/health", self.tei_health),
        ]

    def _embedding_config(self, model: str) -> ModelConfig:
        """The config of a text embedding model; 400 naming the model for any other kind, once
        the caller may use it (403 tells nothing of a model it may not)."""
        config = self._predictor.catalog.config(model)
        current_principal().check_model(config.name)
        if config.kind is ModelKind.GENERATION:
            raise InvalidInput(f"{config.name} is a generation model: it has no embeddings")
        if config.kind is not ModelKind.EMBEDDING:
            raise InvalidInput(f"{config.name} takes tensor inputs, not text: call /v2 infer")
        return config

    def _tei_model_name(self) -> str | None:
        """The model TEI's routes serve: `--tei-model`, else the repository's only text
        embedding model; None where there are several or none."""
        if self._tei_model:
            return self._tei_model
        catalog = self._predictor.catalog
        names = [n for n in catalog.model_names() if catalog.config(n).kind is ModelKind.EMBEDDING]
        return names[0] if len(names) == 1 else None

    def _tei_config(self) -> ModelConfig:
        name = self._tei_model_name()
        if name is None:  # neither named nor counted: a caller may not know of models
            raise InvalidInput(  # it may not use
                "TEI's routes serve one model and this gateway has several embedding models, or "
                "none: start it with --tei-model"
            )
        return self._embedding_config(name)

    async def _embed(
        self, parsed: EmbeddingRequest, config: ModelConfig, request_id: str
    ) -> tuple[np.ndarray, PredictResult]:
        """Runs `parsed` as one Predict call (`request_id`: the caller's X-Request-Id, or "");
        the vectors shaped as it asked."""
        output_dims = config.outputs[0].dims[-1]
        # The model's own size shortens nothing: asked of any model (clients set up with a
        # fixed `dimensions` send it on every call), it is the model's answer as it is.
        dimensions = None if parsed.dimensions == output_dims else parsed.dimensions
        if dimensions is not None:
            if not config.embedding.shortenable:
                raise InvalidInput(
                    f"{config.name} cannot shorten its embeddings: dimensions is only honoured "
                    "for a model whose config declares [embedding] shortenable = true"
                )
            if dimensions > output_dims:
                raise InvalidInput(f"dimensions {dimensions} exceeds {config.name}'s {output_dims}")
        model_normalizes = config.normalizes_embeddings
        normalize = model_normalizes if parsed.normalize is None else parsed.normalize
        truncate = config.embedding.truncate if parsed.truncate is None else parsed.truncate
        result = await self._predictor.predict(
            PredictCall(
                model_name=config.name,
                version_spec="",
                inputs=parsed.inputs,
                principal=current_principal(),
                request_id=request_id,
                timeout_s=None,
                truncate=truncate,
                unnormalized=model_normalizes and not normalize,
            )
        )
        vectors = shaped_vectors(
            result.outputs, dimensions=dimensions,
            is_normalized=model_normalizes and normalize, normalize=normalize,
        )  # fmt: skip
        return vectors, result

    async def openai_embeddings(self, request: web.Request) -> web.Response:
        parsed = openai_embedding_request(parse_json_object(await request.read()))
        label = self._predictor.catalog.label_for(parsed.model)
        with self._metrics.observe_request("openai_embeddings", label):
            config = self._embedding_config(parsed.model)
            vectors, result = await self._embed(parsed, config, header_request_id(request.headers))
            return web.json_response(
                openai_embedding_response(
                    vectors, model=result.model_name, num_tokens=result.num_tokens,
                    encoding=parsed.encoding,
                ),
                dumps=_openai_json,
            )  # fmt: skip

    async def tei_embed(self, request: web.Request) -> web.Response:
        parsed = tei_embed_request(parse_json_object(await request.read()))
        config = self._tei_config()
        with self._metrics.observe_request("tei_embed", config.name):
            vectors, _ = await self._embed(parsed, config, header_request_id(request.headers))
            return web.json_response(vectors.tolist(), dumps=finite_json)

    async def tei_info(self, request: web.Request) -> web.Response:
        """TEI's model information, and the embedding's dims."""
        config = self._tei_config()
        current_principal().check_model(config.name)
        resolved = self._predictor.catalog.resolve(config.name, "")
        max_tokens = resolved.encoder.max_tokens if resolved.encoder is not None else 0
        output = config.outputs[0]
        return web.json_response({
            "model_id": config.name,
            "model_sha": resolved.fingerprint,
            "model_version": resolved.version,
            "model_dtype": _TEI_DTYPES.get(output.dtype, output.dtype.lower()),
            "model_type": {"embedding": {"pooling": config.preprocessing.get("pooling", "mean")}},
            "dims": output.dims[-1],
            "max_input_length": max_tokens,
            "max_batch_tokens": config.max_batch_tokens,
            "max_batch_requests": config.max_batch_size,
            "max_client_batch_size": self._predictor.max_inputs,
            "auto_truncate": config.embedding.truncate,
            "version": SERVER_VERSION,
        })  # fmt: skip

    async def tei_health(self, request: web.Request) -> web.Response:
        """TEI's health, which its deployments' probes read: 200 while a ready worker serves
        the model TEI's routes serve, else 503 (TEI's `Unhealthy`). Open, as the gateway's own
        probes are: it names no model and tells nothing a caller could not learn by failing."""
        del request
        name = self._tei_model_name()
        if name is not None and self._predictor.catalog.ready_versions().get(name, 0) > 0:
            return web.Response(status=200)
        body = {"error": "no ready worker serves the model", "error_type": "Unhealthy"}
        return web.json_response(body, status=503)


def _openai_json(value: object) -> str:
    return finite_json(value, advice='; ask for them as "encoding_format": "base64"')
