"""The command-line client, run from the server's checkout: the slim client package's CLI
(clients/python, installed into the venv by `make install`).

python -m services.client embed "some text" ["more text" ...]
python -m services.client generate "Once upon a time" --max-tokens 32
python -m services.client models

It imports nothing else from `services`: the client package carries its own generated protos,
which must not share a process with the server's (services.pb).
"""

from __future__ import annotations

from inference_fabric_client.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
