"""The worker registry's records and their Redis layout.

Workers heartbeat one JSON record each; routers read them all in one pipelined round trip per
refresh period (never per request). Liveness is the heartbeat's score in a sorted set, compared
with the reader's clock: never an expiry event.

Redis layout (all keys under a configurable prefix, default "fabric"):
- `<prefix>:workers`          sorted set: worker_id -> last heartbeat, unix ms
- `<prefix>:worker:<id>`      string: the WorkerRecord JSON, with a TTL (a safety net only)
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any, TypeVar

if TYPE_CHECKING:
    # Imported where used (`connect`): the records are pure data, and the simulator
    # (services.sim) reads them without pulling redis, and with it asyncio, in.
    import redis.asyncio as aioredis
    from redis.credentials import CredentialProvider


@dataclass(frozen=True)
class ModelRecord:
    """One model version as a worker serves it."""

    name: str
    version: str
    #: Fingerprint of weights + tokenizer + preprocessing: requests must carry it.
    fingerprint: str
    #: Fingerprint of the tokenizer + preprocessing alone: a gateway tokenizes only if its own
    #: tokenizer has the same one.
    tokenizer_fingerprint: str
    kind: str
    max_batch_size: int
    slo_p99_ms: int
    #: Predicted compute per row at the largest batch (seconds): the marginal cost of a row.
    per_row_s: float
    #: Predicted compute of a batch of one (seconds): the floor of any request's latency.
    min_batch_s: float
    #: Rows queued in the worker's batcher for this version when the heartbeat was sent, of
    #: priority classes above `batch` (what an interactive or critical arrival waits behind).
    queued_rows: int
    is_ready: bool
    #: Generation models: free KV-cache blocks, tokens per block, context length (0 otherwise).
    kv_blocks_free: int = 0
    kv_block_size: int = 0
    max_model_len: int = 0
    #: The model refuses what is predicted to finish past its SLO, not only past the deadline.
    shed_past_slo: bool = False
    #: Rows of priority class `batch` queued for this version (they run after every other
    #: class, so only `batch` arrivals wait behind them).
    queued_batch_rows: int = 0
    #: Cumulative since the worker started: batches run, rows run, rows' total queueing time
    #: and batches' total compute time, seconds (Triton-style statistics).
    executions: int = 0
    executed_rows: int = 0
    queue_s_total: float = 0.0
    compute_s_total: float = 0.0
    #: Its batches all fail on this worker lately (services.gpu_worker.batching.failure_streak):
    #: routers send its calls to other workers while any serves it.
    is_failing: bool = False
    #: The model's desired-state revision the worker has applied, its loads and unloads done
    #: with its files read (0: none yet, or the model has no desired state); -1: a worker of a
    #: build before.
    revision: int = -1

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"


@dataclass(frozen=True)
class FailedVersion:
    """A version in a worker's repository and pool that failed to load: not served."""

    name: str
    version: str
    #: The loader's error, one line.
    error: str
    #: The model's desired-state revision the attempt followed (0: none written yet; a
    #: record from before the field). In JSON, the record's `failed_revisions`, one each, in
    #: order: a router of an earlier build refuses a failure with a field it does not know,
    #: and with it the whole record (it skipped every upgraded worker that failed a load).
    revision: int = 0


#: The revision of the internal API (proto/inference/v1/worker.proto) a worker serves, in its
#: heartbeat. 1: one caller's rows per call; 2: bundles (packed rows, a status per slice),
#: which routers and gateways now send. A record without one is a worker from before.
INTERNAL_API = 2


