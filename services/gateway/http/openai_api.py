"""The OpenAI-compatible API: /v1/models (the list, and one by id), /v1/completions and
/v1/chat/completions, streamed (server-sent events ending `data: [DONE]`) or whole, each with
its token `usage`. Generation runs the KServe generate path (services.gateway.kserve_generate.
generate_one): the same checks, tenant admission, routing and counting as gRPC generation."""

from __future__ import annotations

import contextlib
import json
import logging
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiohttp import web

from services.common.errors import InvalidInput, NotFound
from services.common.grpc_errors import is_bug
from services.common.model_repository import ModelKind
from services.gateway.auth import Principal, current_principal
from services.gateway.http.codec import header_request_id, parse_json_object
from services.gateway.http.errors import http_error
from services.gateway.http.kserve_rest import generate_json, generate_request
from services.gateway.http.openai_codec import (
    GenerationRequest,
    ResponseShape,
    chat_request,
    completion_request,
)
from services.gateway.http.sse import DONE_EVENT, SSE_CONTENT_TYPE, EventWriter, sse_event
from services.gateway.kserve_generate import generate_one
from services.gateway.metrics import GatewayMetrics
from services.gateway.predictor import Predictor
from services.gateway.version_memo import VersionMemo

#: The kinds /v1 serves: generation (completions, chat) and text embeddings (/v1/embeddings,
#: services.gateway.http.embeddings_api).
_OPENAI_KINDS = frozenset({ModelKind.GENERATION, ModelKind.EMBEDDING})

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChatTemplate:
    """A model version's chat template and the special tokens it may name."""

    template: str | None = None
    bos_token: str = ""
    eos_token: str = ""


def read_chat_template(weights_dir: Path) -> ChatTemplate:
    """The `chat_template` of `weights_dir/tokenizer_config.json` (none without one; of a
    list of named ones, "default"); its `bos_token` and `eos_token` as strings or as Hugging
    Face's AddedToken objects."""
    path = weights_dir / "tokenizer_config.json"
    if not path.exists():
        return ChatTemplate()
    config = json.loads(path.read_text())
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: Hugging Face's default is "default"
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return ChatTemplate(
        template if isinstance(template, str) else None,
        *(_token_text(config.get(key)) for key in ("bos_token", "eos_token")),
    )


def _token_text(token: Any) -> str:
    if isinstance(token, dict):  # {"__type": "AddedToken", "content": "<s>", ...}
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _model_object(name: str) -> dict[str, Any]:
    """OpenAI's model object for `name`."""
    return {"id": name, "object": "model", "created": 0, "owned_by": "inference-fabric"}


