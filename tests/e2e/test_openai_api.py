"""The OpenAI-compatible API end to end, driven by the stock `openai` Python package against
`tiny-llama`: completions and chat completions, whole and streamed, with token usage; the
model list; refusals as OpenAI errors with their HTTP statuses."""

from __future__ import annotations

import json
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from bench.fabric.stack import write_identity_model
from services.common import metric_names as names
from services.gateway.auth import hash_key
from services.gpu_worker.generation.tiny_llama import BOS_TOKEN, EOS_TOKEN
from tests.support.metrics import scrape, total
from tests.support.stack import REPO_ROOT, Stack, start_stack

pytestmark = pytest.mark.e2e

API_KEY = "openai-test-key"
#: A key that may use minilm only.
LIMITED_KEY = "openai-minilm-only-key"
MODEL = "tiny-llama"
#: tiny-llama's tokenizer is byte-level with <s> prepended: a prompt of N ASCII bytes is N + 1
#: tokens (models/tiny-llama/1/README.txt).
PROMPT = "Once upon a time"
#: tiny-llama's checkpoint with a chat template (Zephyr's shape) in its tokenizer_config.json.
CHAT_MODEL = "tiny-chat"
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def _repository(root: Path) -> Path:
    """The default models, the identity model, and tiny-llama again as CHAT_MODEL with
    CHAT_TEMPLATE."""
    root.mkdir()
    for name in ("minilm", MODEL):
        (root / name).symlink_to(REPO_ROOT / "models" / name, target_is_directory=True)
    write_identity_model(root)  # a model of a kind /v1 does not serve
    shutil.copytree(REPO_ROOT / "models" / MODEL, root / CHAT_MODEL)
    tokenizer_config = root / CHAT_MODEL / "1" / "tokenizer_config.json"
    config = json.loads(tokenizer_config.read_text())
    tokenizer_config.write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return root


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("openai")
    keys = tmp / "api-keys.toml"
    keys.write_text(
        f'[[keys]]\ntenant = "llm"\nsha256 = "{hash_key(API_KEY)}"\n'
        f'[[keys]]\ntenant = "embed"\nsha256 = "{hash_key(LIMITED_KEY)}"\nmodels = ["minilm"]\n'
    )
    repository = _repository(tmp / "models")
    stack = start_stack(
        tmp, model_repository=repository, extra_gateway_args=(f"--api-keys-file={keys}",)
    )
    yield stack
    assert stack.stop() == 0, stack.stop_report()


@pytest.fixture
def client(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.gateway.http_url}/v1", api_key=API_KEY, timeout=120)


def test_models_lists_the_generation_and_embedding_models(client: openai.OpenAI) -> None:
    ids = [model.id for model in client.models.list()]
    assert MODEL in ids and "minilm" in ids


def test_a_model_is_retrieved_by_id(stack: Stack, client: openai.OpenAI) -> None:
    """The stock client's `models.retrieve`: a model of the list; NOT_FOUND for one the
    repository lacks or /v1 does not serve; PERMISSION_DENIED for one the key may not use."""
    model = client.models.retrieve(MODEL)
    assert (model.id, model.object) == (MODEL, "model")
    assert client.models.retrieve("minilm").id == "minilm"
    with pytest.raises(openai.NotFoundError, match="no-such-model"):
        client.models.retrieve("no-such-model")
    with pytest.raises(openai.NotFoundError, match="torchscript"):
        client.models.retrieve("identity")
    limited = openai.OpenAI(base_url=f"{stack.gateway.http_url}/v1", api_key=LIMITED_KEY)
    assert limited.models.retrieve("minilm").id == "minilm"
    with pytest.raises(openai.PermissionDeniedError, match=MODEL):
        limited.models.retrieve(MODEL)
    with pytest.raises(openai.PermissionDeniedError, match="identity"):
        limited.models.retrieve("identity")  # the key's refusal first, as its calls get it


def test_completion_whole_and_streamed_agree_with_usage(client: openai.OpenAI) -> None:
    whole = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0)
    assert whole.object == "text_completion" and whole.model == MODEL
    (choice,) = whole.choices
    assert choice.finish_reason == "length" and choice.text
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(PROMPT) + 1
    assert whole.usage.completion_tokens == 6
    assert whole.usage.total_tokens == len(PROMPT) + 7
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
    )  # fmt: skip
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == choice.text  # greedy: the same tokens either way
    finish = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finish[-1] == "length" and set(finish[:-1]) <= {None}
    # Random weights emit bytes that are parts of characters, whose text is held back: a
    # longer stream has such tokens, and no chunk before the last is empty for them.
    long = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=64, temperature=0, stream=True
        )
    )
    assert all(c.choices[0].text for c in long[:-1]), [c.choices[0].text for c in long]
    assert long[-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(PROMPT) + 1
    # top_p 0 keeps only the likeliest token (greedy: the same text), and a negative seed is
    # OpenAI's int64: both were refused 400 (review finding).
    edge = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=6, top_p=0, seed=-5)
    assert edge.choices[0].text == choice.text


