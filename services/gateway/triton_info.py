"""What Triton's clients ask a server about its models besides inference: `ModelConfig` (in
Triton's ModelConfig message) and `ModelStatistics` (cumulative counts and times per model
version), and the RPCs of Triton's service this server declares but does not serve.

Statistics are the gateway's own: every Predict or ModelInfer this gateway answered, counted
when it finishes (success or failure, with the time from arrival to answer), and the rows it
carried. Queue and compute times are the workers' (summed over the live workers' heartbeats,
see `WorkerTimes`); a worker that leaves takes its share with it, so those are a view of the
fleet now, not a ledger. Pure: no clock reads (times come in as arguments), no I/O.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from services.common.errors import InvalidInput, Unimplemented
from services.common.model_repository import ModelConfig, ModelKind, TensorSpec
from services.common.priority import PriorityClass
from services.pb.inference import grpc_service_pb2 as kserve
from services.pb.inference import model_config_pb2 as triton

#: Platform names as Triton reports them.
PLATFORMS = {
    ModelKind.EMBEDDING: "pytorch",
    ModelKind.TORCHSCRIPT: "pytorch_libtorch",
    ModelKind.GENERATION: "pytorch",
}
#: Triton's priority levels (1 is the highest) for our classes, and the default's level.
PRIORITY_LEVELS = {
    PriorityClass.CRITICAL: 1,
    PriorityClass.INTERACTIVE: 2,
    PriorityClass.BATCH: 3,
}
#: Protocol dtype names to Triton configuration types.
_DATA_TYPES = {
    "BOOL": triton.TYPE_BOOL,
    "UINT8": triton.TYPE_UINT8,
    "INT8": triton.TYPE_INT8,
    "INT16": triton.TYPE_INT16,
    "INT32": triton.TYPE_INT32,
    "INT64": triton.TYPE_INT64,
    "FP16": triton.TYPE_FP16,
    "FP32": triton.TYPE_FP32,
    "FP64": triton.TYPE_FP64,
    "BF16": triton.TYPE_BF16,
    "BYTES": triton.TYPE_STRING,
}
#: The inputs a generation model's request may add to its own (`text_input`): the optional
#: inputs of Triton's vLLM backend that services.gateway.kserve_generate reads.
GENERATION_OPTIONAL_INPUTS = (
    TensorSpec("stream", "BOOL", (1,)),
    TensorSpec("exclude_input_in_output", "BOOL", (1,)),
    TensorSpec("sampling_parameters", "BYTES", (1,)),
)
#: Triton's RPCs that this server declares and answers UNIMPLEMENTED, with the reason.
UNIMPLEMENTED_RPCS: Mapping[str, str] = {
    "SystemSharedMemoryStatus": "shared memory is not supported: send tensors in the request",
    "SystemSharedMemoryRegister": "shared memory is not supported: send tensors in the request",
    "SystemSharedMemoryUnregister": "shared memory is not supported",
    "CudaSharedMemoryStatus": "CUDA shared memory is not supported: send tensors in the request",
    "CudaSharedMemoryRegister": "CUDA shared memory is not supported",
    "CudaSharedMemoryUnregister": "CUDA shared memory is not supported",
    "TraceSetting": "trace settings are not served: tracing is OpenTelemetry, set by OTEL_*",
    "LogSettings": "log settings are not served: set --log-level at start",
}


def model_config_message(config: ModelConfig) -> triton.ModelConfig:
    """`config` in Triton's terms. The dynamic batcher's queue delay is the SLO: the upper
    bound of what the workers derive per batch key (the derived figures are the workers'
    `linger` gauges)."""
    queue_policy = triton.ModelQueuePolicy(
        timeout_action=(
            triton.ModelQueuePolicy.REJECT
            if config.shed_past_slo
            else triton.ModelQueuePolicy.DELAY
        ),
        default_timeout_microseconds=config.default_timeout_ms * 1000,
        allow_timeout_override=True,
        max_queue_size=config.max_queue_size,
    )
    message = triton.ModelConfig(
        name=config.name,
        platform=PLATFORMS[config.kind],
        backend="inference-fabric",
        max_batch_size=config.max_batch_size,
        input=[
            triton.ModelInput(
                name=s.name, data_type=_DATA_TYPES[s.dtype], dims=s.dims, optional=is_optional
            )
            for s, is_optional in request_inputs(config)
        ],
        output=[
            triton.ModelOutput(name=s.name, data_type=_DATA_TYPES[s.dtype], dims=s.dims)
            for s in config.outputs
        ],
        dynamic_batching=triton.ModelDynamicBatching(
            preferred_batch_size=[config.max_batch_size],
            max_queue_delay_microseconds=config.slo_p99_ms * 1000,
            priority_levels=len(PRIORITY_LEVELS),
            default_priority_level=PRIORITY_LEVELS[PriorityClass.INTERACTIVE],
            default_queue_policy=queue_policy,
        ),
        parameters={k: triton.ModelParameter(string_value=v) for k, v in _parameters(config)},
    )
    if config.generation is not None:
        # As Triton writes it: the policy appears only for decoupled models.
        message.model_transaction_policy.decoupled = True
    return message


def request_inputs(config: ModelConfig) -> list[tuple[TensorSpec, bool]]:
    """The inputs a request of `config`'s model takes, each with whether it may be left out:
    the model's own, then a generation model's optional ones (GENERATION_OPTIONAL_INPUTS) that
    it does not declare itself (one it does stays optional: the gateway requires `text_input`
    alone), as Triton lists a vLLM model's in its configuration and metadata."""
    optional = GENERATION_OPTIONAL_INPUTS if config.generation is not None else ()
    optional_names = {s.name for s in optional}
    declared = {s.name for s in config.inputs}  # one declared too is listed once, optional
    return [(s, s.name in optional_names) for s in config.inputs] + [
        (s, True) for s in optional if s.name not in declared
    ]


