"""The job runner's loop: claim queue entries, run their items through the gateway, record.

Each queue entry is a chunk of one job (services.common.job_store). A runner claims new entries
with XREADGROUP and, every few seconds, entries another runner left idle past
`claim_timeout_s` with XAUTOCLAIM (that runner died or hangs). For a chunk it:

1. skips the items that already have a result (a reclaimed chunk may be half done);
2. marks the rest cancelled when the job was cancelled or its completion deadline passed;
3. sends the rest as one `Predict` call at the job's priority (batch by default), through the
   gateway like any client, so batch items share the workers' batches but are queued and shed
   behind online traffic;
4. on an error no retry can fix (INVALID_ARGUMENT...), or one a crashing item may cause
   (INTERNAL, UNKNOWN) once its retries ran out, runs each item alone, a few at a time, to
   find the poison ones (not for an error of the call whatever its items: NOT_FOUND,
   PERMISSION_DENIED...); should one give the chunk up for a later round, the others stop and
   what finished is recorded first (services/jobs/chunk_calls.py); retryable errors are
   retried with capped
   exponential backoff and full jitter, up to `max_attempts`; an item that still fails is
   recorded failed with its gRPC status
   (dead-lettered). UNAUTHENTICATED and PERMISSION_DENIED are no item's fault but the
   runner's own (its key, its tenant's grants): no item fails for them, the chunk is left
   pending for a later retry. Nor are UNAVAILABLE,
   RESOURCE_EXHAUSTED, CANCELLED and DEADLINE_EXCEEDED (the fleet down, restarting, full or
   too slow; CANCELLED: a gateway dropped the call unseen): the chunk is left pending for a
   later round, for FLEET_ROUNDS rounds and `--fleet-patience-s` at least, before its items
   fail;
5. records every result with HSETNX, dead-letters the failed ones and acknowledges the entry,
   in one atomic script; while Redis at its memory cap refuses them, holds them and tries
   again, the entry kept claimed (services/jobs/holding.py).

A chunk whose run fails with an unexpected error (a bug, an answer the runner cannot read) is
left pending for a later round, CRASH_ROUNDS in all; then its items without a result fail
INTERNAL, so that no chunk is rerun by the runners forever.

Delivery is at-least-once (a runner may die after Predict, before recording); the results are
effectively-once: a result written for an index is never overwritten, and each is counted once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections.abc import Awaitable, Callable, Sequence

import grpc
from redis.exceptions import RedisError

from services.common.errors import UpstreamError
from services.common.grpc_errors import without_addresses
from services.common.job_policy import (
    CRASH_ROUNDS,
    FLEET_CODES,
    FLEET_PATIENCE_S,
    GiveUp,
    ItemStatus,
    RetryPolicy,
    is_too_large,
)
from services.common.job_records import ItemOutcome, JobRecord, QueueEntry
from services.common.job_store import JobStore
from services.common.lifecycle import stop_if_cancelled
from services.common.priority import PriorityClass
from services.common.sparse_log import SparseLog
from services.jobs.chunk_calls import (
    SPLIT_CONCURRENCY,
    FleetRound,
    FleetUnavailable,
    RunnerRefused,
    all_or_none,
    item_result,
    left_reason,
    may_be_one_items,
)
from services.jobs.holding import keep_claimed, record_when_room
from services.jobs.metrics import RunnerMetrics
from services.pb.inference.v1 import inference_pb2 as api

log = logging.getLogger(__name__)
_sparse = SparseLog(log)

#: Sends one PredictRequest and returns its response (raises grpc.aio.AioRpcError).
PredictFn = Callable[[api.PredictRequest], Awaitable[api.PredictResponse]]
#: How long XREADGROUP waits for new entries before the loop looks around again.
READ_BLOCK_MS = 1000
#: How often entries left idle by dead runners are looked for (and the consumers of runners
#: that exited forgotten), and the backlog measured.
RECLAIM_PERIOD_S = 2.0
#: Pause after Redis failed, before trying again (Redis restarting).
REDIS_RETRY_S = 0.5
#: What the gateway answers for the runner's own key, never a job's items: unknown
#: (UNAUTHENTICATED), or its tenant not granted a job's priority class or model
#: (PERMISSION_DENIED: the submitter's rights were checked at submit).
_RUNNERS_FAULT = frozenset({grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED})

_Item = tuple[int, bytes]


class JobRunner:
    def __init__(
        self,
        store: JobStore,
        predict: PredictFn,
        metrics: RunnerMetrics,
        *,
        consumer: str,
        retry: RetryPolicy,
        max_in_flight_chunks: int,
        claim_timeout_s: float,
        fleet_patience_s: float = FLEET_PATIENCE_S,
        rng: random.Random | None = None,
    ) -> None:
        self._store = store
        self._predict = predict
        self._metrics = metrics
        self._consumer = consumer
        self._retry = retry
        self._max_in_flight = max_in_flight_chunks
        self._claim_timeout_ms = int(claim_timeout_s * 1000)
        self._fleet_patience_s = fleet_patience_s
        self._rng = rng or random.Random()
        self._tasks: set[asyncio.Task[None]] = set()
        #: Entries this runner is running: a reclaim that finds one of them idle past the
        #: claim timeout (its call retrying) hands it back to this same runner, not to run.
        self._running: set[str] = set()
        #: The last failure of `_round_chores`, logged once while it lasts.
        self._chores_failure = ""

    async def run(self, stopping: asyncio.Event) -> None:
        """Claims and runs chunks until `stopping` is set; Redis outages are waited out."""
        next_reclaim_s = 0.0
        while not stopping.is_set():
            free = self._max_in_flight - len(self._tasks)
            if free <= 0:  # until a chunk ends, or the stop (its chunks are `drain`'s)
                stop = asyncio.ensure_future(stopping.wait())
                try:
                    await asyncio.wait({*self._tasks, stop}, return_when=asyncio.FIRST_COMPLETED)
                finally:
                    stop.cancel()
                continue
            is_round = time.monotonic() >= next_reclaim_s
            try:
                entries: list[QueueEntry] = []
                if is_round:
                    next_reclaim_s = time.monotonic() + RECLAIM_PERIOD_S
                    await self._store.ensure_group()  # Redis may have restarted empty
                    entries = await self._store.reclaim(
                        self._consumer, self._claim_timeout_ms, free
                    )
                if not entries:
                    entries = await self._store.read_new(self._consumer, free, READ_BLOCK_MS)
            except (RedisError, OSError) as error:
                stop_if_cancelled()
                _sparse.warning("queue", "job queue unreachable, retrying: %s", error)
                await asyncio.sleep(REDIS_RETRY_S)
                continue
            for entry in entries:
                if entry.entry_id in self._running:
                    continue
                self._running.add(entry.entry_id)
                task = asyncio.create_task(self._guarded(entry), name=f"chunk-{entry.entry_id}")
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
            if is_round:
                await self._round_chores()

    async def _round_chores(self) -> None:
        """A round's look around, once its entries run (what fails here must not leave them,
        claimed, for another claim timeout): the consumers of runners that exited forgotten
        (idle past the claim timeout, nothing pending), and the backlog measured. A failure is
        logged once while it lasts: a Redis whose ACL is older than this runner refuses the
        first (deploy/k8s/README.md)."""
        failures = []
        for chore in (self._forget_exited, self._measure_backlog):
            try:
                await chore()
            except (RedisError, OSError) as error:  # each apart: one refused, the other runs
                stop_if_cancelled()
                failures.append(f"{chore.__name__}: {error}")
        failure = "; ".join(failures)
        if failure and failure != self._chores_failure:
            log.warning("job queue not looked around: %s", failure)
        self._chores_failure = failure

    async def _forget_exited(self) -> None:
        await self._store.forget_consumers(self._consumer, self._claim_timeout_ms)

    async def drain(self, grace_s: float) -> None:
        """Lets running chunks finish for up to `grace_s`, then cancels the rest (their entries
        stay pending and are reclaimed by another runner)."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_s)
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _measure_backlog(self) -> None:
        queued, claimed, age_s = await self._store.backlog()
        self._metrics.queue_entries.labels("queued").set(queued)
        self._metrics.queue_entries.labels("claimed").set(claimed)
        self._metrics.oldest_entry_age.set(age_s)

    async def _guarded(self, entry: QueueEntry) -> None:
        """Runs one chunk; a failure leaves its entry pending, to be reclaimed and rerun."""
        started = time.perf_counter()
        keep = keep_claimed(self._store, self._consumer, entry, self._claim_timeout_ms / 1000)
        keeping = asyncio.create_task(keep, name=f"keep-{entry.entry_id}")
        try:
            await self._run_chunk(entry)
            # Only a chunk whose results were recorded: one left for a later round has none.
            self._metrics.chunk_seconds.observe(time.perf_counter() - started)
        except (RedisError, OSError, RunnerRefused, FleetUnavailable) as error:
            _sparse.warning(  # the fleet busy or away leaves every chunk: once a period a job
                (left_reason(error), entry.job_id), "chunk %s of job %s left for a retry: %s",
                entry.entry_id, entry.job_id, error,
            )  # fmt: skip
            self._metrics.chunks_left.labels(left_reason(error)).inc()
        except Exception as error:
            stop_if_cancelled()  # a drain's cancel a library turned into an error: no crash
            log.exception("chunk %s of job %s failed", entry.entry_id, entry.job_id)
            await self._after_crash(entry, error)
        finally:
            keeping.cancel()
            self._running.discard(entry.entry_id)

    async def _after_crash(self, entry: QueueEntry, error: Exception) -> None:
        """Counts a round `entry`'s chunk failed with an unexpected error; it is left pending,
        to be reclaimed and run again, CRASH_ROUNDS times in all. Then its items without a
        result fail INTERNAL (dead-lettered; cancelled, those of a job cancelled meanwhile) and
        the entry is acknowledged; a job gone, or one that cannot be read, has it dropped."""
        try:
            crashes = await self._store.count_round(entry.job_id, entry.start, "crashes")
            if 0 <= crashes < CRASH_ROUNDS:
                return
            job = None if crashes < 0 else await self._store.get(entry.job_id)
            if job is None:  # gone (expired, deleted): nothing to record
                await self._store.drop(entry)
                return
            stored = await self._store.results(entry.job_id, entry.start, entry.end - entry.start)
            todo = [(entry.start + i, b"") for i, result in enumerate(stored) if result is None]
            message = f"the job runner failed on this item's chunk {crashes} times: {error!r}"
            outcomes = self._stopped(job, todo) or [
                item_result(i, ItemStatus.FAILED, 0, code="INTERNAL", message=message)
                for i, _ in todo
            ]
            await self._record(job, outcomes, entry)
        except (RedisError, OSError) as redis_error:  # the chunk stays pending: a later round
            log.warning("chunk %s: could not count its failure: %s", entry.entry_id, redis_error)
        except Exception:  # its job cannot be read or recorded: the chunk leaves, or it loops
            log.exception("chunk %s of job %s dropped unrecorded", entry.entry_id, entry.job_id)
            with contextlib.suppress(RedisError, OSError):
                await self._store.drop(entry)

    async def _run_chunk(self, entry: QueueEntry) -> None:
        job = await self._store.get(entry.job_id)
        if job is None:
            await self._store.drop(entry)
            return
        if job.started_s == 0:
            await self._store.mark_started(job.job_id)
        stored = await self._store.results(job.job_id, entry.start, entry.end - entry.start)
        todo = [entry.start + i for i, r in enumerate(stored) if r is None]
        if not todo:
            await self._store.record(job, [], ack=entry)
            return
        # A stopped job's items are recorded cancelled unread (a chunk of 64 MiB is not read
        # only to be cancelled).
        stopped = self._stopped(job, [(i, b"") for i in todo])
        if stopped is not None:
            await self._record(job, stopped, entry)
            return
        payloads = await self._store.items(job.job_id, entry.start, entry.end)
        items = [(i, payloads[i - entry.start]) for i in todo]
        self._metrics.items_running.inc(len(items))
        try:
            fleet_round = FleetRound(self._store, job.job_id, entry.start, self._fleet_patience_s)
            outcomes = await self._run_items(job, items, fleet_round)
        finally:
            self._metrics.items_running.dec(len(items))
        held = self._metrics.chunks_held_for_room
        await record_when_room(lambda: self._record(job, outcomes, entry), entry, held, self._rng)

    async def _record(
        self, job: JobRecord, outcomes: Sequence[ItemOutcome], entry: QueueEntry | None
    ) -> None:
        """Records `outcomes`, acknowledging `entry` (None: it stays pending), and counts by
        status those not recorded before (by another runner that ran the chunk too, after a
        reclaim: the items are counted once over all runners)."""
        for outcome in await self._store.record(job, outcomes, ack=entry):
            self._metrics.items.labels(outcome.status.value).inc()

    def _stopped(self, job: JobRecord, items: Sequence[_Item]) -> list[ItemOutcome] | None:
        """Cancelled outcomes when `job` must not start more items; None to go on."""
        if job.is_cancelled:
            code, message = "CANCELLED", "job cancelled"
        elif job.complete_by_s and time.time() > job.complete_by_s:
            code, message = "DEADLINE_EXCEEDED", "job's completion deadline passed"
        else:
            return None
        return [
            item_result(i, ItemStatus.CANCELLED, 0, code=code, message=message) for i, _ in items
        ]

    async def _run_items(
        self, job: JobRecord, items: Sequence[_Item], fleet_round: FleetRound
    ) -> list[ItemOutcome]:
        """Runs `items` as one call, with retries; splits it on an error only one item may
        cause. Re-reads the job before each retry, so a cancel stops the retries too."""
        num_attempts = 0
        while True:
            stop_if_cancelled()  # re-reading the job may have swallowed a drain's cancel
            stopped = self._stopped(job, items)
            if stopped is not None:
                return stopped
            num_attempts += 1
            try:
                response = await self._predict(self._request(job, items))
            except grpc.aio.AioRpcError as error:
                # Without grpc's naming of the gateway's address: results reach the job's owner.
                code, message = error.code().name, without_addresses(error.details() or "")
                hint_s = UpstreamError.from_rpc_error(error).retry_after_s or 0.0
                if error.code() in _RUNNERS_FAULT:
                    raise RunnerRefused(
                        f"gateway refused the runner's key ({code}): {message}"
                    ) from None
            else:
                return [
                    item_result(i, ItemStatus.OK, num_attempts, output=output)
                    for (i, _), output in zip(items, response.outputs, strict=True)
                ]
            decision = self._retry.decide(num_attempts, code, message, self._rng.random(), hint_s)
            if isinstance(decision, GiveUp) and len(items) > 1 and may_be_one_items(code, message):
                # One poison item fails the whole call: find it by running each alone. (Or
                # their answer together is past the message limit: alone, each may pass.)
                return await self._run_singles(job, items, fleet_round)
            # An answer past the message limit is no item's fault nor the fleet's, but it fails
            # alike however often it is retried: a lone item's fails now.
            gives_up = isinstance(decision, GiveUp)
            is_fleets = gives_up and code in FLEET_CODES and not is_too_large(code, message)
            if is_fleets and not await fleet_round.is_spent():
                self._metrics.retries.labels(code).inc()
                raise FleetUnavailable(f"{code} after {num_attempts} attempts: {message}")
            if is_fleets and code == "DEADLINE_EXCEEDED" and len(items) > 1:
                # The fleet's patience is spent, and the chunk still runs past its deadline:
                # perhaps for one item that hangs the model; its others are run alone.
                return await self._run_singles(job, items, fleet_round)
            if isinstance(decision, GiveUp):
                return [
                    item_result(
                        i,
                        ItemStatus.FAILED,
                        num_attempts,
                        code=decision.code,
                        message=decision.message,
                    )
                    for i, _ in items
                ]
            self._metrics.retries.labels(code).inc()
            await asyncio.sleep(decision.after_s)
            job = await self._store.get(job.job_id) or job

    async def _run_singles(
        self, job: JobRecord, items: Sequence[_Item], fleet_round: FleetRound
    ) -> list[ItemOutcome]:
        """Runs each of `items` alone, SPLIT_CONCURRENCY at a time. Should one fail the chunk
        (left for a later round: the fleet, the runner's key; or an answer it cannot read),
        the others' outcomes are recorded first (the entry stays pending: its rerun skips
        them) and the error raised."""
        limit = asyncio.Semaphore(SPLIT_CONCURRENCY)
        finished: list[ItemOutcome] = []

        async def alone(item: _Item) -> None:
            async with limit:  # the job read again: no item starts after a cancel
                current = await self._store.get(job.job_id)
                if current is not None:  # else gone (expired, deleted): nothing to record
                    finished.extend(await self._run_items(current, [item], fleet_round))

        try:
            await all_or_none(alone(item) for item in items)
        except Exception:  # not a cancel (the drain's): its outcomes would be a cancel's
            if finished:
                with contextlib.suppress(RedisError, OSError):  # the rerun runs them again
                    await self._record(job, finished, None)
            raise
        return sorted(finished, key=lambda outcome: outcome.index)

    def _request(self, job: JobRecord, items: Sequence[_Item]) -> api.PredictRequest:
        return api.PredictRequest(
            model_name=job.model_name,
            model_version=job.model_version,
            inputs=[api.PredictInput.FromString(payload) for _, payload in items],
            # One id for every call of the job: the gateway's sticky key, so that a job naming
            # no version runs on one label's version, not chunks of stable and of canary mixed.
            request_id=f"job-{job.job_id}",
            priority=PriorityClass.parse(job.priority).proto,
        )