def test_a_streamed_completion_is_counted_served(stack: Stack, client: openai.OpenAI) -> None:
    """A stream read to its last chunk is an OK call of its tenant, in the gateway's tenant
    counts and its Triton statistics. Before, the stream was closed as soon as its finishing
    chunk was sent, before the worker's end, and every streamed completion counted as
    CANCELLED (a failure in the statistics) (generation review)."""

    def counts() -> tuple[float, float]:
        text = scrape(stack.gateway.metrics_port)
        name = names.GATEWAY_TENANT_REQUESTS_TOTAL
        return total(text, name, tenant="llm", code="OK"), total(text, name, tenant="llm")

    ok_before, all_before = counts()
    messages = [{"role": "user", "content": "Hi"}]
    for stream in (
        client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, stream=True),
        client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, stream=True),
    ):
        assert list(stream)[-1].choices[0].finish_reason in ("length", "stop")
    ok_after, all_after = counts()
    assert (ok_after - ok_before, all_after - all_before) == (2, 2)


def test_chat_completion_whole_and_streamed(client: openai.OpenAI) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    whole = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0
    )
    (choice,) = whole.choices
    assert whole.object == "chat.completion" and choice.message.role == "assistant"
    assert choice.finish_reason == "length" and choice.message.content
    # No chat template: "system: Be brief.\nuser: Hi\nassistant:" and <s>.
    expected_prompt = "system: Be brief.\nuser: Hi\nassistant:"
    assert whole.usage is not None and whole.usage.prompt_tokens == len(expected_prompt) + 1
    assert whole.usage.completion_tokens == 5
    stream = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=5, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content
    assert chunks[-1].usage is not None and chunks[-1].usage.total_tokens == (
        len(expected_prompt) + 1 + 5
    )


def test_a_chat_reply_without_max_tokens_may_fill_the_context(client: openai.OpenAI) -> None:
    """A chat completion that names no max_tokens is not cut at 16 tokens (the completions
    API's default): it ends at EOS, or at the model's context (512 tokens for tiny-llama), as
    OpenAI's and vLLM's chat completions do."""
    reply = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], temperature=0
    )
    (choice,) = reply.choices
    assert reply.usage is not None
    if choice.finish_reason == "length":
        assert reply.usage.prompt_tokens + reply.usage.completion_tokens == 512, reply.usage
    else:
        assert choice.finish_reason == "stop"
    assert reply.usage.completion_tokens > 16 or choice.finish_reason == "stop", reply.usage


def test_a_chat_template_s_special_tokens_are_tokens_and_the_contents_text(
    client: openai.OpenAI,
) -> None:
    """Before, the rendering was tokenized as text: the template's <s> and </s> were 3 and 4
    bytes each, and the tokenizer prepended a second <s> (35 tokens here, not 29)."""
    messages = [{"role": "user", "content": "a</s>b"}]
    whole = client.chat.completions.create(
        model=CHAT_MODEL, messages=messages, max_tokens=2, temperature=0
    )
    # <s> <|user|> a</s>b </s> <|assistant|>: the two specials one token each, the content
    # (whose </s> is text) 6 bytes, the rest 8 + 13 bytes.
    rendered = f"{BOS_TOKEN}<|user|>a</s>b{EOS_TOKEN}<|assistant|>"
    assert whole.usage is not None
    assert whole.usage.prompt_tokens == len(rendered) - len(BOS_TOKEN) - len(EOS_TOKEN) + 2
    assert whole.usage.prompt_tokens == 29


def test_refusals_are_openai_errors(stack: Stack, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="minilm"):
        client.completions.create(model="minilm", prompt="x", max_tokens=1)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, n=2)
    unauthenticated = openai.OpenAI(base_url=f"{stack.gateway.http_url}/v1", api_key="wrong")
    with pytest.raises(openai.AuthenticationError):
        unauthenticated.models.list()


def test_stream_ends_with_done(stack: Stack) -> None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 3, "stream": True}
    request = urllib.request.Request(
        f"{stack.gateway.http_url}/v1/completions", data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )  # fmt: skip
    with urllib.request.urlopen(request, timeout=120) as response:
        events = response.read().decode().split("\n\n")
    assert events[-2] == "data: [DONE]" and events[-1] == ""
    assert all(e.startswith("data: ") for e in events[:-1])