def _parameters(config: ModelConfig) -> Iterable[tuple[str, str]]:
    yield "kind", config.kind.value
    yield "slo_p99_ms", str(config.slo_p99_ms)
    yield "shed_past_slo", str(config.shed_past_slo).lower()
    if config.generation is None:
        yield "max_batch_tokens", str(config.max_batch_tokens)
        yield "length_buckets", ",".join(map(str, config.length_buckets))
        return
    generation = config.generation
    yield "max_model_len", str(generation.max_model_len)
    yield "kv_block_size", str(generation.block_size)
    yield "num_kv_blocks", str(generation.num_kv_blocks)
    yield "max_num_seqs", str(generation.max_num_seqs)


def unimplemented(rpc: str) -> Unimplemented:
    return Unimplemented(f"{rpc} is not implemented: {UNIMPLEMENTED_RPCS[rpc]}")


@dataclass(frozen=True)
class WorkerTimes:
    """One model version's cumulative batcher figures, summed over the live workers."""

    #: Batches (model executions) run.
    executions: int = 0
    #: Rows' total time queued before their batch ran, seconds.
    queue_s: float = 0.0
    #: Rows that ran.
    rows: int = 0
    #: Executions' total model time, seconds.
    compute_s: float = 0.0


@dataclass
class _Tally:
    success_count: int = 0
    success_ns: int = 0
    fail_count: int = 0
    fail_ns: int = 0
    rows: int = 0
    last_unix_ms: int = 0


