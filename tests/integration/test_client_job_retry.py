"""The slim client's job calls (inference_fabric_client.jobs) sent again when refused for load,
against a real gRPC server on port 0 that refuses as the gateway's JobService does (a submit
past the bytes the gateway holds for jobs being submitted, or a full job store): RESOURCE_
EXHAUSTED with a `retry-after-ms` hint, nothing stored. A refused submit streams every item
again; one dropped unseen (CANCELLED) is sent again only when an idempotency key makes a
second send harmless."""

from __future__ import annotations

import io
import itertools
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc
import pytest
from inference_fabric_client import Client, FabricError, cli
from inference_fabric_client.jobs import RESUME_FIRST_S
from inference_fabric_client.retry import RetryPolicy

from services.pb.inference.v1 import jobs_pb2 as jobs
from services.pb.inference.v1 import jobs_pb2_grpc as jobs_grpc
from tests.support.sync_servers import sync_servers

pytestmark = pytest.mark.integration

TEXTS = [f"text {i}" for i in range(25)]


@dataclass
class RefusingJobs(jobs_grpc.JobServiceServicer):
    """Refuses the first `refusals` calls of each method with `code` (and the hint `hint_ms`,
    None: no hint), after reading a submit's whole stream; then answers."""

    refusals: int = 0
    code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED
    hint_ms: int | None = 50
    #: How long each call takes before it answers or refuses, seconds.
    delay_s: float = 0.0
    #: Per submit call: when it arrived and the texts it streamed.
    submits: list[tuple[float, list[str]]] = field(default_factory=list)
    gets: int = 0
    #: Results streams that end `code` after `per_stream` results; the index each began at.
    broken_streams: int = 0
    per_stream: int = 10
    result_streams: list[int] = field(default_factory=list)
    #: When each results stream was opened (monotonic seconds).
    result_opened_s: list[float] = field(default_factory=list)
    #: Results finished so far (a stream ends after the first `available`).
    available: int = len(TEXTS)
    #: The state a get answers.
    state: int = jobs.JOB_STATE_RUNNING
    #: Results that become finished after each stream that ended normally.
    grows_by: int = 0
    #: The results streams (numbered from 1) refused `code` at once, and the gets.
    refused_streams: frozenset[int] = frozenset()
    refused_gets: frozenset[int] = frozenset()
    lock: threading.Lock = field(default_factory=threading.Lock)

    def SubmitJobStream(
        self, requests: Iterator[jobs.SubmitJobRequest], context: Any
    ) -> jobs.SubmitJobResponse:
        arrived_s = time.monotonic()
        texts = [item.text for request in requests for item in request.items]
        time.sleep(self.delay_s)
        with self.lock:
            self.submits.append((arrived_s, texts))
            self._maybe_refuse(len(self.submits), context)
        return jobs.SubmitJobResponse(job_id="job-1")

    def GetJob(self, request: jobs.GetJobRequest, context: Any) -> jobs.Job:
        time.sleep(self.delay_s)
        with self.lock:
            self.gets += 1
            self._maybe_refuse(self.gets, context)
            if self.gets in self.refused_gets:
                context.abort(self.code, "gateway restarting")
        return jobs.Job(job_id=request.job_id, state=self.state, num_items=25)

    def GetJobResults(
        self, request: jobs.GetJobResultsRequest, context: Any
    ) -> Iterator[jobs.JobItemResult]:
        """Every result from the index asked; the first `broken_streams` streams end
        `code` after `per_stream` results."""
        with self.lock:
            self.result_streams.append(request.start_index)
            self.result_opened_s.append(time.monotonic())
            breaks = len(self.result_streams) <= self.broken_streams
            if len(self.result_streams) in self.refused_streams:
                context.abort(self.code, "gateway restarting")
        for sent, index in enumerate(range(request.start_index, self.available)):
            if breaks and sent == self.per_stream:
                context.abort(self.code, "gateway restarting")
            yield jobs.JobItemResult(index=index, status=jobs.ITEM_STATUS_OK)
        self.available = min(self.available + self.grows_by, len(TEXTS))

    def _maybe_refuse(self, num_calls: int, context: Any) -> None:
        if num_calls <= self.refusals:
            if self.hint_ms is not None:
                context.set_trailing_metadata((("retry-after-ms", str(self.hint_ms)),))
            context.abort(self.code, "busy")


