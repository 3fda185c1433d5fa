"""Sentence embeddings: BERT encoder, mean pooling over the attention mask, L2 normalization
(unless the config turns it off, or a row asks for its embedding before it)."""

from __future__ import annotations

import functools
import itertools
import logging
from collections.abc import Callable, Sequence

import numpy as np
import torch

from services.common.bundles import split_at
from services.common.errors import InvalidInput
from services.common.model_repository import ModelConfigError, ModelVersion
from services.common.text import TextEncoder, TokenIds
from services.gpu_worker.backends.base import (
    Backend,
    PreparedRow,
    RawInput,
    fingerprint_of,
)
from services.gpu_worker.backends.bert import BertEncoder, mean_pool, normalize_rows
from services.gpu_worker.device_busy import device_section

log = logging.getLogger(__name__)

_PRECISIONS = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class TextBackend(Backend):
    """A text model's rows: its own tokenizer and checks (services.common.text), length
    buckets, and warm-up rows; subclasses run them."""

    def __init__(self, version: ModelVersion, device: torch.device) -> None:
        super().__init__(version, device)
        self.text = TextEncoder(version.weights_dir, version.config)

    @property
    def tokenizer_fingerprint(self) -> str:
        return self.text.fingerprint

    @functools.cached_property
    def buckets(self) -> tuple[int, ...]:  # asked for every row (bucket_for): computed once
        """The config's buckets the model's context holds, and its context last where a
        bucket past it was dropped: a row the text encoder admits always has one."""
        longest = self.text.max_tokens
        kept = tuple(b for b in self.config.length_buckets if b <= longest)
        return kept if kept and kept[-1] == longest else (*kept, longest)

    @property
    def length_buckets(self) -> tuple[int, ...]:
        return self.buckets

    @property
    def max_input_tokens(self) -> int:
        return self.text.max_tokens

    @functools.cached_property
    def _bucket_of_length(self) -> tuple[int, ...]:
        """The bucket of each length a row may have (index 0 unused): `bucket_for` a lookup."""
        return (0, *(self.bucket_for(n) for n in range(1, self.text.max_tokens + 1)))

    def _row(self, ids: np.ndarray) -> PreparedRow:
        return PreparedRow(self._bucket_of_length[len(ids)], len(ids), ids)

    def prepare_packed(
        self, token_ids: np.ndarray, lengths: Sequence[int]
    ) -> list[PreparedRow] | None:
        """Every row checked at once (TextEncoder.ids_fit) and converted at once, a view of
        the one array per row; None when a row fails the checks."""
        if not self.text.ids_fit(token_ids, lengths):
            return None
        views = split_at(token_ids.astype(np.int64), list(itertools.accumulate(lengths)))
        bucket_of = self._bucket_of_length
        return [PreparedRow(bucket_of[n], n, ids) for n, ids in zip(lengths, views, strict=True)]

    def prepare(self, value: RawInput) -> PreparedRow:
        return self.prepare_many([value])[0]

    def prepare_many(self, values: Sequence[RawInput]) -> list[PreparedRow]:
        texts = [v for v in values if isinstance(v, str)]
        token_rows = [v.ids for v in values if isinstance(v, TokenIds)]
        if len(texts) + len(token_rows) < len(values):
            raise InvalidInput(f"{self.config.name} takes text inputs, not tensors")
        encoded = iter(self.text.encode_many(texts) if texts else ())
        checked = iter(self.text.check_ids_many(token_rows) if token_rows else ())
        return [self._row(next(encoded if isinstance(v, str) else checked)) for v in values]

    @functools.cached_property
    def _warmup_ids(self) -> tuple[int, int, int]:
        """The first, an inner and the last id of a one-word text, as this model's tokenizer
        makes it ([CLS] the [SEP] for BERT's): ids its vocabulary holds, whatever its size (a
        fixed id past a small vocabulary failed the load, and on CUDA poisoned the device)."""
        ids = [min(int(i), self.text.vocab_size - 1) for i in self.text.tokenize(["the"])[0]]
        return ids[0], ids[len(ids) // 2], ids[-1]

    def warmup_rows(self, bucket: int, batch_size: int) -> list[PreparedRow]:
        # [CLS] word... [SEP] with an ordinary word id: costs what a real row of that length does.
        first, inner, last = self._warmup_ids
        ids = np.full(bucket, inner, dtype=np.int64)
        ids[0], ids[-1] = first, last
        return [PreparedRow(bucket=bucket, num_tokens=bucket, data=ids)] * batch_size


class EmbeddingBackend(TextBackend):
    def __init__(
        self, version: ModelVersion, device: torch.device, *, compile_forward: bool = False
    ) -> None:
        """`compile_forward`: the encoder runs through `torch.compile` (see `warm_up`)."""
        super().__init__(version, device)
        weights = version.weights_dir
        model_files = [weights / "config.json", weights / "model.safetensors"]
        missing = [str(p) for p in model_files if not p.exists()]
        if missing:
            raise ModelConfigError(f"{version.config.name}/{version.version}: missing {missing}")
        preprocessing = version.config.preprocessing
        if preprocessing.get("pooling", "mean") != "mean":
            raise ModelConfigError(f"{version.config.name}: only pooling = 'mean' is supported")
        self._normalize = version.config.normalizes_embeddings
        precision = str(preprocessing.get("precision", "fp32"))
        if precision not in _PRECISIONS:
            raise ModelConfigError(f"{version.config.name}: precision must be in {_PRECISIONS}")
        model = BertEncoder.from_pretrained(weights)
        _check_output(version, model.config.hidden_size)  # before the weights go to the device
        self._model = model.to(device, _PRECISIONS[precision])
        # Dynamic shapes: one graph serves every batch size and padded length. Same weights,
        # same numerics (inductor's kernels, checked at cosine 0.999 by the tests).
        self._forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = (
            torch.compile(self._model, dynamic=True) if compile_forward else self._model
        )
        self.is_compiled = compile_forward
        self._fingerprint = fingerprint_of(
            version.config, model_files, self.text.fingerprint, precision
        )

    @property
    def fingerprint(self) -> str:
        return self._fingerprint

    def run(self, rows: Sequence[PreparedRow]) -> list[np.ndarray]:
        # Pad to the longest row of the batch, not the bucket: on the CPU padding costs linearly.
        length = max(row.num_tokens for row in rows)
        ids = np.zeros((len(rows), length), dtype=np.int64)
        mask = np.zeros((len(rows), length), dtype=bool)
        for i, row in enumerate(rows):
            ids[i, : row.num_tokens] = row.data
            mask[i, : row.num_tokens] = True
        input_ids = torch.from_numpy(ids).to(self.device, non_blocking=True)
        attention = torch.from_numpy(mask).to(self.device, non_blocking=True)
        with torch.inference_mode(), device_section():
            hidden = self._forward(input_ids, attention)
            pooled = mean_pool(hidden.float(), attention)
            if self._normalize:
                pooled = normalize_rows(pooled, [row.is_normalized for row in rows])
        out = pooled.cpu().numpy()
        return list(out)

    def warm_up(self) -> None:
        """Compiles the forward first, where asked: one row (torch specializes a dimension of
        1), then two rows of another length (the dynamic graph every other shape uses). A
        forward that fails to compile (no C++ compiler on a CPU, no triton on a GPU) runs
        uncompiled from then on, with a warning: slower, never down."""
        if self.is_compiled:
            try:
                for size, length in ((1, self.buckets[0]), (2, max(self.buckets))):
                    self.run(self.warmup_rows(length, size))
            except Exception:  # inductor's failures have no common type
                log.warning(
                    "%s/%s: torch.compile failed; serving the model uncompiled",
                    self.config.name,
                    self.version.version,
                    exc_info=True,
                )
                self._forward = self._model
                self.is_compiled = False
        super().warm_up()


def _check_output(version: ModelVersion, hidden_size: int) -> None:
    """Refuses a config whose declared output is not what the encoder gives (one FP32 vector
    of `hidden_size` a row): the gateway sizes bundles, `dimensions` and the APIs' model info
    by the declaration, so a wrong one would answer vectors of another width than it says."""
    outputs = version.config.outputs
    if [(o.dtype, o.dims) for o in outputs] != [("FP32", (hidden_size,))]:
        declared = [(o.name, o.dtype, list(o.dims)) for o in outputs]
        raise ModelConfigError(
            f"{version.config.name}: an embedding model has one FP32 output of dims "
            f"[{hidden_size}] (its encoder's hidden size); the config declares {declared}"
        )