class InferenceStatistics:
    """The gateway's per model version tally of the requests it answered."""

    def __init__(self) -> None:
        self._tallies: dict[tuple[str, str], _Tally] = {}

    def record(
        self,
        model: str,
        version: str,
        *,
        rows: int,
        is_ok: bool,
        duration_s: float,
        finished_unix_s: float,
    ) -> None:
        """One answered request. `version` is the resolved version ("" if it never resolved:
        such failures are not kept, as no version could report them)."""
        if not version:
            return
        tally = self._tallies.setdefault((model, version), _Tally())
        duration_ns = max(0, round(duration_s * 1e9))
        if is_ok:
            tally.success_count += 1
            tally.success_ns += duration_ns
            tally.rows += rows
        else:
            tally.fail_count += 1
            tally.fail_ns += duration_ns
        tally.last_unix_ms = max(tally.last_unix_ms, round(finished_unix_s * 1000))

    def message(self, model: str, version: str, workers: WorkerTimes) -> kserve.ModelStatistics:
        """Triton's ModelStatistics of one version (zeros for a version never asked for)."""
        tally = self._tallies.get((model, version), _Tally())
        return kserve.ModelStatistics(
            name=model,
            version=version,
            last_inference=tally.last_unix_ms,
            inference_count=tally.rows,
            execution_count=workers.executions,
            inference_stats=kserve.InferStatistics(
                success=kserve.StatisticDuration(count=tally.success_count, ns=tally.success_ns),
                fail=kserve.StatisticDuration(count=tally.fail_count, ns=tally.fail_ns),
                queue=kserve.StatisticDuration(count=workers.rows, ns=round(workers.queue_s * 1e9)),
                compute_infer=kserve.StatisticDuration(
                    count=workers.executions, ns=round(workers.compute_s * 1e9)
                ),
            ),
        )

    def forget(self, model: str, version: str) -> None:
        """Drops a version's tally (retired: no worker serves it, the repository holds it no
        more); Triton lists only the versions it has."""
        self._tallies.pop((model, version), None)

    def versions(self, model: str) -> list[str]:
        """Versions of `model` with a tally, in numeric order."""
        found = {v for (m, v) in self._tallies if m == model}
        return sorted(found, key=lambda v: (len(v), v))


@dataclass(frozen=True)
class RequestParameters:
    """The request `parameters` Triton honours, as this gateway honours them."""

    #: Triton's `priority` (1 is the highest of `priority_levels`, 0 the model's default).
    priority: PriorityClass | None = None
    #: Triton's `timeout` (microseconds): the call's deadline if tighter than the gRPC one.
    timeout_s: float | None = None

    def deadline_s(self, time_remaining_s: float | None) -> float | None:
        """The tighter of the gRPC deadline's remaining time and `timeout`."""
        if self.timeout_s is None:
            return time_remaining_s
        return self.timeout_s if time_remaining_s is None else min(self.timeout_s, time_remaining_s)


_LEVEL_CLASSES = {level: cls for cls, level in PRIORITY_LEVELS.items()}
_NO_PARAMETERS = RequestParameters()
#: The longest `timeout` taken, microseconds (a year); a longer one counts as this.
MAX_TIMEOUT_US = 365 * 24 * 3600 * 10**6


def request_parameters(parameters: Mapping[str, kserve.InferParameter]) -> RequestParameters:
    """Reads `priority` and `timeout`; other parameters are left to their readers. Raises
    InvalidInput for a value that is not a non-negative integer or a level out of range."""
    if not parameters:  # what stock clients send: no map lookups
        return _NO_PARAMETERS
    priority = _integer(parameters, "priority")
    timeout_us = _integer(parameters, "timeout")
    if priority is not None and priority != 0 and priority not in _LEVEL_CLASSES:
        raise InvalidInput(
            f"parameter priority={priority}: levels are 1 (highest) to {len(PRIORITY_LEVELS)}, "
            "or 0 for the default"
        )
    return RequestParameters(
        priority=_LEVEL_CLASSES.get(priority) if priority else None,
        # Past a year it is no bound (and 2**64-1 us overflowed the internal calls' uint64).
        timeout_s=min(timeout_us, MAX_TIMEOUT_US) / 1e6 if timeout_us else None,
    )


def _integer(parameters: Mapping[str, kserve.InferParameter], name: str) -> int | None:
    if name not in parameters:
        return None
    parameter = parameters[name]
    which = parameter.WhichOneof("parameter_choice")
    if which not in ("int64_param", "uint64_param"):
        raise InvalidInput(f"parameter {name} must be an integer, got {which or 'nothing'}")
    value = int(getattr(parameter, which))
    if value < 0:
        raise InvalidInput(f"parameter {name} must be >= 0, got {value}")
    return value
