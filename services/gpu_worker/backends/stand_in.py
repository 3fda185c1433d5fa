"""A GPU-speed stand-in for an embedding model, for machines without the GPU.

Rows are the real model's: its tokenizer, checks and length buckets (TextBackend). A batch
takes the time a measured device curve gives for its (bucket, batch size), interpolated as the
worker's own latency model reads a curve (services.sim.curve), and spends it asleep: it holds
no GIL and burns no CPU, as a batch that runs on a GPU does. Each output row has the model's
shape and dtype (a unit vector, not an embedding). On a two-core machine this makes the CPU
tiers, not the model, the bottleneck, as they are on a GPU box (`--stand-in-curve`;
services/sim/curves/ holds the measured curves).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch

from services.common.model_repository import ModelConfigError, ModelVersion
from services.common.tensors import NUMPY_DTYPES
from services.gpu_worker.backends.base import PreparedRow, fingerprint_of
from services.gpu_worker.backends.embedding import TextBackend
from services.gpu_worker.batching.types import BatchKey
from services.sim.curve import LatencyCurve


class StandInBackend(TextBackend):
    """`version`'s rows, batches timed by the curve at `curve_path`."""

    def __init__(self, version: ModelVersion, device: torch.device, curve_path: Path) -> None:
        super().__init__(version, device)
        try:
            curve = LatencyCurve.load(curve_path)
        except (OSError, ValueError, KeyError) as error:
            raise ModelConfigError(f"stand-in curve {curve_path}: {error}") from error
        digest = hashlib.sha256(curve_path.read_bytes()).hexdigest()[:16]
        self._fingerprint = fingerprint_of(
            version.config, [], self.text.fingerprint, "stand-in", digest
        )
        self.curve_path = curve_path
        keys = {b: BatchKey(self.config.name, version.version, self._fingerprint, b)
                for b in self.buckets}  # fmt: skip
        self._truth = curve.truth(keys)
        self._keys = keys
        output = self.config.outputs[0]
        row = np.zeros(output.dims, dtype=NUMPY_DTYPES[output.dtype])
        row.flat[0] = 1
        self._row_output = row

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    @property
    def computes_on_host(self) -> bool:
        """A stand-in's batch sleeps: no thread count makes it faster."""
        return False

    def batch_seconds(self, bucket: int, batch_size: int) -> float:
        """The device time of one batch, as the curve gives it."""
        return self._truth.predict(self._keys[bucket], batch_size)

    def run(self, rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        time.sleep(self.batch_seconds(max(row.bucket for row in rows), len(rows)))
        # One array for the batch, a view per row: what the real backend hands back.
        return list(np.tile(self._row_output, (len(rows), 1)))
