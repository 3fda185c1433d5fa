"""`inference.v1.JobService`: durable batch jobs, served by the gateway (protobuf <-> store).

SubmitJob (items inline) and SubmitJobStream (items streamed in) share one path, `_submit`: it
checks what can be checked up front (the model exists, is a fixed-cost model the tenant may use,
the version asked for exists, the priority is granted) from the first message before reading
more, counts the items against `max_items` as they arrive, and persists the job
(services.common.job_store) before answering; the items themselves are validated when a runner
sends them through Predict, and an item the model refuses fails alone. Every call is scoped to
the caller's tenant: another tenant's job id is NOT_FOUND, never PERMISSION_DENIED, so job ids
reveal nothing.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import AsyncIterable, AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import TypeVar

import grpc
from redis.exceptions import RedisError

from services.common.errors import InvalidInput, NotFound, Overloaded, Unavailable
from services.common.job_policy import JobState, eta_s, finished_prefix, job_state, progress
from services.common.job_records import JobCursor, JobRecord, NewJob, is_job_id
from services.common.job_room import (
    RESULT_OVERHEAD_BYTES,
    JobTooLarge,
    StoreFull,
    is_out_of_memory,
)
from services.common.job_store import JobStore, connect_jobs_redis
from services.common.lifecycle import MAX_MESSAGE_BYTES
from services.common.model_repository import ModelKind
from services.common.priority import PriorityClass
from services.common.redis_acl import GATEWAY, role_credentials
from services.gateway.auth import current_principal
from services.gateway.call_rows import max_call_rows
from services.gateway.catalog import ModelCatalog
from services.gateway.quota_sync import QuotaSyncConfig
from services.pb.inference.v1 import jobs_pb2 as jobs
from services.pb.inference.v1 import jobs_pb2_grpc as jobs_grpc

T = TypeVar("T")
#: Socket timeout of the job store's calls: a 100,000-item submission is a few MB.
STORE_TIMEOUT_S = 10.0
#: Results read from Redis per round trip while streaming.
RESULTS_PAGE = 256
#: Most characters of a submission's idempotency key.
MAX_IDEMPOTENCY_KEY = 256
_STATES = {
    JobState.QUEUED: jobs.JOB_STATE_QUEUED,
    JobState.RUNNING: jobs.JOB_STATE_RUNNING,
    JobState.SUCCEEDED: jobs.JOB_STATE_SUCCEEDED,
    JobState.PARTIALLY_FAILED: jobs.JOB_STATE_PARTIALLY_FAILED,
    JobState.FAILED: jobs.JOB_STATE_FAILED,
    JobState.CANCELLED: jobs.JOB_STATE_CANCELLED,
}


@dataclass(frozen=True)
class JobsApiConfig:
    #: Most items one job may have (inline, or all the messages of a stream together).
    max_items: int = 100_000
    #: Most bytes its items may take together (serialized): what one job holds of the
    #: gateway's memory while it arrives, and of Redis's until its retention ends.
    max_bytes: int = 64 * 1024 * 1024
    #: Most bytes the items of all the jobs being submitted at once may take (each until it
    #: is stored): a gateway process's memory is bounded however many submit together (those
    #: of one tenant: `max_bytes`).
    max_bytes_held: int = 128 * 1024 * 1024
    #: Items per queue entry, and so per Predict call a runner makes...
    chunk_size: int = 64
    #: ... fewer where they would make a call of more bytes than this: half the gateway's
    #: message limit (grpc refuses a call past it before any handler runs)...
    max_chunk_bytes: int = 2 * 1024 * 1024
    #: ... and an item larger goes alone, up to this: the limit less room for the call's own
    #: fields (model, request id); a larger item is refused at submission.
    max_item_bytes: int = 4 * 1024 * 1024 - 64 * 1024
    #: Largest ListJobs page.
    max_page_size: int = 500

    @classmethod
    def for_limits(cls, max_message_bytes: int, max_inputs: int) -> JobsApiConfig:
        """The defaults, with chunks and items bounded for a gateway taking messages of
        `max_message_bytes` (and runners' channels, 64 MiB; room for a call's own fields is
        kept however small the limit) and calls of `max_inputs` inputs at most."""
        limit = min(max_message_bytes, MAX_MESSAGE_BYTES)
        return cls(chunk_size=min(cls.chunk_size, max_inputs), max_chunk_bytes=limit // 2,
                   max_item_bytes=limit - min(64 * 1024, limit // 4))  # fmt: skip


class HeldBytes:
    """The bytes of items that the jobs being submitted to a gateway process hold, in all and
    by tenant, each within its bound."""

    def __init__(self, max_total: int, max_per_tenant: int) -> None:
        self._max_total, self._max_per_tenant = max_total, max_per_tenant
        self.total = 0
        self._by_tenant: dict[str, int] = {}

    def take(self, tenant: str, num_bytes: int) -> None:
        """Holds `num_bytes` more for `tenant`; RESOURCE_EXHAUSTED (nothing held) past a bound."""
        held = self._by_tenant.get(tenant, 0)
        if held + num_bytes > self._max_per_tenant:
            whose = f"tenant {tenant!r}'s jobs being submitted hold {held} bytes"
        elif self.total + num_bytes > self._max_total:
            whose = f"the jobs being submitted to this gateway hold {self.total} bytes"
        else:
            self._by_tenant[tenant] = held + num_bytes
            self.total += num_bytes
            return
        raise Overloaded(f"{whose}, past its bound: submit again shortly", retry_after_s=1.0)

    def give_back(self, tenant: str, num_bytes: int) -> None:
        if num_bytes:
            self.total -= num_bytes
            left = self._by_tenant.pop(tenant) - num_bytes
            if left:
                self._by_tenant[tenant] = left


def job_to_pb(record: JobRecord, now_s: float) -> jobs.Job:
    """The API's view of a stored job; its state and ETA are derived here."""
    counts = record.counts
    return jobs.Job(
        job_id=record.job_id,
        model_name=record.model_name,
        model_version=record.model_version,
        state=_STATES[job_state(record.num_items, counts, is_cancelled=record.is_cancelled)],
        num_items=record.num_items,
        num_ok=counts.num_ok,
        num_failed=counts.num_failed,
        num_cancelled=counts.num_cancelled,
        progress=progress(record.num_items, counts),
        eta_s=eta_s(record.num_items, counts, started_s=record.started_s, now_s=now_s),
        created_unix_s=record.created_s,
        started_unix_s=record.started_s,
        priority=PriorityClass.parse(record.priority).proto,
        idempotency_key=record.idempotency_key,
        complete_by_unix_s=record.complete_by_s,
    )


