"""KServe v2 REST on the gateway's HTTP port, end to end: the stock `tritonclient.http`
client (health, metadata, JSON and binary infer, config, statistics after traffic), the same
embeddings as gRPC, and the HTTP statuses of refused calls (401, 404, 400) in KServe's
{"error": ...} body; Triton's generate extension, whole and streamed (SSE)."""

from __future__ import annotations

import json
import subprocess
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.support.keys import write_keys_with_tight_tenant
from tests.support.kserve import TRITON_PYTHON, run_kserve_client
from tests.support.processes import REPO_ROOT
from tests.support.stack import Stack, start_stack

pytestmark = pytest.mark.e2e

API_KEY = "rest-test-key"
#: A tenant with a quota of one request per 100 s.
TIGHT_KEY = "tight-test-key"
HTTP_CLIENT = REPO_ROOT / "tests" / "support" / "kserve_http_client.py"
TEXTS = ["hello world", "a second text"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("rest")
    keys = write_keys_with_tight_tenant(
        tmp / "api-keys.toml", tenant="rest", key=API_KEY, tight_key=TIGHT_KEY
    )
    stack = start_stack(tmp, extra_gateway_args=(f"--api-keys-file={keys}",))
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def call(
    stack: Stack, path: str, body: bytes | None = None, *, key: str | None = API_KEY,
    headers: dict[str, str] | None = None,
) -> tuple[int, dict[str, str], bytes]:  # fmt: skip
    """(status, headers, body) of one HTTP call; errors are answers too."""
    request = urllib.request.Request(stack.gateway.http_url + path, data=body,
                                     headers=dict(headers or {}))  # fmt: skip
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, dict(response.headers), response.read()
    except urllib.error.HTTPError as error:
        return error.code, dict(error.headers), error.read()


def triton_http_report(stack: Stack, key: str) -> dict[str, Any]:
    completed = subprocess.run(
        [str(TRITON_PYTHON), str(HTTP_CLIENT), "--url", f"127.0.0.1:{stack.gateway.http_port}",
         "--model", "minilm", "--api-key", key, *TEXTS],
        capture_output=True, text=True, timeout=180, check=False, cwd=REPO_ROOT,
    )  # fmt: skip
    assert completed.returncode == 0, completed.stderr
    return json.loads(completed.stdout)


def test_stock_triton_http_client_speaks_to_the_rest_port(stack: Stack) -> None:
    report = triton_http_report(stack, API_KEY)
    assert report["live"] and report["ready"] and report["model_ready"]
    assert report["server_metadata"]["name"] == "inference-fabric"
    assert {"statistics", "binary_tensor_data"} <= set(report["server_metadata"]["extensions"])
    metadata = report["model_metadata"]
    assert metadata["name"] == "minilm"
    assert metadata["inputs"] == [{"name": "text", "datatype": "BYTES", "shape": [-1]}]
    assert metadata["outputs"][0]["shape"] == [-1, 384]
    embeddings, binary = report["json"], report["binary"]
    assert len(embeddings) == 2 and len(embeddings[0]) == 384
    np.testing.assert_allclose(binary, embeddings, atol=1e-5)
    assert not np.allclose(embeddings[0], embeddings[1], atol=1e-3)
    # The gRPC port answers the same texts with the same embeddings.
    grpc_report = run_kserve_client(
        stack.gateway.address, "--model", "minilm", "--api-key", API_KEY, *TEXTS
    )
    np.testing.assert_allclose(grpc_report["embeddings"], embeddings, atol=1e-4)
    config = report["config"]
    assert config["name"] == "minilm" and config["max_batch_size"] > 0
    assert config["input"][0]["name"] == "text" and config["input"][0]["data_type"] == "TYPE_STRING"
    # Numbers, as Triton writes them (protobuf's JSON writes int64 dims as strings).
    assert config["output"][0]["dims"] == [384]
    (stats,) = report["statistics"]["model_stats"]
    # Two infers of two rows each went before the statistics were read.
    assert stats["name"] == "minilm" and stats["inference_count"] >= 4
    assert stats["inference_stats"]["success"]["count"] >= 2
    assert stats["inference_stats"]["success"]["ns"] > 0
    assert report["unknown_model"]["status"] == "404"


def test_infer_json_matches_the_binary_extension(stack: Stack) -> None:
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
    status, _, answer = call(stack, "/v2/models/minilm/infer", json.dumps(body).encode())
    assert status == 200, answer
    (output,) = json.loads(answer)["outputs"]
    assert output["name"] == "embedding" and output["shape"] == [1, 384]
    body["parameters"] = {"binary_data_output": True}
    status, headers, answer = call(stack, "/v2/models/minilm/infer", json.dumps(body).encode())
    assert status == 200
    header_length = int(headers["Inference-Header-Content-Length"])
    header = json.loads(answer[:header_length])
    assert header["outputs"][0]["parameters"]["binary_data_size"] == 384 * 4
    assert len(answer) == header_length + 384 * 4


def test_refusals_have_their_http_status_and_a_json_error(stack: Stack) -> None:
    status, _, body = call(stack, "/v2/models/minilm", key=None)
    assert status == 401 and "API key" in json.loads(body)["error"]
    status, _, body = call(stack, "/v2/models/minilm", key="wrong")
    assert status == 401
    status, _, body = call(stack, "/v2/models/no-such-model")
    assert status == 404 and "no-such-model" in json.loads(body)["error"]
    status, _, body = call(stack, "/v2/models/minilm/infer", b"{not json")
    assert status == 400 and "JSON" in json.loads(body)["error"]
    bad_shape = {"inputs": [{"name": "text", "datatype": "FP32", "shape": [1], "data": [1.0]}]}
    status, _, body = call(stack, "/v2/models/minilm/infer", json.dumps(bad_shape).encode())
    assert status == 400 and "BYTES" in json.loads(body)["error"]
    # Probes need no key.
    assert call(stack, "/v2/health/live", key=None)[0] == 200


def test_answers_carry_the_callers_request_id_and_a_405_names_the_allowed_methods(
    stack: Stack,
) -> None:
    for path, expected in (("/v2/models/minilm", 200), ("/v2/models/no-such-model", 404)):
        status, headers, _ = call(stack, path, headers={"X-Request-Id": f"req {path}"})
        assert status == expected
        assert {k.lower(): v for k, v in headers.items()}["x-request-id"] == f"req {path}"
    _, headers, _ = call(stack, "/v2/models/minilm")  # none sent: none answered
    assert "x-request-id" not in {k.lower() for k in headers}
    status, headers, body = call(stack, "/v2/health/live", b"{}")  # POST to a GET route
    assert status == 405 and "error" in json.loads(body)
    assert "GET" in {k.lower(): v for k, v in headers.items()}["allow"]


def test_generate_extension_whole_and_streamed(stack: Stack) -> None:
    body = {"text_input": "Hello", "parameters": {"max_tokens": 5, "temperature": 0}}
    status, _, answer = call(stack, "/v2/models/tiny-llama/generate", json.dumps(body).encode())
    assert status == 200, answer
    whole = json.loads(answer)
    assert whole["model_name"] == "tiny-llama" and whole["text_output"].startswith("Hello")
    assert whole["completion_tokens"] == 5 and whole["finish_reason"] == "length"
    status, headers, answer = call(
        stack, "/v2/models/tiny-llama/generate_stream", json.dumps(body).encode()
    )
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: ") :]) for line in answer.decode().split("\n\n") if line]
    assert events[-1]["finish_reason"] == "length" and events[-1]["completion_tokens"] == 5
    streamed = "".join(e["text_output"] for e in events)
    assert "Hello" + streamed == whole["text_output"]


def test_bad_sampling_parameter_is_a_400(stack: Stack) -> None:
    body = {"text_input": "Hello", "parameters": {"max_tokenz": 5}}
    status, _, answer = call(stack, "/v2/models/tiny-llama/generate", json.dumps(body).encode())
    assert status == 400 and "max_tokenz" in json.loads(answer)["error"]


@pytest.mark.parametrize(
    ("parameters", "named"),
    [
        # Each but "2.7" was served: 0 read as the default (16 tokens, top_p 1), 2.7 cut to 2,
        # true taken for 1, a mapping's keys taken for stop strings, "false" for true.
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 3, "top_p": 0}, "top_p"),
        ({"max_tokens": 2.7}, "max_tokens"),
        ({"max_tokens": "2.7"}, "max_tokens"),
        ({"max_tokens": True}, "max_tokens"),
        ({"max_tokens": 3, "stop": {"a": 1}}, "stop"),
        ({"max_tokens": 3, "exclude_input_in_output": "false"}, "exclude_input_in_output"),
    ],
)
def test_sampling_values_of_the_wrong_kind_are_a_400(
    stack: Stack, parameters: dict, named: str
) -> None:
    body = {"text_input": "Hello", "parameters": parameters}
    status, _, answer = call(stack, "/v2/models/tiny-llama/generate", json.dumps(body).encode())
    assert status == 400, answer
    assert named in json.loads(answer)["error"]


