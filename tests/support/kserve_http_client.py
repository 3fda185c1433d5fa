"""Drives a server's KServe v2 REST port with the stock Triton HTTP client
(`tritonclient.http`), to prove wire compatibility; runs under `.venv-triton` (see
tests/support/kserve.py) and imports nothing from this repository. Prints one JSON object:

    python tests/support/kserve_http_client.py --url 127.0.0.1:PORT --model minilm \
        [--api-key K] TEXT...

with liveness, readiness, server and model metadata, the `embedding` output for the texts sent
as JSON and as binary tensors, then the model's config and statistics (read after that traffic).
"""

import argparse
import json
import sys

import numpy as np
import tritonclient.http as httpclient
from tritonclient.utils import InferenceServerException

INPUT_NAME = "text"
OUTPUT_NAME = "embedding"


def infer(client, model: str, texts: list[str], *, binary: bool, headers: dict) -> list:
    """Embeddings of `texts`, inputs and outputs sent as binary tensors or as JSON."""
    tensor = httpclient.InferInput(INPUT_NAME, [len(texts)], "BYTES")
    tensor.set_data_from_numpy(np.array([t.encode() for t in texts], dtype=object), binary)
    output = httpclient.InferRequestedOutput(OUTPUT_NAME, binary_data=binary)
    result = client.infer(model, [tensor], outputs=[output], headers=headers)
    return result.as_numpy(OUTPUT_NAME).tolist()


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", required=True, help="host:port of the HTTP endpoint")
    parser.add_argument("--model", required=True)
    parser.add_argument("--api-key", help="sent as `Authorization: Bearer KEY`")
    parser.add_argument("texts", nargs="+")
    args = parser.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    client = httpclient.InferenceServerClient(args.url)
    report = {
        "live": client.is_server_live(headers=headers),
        "ready": client.is_server_ready(headers=headers),
        "model_ready": client.is_model_ready(args.model, headers=headers),
        "server_metadata": client.get_server_metadata(headers=headers),
        "model_metadata": client.get_model_metadata(args.model, headers=headers),
        "json": infer(client, args.model, args.texts, binary=False, headers=headers),
        "binary": infer(client, args.model, args.texts, binary=True, headers=headers),
        "config": client.get_model_config(args.model, headers=headers),
        "statistics": client.get_inference_statistics(args.model, headers=headers),
    }
    try:
        client.get_model_metadata("no-such-model", headers=headers)
        report["unknown_model"] = None
    except InferenceServerException as error:
        report["unknown_model"] = {"status": error.status(), "message": error.message()}
    print(json.dumps(report))


if __name__ == "__main__":
    main(sys.argv[1:])
