"""How many rows one call, and one bundle, of a model may carry at the gateway: what its
workers' queue takes of one call of its class, and what one answer's bytes carry."""

from __future__ import annotations

from services.common.errors import InvalidInput
from services.common.model_repository import ModelConfig
from services.common.multiplex import MAX_CALL_BYTES
from services.common.priority import PriorityClass, max_queued_rows

#: Most bytes of rows and slices one bundle carries, and of outputs its answer carries: a
#: call or an answer past the stream's limit would fail every caller in it
#: (multiplex.MAX_CALL_BYTES); the rest is room for the bundle's own fields.
MAX_BUNDLE_BYTES = MAX_CALL_BYTES - (1 << 20)


def max_bundle_rows(config: ModelConfig, priority: PriorityClass) -> int:
    """Most rows a bundle of `config`'s model in class `priority` takes: a batch, but no more
    than its workers' queue takes of that class (a bundle past it is refused whole there, or,
    of `batch` rows, its later slices on an idle worker too) nor than one answer's bytes
    carry (a model whose rows answer megabytes, served alone at light load, would otherwise
    fail every caller of a full bundle under load)."""
    return min(config.max_batch_size, max_call_rows(config, priority))


def max_call_rows(config: ModelConfig, priority: PriorityClass) -> int:
    """Most rows one call of `config`'s model in class `priority` may carry
    (`check_call_rows`)."""
    queued = max_queued_rows(priority, config.max_queue_size)
    return max(1, min(queued, _rows_by_bytes(config)))


def check_call_rows(config: ModelConfig, num_rows: int, priority: PriorityClass) -> None:
    """Refuses (INVALID_ARGUMENT) a call of more rows than `config`'s model could ever serve
    at once: past what its workers' queue takes of one call of its class (refused there on an
    idle worker too, with a retry hint, for good), or answering more bytes than one answer
    carries (a caller past a bundle's rows is sent alone: its rows were computed, then refused
    RESOURCE_EXHAUSTED as if for load, and retried for good)."""
    if num_rows > (queued := max_queued_rows(priority, config.max_queue_size)):
        whose = (
            "" if queued == config.max_queue_size else f"{priority.value}-class calls' share of "
        )
        raise InvalidInput(
            f"{num_rows} inputs exceed {whose}{config.name}'s queue of {config.max_queue_size} "
            f"rows ({queued}): send at most that many a call"
        )
    if num_rows > (by_bytes := _rows_by_bytes(config)):
        raise InvalidInput(
            f"{num_rows} inputs of {config.name} answer {num_rows * config.output_row_bytes} "
            f"bytes, past the {MAX_BUNDLE_BYTES} one answer carries: send at most {by_bytes} "
            "a call"
        )


def _rows_by_bytes(config: ModelConfig) -> int:
    return MAX_BUNDLE_BYTES // max(1, config.output_row_bytes)