class OpenAiApi:
    """The /v1 routes over `predictor`'s generation path."""

    def __init__(self, predictor: Predictor, metrics: GatewayMetrics):
        self._predictor = predictor
        self._metrics = metrics
        self._templates: VersionMemo[tuple[str, str], ChatTemplate] = VersionMemo(
            lambda key: predictor.catalog.has_version(*key)
        )

    def routes(self) -> list[web.RouteDef]:
        return [
            web.get("/v1/models", self.models),
            web.get("/v1/models/{model}", self.model),
            web.post("/v1/completions", self.completions),
            web.post("/v1/chat/completions", self.chat_completions),
        ]

    async def models(self, request: web.Request) -> web.Response:
        """The generation and text embedding models this caller may use."""
        catalog, principal = self._predictor.catalog, current_principal()
        names = [
            n for n in catalog.model_names()
            if catalog.config(n).kind in _OPENAI_KINDS
            and (principal.models is None or n in principal.models)
        ]  # fmt: skip
        return web.json_response({"object": "list", "data": [_model_object(n) for n in names]})

    async def model(self, request: web.Request) -> web.Response:
        """One model of the list (the stock client's `models.retrieve`): NOT_FOUND for a model
        the repository lacks or /v1 does not serve (its kind), PERMISSION_DENIED for one this
        caller's key may not use, as its calls would be answered."""
        config = self._predictor.catalog.config(request.match_info["model"])
        current_principal().check_model(config.name)
        if config.kind not in _OPENAI_KINDS:
            raise NotFound(f"model {config.name!r} ({config.kind.value}) is not served by /v1")
        return web.json_response(_model_object(config.name))

    def _template(
        self, model: str, principal: Principal, request_id: str
    ) -> tuple[str, ChatTemplate]:
        """The version a chat request for `model` runs on, and that version's template: the
        generation is sent to the same version, so a canary's prompts are built by its own
        template. Chosen as a completion's is: one X-Request-Id, one version while weights
        stand (chosen here without it, a conversation's turns were spread over a canary's
        versions; review finding)."""
        catalog = self._predictor.catalog
        name = catalog.config(model).name
        principal.check_model(name)
        resolved = catalog.resolve(name, "", sticky_key=request_id or None)
        version, encoder = resolved.version, resolved.encoder
        if encoder is None:
            raise InvalidInput(f"{name} has no tokenizer")
        # Beside its tokenizer, where its weights are: a version.toml may point elsewhere (the
        # version's own folder, read before, held no template, and prompts went untemplated).
        template = self._templates.get(
            (name, version), lambda: read_chat_template(encoder.weights_dir)
        )
        return version, template

    async def completions(self, request: web.Request) -> web.StreamResponse:
        parsed = completion_request(parse_json_object(await request.read()))
        return await self._answer(request, parsed, is_chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        body = parse_json_object(await request.read())
        model = body.get("model")
        version, template = "", ChatTemplate()
        if isinstance(model, str):
            request_id = header_request_id(request.headers)
            version, template = self._template(model, current_principal(), request_id)
        parsed = chat_request(
            body, template.template, bos_token=template.bos_token, eos_token=template.eos_token
        )
        return await self._answer(request, parsed, is_chat=True, version=version)

    def _generate(
        self, parsed: GenerationRequest, version: str, request_id: str
    ) -> AsyncGenerator[dict[str, Any], None]:
        parameters = {**parsed.sampling, "stream": True, "exclude_input_in_output": True}
        message = generate_request(parsed.model, version, {"text_input": parsed.prompt,
                                                           "parameters": parameters})  # fmt: skip
        message.id = request_id  # the caller's X-Request-Id: logs, traces, sticky routing
        principal = current_principal()
        # A chat body without max_tokens has none in its sampling: its reply may fill the
        # context (a completion's defaults to DEFAULT_MAX_TOKENS, as OpenAI's does).
        responses = generate_one(self._predictor, message, principal, None, parsed.templated,
                                 fills_context="max_tokens" not in parsed.sampling)  # fmt: skip
        return _as_json(responses)

    async def _answer(
        self, request: web.Request, parsed: GenerationRequest, *, is_chat: bool, version: str = ""
    ) -> web.StreamResponse:
        prefix = "chatcmpl" if is_chat else "cmpl"
        shape = ResponseShape(f"{prefix}-{uuid.uuid4().hex}", parsed.model, int(time.time()),
                              is_chat)  # fmt: skip
        label = self._predictor.catalog.label_for(parsed.model)
        with self._metrics.observe_request("openai", label):
            # Closed however the answer ends (its client gone): the generation is cancelled now.
            generated = self._generate(parsed, version, header_request_id(request.headers))
            async with contextlib.aclosing(generated) as chunks:
                if not parsed.is_streaming:
                    texts, final = [], {}
                    async for final in chunks:
                        texts.append(final["text_output"])
                    return web.json_response(
                        shape.whole("".join(texts), final["finish_reason"],
                                    final["prompt_tokens"], final["completion_tokens"])
                    )  # fmt: skip
                return await _stream(request, shape, chunks, include_usage=parsed.include_usage)


async def _as_json(responses: AsyncGenerator[Any, None]) -> AsyncGenerator[dict[str, Any], None]:
    async with contextlib.aclosing(responses) as closing:  # closed with this one
        async for response in closing:
            yield generate_json(response)


async def _stream(
    request: web.Request,
    shape: ResponseShape,
    chunks: AsyncIterator[dict[str, Any]],
    *,
    include_usage: bool,
) -> web.StreamResponse:
    """SSE chunks of one generation; the first is read before the headers go, so a refused
    request is answered with its HTTP status rather than inside a 200 stream."""
    first = await anext(chunks)
    answer = web.StreamResponse(headers={"Content-Type": SSE_CONTENT_TYPE})
    await answer.prepare(request)
    events = EventWriter(request, answer)
    chunk = first
    try:
        if shape.is_chat:
            await events.send(sse_event(shape.chunk("", None, is_first=True)))
        while True:
            reason = chunk.get("finish_reason")
            # A token whose text is held back (part of a character, a possible stop string)
            # comes with none: OpenAI sends no empty chunk, so neither does this stream.
            if chunk["text_output"] or reason is not None:
                await events.send(sse_event(shape.chunk(chunk["text_output"], reason)))
            if reason is not None:
                break
            chunk = await anext(chunks)
        # The stream read to its end (its status follows the last chunk at once): closed
        # before it, the generation was counted as given up by its caller, not served. Its
        # answer is whole: a failure after its last chunk is counted, and logged, not sent.
        try:
            async for _ in chunks:
                pass
        except Exception as error:
            if is_bug(error):
                log.exception("OpenAI stream of %r failed after its last chunk", request.path)
        if include_usage:
            usage = shape.usage_chunk(chunk["prompt_tokens"], chunk["completion_tokens"])
            await events.send(sse_event(usage))
        await events.send(DONE_EVENT)
        await events.end()
    except Exception as error:  # headers are sent: the error goes in-band, as OpenAI does
        if is_bug(error):
            log.exception("OpenAI stream of %r failed", request.path)
        error_event = sse_event(json.loads(http_error(error).openai_body()))
        await events.end_in_band((error_event, DONE_EVENT), error)
    return answer
