"""Registry records (services.common.registry_schema) for tests that load a route table by
hand, as the registry sync would: one factory, every field a keyword with a plain default."""

from __future__ import annotations

from typing import Any

from services.common.registry_schema import ModelRecord


def model_record(
    *,
    name: str = "minilm",
    version: str = "1",
    per_row_s: float = 0.01,
    min_batch_s: float = 0.01,
    queued_rows: int = 0,
    is_ready: bool = True,
    **fields: Any,
) -> ModelRecord:
    """A ready embedding model's heartbeat record: 10 ms a row, nothing queued, batches of 32,
    a 100 ms SLO; `fields` are any other ModelRecord fields."""
    defaults: dict[str, Any] = {
        "fingerprint": "fp",
        "tokenizer_fingerprint": "tfp",
        "kind": "embedding",
        "max_batch_size": 32,
        "slo_p99_ms": 100,
    }
    return ModelRecord(
        name=name,
        version=version,
        per_row_s=per_row_s,
        min_batch_s=min_batch_s,
        queued_rows=queued_rows,
        is_ready=is_ready,
        **{**defaults, **fields},
    )