@pytest.fixture
def serve() -> Iterator[Any]:
    with sync_servers(jobs_grpc.add_JobServiceServicer_to_server) as start:
        yield start


def test_a_submit_refused_for_load_streams_every_item_again_after_the_hint(serve: Any) -> None:
    servicer = RefusingJobs(refusals=2, hint_ms=50)
    with Client(serve(servicer), timeout_s=10) as client:
        job_id = client.jobs().submit("m", TEXTS, items_per_message=10)
    assert job_id == "job-1"
    assert [texts for _, texts in servicer.submits] == [TEXTS] * 3
    arrivals = [arrived_s for arrived_s, _ in servicer.submits]
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert all(gap >= 0.05 for gap in gaps), gaps


def test_job_retries_stop_at_max_retries_and_at_the_timeout(serve: Any) -> None:
    servicer = RefusingJobs(refusals=100, hint_ms=10)
    policy = RetryPolicy(max_retries=3)
    client = Client(serve(servicer), retry=policy, timeout_s=10)
    with client, pytest.raises(FabricError) as raised:
        client.jobs().get("job-1")
    assert raised.value.code == "RESOURCE_EXHAUSTED" and servicer.gets == 4

    full = RefusingJobs(refusals=100, hint_ms=60_000)  # the job store's hint: full for now
    with Client(serve(full), timeout_s=10) as client, pytest.raises(FabricError) as raised:
        client.jobs().submit("m", TEXTS)
    assert raised.value.retry_after_s == 60.0 and len(full.submits) == 1


def test_a_get_refused_for_load_is_sent_again(serve: Any) -> None:
    servicer = RefusingJobs(refusals=1, hint_ms=20)
    with Client(serve(servicer), timeout_s=10) as client:
        assert client.jobs().get("job-1").state == "running"
    assert servicer.gets == 2


def test_a_dropped_submit_is_sent_again_only_with_an_idempotency_key(serve: Any) -> None:
    """CANCELLED may be a drop before the gateway saw the submit, or a submit cut short after
    it stored the job: sent again, a submit without a key could make a second job."""
    policy = RetryPolicy(dropped_retry_s=0.01)
    keyless = RefusingJobs(refusals=1, code=grpc.StatusCode.CANCELLED, hint_ms=None)
    client = Client(serve(keyless), retry=policy, timeout_s=10)
    with client, pytest.raises(FabricError) as raised:
        client.jobs().submit("m", TEXTS)
    assert raised.value.code == "CANCELLED" and len(keyless.submits) == 1

    keyed = RefusingJobs(refusals=1, code=grpc.StatusCode.CANCELLED, hint_ms=None)
    with Client(serve(keyed), retry=policy, timeout_s=10) as client:
        assert client.jobs().submit("m", TEXTS, idempotency_key="run-42") == "job-1"
    assert len(keyed.submits) == 2


def test_a_submit_is_sent_again_only_with_as_long_left_as_its_refused_attempt_took(
    serve: Any,
) -> None:
    """A submit refused after 4 s (once most of its items were streamed) is not sent again
    with less than that left of its timeout: the retry would only end DEADLINE_EXCEEDED,
    leaving a caller without an idempotency key unsure whether the job was stored. A get
    refused as slowly is sent again (a unary call's time may have gone to connecting)."""
    slow = RefusingJobs(refusals=1, hint_ms=10, delay_s=4.0)
    # Refused after at least 4 s, at most 3 s left: never room for a second attempt however
    # slow the machine, and 3 s of room for the first one's set-up and its refusal's way back.
    client = Client(serve(slow), timeout_s=7.0)
    with client, pytest.raises(FabricError) as raised:
        client.jobs().submit("m", TEXTS)
    assert raised.value.code == "RESOURCE_EXHAUSTED" and len(slow.submits) == 1

    slow_get = RefusingJobs(refusals=1, hint_ms=10, delay_s=0.3)
    with Client(serve(slow_get), timeout_s=10) as client:  # room for a busy machine
        assert client.jobs().get("job-1").state == "running"
    assert slow_get.gets == 2


