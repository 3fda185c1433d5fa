"""A bundle's packed rows at the worker (worker.proto's `PackedRows`): the columns checked,
each row made once the bundle door let it in, prepared as columns where the backend can."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from services.common.bundles import split_at, token_row_ends
from services.common.errors import InvalidInput
from services.common.tensors import tensor_from_pb
from services.common.text import TokenIds
from services.gpu_worker.backends.base import Backend, PreparedRow, RawInput
from services.gpu_worker.backends.embedding import TextBackend
from services.pb.inference.v1 import worker_pb2 as pb


class BundleRows(NamedTuple):
    """A bundle's packed rows, their columns checked (`bundle_rows`): a text bundle's token
    ids (int32, concatenated) and each row's length, or a tensor bundle's rows stacked."""

    token_ids: np.ndarray | None = None
    lengths: list[int] | None = None
    stacked: np.ndarray | None = None

    def raw(self) -> list[RawInput]:
        """Every row as a caller's input, in slice order."""
        if self.token_ids is not None and self.lengths is not None:
            ends = list(itertools.accumulate(self.lengths))
            return [TokenIds(ids) for ids in split_at(self.token_ids, ends)]
        return [] if self.stacked is None else list(self.stacked)

    def prepare(self, backend: Backend) -> list[PreparedRow] | None:
        """Every row prepared at once, as columns (Backend.prepare_packed), or None where the
        backend prepares rows one by one, or one row needs an answer of its own."""
        if self.token_ids is None or self.lengths is None:
            return None
        return backend.prepare_packed(self.token_ids, self.lengths)


def bundle_rows(request: pb.InferRequest, num_rows: int) -> BundleRows:
    """Every row of a bundle's packed columns, in slice order, the columns checked now:
    INVALID_ARGUMENT for columns that do not make `num_rows` rows (the whole bundle fails: its
    caller built it wrong). The rows are prepared once the door let the bundle in."""
    packed = request.packed
    if packed.token_ids or packed.row_lengths:
        if not request.fingerprint:
            raise InvalidInput("token_ids inputs require the tokenizer's fingerprint")
        token_row_ends(packed.token_ids, packed.row_lengths, num_rows)
        lengths = np.frombuffer(packed.row_lengths, dtype="<i4").tolist()
        return BundleRows(np.frombuffer(packed.token_ids, dtype="<i4"), lengths)
    if packed.HasField("tensor"):
        stacked = tensor_from_pb(packed.tensor)
        if stacked.ndim < 1 or stacked.shape[0] != num_rows:
            raise InvalidInput(
                f"packed tensor of shape {list(stacked.shape)} is not {num_rows} rows"
            )
        return BundleRows(stacked=stacked)
    raise InvalidInput("a bundle carries no packed rows (token_ids or tensor)")


def row_buckets(backend: Backend, packed: pb.PackedRows) -> Sequence[int] | None:
    """The buckets of a bundle's token rows (their columns checked: bundle_rows) for a text
    model whose checks every row passes (TextEncoder.ids_fit); None otherwise: a tensor
    model's rows, or a row with an answer of its own (INVALID_ARGUMENT), take the row path."""
    if not packed.token_ids or not isinstance(backend, TextBackend):
        return None
    lengths = np.frombuffer(packed.row_lengths, dtype="<i4")
    if not backend.text.ids_fit(np.frombuffer(packed.token_ids, dtype="<i4"), lengths):
        return None
    return sorted({backend.bucket_for(length) for length in np.unique(lengths).tolist()})
