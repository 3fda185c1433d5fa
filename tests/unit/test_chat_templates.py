"""Chat prompts of a model's template: where the callers' contents sit in the rendering, and
the ids the gateway makes of it (the template's special tokens as tokens, the contents as
text), with tiny-llama's real tokenizer; and the end-of-sequence tokens a checkpoint's
generation_config.json adds."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry
from tokenizers import AddedToken

from services.common.errors import InvalidInput
from services.common.model_repository import load_repository
from services.common.templated_text import TemplatedText, TemplateTokens
from services.common.text import TextEncoder
from services.gateway.auth import LOCAL_PRINCIPAL
from services.gateway.catalog import ModelCatalog
from services.gateway.http.openai_api import ChatTemplate, OpenAiApi, read_chat_template
from services.gateway.http.openai_codec import chat_request, plain_prompt, templated_prompt
from services.gateway.metrics import GatewayMetrics
from services.gpu_worker.generation.llama import LlamaConfig
from services.gpu_worker.generation.tiny_llama import BOS_TOKEN_ID, EOS_TOKEN_ID, build_tokenizer
from services.pb.inference.v1 import worker_pb2 as pb

pytestmark = pytest.mark.unit

REPOSITORY = Path(__file__).resolve().parents[2] / "models"
#: A Zephyr-like template: BOS, then each turn between role markers, ended by EOS.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content | trim }}"
    "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
SPECIALS = {"bos_token": "<s>", "eos_token": "</s>"}


@pytest.fixture(scope="module")
def encoder() -> TextEncoder:
    version = next(v for v in load_repository(REPOSITORY) if v.config.name == "tiny-llama")
    return TextEncoder(version.weights_dir, version.config)


def _bytes(text: str) -> list[int]:
    """tiny-llama's ids of `text` read as text: byte b is id b."""
    return list(text.encode())


def test_the_contents_are_located_in_the_rendering() -> None:
    messages = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "a</s>b"}]
    prompt = templated_prompt(messages, TEMPLATE, **SPECIALS)
    assert prompt.text == "<s><|system|>Be brief.</s><|user|>a</s>b</s><|assistant|>"
    assert prompt.literal_spans is not None
    assert [prompt.text[a:b] for a, b in prompt.literal_spans] == ["Be brief.", "a</s>b"]
    assert prompt.literals == (" Be brief. ", "a</s>b")


def test_a_template_that_drops_or_repeats_a_content() -> None:
    messages = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    drops = "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}[{{ m.content }}]{% endfor %}"  # noqa: E501
    dropped = templated_prompt(messages, drops)
    assert dropped.text == "[u]" and dropped.literal_spans == ((1, 2),)
    repeats = "{% for m in messages %}{{ m.content }}/{{ m.content }}{% endfor %}"
    assert templated_prompt(messages, repeats).literal_spans is None
    # A template that branches on the contents renders the stand-ins differently.
    branches = (
        "{% for m in messages %}{% if m.content == 'u' %}!{% endif %}{{ m.content }}{% endfor %}"
    )
    assert templated_prompt(messages, branches).literal_spans is None


def test_hugging_face_template_helpers_and_failures() -> None:
    alternates = (
        "{% for m in messages %}{% if loop.index0 > 0 and m.role == messages[loop.index0 - 1].role %}"  # noqa: E501
        "{{ raise_exception('roles must alternate') }}{% endif %}{{ m.content }}{% endfor %}"
    )
    two_users = [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]
    with pytest.raises(InvalidInput, match="roles must alternate"):
        templated_prompt(two_users, alternates)
    breaks = "{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.content }}{% endfor %}"  # noqa: E501
    assert templated_prompt(two_users, breaks).text == "a"
    for broken in ("{{ messages.__class__.__mro__ }}{{ undefined() }}", "{% for %}"):
        with pytest.raises(InvalidInput, match="template"):
            templated_prompt(two_users, broken)
    with pytest.raises(InvalidInput, match="role"):
        plain_prompt([{"role": "wizard", "content": "x"}])
    assert plain_prompt([{"role": "user", "content": "u"}]) == "user: u\nassistant:"