class JobServicer(jobs_grpc.JobServiceServicer):
    def __init__(self, store: JobStore, catalog: ModelCatalog, config: JobsApiConfig) -> None:
        self._store = store
        self._catalog = catalog
        self._config = config
        #: Bytes of items the jobs being submitted now hold: `max_bytes_held` in all, and one
        #: job's `max_bytes` a tenant (one tenant's slow streams cannot shut out the rest).
        self._held = HeldBytes(config.max_bytes_held, config.max_bytes)

    async def _own_job(self, job_id: str) -> JobRecord:
        """The caller's job `job_id`; NotFound when missing or another tenant's."""
        # An id of another shape names no job (and must not reach Redis: `<id>:items` is a key).
        record = await _stored(self._store.get(job_id)) if is_job_id(job_id) else None
        if record is None or record.tenant != current_principal().tenant:
            raise NotFound(f"job {job_id!r} not found")
        return record

    async def SubmitJob(
        self, request: jobs.SubmitJobRequest, context: grpc.aio.ServicerContext
    ) -> jobs.SubmitJobResponse:
        return await self._submit(_one(request))

    async def SubmitJobStream(
        self, requests: AsyncIterable[jobs.SubmitJobRequest], context: grpc.aio.ServicerContext
    ) -> jobs.SubmitJobResponse:
        return await self._submit(aiter(requests))

    async def _submit(
        self, messages: AsyncIterator[jobs.SubmitJobRequest]
    ) -> jobs.SubmitJobResponse:
        """Submits the job the first of `messages` describes, with the items of them all.
        Refused as soon as a message breaks a rule: the rest of the stream is never read."""
        header = await anext(messages, None)
        if header is None:
            raise InvalidInput("the stream has no message: the first one names the model")
        principal = current_principal()
        config = self._catalog.config(header.model_name)  # NOT_FOUND first, as Predict
        principal.check_model(config.name)
        if config.kind == ModelKind.GENERATION:
            raise InvalidInput("jobs run fixed-cost (Predict) models, not generation models")
        if header.model_version.strip():  # one no worker serves yet may be loading: not refused
            self._catalog.version_of(config.name, header.model_version)
        try:
            requested = PriorityClass.from_proto(header.priority) or PriorityClass.BATCH
        except ValueError as error:
            raise InvalidInput(str(error)) from None
        if requested is PriorityClass.CRITICAL:  # the runners' key holds no such grant
            raise InvalidInput("a job runs at interactive or batch priority, not critical")
        priority = principal.policy.priority_for(requested)
        complete_by_s = _complete_by_s(header.complete_by_unix_s)
        idempotency_key = _idempotency_key(header.idempotency_key)
        if complete_by_s and (past_s := time.time() - complete_by_s) >= 0.0:
            # A resend of a job whose deadline has since passed still gets its job.
            job_of_key = self._store.job_of_key(principal.tenant, idempotency_key)
            if (existing := await _stored(job_of_key)) is None:
                raise InvalidInput(f"complete_by_unix_s {complete_by_s} passed {past_s:.1f} s ago")
            return jobs.SubmitJobResponse(job_id=existing, is_existing=True)
        items: list[bytes] = []
        num_bytes = 0  # of the gateway's memory, held until the job is stored
        tenant = principal.tenant
        try:
            num_bytes = self._add_items(items, header, 0, tenant)
            async for message in messages:
                _check_same_header(header, message)
                num_bytes = self._add_items(items, message, num_bytes, tenant)
            if not items:
                raise InvalidInput(f"a job needs 1 to {self._config.max_items} items")
            job = NewJob(
                tenant=tenant,
                model_name=header.model_name,
                model_version=header.model_version,
                priority=priority.value,
                items=items,
                idempotency_key=idempotency_key,
                complete_by_s=complete_by_s,
                result_bytes=len(items) * (max(0, config.output_row_bytes) + RESULT_OVERHEAD_BYTES),
            )
            # A chunk is one call: no more rows than the model takes in one (check_call_rows
            # refuses more, and the runner would split each such chunk into one-item calls).
            chunk_size = min(self._config.chunk_size, max_call_rows(config, priority))
            max_chunk_bytes = self._config.max_chunk_bytes
            job_id, is_existing = await _stored(
                self._store.submit(job, chunk_size=chunk_size, max_chunk_bytes=max_chunk_bytes)
            )
        finally:
            self._held.give_back(tenant, num_bytes)
        return jobs.SubmitJobResponse(job_id=job_id, is_existing=is_existing)

    def _add_items(
        self, items: list[bytes], message: jobs.SubmitJobRequest, num_bytes: int, tenant: str
    ) -> int:
        """Appends `message`'s items, serialized, to `items` (holding `num_bytes`); returns
        their bytes now. InvalidInput, before appending any, when they would take the job past
        `max_items` or `max_bytes`; RESOURCE_EXHAUSTED past what the gateway holds at once."""
        if len(items) + len(message.items) > self._config.max_items:
            raise InvalidInput(f"a job needs 1 to {self._config.max_items} items")
        added = [item.SerializeToString() for item in message.items]
        if b"" in added:  # no payload (text or tensor): each would fail at run time, alone
            index = len(items) + added.index(b"")
            raise InvalidInput(f"item {index} has no payload (text or tensor)")
        if any(len(item) > self._config.max_item_bytes for item in added):
            raise InvalidInput(
                f"an item may take at most {self._config.max_item_bytes} bytes (its runner's "
                "call must fit the gateway's message limit)"
            )
        num_added = sum(map(len, added))
        if num_bytes + num_added > self._config.max_bytes:
            raise InvalidInput(
                f"a job's items may take at most {self._config.max_bytes} bytes: split it"
            )
        self._held.take(tenant, num_added)
        items.extend(added)
        return num_bytes + num_added

    async def GetJob(
        self, request: jobs.GetJobRequest, context: grpc.aio.ServicerContext
    ) -> jobs.Job:
        return job_to_pb(await self._own_job(request.job_id), time.time())

    async def ListJobs(
        self, request: jobs.ListJobsRequest, context: grpc.aio.ServicerContext
    ) -> jobs.ListJobsResponse:
        size = min(request.page_size or 50, self._config.max_page_size)
        try:
            after = JobCursor.parse(request.page_token) if request.page_token else None
        except ValueError:
            size = 0  # refused below, as a size that is not positive
        if size < 1:
            raise InvalidInput("page_size must be positive and page_token a previous token")
        tenant = current_principal().tenant
        found = await _stored(self._store.list_ids(tenant, after=after, limit=size + 1))
        now_s = time.time()
        records = await _stored(self._store.get_many([i for i, _ in found[:size]]))
        expired = [i for (i, _), record in zip(found[:size], records, strict=True) if not record]
        if expired:  # kept past their retention: gone for good (a later list tries again)
            with contextlib.suppress(RedisError, OSError):
                await self._store.forget(tenant, expired)
        return jobs.ListJobsResponse(
            jobs=[job_to_pb(r, now_s) for r in records if r is not None],
            next_page_token=found[size - 1][1].token() if len(found) > size else "",
        )

    async def CancelJob(
        self, request: jobs.CancelJobRequest, context: grpc.aio.ServicerContext
    ) -> jobs.Job:
        record = await self._own_job(request.job_id)
        state = job_state(record.num_items, record.counts, is_cancelled=record.is_cancelled)
        if not state.is_terminal:
            await _stored(self._store.cancel(record.job_id))
            record = await self._own_job(request.job_id)
        return job_to_pb(record, time.time())

    async def GetJobResults(
        self, request: jobs.GetJobResultsRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[jobs.JobItemResult]:
        record = await self._own_job(request.job_id)
        if not 0 <= request.start_index <= record.num_items:
            raise InvalidInput(
                f"start_index must be in [0, {record.num_items}] (the job's items), got "
                f"{request.start_index}"
            )
        index = request.start_index
        while index < record.num_items:
            count = min(RESULTS_PAGE, record.num_items - index)
            page = await _stored(self._store.results(record.job_id, index, count))
            found = finished_prefix(page)
            for payload in found:
                yield jobs.JobItemResult.FromString(payload)
            index += len(found)
            if len(found) < count:
                return


def _complete_by_s(value: float) -> float:
    """A submission's completion deadline: 0 (none) or a finite time after the epoch (one
    already past is refused unless its idempotency key names a job: it would only cancel every
    item)."""
    if not (value == 0.0 or 0.0 < value < math.inf):
        raise InvalidInput(f"complete_by_unix_s must be 0 (none) or a time, got {value}")
    return value


def _idempotency_key(key: str) -> str:
    """A submission's idempotency key, at most MAX_IDEMPOTENCY_KEY characters (it names a
    Redis key and field)."""
    if len(key) > MAX_IDEMPOTENCY_KEY:
        raise InvalidInput(
            f"idempotency_key has {len(key)} characters; at most {MAX_IDEMPOTENCY_KEY}"
        )
    return key


async def _one(request: jobs.SubmitJobRequest) -> AsyncIterator[jobs.SubmitJobRequest]:
    """An inline submission as the stream of its one message."""
    yield request


def _check_same_header(header: jobs.SubmitJobRequest, message: jobs.SubmitJobRequest) -> None:
    """A later message of a stream may set a field other than `items` only to the value the
    first message (`header`) gave it. Unset fields are absent from ListFields (proto3)."""
    for field, value in message.ListFields():
        if field.name != "items" and value != getattr(header, field.name):
            raise InvalidInput(
                f"{field.name} differs from the stream's first message: a later message "
                "carries items only"
            )


#: The retry hint of a job refused because the store is full: jobs finish and expire slowly.
STORE_FULL_RETRY_S = 60.0


async def _stored(awaitable: Awaitable[T]) -> T:
    """Awaits a store call; Redis unreachable is UNAVAILABLE (safe to retry), Redis at its
    memory cap (`--maxmemory`, nothing evicted) RESOURCE_EXHAUSTED: a resend fails alike until
    jobs expire or the store grows."""
    try:
        return await awaitable
    except JobTooLarge as error:
        raise InvalidInput(
            f"the job's items and expected results take {error}: submit fewer items"
        ) from None
    except StoreFull as error:
        raise Overloaded(
            f"the job store is full (Redis near its memory cap: {error}): retry once jobs "
            "have finished and expired, or submit fewer items",
            retry_after_s=STORE_FULL_RETRY_S,
        ) from None
    except RedisError as error:
        if not is_out_of_memory(error):
            raise Unavailable(f"job store unavailable: {type(error).__name__}") from None
        raise Overloaded(
            f"the job store is full (Redis at its memory cap: {error}): retry once jobs have "
            "finished and expired",
            retry_after_s=STORE_FULL_RETRY_S,
        ) from None
    except OSError as error:
        raise Unavailable(f"job store unavailable: {type(error).__name__}") from None


def add_job_service(
    server: grpc.aio.Server, catalog: ModelCatalog, redis: QuotaSyncConfig,
    max_message_bytes: int, max_inputs: int,
) -> JobStore | None:  # fmt: skip
    """Serves JobService on `server` when the gateway has a Redis (its quota-sharing one, as
    Redis user `gateway`); the store (None: no Redis, UNIMPLEMENTED). Chunks fit the limits."""
    if not redis.redis_url:
        return None
    credentials = role_credentials(GATEWAY, redis.redis_url, redis.redis_password_file)
    client = connect_jobs_redis(redis.redis_url, timeout_s=STORE_TIMEOUT_S, credentials=credentials)
    store = JobStore(client, prefix=redis.key_prefix)
    config = JobsApiConfig.for_limits(max_message_bytes, max_inputs)
    jobs_grpc.add_JobServiceServicer_to_server(JobServicer(store, catalog, config), server)
    return store