def test_sampling_numbers_written_as_strings_are_taken(stack: Stack) -> None:
    """As Triton's vLLM backend's clients send them: `"3"`, `"0"`, `"1.0"`."""
    body = {"text_input": "Hello",
            "parameters": {"max_tokens": "3", "temperature": "0", "top_p": "1.0"}}  # fmt: skip
    status, _, answer = call(stack, "/v2/models/tiny-llama/generate", json.dumps(body).encode())
    assert status == 200, answer
    assert json.loads(answer)["completion_tokens"] == 3


def test_generate_stream_with_null_parameters_still_streams(stack: Stack) -> None:
    """`"parameters": null` is no parameters: the stream endpoint streams (before, it sent one
    event with the whole text)."""
    body = {"text_input": "Hello", "parameters": None}
    status, _, answer = call(
        stack, "/v2/models/tiny-llama/generate_stream", json.dumps(body).encode()
    )
    assert status == 200, answer
    events = [json.loads(line[len("data: ") :]) for line in answer.decode().split("\n\n") if line]
    assert len(events) > 1 and events[-1]["finish_reason"]
    assert not events[0]["text_output"].startswith("Hello")  # tokens, not prompt and all


def test_tenant_quota_refusal_is_a_429_with_retry_after(stack: Stack) -> None:
    body = json.dumps(
        {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["hi"]}]}
    ).encode()
    # Metadata calls are never counted against the quota.
    assert call(stack, "/v2/models/minilm", key=TIGHT_KEY)[0] == 200
    assert call(stack, "/v2/models/minilm/infer", body, key=TIGHT_KEY)[0] == 200
    status, headers, answer = call(stack, "/v2/models/minilm/infer", body, key=TIGHT_KEY)
    assert status == 429, answer
    assert int(headers["Retry-After"]) >= 1 and json.loads(answer)["error"]


def test_metadata_and_statistics_take_a_version_as_every_route_does(stack: Stack) -> None:
    # Before, they compared the path's string: "01" was not "1", so 404 where /ready and
    # /infer with the same version answered.
    for version in ("1", "01", "stable"):
        status, _, body = call(stack, f"/v2/models/minilm/versions/{version}")
        assert status == 200, body
        status, _, body = call(stack, f"/v2/models/minilm/versions/{version}/stats")
        assert status == 200, body
        assert [s["version"] for s in json.loads(body)["model_stats"]] == ["1"]
    assert call(stack, "/v2/models/minilm/versions/7")[0] == 404
