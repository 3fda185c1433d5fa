"""Durable batch jobs (`inference.v1.JobService`) from the blocking client.

    with Client("127.0.0.1:8001") as client:
        jobs = client.jobs()
        job_id = jobs.submit("minilm", ["a", "b"], idempotency_key="run-42")
        print(jobs.get(job_id).state)
        for result in jobs.results(job_id):          # input order, resumable with start_index
            ...

`submit` streams the texts in (SubmitJobStream, `items_per_message` per message), so no gRPC
message limit bounds a job; only the gateway's max items per job (100,000 by default) does.
Results come back in input order; a call streams up to the first item not finished yet, so
`results(..., wait=True)` calls again from the next index until the job is finished.

`submit`, `get` and `cancel` refused for load (RESOURCE_EXHAUSTED with a `retry-after-ms`
hint: the gateway holds too many items being submitted, or the job store is full) are sent
again after the hint, within the call's timeout and the client's retry budget, as predicts
are (inference_fabric_client.retry): a refused submit stored nothing, so the whole stream is
sent again. A submit the gateway's grpc dropped unseen (CANCELLED) is sent again only with an
`idempotency_key`: a submit cut short after the gateway stored it would otherwise make a
second job.
"""

from __future__ import annotations

import itertools
import random
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import grpc
import numpy as np

from inference_fabric_client._pb.inference.v1 import inference_pb2 as api
from inference_fabric_client._pb.inference.v1 import jobs_pb2 as jobs
from inference_fabric_client._pb.inference.v1 import jobs_pb2_grpc as jobs_grpc
from inference_fabric_client.client import opening
from inference_fabric_client.results import FabricError
from inference_fabric_client.tensors import to_array

_STATES = {value: name.removeprefix("JOB_STATE_").lower()
           for name, value in jobs.JobState.items()}  # fmt: skip
_ITEM_STATUSES = {value: name.removeprefix("ITEM_STATUS_").lower()
                  for name, value in jobs.ItemStatus.items()}  # fmt: skip
TERMINAL_STATES = frozenset({"succeeded", "partially_failed", "failed", "cancelled"})
#: How a results stream that brought results may end and be opened again from the next index.
_RESUMED = frozenset({grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED})
_RESUMED_NAMES = frozenset(code.name for code in _RESUMED)
#: A results stream resumed again without ending normally waits this long before it is opened
#: again, doubling with each such resume up to `RESUME_MAX_S` (times 0.5 to 1.5 at random); the
#: first resume is at once. A gateway that breaks every stream after a result is not reopened
#: in a tight loop.
RESUME_FIRST_S = 0.1
RESUME_MAX_S = 2.0
#: Openings in a row, after a stream broke, that may fail as a broken stream may end (the
#: gateway still restarting) and be tried again, each after the next resume's pause (about
#: 10 s in all); the last one's error fails the call.
RESUME_OPENINGS = 8
#: Texts per SubmitJobStream message: short texts make messages of tens of KB, far below the
#: 4 MiB default limit, and the gateway counts them against its max items as they arrive.
ITEMS_PER_MESSAGE = 1_000


@dataclass(frozen=True)
class JobInfo:
    """A job's state ("queued", "running", "succeeded", "partially_failed", "failed",
    "cancelled"), counts, progress (0..1) and ETA in seconds (0: unknown)."""

    job_id: str
    state: str
    num_items: int
    num_ok: int
    num_failed: int
    num_cancelled: int
    progress: float
    eta_s: float

    @property
    def is_finished(self) -> bool:
        return self.state in TERMINAL_STATES


@dataclass(frozen=True)
class ItemResult:
    """One item's result: status "ok" with `output`, or "failed"/"cancelled" with the gRPC
    status `code` and `message`."""

    index: int
    status: str
    output: np.ndarray | None
    code: str
    message: str
    num_attempts: int