def test_a_closed_clients_job_calls_fail_cancelled_unsent(serve: Any) -> None:
    """A closed client's job calls fail CANCELLED unsent, as its predicts do, from a `jobs()`
    asked for before or after the close (asking after it crashed the process: grpc segfaults
    making a stub on a closed channel)."""
    servicer = RefusingJobs()
    client = Client(serve(servicer), timeout_s=10)
    jobs_before = client.jobs()
    client.close()
    calls = (
        lambda: jobs_before.submit("m", TEXTS),
        lambda: client.jobs().get("job-1"),
        lambda: list(client.jobs().results("job-1")),
    )
    for call in calls:
        with pytest.raises(FabricError) as raised:
            call()
        assert raised.value.code == "CANCELLED"
    assert (servicer.submits, servicer.gets) == ([], 0)


@pytest.mark.parametrize("code", [grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED])
def test_a_results_stream_broken_after_results_came_is_opened_again_from_the_next(
    serve: Any, code: grpc.StatusCode
) -> None:
    """A gateway restarting, or results slower to read than the client's timeout, ended the
    call partway with what it had brought; the caller had to find the index to go on from
    (review finding). The client opens the stream again from the next index."""
    servicer = RefusingJobs(code=code, broken_streams=2, per_stream=10)
    with Client(serve(servicer), timeout_s=10) as client:
        results = list(client.jobs().results("job-1"))
    assert [r.index for r in results] == list(range(25))
    assert servicer.result_streams == [0, 10, 20]


def test_a_results_stream_broken_again_and_again_is_opened_again_after_growing_pauses(
    serve: Any,
) -> None:
    """Each stream broke after a few results and was opened again at once, however often: a
    gateway failing every stream was asked again in a tight loop (review finding). The first
    resume is at once; each further one waits twice the last (jittered 0.5 to 1.5)."""
    servicer = RefusingJobs(code=grpc.StatusCode.UNAVAILABLE, broken_streams=4, per_stream=5)
    with Client(serve(servicer), timeout_s=10) as client:
        results = list(client.jobs().results("job-1"))
    assert [r.index for r in results] == list(range(25))
    assert servicer.result_streams == [0, 5, 10, 15, 20]
    gaps = [b - a for a, b in itertools.pairwise(servicer.result_opened_s)]
    least = [0.5 * RESUME_FIRST_S * 2**n for n in range(3)]  # the 2nd, 3rd and 4th resumes'
    assert all(gap >= bound for gap, bound in zip(gaps[1:], least, strict=True)), gaps


def test_a_submit_of_anything_but_strings_is_a_type_error_unsent(serve: Any) -> None:
    """A non-string item failed the call UNKNOWN, found only as the stream was read, and a
    lone string was sent as a job of its characters (review finding)."""
    servicer = RefusingJobs()
    with Client(serve(servicer), timeout_s=10) as client:
        for texts in ("abc", ["a", 1], [b"bytes"]):
            with pytest.raises(TypeError, match="sequence of str"):
                client.jobs().submit("m", texts)  # type: ignore[arg-type]
    assert servicer.submits == []


@pytest.mark.parametrize(
    ("state", "status"),
    [(jobs.JOB_STATE_SUCCEEDED, 0), (jobs.JOB_STATE_PARTIALLY_FAILED, 1),
     (jobs.JOB_STATE_CANCELLED, 1)],
)  # fmt: skip
def test_job_results_waited_for_exits_1_unless_the_job_succeeded(
    serve: Any, tmp_path: Any, capsys: pytest.CaptureFixture[str], state: int, status: int
) -> None:
    """`job results` exited 0 whatever the job's end, where the README (and a waited submit)
    says 1 for a job that did not succeed (review finding). Without waiting it exits 0."""
    address = serve(RefusingJobs(state=state))
    out = tmp_path / "results.jsonl"
    args = ["--address", address, "job", "results", "job-1", "--out", str(out)]
    assert cli.main(args) == status
    assert len(out.read_text().splitlines()) == 25
    err = capsys.readouterr().err
    assert ('"state": "' in err) == (status == 1)
    assert cli.main([*args, "--no-wait"]) == 0


