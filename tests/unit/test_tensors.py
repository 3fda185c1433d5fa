"""Wire tensors (services.common.tensors): what `tensor_to_pb` writes reads back the same."""

from __future__ import annotations

import numpy as np
import pytest

from services.common.tensors import NUMPY_DTYPES, tensor_from_pb, tensor_to_pb

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("name", sorted(NUMPY_DTYPES))
def test_every_wire_dtype_round_trips(name: str) -> None:
    array = np.arange(6).reshape(2, 3).astype(NUMPY_DTYPES[name])
    back = tensor_from_pb(tensor_to_pb(array))
    assert back.dtype == array.dtype and back.shape == (2, 3)
    assert np.array_equal(back, array)


@pytest.mark.parametrize(("numpy_dtype", "wire"), [(">f4", "<f4"), (">i8", "<i8"), (">i4", "<i4")])
def test_a_big_endian_array_goes_as_its_little_endian_twin(numpy_dtype: str, wire: str) -> None:
    array = np.array([[1, -2], [3, 40000]], dtype=numpy_dtype)
    back = tensor_from_pb(tensor_to_pb(array))
    assert back.dtype == np.dtype(wire)
    assert np.array_equal(back, array)


@pytest.mark.parametrize("numpy_dtype", [np.float64, np.uint8, object])
def test_a_dtype_with_no_wire_name_is_refused(numpy_dtype: type) -> None:
    with pytest.raises(TypeError, match="no wire dtype"):
        tensor_to_pb(np.zeros(2, dtype=numpy_dtype))
