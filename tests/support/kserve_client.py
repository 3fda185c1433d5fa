"""Drives a server with the stock Triton gRPC client, to prove KServe v2 wire compatibility.

Runs under the separate `.venv-triton` interpreter (tritonclient brings its own generated
`inference` protos, which must not share a process with ours), so it imports nothing from this
repository. Prints exactly one JSON object on stdout:

    python tests/support/kserve_client.py --url 127.0.0.1:PORT --model minilm [--api-key K] TEXT...

prints liveness, readiness, server and model metadata, and the `embedding` output for the texts.
With `--introspect` it prints the model's config and statistics as JSON (as perf_analyzer reads
them) and the status of an RPC this server declares but does not serve.
With `--repository index|load|unload` it calls Triton's repository extension (--model names
the model to load or unload) and prints {"status": "OK" or the error status, "message", "index"}.
With `--stream` it sends each text as a request of its own on one ModelStreamInfer stream
(`async_stream_infer`), and one FP32 request beside them, and prints {"embeddings": {request id:
rows}, "errors": [messages]}.
With `--expect-error` it only sends the infer request and prints the error it got back
({"error_status": "StatusCode.INVALID_ARGUMENT", "message": ...}); exits 1 if the call succeeded.
"""

import argparse
import json
import queue
import sys

import numpy as np
import tritonclient.grpc as grpcclient
from tritonclient.utils import InferenceServerException, triton_to_np_dtype

INPUT_NAME = "text"
OUTPUT_NAME = "embedding"


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="host:port of the gRPC endpoint")
    parser.add_argument("--model", required=True, help="model name, for example minilm")
    parser.add_argument("--model-version", default="", help="empty lets the server choose")
    parser.add_argument("--api-key", help="sent as the `authorization: Bearer KEY` header")
    parser.add_argument(
        "--expect-error", action="store_true", help="only infer, and report the error status"
    )
    parser.add_argument(
        "--datatype",
        default="BYTES",
        help="datatype of the `text` input; anything but BYTES sends zeros of that type",
    )
    parser.add_argument("--timeout-s", type=float, default=60.0, help="per-call client timeout")
    parser.add_argument(
        "--priority", type=int, default=0, help="Triton's `priority` request parameter (0: default)"
    )
    parser.add_argument(
        "--server-timeout-us",
        type=int,
        default=None,
        help="Triton's `timeout` request parameter, microseconds (the server's own deadline)",
    )
    parser.add_argument(
        "--generate",
        metavar="SAMPLING_JSON",
        help="stream a generation (decoupled model) of the first text with these sampling "
        "parameters, as Triton's LLM backends are called; prints the chunks and the final flags",
    )
    parser.add_argument(
        "--stream",
        action="store_true",
        help="each text a request of its own on one ModelStreamInfer stream, and one FP32 "
        "request beside them; prints the embeddings by request id and the errors",
    )
    parser.add_argument("--no-stream", action="store_true", help="with --generate: stream=false")
    parser.add_argument(
        "--burst",
        type=int,
        metavar="N",
        help="send N single-text infers at once (texts cycled), then --sequential ones one by "
        "one; prints the status of every call",
    )
    parser.add_argument("--sequential", type=int, default=0, help="with --burst: calls after it")
    parser.add_argument(
        "--introspect",
        action="store_true",
        help="print get_model_config and get_inference_statistics (as JSON, as perf_analyzer "
        "reads them) and the status of an RPC the server does not implement",
    )
    parser.add_argument(
        "--repository",
        choices=("index", "load", "unload"),
        help="call RepositoryIndex, or RepositoryModelLoad / Unload of --model, and print the "
        "status (and the index)",
    )
    parser.add_argument("texts", nargs="*", help="input texts, one row each")
    return parser.parse_args(argv)


def make_input(texts: list[str], datatype: str) -> grpcclient.InferInput:
    """One `text` tensor of shape [N]; BYTES holds the UTF-8 texts, other types hold zeros."""
    infer_input = grpcclient.InferInput(INPUT_NAME, [len(texts)], datatype)
    if datatype == "BYTES":
        data = np.array([text.encode("utf-8") for text in texts], dtype=np.object_)
    else:
        data = np.zeros([len(texts)], dtype=triton_to_np_dtype(datatype))
    infer_input.set_data_from_numpy(data)
    return infer_input


def tensor_metadata(tensors) -> list[dict]:
    return [
        {"name": t.name, "datatype": t.datatype, "shape": [int(d) for d in t.shape]}
        for t in tensors
    ]


