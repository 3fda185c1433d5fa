"""A fixed-cost call's inputs as the worker takes them: checked per call, tokenized per bundle.

The checks that need no tokenizer (types, shapes, empty or oversized texts, token ids in the
vocabulary) run in the call's own path, so a bad input is refused at once. Texts are tokenized
when their bundle leaves (services.gateway.coalescer), every caller's in one call of the Rust
tokenizer; a text too many tokens long then refuses its own caller alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from time import perf_counter
from typing import Protocol

import numpy as np

from services.common.errors import InvalidInput
from services.common.tensors import check_row
from services.common.text import TokenIds
from services.gateway.bundle_parts import Made, Prepare
from services.gateway.catalog import ResolvedModel
from services.gateway.version_memo import VersionMemo

#: One input row as a client sent it: text (or its token ids) for text models, a tensor row
#: otherwise.
PredictValue = str | TokenIds | np.ndarray


class Observer(Protocol):
    def observe(self, amount: float) -> None: ...


def check_num_inputs(count: int, max_inputs: int) -> None:
    """Refuses a call of more inputs (rows) than `max_inputs` (--max-inputs-per-request)."""
    if count > max_inputs:
        raise InvalidInput(f"{count} inputs exceed the limit of {max_inputs}")


def checked_rows(
    model: ResolvedModel, values: Sequence[PredictValue], *, truncate: bool
) -> list[str | np.ndarray]:
    """Each input row after the checks made per call: a text model's texts checked (see
    `bundle_tokenizer`) and its token ids as int64; a tensor model's rows checked against its
    input."""
    config = model.config
    if model.encoder is not None:
        rows: list[str | np.ndarray] = []
        for value in values:
            if isinstance(value, str):
                (text,) = model.encoder.check_texts([value], truncate=truncate)
                rows.append(text)
            elif isinstance(value, TokenIds):
                # Cut as a text is (TEI re-encodes ids with its truncation): their first ids.
                ids = value.ids[: model.encoder.max_tokens] if truncate else value.ids
                rows.append(model.encoder.check_ids(ids))
            else:
                raise InvalidInput(f"{config.name} takes text inputs")
        return rows
    spec = config.inputs[0]
    checked: list[str | np.ndarray] = []
    for value in values:
        if not isinstance(value, np.ndarray):
            raise InvalidInput(f"{config.name} takes tensor inputs")
        checked.append(check_row(spec.name, spec.dtype, spec.dims, value))
    return checked


def bundle_tokenizer(model: ResolvedModel, *, truncate: bool, seconds: Observer) -> Prepare:
    """Tokenizes the texts of every caller of a bundle in one call (observing its duration in
    `seconds`); a caller whose text does not fit the model is refused alone."""
    encoder = model.encoder
    if encoder is None:
        raise ValueError(f"{model.config.name} has no tokenizer")

    def tokenize(calls: Sequence[Sequence[str | np.ndarray]]) -> list[Made]:
        started = perf_counter()
        texts = [v for values in calls for v in values if isinstance(v, str)]
        encoded = iter(encoder.tokenize(texts, truncate=truncate))
        made: list[Made] = []
        for values in calls:
            rows = [v if isinstance(v, np.ndarray) else next(encoded) for v in values]
            try:
                made.append([encoder.check_ids(r) for r in rows])
            except InvalidInput as error:
                made.append(error)
        seconds.observe(perf_counter() - started)
        return made

    return tokenize


class BundleTokenizers:
    """The bundle tokenizer of each text model version in use, made once, not per call
    (`seconds_of` gives the duration observer of a model's), kept while `is_current` (model,
    version, fingerprint: not a version the catalog forgot, one no live worker serves, or one
    its workers now serve with another fingerprint; VersionMemo)."""

    def __init__(
        self, is_current: Callable[[str, str, str], bool], seconds_of: Callable[[str], Observer]
    ) -> None:
        self._seconds_of = seconds_of
        self._made: VersionMemo[tuple[str, str, str, bool], Prepare] = VersionMemo(
            lambda key: is_current(*key[:3])
        )

    def __len__(self) -> int:
        return len(self._made)

    def get(self, model: ResolvedModel, *, truncate: bool) -> Prepare:
        key = (model.config.name, model.version, model.fingerprint, truncate)
        return self._made.get(
            key,
            lambda: bundle_tokenizer(
                model, truncate=truncate, seconds=self._seconds_of(model.config.name)
            ),
        )
