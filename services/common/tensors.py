"""Tensor payloads between protobuf and numpy, in one place for every tier."""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from services.common.errors import InvalidInput
from services.pb.inference.v1 import worker_pb2 as pb

#: Config / Open Inference Protocol dtype names to numpy dtypes (little-endian).
NUMPY_DTYPES: dict[str, np.dtype] = {
    "FP32": np.dtype("<f4"),
    "FP16": np.dtype("<f2"),
    "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"),
}
_PB_TO_NAME: dict[pb.DataType, str] = {
    pb.DATA_TYPE_FP32: "FP32",
    pb.DATA_TYPE_FP16: "FP16",
    pb.DATA_TYPE_INT32: "INT32",
    pb.DATA_TYPE_INT64: "INT64",
    pb.DATA_TYPE_BYTES: "BYTES",
}
_NAME_TO_PB = {name: value for value, name in _PB_TO_NAME.items()}
#: The wire name of each little-endian numpy dtype (native order here).
_WIRE_NAMES: dict[np.dtype, str] = {dtype: name for name, dtype in NUMPY_DTYPES.items()}

#: Largest tensor dimension product accepted from the wire (guards against shape bombs).
MAX_ELEMENTS = 1 << 26
#: Most dimensions a wire tensor may have (numpy's own limit is 64; the product of thousands of
#: dimensions would be a number too long to even print).
MAX_DIMS = 16


def dtype_name(value: pb.DataType) -> str:
    """Proto enum value to dtype name; INVALID_ARGUMENT if unspecified or unknown."""
    name = _PB_TO_NAME.get(value)
    if name is None:
        raise InvalidInput("tensor dtype is unspecified or unknown")
    return name


def dtype_pb(name: str) -> pb.DataType:
    return _NAME_TO_PB[name]


def tensor_from_pb(tensor: pb.Tensor) -> np.ndarray:
    """Decodes a `Tensor`; INVALID_ARGUMENT if dtype, shape and byte length disagree."""
    name = dtype_name(tensor.dtype)
    if name == "BYTES":
        raise InvalidInput("BYTES tensors carry no raw_data; send text inputs instead")
    shape = tuple(tensor.shape)
    if len(shape) > MAX_DIMS:
        raise InvalidInput(f"tensor has {len(shape)} dimensions; at most {MAX_DIMS}")
    if shape and min(shape) < 0:
        raise InvalidInput(f"tensor shape {list(shape)} has a negative dimension")
    count = math.prod(shape)  # Python ints: a numpy product would wrap around to a small one
    # One dimension past the limit is refused even where another is 0 (numpy cannot make it).
    if count > MAX_ELEMENTS or (shape and max(shape) > MAX_ELEMENTS):
        raise InvalidInput(f"tensor of {count} elements exceeds the limit of {MAX_ELEMENTS}")
    dtype = NUMPY_DTYPES[name]
    data = tensor.raw_data  # each read of the field is a copy of its bytes
    if len(data) != count * dtype.itemsize:
        raise InvalidInput(
            f"tensor raw_data has {len(data)} bytes; shape {list(shape)} of {name} "
            f"needs {count * dtype.itemsize}"
        )
    return np.frombuffer(data, dtype=dtype).reshape(shape)


def tensor_to_pb(array: np.ndarray) -> pb.Tensor:
    name = _WIRE_NAMES.get(array.dtype)
    if name is None:  # not in native order: its little-endian twin's name, if it has one
        name = _WIRE_NAMES.get(array.dtype.newbyteorder("<"))
    if name is None:
        raise TypeError(f"no wire dtype for numpy {array.dtype}")
    data = np.ascontiguousarray(array, dtype=NUMPY_DTYPES[name]).tobytes()
    return pb.Tensor(dtype=_NAME_TO_PB[name], shape=list(array.shape), raw_data=data)


def check_row(name: str, dtype: str, dims: tuple[int, ...], row: np.ndarray) -> np.ndarray:
    """Validates one row of a tensor input against its declared dtype and dims (and rejects
    NaN/Inf in float rows); INVALID_ARGUMENT otherwise."""
    if row.dtype != NUMPY_DTYPES.get(dtype):
        raise InvalidInput(f"input {name} must be {dtype}, got {row.dtype}")
    if row.shape != dims:
        raise InvalidInput(f"input {name} must have shape {list(dims)}, got {list(row.shape)}")
    if row.dtype.kind == "f" and not np.isfinite(row).all():
        raise InvalidInput(f"input {name} contains NaN or Inf")
    return row


def stack_rows(rows: Sequence[np.ndarray]) -> np.ndarray:
    """`np.stack(rows)`, rows of one shape, without its Python per call (here 1.7 us for one
    row, 10 for 27): one row is viewed with a new first axis (never written through: every
    caller reads or copies it), more are copied by np.array's C loop. Rows of objects go
    through np.stack: np.array could read their elements as sequences."""
    if len(rows) == 1:
        return rows[0][np.newaxis]
    if rows and rows[0].dtype != object:
        return np.array(rows)
    return np.stack(rows)