@dataclass(frozen=True)
class WorkerRecord:
    """One worker's heartbeat."""

    worker_id: str
    #: host:port the router dials.
    address: str
    is_draining: bool
    #: Worker's wall clock when sent, unix ms (informational; liveness uses the zset score).
    sent_at_ms: int
    models: tuple[ModelRecord, ...]
    #: Versions that failed to load (at start or on a hot load), for operators and tools.
    failed: tuple[FailedVersion, ...] = ()
    #: The internal API it serves (INTERNAL_API when it is this build).
    internal_api: int = INTERNAL_API
    #: When its process started, unix ms (0: not said): a new process under a known id (a
    #: container restarted in its pod keeps its hostname, and may its pid) is a new worker.
    started_at_ms: int = 0

    def to_json(self) -> str:
        raw = asdict(self)
        raw["failed_revisions"] = [failure.pop("revision") for failure in raw["failed"]]
        return json.dumps(raw, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerRecord:
        raw = json.loads(text)
        return cls(
            worker_id=str(raw["worker_id"]),
            address=str(raw["address"]),
            is_draining=bool(raw["is_draining"]),
            sent_at_ms=int(raw["sent_at_ms"]),
            models=tuple(_typed(ModelRecord, m) for m in raw["models"]),
            failed=_failed(raw.get("failed", ()), raw.get("failed_revisions")),
            internal_api=int(raw.get("internal_api", 1)),
            started_at_ms=int(raw.get("started_at_ms", 0)),
        )

    def model(self, name: str, version: str) -> ModelRecord | None:
        return next((m for m in self.models if m.name == name and m.version == version), None)


def _failed(failures: list[Any], revisions: Any) -> tuple[FailedVersion, ...]:
    """A record's failed versions, each with its revision (`failed_revisions`; none: all 0)."""
    if revisions is None:  # a record from before `failed_revisions`
        return tuple(_typed(FailedVersion, failure) for failure in failures)
    if not (isinstance(revisions, list) and len(revisions) == len(failures)
            and all(_is_json_type(r, "int") for r in revisions)):  # fmt: skip
        raise TypeError(f"failed_revisions is not one int per failure: {revisions!r}")
    return tuple(
        replace(_typed(FailedVersion, failure), revision=revision)
        for failure, revision in zip(failures, revisions, strict=True)
    )


_R = TypeVar("_R", ModelRecord, FailedVersion)
#: The largest integer a float holds exactly.
_MAX_EXACT_INT = 2**53
#: The numeric fields that may be negative (-1: a writer of a build before them); any other
#: is a count, a time or a size, and a negative one (a forged or buggy record's) priced its
#: worker below every other, and routers sent it every call (review finding).
_SIGNED_FIELDS = frozenset({"revision"})


def _is_json_type(value: object, kind: str) -> bool:
    """Whether a JSON value is of a record field's annotated type (a string: annotations are
    postponed): a bool is no number, a float is finite, an int does for a float, and an int is
    within a float's exact range (a 400-digit count overflowed routing's float arithmetic)."""
    if kind == "bool" or isinstance(value, bool):
        return kind == "bool" and isinstance(value, bool)
    if kind in ("int", "float") and isinstance(value, int):
        return abs(value) <= _MAX_EXACT_INT
    if kind == "float":
        return isinstance(value, float) and math.isfinite(value)
    return kind == "str" and isinstance(value, str)


def _typed(cls: type[_R], raw: Mapping[str, object]) -> _R:
    """`cls(**raw)`, each field's type checked: a forged or corrupt record (`"queued_rows":
    "3"`) is refused here, as malformed, and readers skip it; it raised TypeError in routing,
    every call, on every router."""
    known = {}
    for field in fields(cls):
        if field.name in raw:
            value = raw[field.name]
            if not _is_json_type(value, str(field.type)):
                raise TypeError(f"{cls.__name__}.{field.name} is not {field.type}: {value!r}")
            if isinstance(value, int | float) and value < 0 and field.name not in _SIGNED_FIELDS:
                raise TypeError(f"{cls.__name__}.{field.name} is negative: {value!r}")
            known[field.name] = value
    # A field of a later build is left out: a reader reads the records of writers upgraded
    # before it (workers are upgraded first), as protobuf readers skip unknown fields.
    return cls(**known)  # type: ignore[arg-type]  # checked above


@dataclass(frozen=True)
class RegistryKeys:
    prefix: str = "fabric"

    @property
    def workers(self) -> str:
        return f"{self.prefix}:workers"

    def worker(self, worker_id: str) -> str:
        return f"{self.prefix}:worker:{worker_id}"

    @property
    def epoch(self) -> str:
        """A token the first heartbeat into an empty Redis writes (SET NX): it changes when
        Redis loses the registry (restarted empty, flushed, failed over to an empty replica),
        which a router's reads may not see fail (a client retrying the connection)."""
        return f"{self.prefix}:epoch"


#: What a tier says when Redis refuses it the registry's epoch (NOPERM).
ACL_BEHIND = (
    "Redis refuses the registry's epoch key: its ACL predates this release (ACL LOAD the "
    "updated users.acl, or restart Redis); until then a Redis that loses the registry unseen "
    "is not told"
)


#: Routing metadata the gateway attaches to a router call, so the router forwards the body as
#: opaque bytes without parsing it.
ROUTE_MODEL_KEY = "x-route-model"
ROUTE_VERSION_KEY = "x-route-version"
ROUTE_ROWS_KEY = "x-route-rows"
#: Priority class name (`services.common.priority.PriorityClass` value); absent means the
#: default class.
ROUTE_PRIORITY_KEY = "x-route-priority"
#: The caller's tenant and its fair-share weight: the router predicts a request's wait from the
#: rows fair share serves before it, not from every row queued (one tenant's backlog must not
#: make another's request look late). Absent: one anonymous tenant of weight 1.
ROUTE_TENANT_KEY = "x-route-tenant"
ROUTE_WEIGHT_KEY = "x-route-tenant-weight"


def route_metadata(
    name: str,
    version: str,
    num_rows: int,
    priority: str = "",
    *,
    tenant: str = "",
    weight: float = 1.0,
) -> tuple[tuple[str, str], ...]:
    pairs = [(ROUTE_MODEL_KEY, name), (ROUTE_VERSION_KEY, version), (ROUTE_ROWS_KEY, str(num_rows))]
    if priority:
        pairs.append((ROUTE_PRIORITY_KEY, priority))
    if tenant:
        pairs += [(ROUTE_TENANT_KEY, tenant), (ROUTE_WEIGHT_KEY, repr(float(weight)))]
    return tuple(pairs)


def parse_route_metadata(metadata: Mapping[str, str]) -> tuple[str, str, int] | None:
    """(model, version, rows) from call metadata, or None when any is missing or malformed."""
    name = metadata.get(ROUTE_MODEL_KEY)
    version = metadata.get(ROUTE_VERSION_KEY)
    rows = metadata.get(ROUTE_ROWS_KEY, "")
    # isascii too: "²".isdigit() is True, and int() of it raises.
    if not name or not version or not (rows.isascii() and rows.isdigit()) or int(rows) < 1:
        return None
    return name, version, int(rows)


def connect(
    url: str, *, timeout_s: float = 0.5, credentials: CredentialProvider | None = None
) -> aioredis.Redis:
    """A client whose calls fail fast: a slow or dead Redis must never stall the event loop.
    `credentials` (services.common.redis_acl.role_credentials) when the URL carries none."""
    import redis.asyncio as aioredis

    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry_on_timeout=False,
        credential_provider=credentials,
    )
