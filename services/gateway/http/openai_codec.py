"""OpenAI API bodies <-> this server's generation terms. Pure: dicts in, dicts out.

Requests: `model`, `prompt` (completions) or `messages` (chat), `max_tokens` (chat also
`max_completion_tokens`), `temperature`, `top_p`, `seed`, `stop`, `stream`,
`stream_options.include_usage`; `n` must be 1. Fields OpenAI defines that change nothing here
(`user`, `logprobs: null`...) are accepted and ignored; unknown sampling fields are refused.

Chat prompts use the model's chat template (`chat_template` of its tokenizer_config.json, a
Jinja template as Hugging Face writes them) when it has one, its special tokens read as tokens
and the message contents as text (`templated_prompt`); otherwise every message becomes
"<role>: <content>" on its own line, followed by "assistant:" for the reply.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from jinja2 import Template, nodes
from jinja2.exceptions import TemplateError
from jinja2.ext import Extension, loopcontrols
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment

from services.common.errors import InvalidInput
from services.common.sampling import MIN_TEMPERATURE
from services.common.templated_text import TemplatedText

#: OpenAI's default completion length (tokens) when a request gives none.
DEFAULT_MAX_TOKENS = 16
_ROLES = ("system", "user", "assistant", "tool", "developer")
#: Fields accepted whatever their value: they ask nothing of the generation (newer SDKs send
#: `safety_identifier` and `prompt_cache_key` where `user` was; `service_tier` is a billing
#: tier's).
_IGNORED = frozenset({"user", "parallel_tool_calls", "store", "metadata", "safety_identifier",
                      "prompt_cache_key", "service_tier"})  # fmt: skip
#: Fields accepted null or at their defaults only: any other value asks for what is not
#: generated (log probabilities, an echoed prompt, penalties, JSON output), and answering
#: without it would hand a client that reads it an answer it did not ask for.
_AT_DEFAULT: dict[str, tuple[Any, ...]] = {
    "logprobs": (False,), "top_logprobs": (0,), "logit_bias": ({},), "echo": (False,),
    "suffix": ("",), "frequency_penalty": (0,), "presence_penalty": (0,), "best_of": (1,),
    "response_format": ({"type": "text"},),
}  # fmt: skip


@dataclass(frozen=True)
class GenerationRequest:
    """What one OpenAI request asks of the generation path."""

    model: str
    prompt: str
    #: services.gateway.kserve_generate's sampling parameters (JSON keys).
    sampling: dict[str, Any]
    is_streaming: bool
    include_usage: bool
    #: A chat prompt of the model's template: `prompt` with its contents located (None: the
    #: prompt is all the caller's text).
    templated: TemplatedText | None = None


#: OpenAI's temperature for a body that names none.
OPENAI_TEMPERATURE = 1.0


def _sampling(
    body: dict[str, Any], max_tokens_keys: tuple[str, ...], default: int | None
) -> dict[str, Any]:
    """The sampling of a body; `default` is max_tokens when the body names none (None: the
    rest of the model's context, as OpenAI's and vLLM's chat completions have it). A body
    naming no temperature samples at OpenAI's default of 1 (the internal default, 0, is
    greedy: every call gave the same text)."""
    sampling: dict[str, Any] = {"temperature": OPENAI_TEMPERATURE}
    if default is not None:
        sampling["max_tokens"] = default
    for key in max_tokens_keys:
        if body.get(key) is not None:
            sampling["max_tokens"] = body[key]
    for key in ("temperature", "top_p", "seed", "stop"):
        if body.get(key) is not None:
            sampling[key] = body[key]
    temperature = sampling["temperature"]
    if isinstance(temperature, int | float) and 0 < temperature < MIN_TEMPERATURE:
        # OpenAI takes any temperature in [0, 2]; one this small means greedy (vLLM's reading
        # too), which the sampler is for it, rather than refused.
        sampling["temperature"] = 0.0
    if sampling.get("top_p") == 0 and not isinstance(sampling["top_p"], bool):
        # OpenAI takes top_p in [0, 1]; 0 keeps only the likeliest token: greedy, as the
        # sampler is at temperature 0 (the internal wire reads a top_p of 0 as unset, and
        # refused it).
        del sampling["top_p"]
        sampling["temperature"] = 0.0
    seed = sampling.get("seed")
    if isinstance(seed, int) and not isinstance(seed, bool) and -(2**63) <= seed < 0:
        sampling["seed"] = seed % 2**64  # OpenAI's seed is any int64; the wire's unsigned
    if body.get("n") is not None and not _is(body["n"], 1):  # true is not 1
        raise InvalidInput("n must be 1: one choice per request")
    return sampling


def _is(value: Any, default: Any) -> bool:
    """Whether `value` is `default`: a bool only a bool (`"logprobs": 0` asks completions for
    the sampled token's log probability, though 0 == False), numbers at any type (0.0, 0)."""
    if isinstance(value, bool) or isinstance(default, bool):
        return type(value) is type(default) and value == default
    return bool(value == default)


def _common(body: dict[str, Any], known: frozenset[str]) -> tuple[str, bool, bool]:
    unknown = sorted(set(body) - known - _IGNORED - set(_AT_DEFAULT))
    if unknown:
        raise InvalidInput(f"unsupported fields {unknown}")
    asked = sorted(
        key for key, defaults in _AT_DEFAULT.items()
        if body.get(key) is not None and not any(_is(body[key], d) for d in defaults)
    )  # fmt: skip
    if asked:
        raise InvalidInput(f"unsupported {asked}: accepted only null or at their defaults")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise InvalidInput("model (a string) is required")
    options = body.get("stream_options") or {}
    if not isinstance(options, dict):
        raise InvalidInput("stream_options must be an object")
    # Read as false, "stream": "true" was answered whole, to a caller waiting for events.
    for name, value in (
        ("stream", body.get("stream")),
        ("stream_options.include_usage", options.get("include_usage")),
    ):
        if value is not None and not isinstance(value, bool):
            raise InvalidInput(f"{name} must be a boolean, got {value!r}")
    return model, body.get("stream") is True, options.get("include_usage") is True


_SHARED = frozenset({"model", "max_tokens", "temperature", "top_p", "seed", "stop", "n",
                     "stream", "stream_options"})  # fmt: skip


def completion_request(body: dict[str, Any]) -> GenerationRequest:
    """A /v1/completions body; `prompt` is a string or a list of exactly one."""
    model, is_streaming, include_usage = _common(body, _SHARED | {"prompt"})
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1:
        prompt = prompt[0]
    if not isinstance(prompt, str):
        raise InvalidInput("prompt must be a string (or a list of one string)")
    sampling = _sampling(body, ("max_tokens",), default=DEFAULT_MAX_TOKENS)
    return GenerationRequest(model, prompt, sampling, is_streaming, include_usage)


def _content(message: Any) -> tuple[str, str]:
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        raise InvalidInput(f"each message needs a role, one of {list(_ROLES)}")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text ones are served
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise InvalidInput("only text content parts are supported")
        if not all(isinstance(p.get("text"), str) for p in content):  # not str() of an object
            raise InvalidInput("each text content part needs its text, a string")
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise InvalidInput("message content must be a string")
    return message["role"], content


def plain_prompt(messages: Any) -> str:
    """The prompt for `messages` of a model without a chat template (module docstring)."""
    return "".join(f"{role}: {content}\n" for role, content in _pairs(messages)) + "assistant:"


def templated_prompt(
    messages: Any, template: str, *, bos_token: str = "", eos_token: str = ""
) -> TemplatedText:
    """The prompt for `messages` rendered by the model's chat `template`, with where the
    message contents sit in it (`_located`): the gateway reads the template's special tokens
    as tokens and the contents as text (TextEncoder.encode_templated)."""
    pairs = _pairs(messages)
    roles, contents = [role for role, _ in pairs], tuple(content for _, content in pairs)

    def render(shown: Sequence[str]) -> str:
        return _compiled(template).render(
            messages=[{"role": r, "content": c} for r, c in zip(roles, shown, strict=True)],
            add_generation_prompt=True,
            bos_token=bos_token,
            eos_token=eos_token,
            # As Hugging Face renders: templates test these (`tools is not none`).
            tools=None,
            documents=None,
        )

    try:
        text = render(contents)
    except TemplateError as error:
        raise InvalidInput(f"the model's chat template failed: {error}") from None
    except Exception as error:  # the template's own code failed on these messages
        raise InvalidInput(f"the model's chat template failed: {error!r}") from None
    try:
        marked = render([_marker(i) for i in range(len(contents))])
    except Exception:  # a template that computes with the contents: they are not located
        marked = ""
    return TemplatedText(text, _located(text, marked, contents), contents, marked)


def _pairs(messages: Any) -> list[tuple[str, str]]:
    if not isinstance(messages, list) or not messages:
        raise InvalidInput("messages must be a non-empty list")
    return [_content(m) for m in messages]


def _raise_exception(message: str) -> None:
    """What Hugging Face's chat templates call to refuse a conversation."""
    raise TemplateError(message)


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Template:
    """`template` compiled in the sandbox chat templates render in, with what Hugging Face's
    renderer adds: loop controls, `raise_exception` and `strftime_now` (once per template:
    a gateway serves a few)."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, _Generation]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: time.strftime(fmt)
    return environment.from_string(template)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    """Hugging Face's `tojson`: JSON as written, not escaped for HTML as Jinja's is."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _Generation(Extension):
    """`{% generation %}...{% endgeneration %}`: Hugging Face's marker of the assistant's
    tokens (for training masks); it renders its body."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


def _marker(index: int) -> str:
    """Message `index`'s stand-in while locating contents: private-use characters, with no
    whitespace for a template's `trim` to take."""
    return f"\ue000{index}\ue001"


_MARKER = re.compile("\ue000([0-9]+)\ue001")


def _located(text: str, marked: str, contents: Sequence[str]) -> tuple[tuple[int, int], ...] | None:
    """Where each content the template showed sits in `text`, in the order shown, from the
    rendering of the same messages with stand-ins for contents (`marked`); None when they
    cannot be told apart from the template's own text: a content shown twice, or changed
    beyond `trim`, or a template whose text depends on them."""
    parts = _MARKER.split(marked)
    own, shown = parts[0::2], [int(i) for i in parts[1::2]]
    if not marked or len(set(shown)) != len(shown) or any(i >= len(contents) for i in shown):
        return None
    if not text.startswith(own[0]):
        return None
    position, spans = len(own[0]), []
    for index, after in zip(shown, own[1:], strict=True):
        content = contents[index]
        for candidate in dict.fromkeys((content, content.strip())):
            end = position + len(candidate)
            if text.startswith(candidate, position) and text.startswith(after, end):
                break
        else:
            return None
        spans.append((position, end))
        position = end + len(after)
    return tuple(spans) if position == len(text) else None


def chat_request(
    body: dict[str, Any], template: str | None, *, bos_token: str = "", eos_token: str = ""
) -> GenerationRequest:
    """A /v1/chat/completions body, its messages rendered into one prompt."""
    model, is_streaming, include_usage = _common(
        body, _SHARED | {"messages", "max_completion_tokens"}
    )
    messages = body.get("messages")
    templated = None
    if template is None:
        prompt = plain_prompt(messages)
    else:
        templated = templated_prompt(messages, template, bos_token=bos_token, eos_token=eos_token)
        prompt = templated.text
    sampling = _sampling(body, ("max_tokens", "max_completion_tokens"), default=None)
    return GenerationRequest(model, prompt, sampling, is_streaming, include_usage, templated)


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


@dataclass(frozen=True)
class ResponseShape:
    """How one endpoint writes its answers (ids, object names, where the text goes)."""

    request_id: str
    model: str
    created_s: int
    is_chat: bool

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created_s,
                "model": self.model, "choices": choices}  # fmt: skip

    def chunk(self, text: str, finish_reason: str | None, *, is_first: bool = False
              ) -> dict[str, Any]:  # fmt: skip
        """One streamed chunk carrying `text` (and the finish reason on the last one)."""
        if not self.is_chat:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            return self._envelope("text_completion", [choice])
        delta: dict[str, Any] = {"role": "assistant"} if is_first else {}
        if text or is_first:
            delta["content"] = text
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        return self._envelope("chat.completion.chunk", [choice])

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
        """The last chunk of a stream that asked for usage: no choices, the counts."""
        obj = "chat.completion.chunk" if self.is_chat else "text_completion"
        return {**self._envelope(obj, []), "usage": usage(prompt_tokens, completion_tokens)}

    def whole(self, text: str, finish_reason: str, prompt_tokens: int, completion_tokens: int
              ) -> dict[str, Any]:  # fmt: skip
        """The non-streaming answer."""
        if self.is_chat:
            message = {"role": "assistant", "content": text}
            choice = {"index": 0, "message": message, "logprobs": None,
                      "finish_reason": finish_reason}  # fmt: skip
            answer = self._envelope("chat.completion", [choice])
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
            answer = self._envelope("text_completion", [choice])
        return {**answer, "usage": usage(prompt_tokens, completion_tokens)}
