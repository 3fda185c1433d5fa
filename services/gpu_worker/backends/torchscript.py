"""Bring-your-own fixed-cost model: a TorchScript module (`model.pt`) taking a batch of rows.

The config declares one input and one output with fixed per-row dims; the module receives
`[batch, *dims]` and must return `[batch, *output_dims]`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import numpy as np
import torch

from services.common.errors import InvalidInput
from services.common.model_repository import ModelConfigError, ModelVersion
from services.common.tensors import NUMPY_DTYPES, check_row
from services.gpu_worker.backends.base import Backend, PreparedRow, RawInput, fingerprint_of
from services.gpu_worker.device_busy import device_section


class TorchScriptBackend(Backend):
    def __init__(self, version: ModelVersion, device: torch.device) -> None:
        super().__init__(version, device)
        config = version.config
        if len(config.inputs) != 1 or len(config.outputs) != 1:
            raise ModelConfigError(f"{config.name}: torchscript takes one input and one output")
        self._input, self._output = config.inputs[0], config.outputs[0]
        for spec in (self._input, self._output):
            if spec.dtype not in NUMPY_DTYPES:
                raise ModelConfigError(f"{config.name}: {spec.name} must be a numeric dtype")
        path = version.weights_dir / "model.pt"
        if not path.exists():
            raise ModelConfigError(f"{config.name}/{version.version}: missing {path}")
        with warnings.catch_warnings():
            # torch 2.13 marks TorchScript deprecated in favour of torch.export; TorchScript is
            # still what users ship, and loading it works unchanged.
            warnings.simplefilter("ignore", DeprecationWarning)
            self._module = torch.jit.load(str(path), map_location=device).eval()
        self._in_dtype = NUMPY_DTYPES[self._input.dtype]
        self._out_dtype = NUMPY_DTYPES[self._output.dtype]
        self._fingerprint = fingerprint_of(config, [path], repr(self._input), repr(self._output))

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def prepare(self, value: RawInput) -> PreparedRow:
        if not isinstance(value, np.ndarray):
            raise InvalidInput(f"{self.config.name} takes tensor inputs")
        spec = self._input
        return PreparedRow(
            bucket=1, num_tokens=1, data=check_row(spec.name, spec.dtype, spec.dims, value)
        )

    def run(self, rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        batch = torch.from_numpy(np.stack([row.data for row in rows])).to(self.device)
        with torch.inference_mode(), device_section():
            result = self._module(batch)
        if not isinstance(result, torch.Tensor) or result.shape[0] != len(rows):
            raise RuntimeError(f"{self.config.name} returned no [batch, ...] tensor")
        if tuple(result.shape[1:]) != self._output.dims:
            raise RuntimeError(
                f"{self.config.name} returned rows of shape {list(result.shape[1:])}, "
                f"config declares {list(self._output.dims)}"
            )
        values = result.cpu().numpy()
        if not np.can_cast(values.dtype, self._out_dtype, casting="same_kind"):
            # Floats into an integer type were cut without a word (review finding).
            raise RuntimeError(
                f"{self.config.name} returned {values.dtype} rows, config declares "
                f"{self._output.dtype}"
            )
        cast = values.astype(self._out_dtype, copy=False)
        if not np.can_cast(values.dtype, self._out_dtype, casting="safe") and _past_range(
            values, cast
        ):  # int64 into INT32 wrapped, float32 past FP16's range became inf (review finding)
            raise RuntimeError(
                f"{self.config.name} returned values past the range of {self._output.dtype}, "
                "the type its config declares"
            )
        return list(cast)

    def warmup_rows(self, bucket: int, batch_size: int) -> list[PreparedRow]:
        row = np.zeros(self._input.dims, dtype=self._in_dtype)
        return [PreparedRow(bucket=1, num_tokens=1, data=row)] * batch_size


def _past_range(values: np.ndarray, cast: np.ndarray) -> bool:
    """Whether narrowing `values` into `cast` changed an integer or made a finite float
    infinite (a float's lost digits are what narrowing is)."""
    if cast.dtype.kind == "f":
        return bool(np.any(np.isinf(cast) & np.isfinite(values)))
    return not np.array_equal(cast, values)
