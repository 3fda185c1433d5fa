"""Generation end to end through `make run`'s stack (default repository: tiny-llama)."""

from __future__ import annotations

import asyncio
import json
import struct
import sys
from collections.abc import AsyncIterator, Iterator

import grpc
import pytest

from services.common import metric_names as names
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import grpc_service_pb2_grpc as kserve_grpc
from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc
from services.pb.inference.v1 import worker_pb2 as pb
from tests.support.generation_cancel import cancel_before_the_end
from tests.support.kserve import run_kserve_client
from tests.support.metrics import scrape, total
from tests.support.stack import Stack, start_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    stack = start_stack(tmp_path_factory.mktemp("generation"))
    yield stack
    assert stack.stop() == 0, stack.stop_report()


def generate_request(prompt: str, **sampling: object) -> api.GenerateRequest:
    return api.GenerateRequest(
        model_name="tiny-llama", prompt=prompt, sampling=pb.SamplingParameters(**sampling)
    )


async def stream(
    stub: api_grpc.InferenceServiceStub, request: api.GenerateRequest
) -> list[pb.GenerateResponse]:
    return [m async for m in stub.Generate(request, timeout=60)]


async def test_s19_generate_streams_tokens_with_a_final_summary(stack: Stack) -> None:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        first, second = await asyncio.gather(
            *(
                stream(stub, generate_request("Once upon a time", max_tokens=12, ignore_eos=True))
                for _ in range(2)
            )
        )
    tokens = [t for m in first for t in m.token_ids]
    assert len(tokens) == 12 and len(first) >= 2, "tokens must arrive over several messages"
    assert [m.finish_reason for m in first[:-1]] == [pb.FINISH_REASON_UNSPECIFIED] * (
        len(first) - 1
    )
    final = first[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    assert final.completion_tokens == 12 and final.prompt_tokens == len("Once upon a time") + 1
    assert tokens == [t for m in second for t in m.token_ids], "greedy is deterministic"


async def test_stock_triton_client_streams_from_tiny_llama(stack: Stack) -> None:
    def streamed() -> float:  # the gateway's count of the stream's generation requests
        return total(
            scrape(stack.gateway.metrics_port), names.GATEWAY_REQUESTS_TOTAL,
            api="kserve_v2_stream", model="tiny-llama", code="OK",
        )  # fmt: skip

    before = streamed()
    sampling = json.dumps({"max_tokens": 10, "temperature": 0, "ignore_eos": True})
    result = await asyncio.to_thread(
        run_kserve_client,
        stack.gateway.address,
        "--model",
        "tiny-llama",
        "--generate",
        sampling,
        "Hello",
    )
    assert "error" not in result, result
    assert len(result["chunks"]) >= 2, result
    assert result["final"]["finish_reason"] == "length"
    assert result["final"]["completion_tokens"] == 10
    assert result["final"]["id"] == "gen-1"
    # The inputs it took are the ones the model declares, three of them optional, as Triton
    # declares a vLLM model's (a client that builds requests from metadata finds them).
    assert result["declared"] == {
        "inputs": [
            ["text_input", "BYTES"],
            ["stream", "BOOL"],
            ["exclude_input_in_output", "BOOL"],
            ["sampling_parameters", "BYTES"],
        ],
        "optional": ["stream", "exclude_input_in_output", "sampling_parameters"],
    }
    # Counted once, as its stream ended (it was not counted).
    await eventually(lambda: streamed() == before + 1, message="the stream's request counted")
    # stream=false: one final response with the whole text, prompt included.
    whole = await asyncio.to_thread(
        run_kserve_client,
        stack.gateway.address,
        "--model",
        "tiny-llama",
        "--generate",
        sampling,
        "--no-stream",
        "Hello",
    )
    assert len(whole["chunks"]) == 1 and whole["chunks"][0].startswith("Hello")


async def test_s10_cancel_at_the_gateway_stops_the_worker(stack: Stack) -> None:
    worker = stack.workers[0]

    def worker_total(name: str) -> float:
        return total(scrape(worker.metrics_port), name)

    async def start_and_cancel() -> None:
        async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
            stub = api_grpc.InferenceServiceStub(channel)
            call = stub.Generate(
                generate_request("cancel me", max_tokens=400, ignore_eos=True), timeout=60
            )
            async for _ in call:
                break
            call.cancel()

    # The cancel travels gateway -> router -> worker asynchronously (30 s: three processes on
    # a loaded machine).
    await cancel_before_the_end(start_and_cancel, worker_total, timeout_s=30.0)
    # Its blocks are free once the engine's loop next turns (the cancel is counted at once).
    await eventually(lambda: worker_total(names.GENERATION_KV_BLOCKS_USED) == 0)
    assert worker_total(names.GENERATION_KV_BLOCKS_FREE) > 0


@pytest.mark.parametrize(
    ("request_", "message"),
    [
        (generate_request("hi", max_tokens=100_000), "maximum length"),
        (generate_request("hi", temperature=-1.0), "temperature"),
        (generate_request("hi", temperature=1e-45), "temperature"),
        (generate_request("hi", stop=["x" * 100_000]), "stop strings"),
        (generate_request("hi", top_p=1.5), "top_p"),
        (generate_request(""), "empty"),
        (api.GenerateRequest(model_name="minilm", prompt="hi"), "not a generation model"),
    ],
)
async def test_s38_bad_generation_input_is_invalid_argument(
    stack: Stack, request_, message: str
) -> None:
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stream(stub, request_)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert message in raised.value.details()


async def test_s38_predict_on_a_generation_model_is_refused_at_the_gateway(stack: Stack) -> None:
    rows_before = total(scrape(stack.workers[0].metrics_port), names.WORKER_REQUESTS_TOTAL)
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await stub.Predict(
                api.PredictRequest(model_name="tiny-llama", inputs=[api.PredictInput(text="x")]),
                timeout=10,
            )
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "call Generate" in raised.value.details()
    assert total(scrape(stack.workers[0].metrics_port), names.WORKER_REQUESTS_TOTAL) == rows_before


def _kserve_generate(
    *tensors: tuple[str, bytes], raw: bool = True, drop_raw: int = 0
) -> kserve.ModelInferRequest:
    """A ModelStreamInfer request for tiny-llama with BYTES scalars (raw_input_contents, or
    `contents` when `raw` is false); `drop_raw` leaves out that many trailing raw entries."""
    request = kserve.ModelInferRequest(model_name="tiny-llama", id=f"r{len(tensors)}{drop_raw}")
    for name, value in tensors:
        tensor = request.inputs.add(name=name, datatype="BYTES", shape=[1])
        if raw:
            request.raw_input_contents.append(struct.pack("<I", len(value)) + value)
        else:
            tensor.contents.bytes_contents.append(value)
    del request.raw_input_contents[len(request.raw_input_contents) - drop_raw :]
    return request


async def test_s39_malformed_stream_requests_each_get_an_error_and_the_stream_ends(
    stack: Stack,
) -> None:
    # Issue 16: errors other than the fabric's own killed the request's task without an answer,
    # and ModelStreamInfer never ended.
    prompt = ("text_input", b"hello")
    cases = {
        "short raw": _kserve_generate(prompt, ("sampling_parameters", b"{}"), drop_raw=1),
        "1e999": _kserve_generate(prompt, ("sampling_parameters", b'{"max_tokens": 1e999}')),
        "nested": _kserve_generate(prompt, ("sampling_parameters", b"[" * 5000 + b"]" * 5000)),
        "duplicate": _kserve_generate(prompt, prompt),
        # Each ran with the defaults (16 tokens, greedy), the field dropped without a word.
        "max_tokens tensor": _kserve_generate(prompt),
        "temperature parameter": _kserve_generate(prompt),
        "unknown output": _kserve_generate(prompt),
    }
    tensor = cases["max_tokens tensor"].inputs.add(name="max_tokens", datatype="INT32", shape=[1])
    tensor.contents.int_contents.append(64)
    del cases["max_tokens tensor"].raw_input_contents[:]
    cases["max_tokens tensor"].inputs[0].contents.bytes_contents.append(b"hello")
    cases["temperature parameter"].parameters["temperature"].double_param = 0.7
    cases["unknown output"].outputs.add(name="text")
    for name, request in cases.items():
        request.id = name
    both = _kserve_generate(prompt)
    both.inputs[0].contents.bytes_contents.append(b"hello")
    both.id = "raw and contents"
    requests = [*cases.values(), both]

    async def send() -> AsyncIterator[kserve.ModelInferRequest]:
        for request in requests:
            yield request

    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        responses = [r async for r in stub.ModelStreamInfer(send(), timeout=30)]
    errors = {r.infer_response.id: r.error_message for r in responses}
    assert set(errors) == {r.id for r in requests}
    assert all(message.startswith("INVALID_ARGUMENT") for message in errors.values()), errors
    assert "raw_input_contents" in errors["short raw"]
    assert "given more than once" in errors["duplicate"]
    assert "exclusive" in errors["raw and contents"]
    assert "input(s) ['max_tokens'] not taken" in errors["max_tokens tensor"]
    assert "parameter(s) ['temperature'] not taken" in errors["temperature parameter"]
    assert "output(s) ['text'] not taken" in errors["unknown output"]


async def test_a_stream_asking_for_an_empty_final_response_is_served(stack: Stack) -> None:
    """tritonclient's `async_stream_infer(enable_empty_final_response=True)` sends the request
    parameter `triton_enable_empty_final_response`: taken (the last response always says it
    is the last), not refused as a parameter a generation model does not read."""
    request = _kserve_generate(
        ("text_input", b"hello"), ("sampling_parameters", b'{"max_tokens": 3}')
    )
    request.parameters["triton_enable_empty_final_response"].bool_param = True

    async def send() -> AsyncIterator[kserve.ModelInferRequest]:
        yield request

    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        responses = [r async for r in stub.ModelStreamInfer(send(), timeout=60)]
    assert [r.error_message for r in responses] == [""] * len(responses)
    assert responses[-1].infer_response.parameters["triton_final_response"].bool_param
    # Each names the version that served it, not the "" asked for.
    assert {r.infer_response.model_version for r in responses} == {"1"}


async def test_the_command_line_client_streams_a_generation(stack: Stack) -> None:
    """`python -m services.client generate` (the slim client package's CLI) streams the same
    greedy tokens the gRPC API returns, and ends with the finish reason and counts."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "services.client", "--address", stack.gateway.address,
        "generate", "Once upon a time", "--max-tokens", "12", "--json",
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    stdout, stderr = await asyncio.wait_for(process.communicate(), timeout=120)
    assert process.returncode == 0, stderr.decode()
    chunks = [json.loads(line) for line in stdout.decode().splitlines()]
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        request = generate_request("Once upon a time", max_tokens=12)
        expected = await stream(api_grpc.InferenceServiceStub(channel), request)
    assert [t for c in chunks for t in c["token_ids"]] == [t for m in expected for t in m.token_ids]
    assert chunks[-1]["finish_reason"] in ("length", "stop")
    assert chunks[-1]["completion_tokens"] == expected[-1].completion_tokens
    assert chunks[-1]["prompt_tokens"] == expected[-1].prompt_tokens


async def test_a_shared_system_prompt_is_prefilled_once(stack: Stack) -> None:
    """Two requests that start with the same 64-character system prompt: the second shares the
    first's KV blocks for it (the worker's prefix-cache hit counter moves by those tokens), and
    a greedy reply is the same either way."""
    system = f"{'You are the fabric test assistant; answer in one short line.':<64}"
    prompts = [system + "Who are you?", system + "What is batching?"]
    port = stack.workers[0].metrics_port
    hits_before = total(scrape(port), names.GENERATION_PREFIX_CACHE_HIT_TOKENS_TOTAL)
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        replies = []
        for prompt in (*prompts, prompts[0]):
            messages = await stream(stub, generate_request(prompt, max_tokens=6, ignore_eos=True))
            replies.append([t for m in messages for t in m.token_ids])
    hits = total(scrape(port), names.GENERATION_PREFIX_CACHE_HIT_TOKENS_TOTAL) - hits_before
    # [BOS] + 64 characters: 4 full blocks of 16 shared by the second prompt, and the third
    # (the first again) finds all but the block holding its last token.
    full_blocks_of_first = (1 + len(prompts[0]) - 1) // 16
    assert hits == 16 * 4 + 16 * full_blocks_of_first, hits
    assert replies[2] == replies[0] and len(replies[0]) == 6


TALLY_PROMPT = "Tally me"


async def test_model_statistics_count_generations_and_their_failures(stack: Stack) -> None:
    """A generation is one request of one row in Triton's ModelStatistics (a decoupled model);
    one refused at the gateway after its version resolved counts as a failure of that version.
    The worker charges the caller's tenant the tokens it computed and their step time."""
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        kserve_stub = kserve_grpc.GRPCInferenceServiceStub(channel)
        stats_request = kserve.ModelStatisticsRequest(name="tiny-llama")

        async def statistics() -> kserve.ModelStatistics:
            response = await kserve_stub.ModelStatistics(stats_request, timeout=10)
            (stats,) = [s for s in response.model_stats if s.version == "1"]
            return stats

        before = await statistics()
        worker_port = stack.workers[0].metrics_port
        tokens_before = total(scrape(worker_port), names.WORKER_TENANT_TOKENS_TOTAL)
        compute_before = total(scrape(worker_port), names.WORKER_TENANT_COMPUTE_SECONDS_TOTAL)
        stub = api_grpc.InferenceServiceStub(channel)
        # Shorter than a KV block (16 tokens), so the prefix cache never holds any of it: every
        # prompt token is computed, and charged, for each of the three.
        await asyncio.gather(
            *(
                stream(stub, generate_request(TALLY_PROMPT, max_tokens=4, ignore_eos=True))
                for _ in range(3)
            )
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stream(stub, generate_request("Once upon a time", max_tokens=10**6))
        after = await statistics()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    success, fail = after.inference_stats.success, after.inference_stats.fail
    assert success.count - before.inference_stats.success.count == 3
    assert after.inference_count - before.inference_count == 3
    assert fail.count - before.inference_stats.fail.count == 1
    assert success.ns > before.inference_stats.success.ns
    assert after.last_inference >= before.last_inference and after.last_inference > 0
    # The worker charged the tenant for every prompt token and each decode step.
    metrics = scrape(worker_port)
    prompt_tokens = len(TALLY_PROMPT) + 1
    tokens = total(metrics, names.WORKER_TENANT_TOKENS_TOTAL) - tokens_before
    assert tokens == 3 * (prompt_tokens + 3), tokens
    assert total(metrics, names.WORKER_TENANT_COMPUTE_SECONDS_TOTAL) > compute_before