def infer(client, args: argparse.Namespace, headers: dict | None):
    return client.infer(
        args.model,
        inputs=[make_input(args.texts, args.datatype)],
        model_version=args.model_version,
        outputs=[grpcclient.InferRequestedOutput(OUTPUT_NAME)],
        headers=headers,
        client_timeout=args.timeout_s,
        priority=args.priority,
        timeout=args.server_timeout_us,
    )


def run_expect_error(client, args: argparse.Namespace, headers: dict | None) -> int:
    try:
        infer(client, args, headers)
    except InferenceServerException as error:
        print(json.dumps({"error_status": error.status(), "message": error.message()}))
        return 0
    print(json.dumps({"error_status": None, "message": "the call succeeded"}))
    return 1


def run_happy_path(client, args: argparse.Namespace, headers: dict | None) -> int:
    call = {"headers": headers, "client_timeout": args.timeout_s}
    live = client.is_server_live(**call)
    ready = client.is_server_ready(**call)
    model_ready = client.is_model_ready(args.model, args.model_version, **call)
    server = client.get_server_metadata(**call)
    model = client.get_model_metadata(args.model, args.model_version, **call)
    embeddings = infer(client, args, headers).as_numpy(OUTPUT_NAME)
    report = {
        "live": live,
        "ready": ready,
        "model_ready": model_ready,
        "server_metadata": {
            "name": server.name,
            "version": server.version,
            "extensions": list(server.extensions),
        },
        "model_metadata": {
            "name": model.name,
            "versions": list(model.versions),
            "platform": model.platform,
            "inputs": tensor_metadata(model.inputs),
            "outputs": tensor_metadata(model.outputs),
        },
        "embedding_shape": None if embeddings is None else list(embeddings.shape),
        "embeddings": None if embeddings is None else embeddings.tolist(),
    }
    print(json.dumps(report))
    return 0


def run_burst(client, args: argparse.Namespace, headers: dict | None) -> int:
    """N concurrent single-text infers (as many callers hitting a fresh server at once), then
    sequential ones; reports each call's status ("OK" or the gRPC status name) and message."""
    done: queue.Queue = queue.Queue()
    for i in range(args.burst):
        text = args.texts[i % len(args.texts)]
        client.async_infer(
            args.model,
            inputs=[make_input([text], args.datatype)],
            callback=lambda result, error, i=i: done.put((i, error)),
            model_version=args.model_version,
            outputs=[grpcclient.InferRequestedOutput(OUTPUT_NAME)],
            headers=headers,
            client_timeout=args.timeout_s,
        )
    burst = [None] * args.burst
    for _ in range(args.burst):
        i, error = done.get(timeout=args.timeout_s + 30)
        burst[i] = "OK" if error is None else f"{error.status()}: {error.message()}"
    sequential = []
    for i in range(args.sequential):
        text = args.texts[i % len(args.texts)]
        try:
            client.infer(
                args.model,
                inputs=[make_input([text], args.datatype)],
                model_version=args.model_version,
                headers=headers,
                client_timeout=args.timeout_s,
            )
            sequential.append("OK")
        except InferenceServerException as error:
            sequential.append(f"{error.status()}: {error.message()}")
    print(json.dumps({"burst": burst, "sequential": sequential}))
    return 0


def scalar(name: str, value, datatype: str) -> grpcclient.InferInput:
    tensor = grpcclient.InferInput(name, [1], datatype)
    tensor.set_data_from_numpy(np.array([value], dtype=triton_to_np_dtype(datatype)))
    return tensor


def run_generate(client, args: argparse.Namespace, headers: dict | None) -> int:
    """ModelStreamInfer with text_input / stream / sampling_parameters; collects responses
    until the one flagged triton_final_response. Reports too the inputs the model's metadata
    lists and those its configuration marks optional, as a client reads them before it
    builds a request."""
    call = {"headers": headers, "client_timeout": args.timeout_s}
    metadata = client.get_model_metadata(args.model, **call)
    config = client.get_model_config(args.model, **call).config
    declared = {
        "inputs": [[t.name, t.datatype] for t in metadata.inputs],
        "optional": [i.name for i in config.input if i.optional],
    }
    responses: queue.Queue = queue.Queue()
    client.start_stream(
        callback=lambda result, error: responses.put((result, error)), headers=headers
    )
    inputs = [
        scalar("text_input", args.texts[0].encode(), "BYTES"),
        scalar("stream", not args.no_stream, "BOOL"),
        scalar("sampling_parameters", args.generate.encode(), "BYTES"),
    ]
    client.async_stream_infer(model_name=args.model, inputs=inputs, request_id="gen-1")
    chunks, final = [], {}
    while True:
        result, error = responses.get(timeout=args.timeout_s)
        if error is not None:
            client.stop_stream()
            print(json.dumps({"error": str(error)}))
            return 0
        response = result.get_response()
        chunks.append(result.as_numpy("text_output")[0].decode("utf-8", errors="replace"))
        params = response.parameters
        if params["triton_final_response"].bool_param:
            final = {
                "id": response.id,
                "finish_reason": params["finish_reason"].string_param,
                "prompt_tokens": params["prompt_tokens"].int64_param,
                "completion_tokens": params["completion_tokens"].int64_param,
            }
            break
    client.stop_stream()
    print(json.dumps({"chunks": chunks, "final": final, "declared": declared}))
    return 0