class Attempts(Protocol):
    """A Client's attempts at one call: `method(request, timeout=, metadata=)`, sent again
    while its retry policy allows (Client._attempts)."""

    def __call__(
        self,
        method: object,
        request: object,
        timeout_s: float,
        throttle: None = None,
        *,
        is_dropped_retried: bool = True,
        is_costly: bool = False,
    ) -> object: ...


class Jobs:
    """JobService calls over a Client's channel (Client.jobs())."""

    def __init__(
        self,
        stub: jobs_grpc.JobServiceStub,
        metadata: tuple[tuple[str, str], ...],
        timeout_s: float,
        attempts: Attempts,
        *,
        closed: threading.Event,
    ) -> None:
        """`closed`: set once the client is closed; its calls then fail CANCELLED unsent, and
        a wait between polls or resumes ends at once."""
        self._stub = stub
        self._metadata = metadata
        self._timeout_s = timeout_s
        self._attempts = attempts
        self._closed = closed

    def submit(
        self,
        model: str,
        texts: Sequence[str],
        *,
        version: str = "",
        idempotency_key: str = "",
        complete_by_unix_s: float = 0.0,
        items_per_message: int = ITEMS_PER_MESSAGE,
    ) -> str:
        """Submits a job of texts, streamed `items_per_message` to a message; returns its id
        (the existing job's, for a known key). TypeError, nothing sent, unless `texts` is a
        sequence of strings (a lone string would be a job of its characters)."""
        if items_per_message < 1:
            raise ValueError("items_per_message must be positive")
        if isinstance(texts, str | bytes) or not all(isinstance(t, str) for t in texts):
            # Found only while streaming, a bad item failed the call UNKNOWN (review finding).
            raise TypeError("a job's texts must be a sequence of str")
        header = jobs.SubmitJobRequest(
            model_name=model,
            model_version=version,
            idempotency_key=idempotency_key,
            complete_by_unix_s=complete_by_unix_s,
        )

        def messages() -> Iterator[jobs.SubmitJobRequest]:
            # The first message names the job and carries the first items; the rest, items
            # only. No texts: the header alone, which the gateway refuses as an empty job.
            for start in range(0, max(len(texts), 1), items_per_message):
                message = jobs.SubmitJobRequest()
                if start == 0:
                    message.CopyFrom(header)  # a copy: every attempt streams from the header
                chunk = texts[start : start + items_per_message]
                message.items.extend(api.PredictInput(text=t) for t in chunk)
                yield message

        def send(_: None, *, timeout: float, metadata: Any) -> jobs.SubmitJobResponse:
            # Each attempt streams every message again (a refused one stored nothing).
            return self._stub.SubmitJobStream(messages(), timeout=timeout, metadata=metadata)

        response = self._call(send, None, is_dropped_retried=bool(idempotency_key), is_costly=True)
        return str(response.job_id)

    def get(self, job_id: str) -> JobInfo:
        return _info(self._call(self._stub.GetJob, jobs.GetJobRequest(job_id=job_id)))

    def cancel(self, job_id: str) -> JobInfo:
        return _info(self._call(self._stub.CancelJob, jobs.CancelJobRequest(job_id=job_id)))

    def results(
        self, job_id: str, *, start_index: int = 0, wait: bool = False, poll_s: float = 0.5
    ) -> Iterator[ItemResult]:
        """Results from `start_index` in input order; with `wait`, until every item is in. A
        stream that ends UNAVAILABLE or DEADLINE_EXCEEDED (a gateway restarting, results
        slower to read than the client's timeout) after results came is opened again from the
        next index: only a stream that brought none fails the call, once the retries a get
        would have (a dropped or refused opening) are spent. The first resume is at once;
        each further one before a stream ends normally waits twice as long as the last
        (`RESUME_FIRST_S` up to `RESUME_MAX_S`, jittered). An opening after a break that
        fails UNAVAILABLE or DEADLINE_EXCEEDED is such a resume too, `RESUME_OPENINGS` in a
        row at most; so is one between a wait's polls, and a poll's get that fails so (a
        gateway restarting while the job runs ended an hour's wait: review finding)."""
        index = start_index
        resumes = 0  # since a stream last ended normally
        failed_openings = 0  # in a row, since a stream broke
        is_waiting = False  # a stream ended normally and the job was not done: polls since
        while True:
            if resumes > 1:
                pause_s = min(RESUME_FIRST_S * 2 ** (resumes - 2), RESUME_MAX_S)
                self._closed.wait(pause_s * random.uniform(0.5, 1.5))
            if self._closed.is_set():
                raise FabricError("CANCELLED", "the client is closed")
            request = jobs.GetJobResultsRequest(job_id=job_id, start_index=index)
            # Opened again as a get is (a drop, a refusal with a hint) until a result came: a
            # dropped poll ended a wait of an hour (review finding).
            try:
                stream, first = self._call(opening(self._stub.GetJobResults), request)
            except FabricError as error:
                # A stream broke (a gateway restarting) and the next does not open yet: it is
                # opened again after the next pause, not given up at once (review finding).
                failed_openings += 1
                if (
                    (resumes or is_waiting)
                    and error.code in _RESUMED_NAMES
                    and failed_openings < RESUME_OPENINGS
                ):
                    resumes += 1
                    continue
                raise
            failed_openings = 0
            opened_at = index
            try:
                for result in itertools.chain(first, stream):
                    index = result.index + 1
                    output = to_array(result.output) if result.HasField("output") else None
                    yield ItemResult(result.index, _ITEM_STATUSES[result.status], output,
                                     result.code, result.message, result.num_attempts)  # fmt: skip
            except grpc.RpcError as error:
                if index > opened_at and error.code() in _RESUMED:  # type: ignore[attr-defined]
                    resumes += 1
                    continue  # from the next index
                raise FabricError.from_rpc(error) from None
            finally:  # the caller stopped reading: the server's stream stops now, not at GC
                stream.cancel()
            resumes = 0
            if not wait or index >= self.poll(job_id).num_items:
                return
            is_waiting = True
            self._closed.wait(poll_s)  # a close ends the wait; the next round fails CANCELLED

    def poll(self, job_id: str) -> JobInfo:
        """`get`, for a wait's poll: one that fails UNAVAILABLE or DEADLINE_EXCEEDED (a gateway
        restarting, a Redis blip) is sent again after a pause (RESUME_FIRST_S, doubling up to
        RESUME_MAX_S), `RESUME_OPENINGS` times in all, where a get fails at once."""
        for attempt in range(1, RESUME_OPENINGS + 1):
            try:
                return self.get(job_id)
            except FabricError as error:
                if error.code not in _RESUMED_NAMES or attempt == RESUME_OPENINGS:
                    raise
                # As a resume's pauses, doubling: about 10 s in all (a fixed 0.1 s gave up
                # within a second, before a restarting gateway listens: diff review).
                pause_s = min(RESUME_FIRST_S * 2 ** (attempt - 1), RESUME_MAX_S)
                if self._closed.wait(pause_s * random.uniform(0.5, 1.5)):
                    raise FabricError("CANCELLED", "the client is closed") from None
        raise AssertionError("unreachable")

    def _call(
        self,
        method: Callable[..., Any],
        request: Any,
        *,
        is_dropped_retried: bool = True,
        is_costly: bool = False,
    ) -> Any:
        return self._attempts(
            method,
            request,
            self._timeout_s,
            is_dropped_retried=is_dropped_retried,
            is_costly=is_costly,
        )


def _info(j: jobs.Job) -> JobInfo:
    return JobInfo(j.job_id, _STATES[j.state], j.num_items, j.num_ok, j.num_failed,
                   j.num_cancelled, j.progress, j.eta_s)  # fmt: skip
