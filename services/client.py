"""A small command-line client for the gateway's own API.

python -m services.client embed "some text" ["more text" ...]
python -m services.client models
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import grpc
import numpy as np

from services.pb.inference.v1 import inference_pb2 as api
from services.pb.inference.v1 import inference_pb2_grpc as api_grpc


def _metadata(api_key: str | None) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {api_key}"),) if api_key else ()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m services.client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--address",
        default=os.environ.get("FABRIC_ADDRESS", "127.0.0.1:8001"),
        help="gateway host:port (env FABRIC_ADDRESS)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get("FABRIC_API_KEY"),
        help="API key (env FABRIC_API_KEY); not needed in local mode",
    )
    parser.add_argument("--timeout-s", type=float, default=5.0)
    commands = parser.add_subparsers(dest="command", required=True)
    embed = commands.add_parser("embed", help="embed texts; prints one JSON line per text")
    embed.add_argument("texts", nargs="+")
    embed.add_argument("--model", default="minilm")
    embed.add_argument("--version", default="", help="number or label (default: stable)")
    embed.add_argument("--full", action="store_true", help="print whole vectors, not 8 values")
    commands.add_parser("models", help="list the models this key may use")
    return parser


def _print_models(stub: api_grpc.InferenceServiceStub, args: argparse.Namespace) -> None:
    reply = stub.ListModels(
        api.ListModelsRequest(), timeout=args.timeout_s, metadata=_metadata(args.api_key)
    )
    for model in reply.models:
        versions = [f"{v.model_version}@{v.fingerprint}" for v in model.versions]
        print(json.dumps({"name": model.name, "versions": versions, "labels": dict(model.labels)}))


def _print_embeddings(stub: api_grpc.InferenceServiceStub, args: argparse.Namespace) -> None:
    request = api.PredictRequest(
        model_name=args.model,
        model_version=args.version,
        inputs=[api.PredictInput(text=t) for t in args.texts],
    )
    reply = stub.Predict(request, timeout=args.timeout_s, metadata=_metadata(args.api_key))
    for text, tensor in zip(args.texts, reply.outputs, strict=True):
        vector = np.frombuffer(tensor.raw_data, dtype="<f4")
        shown = vector if args.full else vector[:8]
        print(
            json.dumps(
                {
                    "text": text,
                    "model": f"{reply.model_name}/{reply.model_version}",
                    "dims": len(vector),
                    "embedding": [round(float(x), 6) for x in shown],
                }
            )
        )


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    with grpc.insecure_channel(args.address) as channel:
        stub = api_grpc.InferenceServiceStub(channel)
        try:
            if args.command == "models":
                _print_models(stub, args)
            else:
                _print_embeddings(stub, args)
        except grpc.RpcError as error:
            print(f"error: {error.code().name}: {error.details()}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