def run_stream(client, args: argparse.Namespace, headers: dict | None) -> int:
    """A model that is not decoupled on ModelStreamInfer, as Triton serves it: one response per
    request; errors come in-band (the callback's `error`, with no request id)."""
    responses: queue.Queue = queue.Queue()
    client.start_stream(
        callback=lambda result, error: responses.put((result, error)), headers=headers
    )
    output = [grpcclient.InferRequestedOutput(OUTPUT_NAME)]
    for i, text in enumerate(args.texts):
        client.async_stream_infer(
            model_name=args.model,
            inputs=[make_input([text], "BYTES")],
            request_id=f"t{i}",
            outputs=output,
        )
    client.async_stream_infer(
        model_name=args.model, inputs=[make_input(["wrong"], "FP32")], request_id="wrong"
    )
    embeddings, errors = {}, []
    for _ in range(len(args.texts) + 1):
        result, error = responses.get(timeout=args.timeout_s)
        if error is not None:
            errors.append(error.message())
        else:
            embeddings[result.get_response().id] = result.as_numpy(OUTPUT_NAME).tolist()
    client.stop_stream()
    print(json.dumps({"embeddings": embeddings, "errors": errors}))
    return 0


def run_introspect(client, args: argparse.Namespace, headers: dict | None) -> int:
    """ModelConfig and ModelStatistics as perf_analyzer and genai-perf call them, and the
    answer to a repository RPC (declared by Triton's service, not served here), after one
    infer of the given texts (if any), so the statistics count at least that."""
    if args.texts:
        inputs = [make_input(args.texts, "BYTES")]
        client.infer(args.model, inputs, headers=headers, client_timeout=args.timeout_s)
    call = {"headers": headers, "client_timeout": args.timeout_s, "as_json": True}
    config = client.get_model_config(args.model, args.model_version, **call)
    statistics = client.get_inference_statistics(args.model, args.model_version, **call)
    try:
        client.get_system_shared_memory_status(headers=headers, client_timeout=args.timeout_s)
        unimplemented = {"status": None, "message": "the call succeeded"}
    except InferenceServerException as error:
        unimplemented = {"status": error.status(), "message": error.message()}
    print(json.dumps({"config": config, "statistics": statistics, "unimplemented": unimplemented}))
    return 0


def run_repository(client, args: argparse.Namespace, headers: dict | None) -> int:
    """Triton's repository extension as an operator's script calls it; prints the status
    ("OK" or the gRPC status) and, for `index`, the index as JSON."""
    call = {"headers": headers, "client_timeout": args.timeout_s}
    report = {"status": "OK", "message": ""}
    try:
        if args.repository == "load":
            client.load_model(args.model, **call)
        elif args.repository == "unload":
            client.unload_model(args.model, **call)
        else:
            index = client.get_model_repository_index(as_json=True, **call)
            report["index"] = index.get("models", [])
    except InferenceServerException as error:
        report = {"status": error.status(), "message": error.message()}
    print(json.dumps(report))
    return 0


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    headers = {"authorization": f"Bearer {args.api_key}"} if args.api_key else None
    client = grpcclient.InferenceServerClient(url=args.url)
    try:
        if args.generate is not None:
            return run_generate(client, args, headers)
        if args.stream:
            return run_stream(client, args, headers)
        if args.introspect:
            return run_introspect(client, args, headers)
        if args.repository is not None:
            return run_repository(client, args, headers)
        if args.burst is not None:
            return run_burst(client, args, headers)
        if args.expect_error:
            return run_expect_error(client, args, headers)
        return run_happy_path(client, args, headers)
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
