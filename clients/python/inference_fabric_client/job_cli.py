"""The `job` commands of the command line.

    fabric-client job submit texts.jsonl [--model minilm] [--idempotency-key KEY] [--no-wait]
                                         [--items-per-message N]
    fabric-client job status JOB_ID
    fabric-client job results JOB_ID --out results.jsonl [--start-index N]
    fabric-client job cancel JOB_ID

An input line is a JSON string or an object with "text". `submit` streams the texts to the
gateway (SubmitJobStream, 1,000 to a message: no gRPC message limit bounds the file, only the
gateway's max items per job), prints the job id, then (unless --no-wait) draws a progress bar
on stderr until the job is finished. A result line is {"index", "status", "embedding"} for ok
items and {"index", "status", "code", "message"} for the others, in input order.

A `submit` waited for, and a `results` waited for (without --no-wait), exit 1 unless the job
succeeded (its state is then printed on stderr), as a call the gateway failed does.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from inference_fabric_client.client import Client
from inference_fabric_client.jobs import ITEMS_PER_MESSAGE, ItemResult, JobInfo

BAR_WIDTH = 30
POLL_S = 0.5


def add_job_commands(commands: argparse._SubParsersAction) -> None:  # type: ignore[type-arg,unused-ignore]
    job = commands.add_parser("job", help="durable batch jobs: submit, status, results, cancel")
    actions = job.add_subparsers(dest="job_command", required=True)
    submit = actions.add_parser("submit", help="submit a JSONL file of texts")
    submit.add_argument("file", type=Path)
    submit.add_argument("--model", default="minilm")
    submit.add_argument("--version", default="")
    submit.add_argument("--idempotency-key", default="")
    submit.add_argument("--no-wait", action="store_true", help="print the job id and exit")
    submit.add_argument("--items-per-message", type=int, default=ITEMS_PER_MESSAGE,
                        help="texts per streamed message")  # fmt: skip
    for name, about in (("status", "a job's state and counts"), ("cancel", "cancel a job")):
        actions.add_parser(name, help=about).add_argument("job_id")
    results = actions.add_parser("results", help="write a job's results as JSONL")
    results.add_argument("job_id")
    results.add_argument("--out", type=Path, required=True)
    results.add_argument("--start-index", type=int, default=0, help="resume from this item")
    results.add_argument("--no-wait", action="store_true", help="only the results ready now")


def _texts(path: Path) -> list[str]:
    """The file's texts; ValueError naming the line for one that is not a JSON string or an
    object with "text"."""
    texts = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            value = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{path}:{number}: not JSON: {error}") from None
        if isinstance(value, dict):
            if not isinstance(value.get("text"), str):
                raise ValueError(f'{path}:{number}: an object needs "text", a string')
            value = value["text"]
        elif not isinstance(value, str):  # 123, null, [..]: sent as "123", "None" (review)
            raise ValueError(f'{path}:{number}: not a JSON string or an object with "text"')
        texts.append(value)
    return texts


def _bar(info: JobInfo) -> str:
    filled = int(info.progress * BAR_WIDTH)
    eta = f" eta {info.eta_s:.0f}s" if info.eta_s else ""
    done = info.num_ok + info.num_failed + info.num_cancelled
    return (f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {done}/{info.num_items} "
            f"{info.state} (failed {info.num_failed}){eta}")  # fmt: skip


def _status_line(info: JobInfo) -> str:
    return json.dumps(info.__dict__)


def run_job_command(client: Client, args: argparse.Namespace) -> int:
    """The command's exit status: a submit or results waited for exits 1 unless its job
    succeeded."""
    jobs = client.jobs()
    if args.job_command == "submit":
        job_id = jobs.submit(
            args.model, _texts(args.file), version=args.version,
            idempotency_key=args.idempotency_key, items_per_message=args.items_per_message,
        )  # fmt: skip
        print(job_id, flush=True)
        if args.no_wait:
            return 0
        info = jobs.poll(job_id)
        while not info.is_finished:
            print(_bar(info), end="", file=sys.stderr, flush=True)
            time.sleep(POLL_S)
            info = jobs.poll(job_id)
        print(_bar(info), file=sys.stderr, flush=True)
        return 0 if info.state == "succeeded" else 1
    if args.job_command in ("status", "cancel"):
        call = jobs.get if args.job_command == "status" else jobs.cancel
        print(_status_line(call(args.job_id)))
        return 0
    results = jobs.results(args.job_id, start_index=args.start_index, wait=not args.no_wait)
    _write_results(results, args.out, is_resumed=args.start_index > 0)
    if args.no_wait:
        return 0
    # Every item is in: a job that did not succeed exits 1, as a waited submit's does (it
    # exited 0 whatever the job's end: review finding).
    info = jobs.get(args.job_id)
    if info.state == "succeeded":
        return 0
    print(_status_line(info), file=sys.stderr)
    return 1


def _write_results(results: Iterator[ItemResult], path: Path, *, is_resumed: bool) -> None:
    """Writes `results` as JSONL to `path`, appended when `is_resumed`. The file is opened (and
    a fresh one emptied) only once the first result came: a call that fails at once (a job id
    mistyped, the job expired) leaves a file written before as it was, and one that fails
    later keeps the results received, to resume from with --start-index. A fresh call that
    ends without results (none finished yet) leaves an empty file, not an earlier one's."""
    out: TextIO | None = None
    try:
        for result in results:
            if out is None:
                out = path.open("a" if is_resumed else "w")
            line: dict[str, object] = {"index": result.index, "status": result.status}
            if result.output is not None:
                line["embedding"] = [float(x) for x in result.output]
            else:
                line.update(code=result.code, message=result.message)
            out.write(json.dumps(line) + "\n")
    finally:
        if out is not None:
            out.close()
    if out is None and not is_resumed:
        path.write_text("")
