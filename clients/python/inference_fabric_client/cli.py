"""Command line for the gateway's public API.

    fabric-client embed "some text" ["more text" ...]
    fabric-client generate "Once upon a time" --max-tokens 32
    fabric-client models
    fabric-client job submit texts.jsonl | job status ID | job results ID --out FILE

(`python -m inference_fabric_client ...` and, in the server's checkout, `python -m
services.client ...` are the same program.) Settings also come from the environment:
FABRIC_ADDRESS, FABRIC_API_KEY, FABRIC_TLS, FABRIC_CA_FILE, FABRIC_SERVER_NAME.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from inference_fabric_client.client import Client
from inference_fabric_client.job_cli import add_job_commands, run_job_command
from inference_fabric_client.results import FabricError

#: How an environment variable says yes or no (any other value is refused).
_YES, _NO = {"1", "true", "yes", "on"}, {"", "0", "false", "no", "off"}


def _env_flag(name: str) -> bool:
    """A yes/no setting from the environment: FABRIC_TLS=true read as not "1" was plaintext,
    the API key sent in clear (review finding); a value it cannot read exits with the reason."""
    value = os.environ.get(name, "").strip().lower()
    if value not in _YES | _NO:
        # Status 2, a setting's (main's docstring); sys.exit with the text was status 1, as
        # for a call the gateway refused (review finding).
        print(f"fabric-client: error: {name} must be one of 1, true, yes, on, 0, false, no, off",
              file=sys.stderr)  # fmt: skip
        sys.exit(2)
    return value in _YES


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fabric-client",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    env = os.environ.get
    parser.add_argument("--address", default=env("FABRIC_ADDRESS", "127.0.0.1:8001"),
                        help="gateway host:port (env FABRIC_ADDRESS)")  # fmt: skip
    parser.add_argument("--api-key", default=env("FABRIC_API_KEY"),
                        help="API key (env FABRIC_API_KEY); not needed in local mode")  # fmt: skip
    parser.add_argument("--tls", action="store_true", default=_env_flag("FABRIC_TLS"),
                        help="use TLS (env FABRIC_TLS=1, true, yes or on)")  # fmt: skip
    parser.add_argument("--ca-file", default=env("FABRIC_CA_FILE"),
                        help="PEM roots to verify the gateway (default: the system's); "
                             "implies --tls")  # fmt: skip
    parser.add_argument("--server-name", default=env("FABRIC_SERVER_NAME"),
                        help="the name to check in the gateway's certificate, when the address "
                             "is another (a port-forward's 127.0.0.1; env FABRIC_SERVER_NAME); "
                             "implies --tls")  # fmt: skip
    parser.add_argument("--timeout-s", type=float, default=30.0, help="deadline of each call")
    parser.add_argument("--priority", choices=["critical", "interactive", "batch"],
                        help="priority class (default: the tenant's)")  # fmt: skip
    commands = parser.add_subparsers(dest="command", required=True)
    embed = commands.add_parser("embed", help="embed texts; prints one JSON line per text")
    embed.add_argument("texts", nargs="+")
    embed.add_argument("--model", default="minilm")
    embed.add_argument("--version", default="", help="number or label (default: stable)")
    embed.add_argument("--full", action="store_true", help="print whole vectors, not 8 values")
    generate = commands.add_parser("generate", help="stream a generation to stdout")
    generate.add_argument("prompt")
    generate.add_argument("--model", default="tiny-llama")
    generate.add_argument("--version", default="")
    generate.add_argument("--max-tokens", type=int, default=64)
    generate.add_argument("--temperature", type=float, default=0.0)
    generate.add_argument("--seed", type=int)
    generate.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    generate.add_argument("--json", action="store_true", help="one JSON line per chunk")
    commands.add_parser("models", help="list the models this key may use")
    add_job_commands(commands)
    return parser


def _embed(client: Client, args: argparse.Namespace) -> None:
    result = client.predict(args.model, args.texts, version=args.version, priority=args.priority)
    for text, vector in zip(args.texts, result.outputs, strict=True):
        shown = vector if args.full else vector[:8]
        line = {
            "text": text,
            "model": f"{result.model}/{result.version}",
            "dims": len(vector),
            "embedding": [round(float(x), 6) for x in shown],
        }
        print(json.dumps(line))


def _generate(client: Client, args: argparse.Namespace) -> None:
    chunks = client.generate(
        args.model,
        args.prompt,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        seed=args.seed,
        stop=args.stop,
        version=args.version,
        priority=args.priority,
    )
    for chunk in chunks:
        if args.json:
            print(json.dumps(chunk.__dict__), flush=True)
            continue
        print(chunk.text, end="", flush=True)
        if chunk.finish_reason:
            tokens = f"{chunk.prompt_tokens} prompt + {chunk.completion_tokens} generated tokens"
            print(f"\n[{chunk.finish_reason}; {tokens}]", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """0 on success; 1 when the gateway refused or failed a call (or a job did not succeed);
    2 for bad input (arguments, files that do not read), reported in one line."""
    args = _parser().parse_args(argv)
    try:
        client = Client(
            args.address,
            api_key=args.api_key,
            # Roots to verify with, or a name to check: TLS, surely.
            tls=args.tls or args.ca_file is not None or args.server_name is not None,
            root_certificates=args.ca_file,
            server_name=args.server_name,
            timeout_s=args.timeout_s,
        )
        with client:
            if args.command == "models":
                for model in client.models():
                    print(json.dumps(model))
            elif args.command == "job":
                return run_job_command(client, args)
            elif args.command == "generate":
                _generate(client, args)
            else:
                _embed(client, args)
    except FabricError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except BrokenPipeError:  # `| head`: the reader has what it wanted; not bad input (2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no error at exit
        return 0
    except (OSError, ValueError) as error:  # a file, a line, a setting
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0