def test_a_close_ends_a_results_wait_between_polls(serve: Any) -> None:
    """The wait between polls for results not finished yet was a sleep no close could end."""
    servicer = RefusingJobs(available=0)
    client = Client(serve(servicer), timeout_s=10)
    closer = threading.Timer(0.3, client.close)
    closer.start()
    began_s = time.monotonic()
    with pytest.raises(FabricError) as raised:
        list(client.jobs().results("job-1", wait=True, poll_s=60.0))
    assert raised.value.code == "CANCELLED"
    assert time.monotonic() - began_s < 30.0  # the poll's wait of 60 s was cut short
    closer.join()


def test_a_wait_for_results_outlasts_a_gateway_restarting_between_its_polls(
    serve: Any,
) -> None:
    """Most of a long wait is between polls: a get, or the next opening, failing UNAVAILABLE
    there (a gateway restarting, a Redis blip) ended the wait, and the CLI's, an hour into a
    job (review finding). They are tried again after a pause."""
    refused = {"refused_gets": frozenset({1}), "refused_streams": frozenset({2})}
    servicer = RefusingJobs(code=grpc.StatusCode.UNAVAILABLE, available=10, grows_by=15, **refused)
    with Client(serve(servicer), timeout_s=10) as client:
        results = list(client.jobs().results("job-1", wait=True, poll_s=0.01))
    assert [r.index for r in results] == list(range(25))
    assert servicer.result_streams == [0, 10, 10] and servicer.gets == 3


def test_a_results_stream_broken_before_any_result_fails_the_call(serve: Any) -> None:
    """Opened again only where the stream brought results: one that brought none is the
    caller's to hear of, not to be opened for ever."""
    servicer = RefusingJobs(code=grpc.StatusCode.UNAVAILABLE, broken_streams=5, per_stream=0)
    with Client(serve(servicer), timeout_s=10) as client, pytest.raises(FabricError) as failed:
        list(client.jobs().results("job-1"))
    assert failed.value.code == "UNAVAILABLE"
    assert servicer.result_streams == [0]


def test_a_results_poll_dropped_before_any_result_is_opened_again(serve: Any) -> None:
    """A results stream dropped unseen (CANCELLED before any result) ended the whole wait for
    the job's results, where a get beside it was sent again (review finding). It is opened
    again after the drop's wait, from the same index."""
    servicer = RefusingJobs(code=grpc.StatusCode.CANCELLED, broken_streams=2, per_stream=0)
    policy = RetryPolicy(dropped_retry_s=0.05)
    with Client(serve(servicer), timeout_s=10, retry=policy) as client:
        results = list(client.jobs().results("job-1"))
    assert [r.index for r in results] == list(range(25))
    assert servicer.result_streams == [0, 0, 0]


def test_a_reader_that_closed_its_pipe_is_no_bad_input(
    serve: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fabric-client ... | head -1`: the pipe's reader gone, the print raised BrokenPipeError,
    an OSError, reported as bad input with status 2 (review finding). It ends quietly."""

    class ClosedPipe(io.StringIO):
        def write(self, text: str) -> int:
            raise BrokenPipeError(32, "Broken pipe")

        def fileno(self) -> int:
            return sink

    sink = os.open(tmp_path / "sink", os.O_WRONLY | os.O_CREAT)
    try:
        monkeypatch.setattr(sys, "stdout", ClosedPipe())
        status = cli.main(["--address", serve(RefusingJobs()), "job", "status", "job-1"])
    finally:
        os.close(sink)
    assert status == 0