def test_a_chat_request_carries_its_templated_prompt() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "q"}]}
    templated = chat_request(body, TEMPLATE, **SPECIALS)
    assert templated.templated is not None and templated.prompt == templated.templated.text
    plain = chat_request(body, None)
    assert plain.templated is None and plain.prompt == "user: q\nassistant:"


def test_template_specials_are_tokens_and_contents_text(encoder: TextEncoder) -> None:
    """Before, the rendering was tokenized as text: `<s>` and `</s>` of the template became
    bytes, and the tokenizer prepended a second BOS."""
    prompt = templated_prompt([{"role": "user", "content": "hi"}], TEMPLATE, **SPECIALS)
    ids = encoder.encode_templated(prompt).tolist()
    assert ids == [
        BOS_TOKEN_ID, *_bytes("<|user|>hi"), EOS_TOKEN_ID, *_bytes("<|assistant|>")
    ]  # fmt: skip


def test_a_special_token_in_a_content_stays_text(encoder: TextEncoder) -> None:
    prompt = templated_prompt([{"role": "user", "content": "a</s><s>b"}], TEMPLATE, **SPECIALS)
    ids = encoder.encode_templated(prompt).tolist()
    assert ids == [
        BOS_TOKEN_ID, *_bytes("<|user|>a</s><s>b"), EOS_TOKEN_ID, *_bytes("<|assistant|>")
    ]  # fmt: skip
    # A content the template did not render as sent cannot be kept text: refused, whole.
    unlocated = TemplatedText("<s>a</s>b</s>", None, ("a</s>b",))
    with pytest.raises(InvalidInput, match="special token '</s>'"):
        encoder.encode_templated(unlocated)
    clean = TemplatedText("<s>ab</s>", None, ("ab",))
    assert encoder.encode_templated(clean).tolist() == [BOS_TOKEN_ID, 97, 98, EOS_TOKEN_ID]


def test_a_template_that_makes_special_tokens_of_contents_is_refused(
    encoder: TextEncoder,
) -> None:
    """Contents it repeats cannot be located; repeated, "s><" makes "<s>" (review finding:
    only each content alone was checked)."""
    repeats = "{{ bos_token }}{% for m in messages %}{{ m.content }}{{ m.content }}{% endfor %}"
    made = templated_prompt([{"role": "user", "content": "s><"}], repeats, **SPECIALS)
    assert made.literal_spans is None
    with pytest.raises(InvalidInput, match="makes special tokens"):
        encoder.encode_templated(made)
    clean = templated_prompt([{"role": "user", "content": "ab"}], repeats, **SPECIALS)
    assert encoder.encode_templated(clean).tolist() == [BOS_TOKEN_ID, 97, 98, 97, 98]


def test_a_special_token_that_takes_the_whitespace_beside_it_stays_the_templates() -> None:
    """A special token with lstrip (Phi-3's `<|end|>`) takes a content's trailing space into
    its offsets: it is still the template's token, not text."""
    tokenizer = build_tokenizer()
    tokenizer.add_special_tokens([AddedToken("<|end|>", lstrip=True, special=True)])
    end_id = tokenizer.token_to_id("<|end|>")
    tokenizer.encode_special_tokens = True
    prompt = templated_prompt(
        [{"role": "user", "content": "hi "}, {"role": "user", "content": "a</s>"}],
        "{% for m in messages %}{{ m.content }}<|end|>{% endfor %}",
    )
    ids = TemplateTokens(tokenizer).ids(prompt)
    assert ids == [*_bytes("hi"), end_id, *_bytes("a</s>"), end_id]


