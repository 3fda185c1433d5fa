"""What every fixed-cost backend provides to the worker: prepare rows, run a batch of them."""

from __future__ import annotations

import abc
import bisect
import hashlib
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from services.common.model_repository import ModelConfig, ModelVersion
from services.common.registry_schema import ModelRecord
from services.common.text import TokenIds
from services.gpu_worker.served_model import BatchLoads, ServedModel

#: One input row as a client sent it, after decoding from protobuf.
RawInput = str | TokenIds | np.ndarray


@dataclass(slots=True)
class PreparedRow:
    """A validated row, ready to be batched with rows of the same bucket. Never changed once
    built (`dataclasses.replace` makes another): not frozen only because a frozen dataclass
    builds three times as slowly, and one is built per row a worker takes."""

    #: Padded length class (tokens) for text; 1 for fixed-shape tensor models.
    bucket: int
    #: Real length in tokens (padding-waste accounting); 1 for tensor models.
    num_tokens: int
    data: np.ndarray
    #: Embedding models that normalize: False for a row whose caller asked for the embedding
    #: before L2 normalization (it batches with every other row).
    is_normalized: bool = True


def select_device() -> torch.device:
    """`cuda` when a GPU is visible, else `cpu`; the same code path runs on both."""
    return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")


def check_device(device: torch.device) -> None:
    """Raises (RuntimeError) if `device` no longer runs work: after a version's warm-up
    failed, the failure may have been the device's (a CUDA error that poisons the context,
    every later call failing), not the version's alone. Runs one small op and waits for it."""
    probe = torch.ones(8, device=device) * 2
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    if float(probe.sum()) != 16.0:
        raise RuntimeError(f"{device} computed a wrong sum: it is not fit to serve")


def fingerprint_of(config: ModelConfig, files: Iterable[Path], *extra: str) -> str:
    """A short digest of weights, tokenizer and preprocessing: inputs prepared for one
    fingerprint must never run against another."""
    digest = hashlib.sha256()
    digest.update(config.kind.value.encode())
    digest.update(json.dumps(dict(config.preprocessing), sort_keys=True).encode())
    for part in extra:
        digest.update(part.encode())
    for path in sorted(files):
        digest.update(path.name.encode())
        with path.open("rb") as handle:
            while chunk := handle.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:16]


class Backend(ServedModel):
    """A loaded fixed-cost model version. `prepare*` run on the event loop (cheap, CPU); `run`
    runs on the batching driver's executor thread."""

    def __init__(self, version: ModelVersion, device: torch.device) -> None:
        self.version = version
        self.config = version.config
        self.device = device

    @property
    def buckets(self) -> tuple[int, ...]:
        """Bucket values this backend produces (warm-up runs each)."""
        return (1,)

    @property
    def computes_on_host(self) -> bool:
        """Whether a batch computes on the host's cores, on torch's intra-op threads (a CPU
        device), so that how many it takes is worth measuring (execution.batch_threads)."""
        return self.device.type == "cpu"

    def warm_up(self) -> None:
        """One batch of one row of the smallest bucket (allocator, lazy init)."""
        self.run(self.warmup_rows(self.buckets[0], 1))

    def model_record(self, *, is_ready: bool, batching: BatchLoads) -> ModelRecord:
        load = batching.load_report(self)
        return self._record(
            is_ready=is_ready,
            max_batch_size=self.config.max_batch_size,
            per_row_s=load.per_row_s,
            min_batch_s=load.min_batch_s,
            queued_rows=load.queued_rows,
            queued_batch_rows=load.queued_batch_rows,
            executions=load.totals.executions,
            executed_rows=load.totals.rows,
            queue_s_total=load.totals.queue_s,
            compute_s_total=load.totals.compute_s,
            is_failing=load.is_failing,
        )

    @abc.abstractmethod
    def prepare(self, value: RawInput) -> PreparedRow:
        """Validates and prepares one row; raises InvalidInput."""

    def prepare_many(self, values: Sequence[RawInput]) -> list[PreparedRow]:
        """Prepares the rows of one request (backends may batch the work)."""
        return [self.prepare(value) for value in values]

    def prepare_packed(
        self, token_ids: np.ndarray, lengths: Sequence[int]
    ) -> list[PreparedRow] | None:
        """The rows of a bundle's packed token columns (`token_ids` concatenated, rows of
        `lengths`), prepared at once, or None: the backend takes no token ids, or one row
        fails its checks (`prepare_many` then answers each row)."""
        return None

    @abc.abstractmethod
    def run(self, rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        """Runs one batch (all rows share a bucket); one output array per row, in order."""

    @abc.abstractmethod
    def warmup_rows(self, bucket: int, batch_size: int) -> list[PreparedRow]:
        """Synthetic rows that cost what real rows of `bucket` cost."""

    def bucket_for(self, num_tokens: int) -> int:
        """Smallest bucket holding `num_tokens` (callers validate the length first)."""
        buckets = self.buckets
        return buckets[bisect.bisect_left(buckets, num_tokens)]
