"""numpy arrays to and from the API's tensors (little-endian raw bytes)."""

from __future__ import annotations

import numpy as np

from inference_fabric_client._pb.inference.v1 import types_pb2 as types

DTYPES = {
    types.DATA_TYPE_FP32: np.dtype("<f4"),
    types.DATA_TYPE_FP16: np.dtype("<f2"),
    types.DATA_TYPE_INT32: np.dtype("<i4"),
    types.DATA_TYPE_INT64: np.dtype("<i8"),
}
_TO_PB = {dtype: value for value, dtype in DTYPES.items()}


def to_tensor(array: np.ndarray) -> types.Tensor:
    array = np.asarray(array)
    little = array.dtype.newbyteorder("<")
    value = _TO_PB.get(little)
    if value is None:
        raise ValueError(f"dtype {array.dtype} is not supported; use float32/16, int32/64")
    raw = np.ascontiguousarray(array, dtype=little).tobytes()
    return types.Tensor(dtype=value, shape=list(array.shape), raw_data=raw)


def to_array(tensor: types.Tensor) -> np.ndarray:
    """The tensor as an array of its own, writable (a view of the message's bytes is not)."""
    array = np.frombuffer(tensor.raw_data, dtype=DTYPES[tensor.dtype]).reshape(tuple(tensor.shape))
    return array.copy()