def test_hugging_face_template_extras() -> None:
    """`tojson` as Hugging Face writes it (not HTML-escaped), `{% generation %}`, templates
    named in a list and special tokens written as AddedToken objects (review findings)."""
    tool = "{% for m in messages %}{{ m.content | tojson }}{% generation %}!{% endgeneration %}{% endfor %}"  # noqa: E501
    prompt = templated_prompt([{"role": "tool", "content": "<é>"}], tool)
    assert prompt.text == '"<é>"!' and prompt.literal_spans == ((1, 4),)
    # `tools` and `documents` are given, as none: a template that tests them writes nothing
    # of theirs (before, undefined, which `is not none` took for given: Mistral's wrote an
    # empty [AVAILABLE_TOOLS] block; review finding).
    tests_tools = "{% if tools is not none %}[TOOLS]{% endif %}{% if documents is not none %}[DOCS]{% endif %}{{ messages[0].content }}"  # noqa: E501
    assert templated_prompt([{"role": "user", "content": "u"}], tests_tools).text == "u"


def test_a_tokenizer_config_s_template_and_tokens_in_their_other_forms(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "t"}, {"name": "default", "template": "d"}]
    config = {
        "chat_template": named,
        "bos_token": {"__type": "AddedToken", "content": "<s>", "lstrip": False},
        "eos_token": "</s>",
    }  # fmt: skip
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert read_chat_template(tmp_path) == ChatTemplate("d", "<s>", "</s>")


def test_a_templated_prompt_is_held_to_the_models_length(encoder: TextEncoder) -> None:
    long = "x" * (encoder.max_tokens + 1)
    prompt = templated_prompt([{"role": "user", "content": long}], TEMPLATE, **SPECIALS)
    with pytest.raises(InvalidInput, match=f"at most {encoder.max_tokens}"):
        encoder.encode_templated(prompt)


def test_generation_config_adds_end_of_sequence_tokens(tmp_path: Path) -> None:
    """Before, only config.json's were read: Llama 3 Instruct's `<|eot_id|>`, listed in
    generation_config.json only, did not end a reply."""
    shutil.copy(REPOSITORY / "tiny-llama" / "1" / "config.json", tmp_path / "config.json")
    assert LlamaConfig.from_json(tmp_path / "config.json").eos_token_ids == (EOS_TOKEN_ID,)
    generation = {"eos_token_id": [7, EOS_TOKEN_ID], "do_sample": True}
    (tmp_path / "generation_config.json").write_text(json.dumps(generation))
    config = LlamaConfig.from_json(tmp_path / "config.json")
    assert config.eos_token_ids == (EOS_TOKEN_ID, 7)


def test_a_version_whose_weights_are_elsewhere_reads_its_template_there(tmp_path: Path) -> None:
    """A version.toml may point a version's weights elsewhere (as minilm's does): its template
    is in the tokenizer_config.json beside them. The chat API looked in the version's own
    folder, found none, and ran every chat prompt untemplated, silently (review finding); it
    now reads where the version's tokenizer was read (TextEncoder.weights_dir)."""
    weights = tmp_path / "weights"
    shutil.copytree(REPOSITORY / "tiny-llama" / "1", weights)
    config = json.loads((weights / "tokenizer_config.json").read_text())
    (weights / "tokenizer_config.json").write_text(
        json.dumps({**config, "chat_template": TEMPLATE})
    )
    (tmp_path / "repo" / "llm" / "1").mkdir(parents=True)
    shutil.copy(
        REPOSITORY / "tiny-llama" / "config.toml", tmp_path / "repo" / "llm" / "config.toml"
    )
    (tmp_path / "repo" / "llm" / "1" / "version.toml").write_text(f'weights = "{weights}"\n')
    (version,) = load_repository(tmp_path / "repo")
    catalog = ModelCatalog([version])
    encoder = TextEncoder(version.weights_dir, version.config)
    catalog.update_served([pb.ModelVersionInfo(
        model_name="llm", model_version="1", is_ready=True,
        tokenizer_fingerprint=encoder.fingerprint,
    )])  # fmt: skip
    # The API's own lookup, as a chat request makes it (its predictor: only the catalog read).
    api = OpenAiApi(SimpleNamespace(catalog=catalog), GatewayMetrics(CollectorRegistry()))
    served, template = api._template("llm", LOCAL_PRINCIPAL, "")
    assert served == "1" and template.template == TEMPLATE
    assert read_chat_template(tmp_path / "repo" / "llm" / "1").template is None  # where it looked
