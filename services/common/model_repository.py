"""The model repository: `<root>/<model>/config.toml` plus one directory per version.

Layout::

    <root>/<model>/config.toml          kind, batching, SLO, buckets, inputs/outputs, labels
    <root>/<model>/<version>/           weights (files here, or version.toml pointing elsewhere)
    <root>/<model>/<version>/version.toml   optional: weights = "package:<module>" | "<path>"

Parsed once into frozen types; a bad file fails loading with its path in the message.
"""

from __future__ import annotations

import enum
import functools
import importlib
import math
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from services.common.model_config_fields import MAX_SETTING as MAX_SETTING
from services.common.model_config_fields import ModelConfigError as ModelConfigError
from services.common.model_config_fields import batch_tokens
from services.common.model_config_fields import optional as _optional
from services.common.model_config_fields import positive as _positive
from services.common.model_config_fields import require as _require
from services.common.model_routing import is_label_name

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
#: Bytes of one value of each dtype (BYTES: at least one).
_DTYPE_BYTES = {"FP32": 4, "FP16": 2, "INT32": 4, "INT64": 8, "BYTES": 1}
_DTYPES = frozenset(_DTYPE_BYTES)
#: A request's deadline when neither its caller nor its model's config sets one, ms.
DEFAULT_TIMEOUT_MS = 30_000


class ModelKind(enum.Enum):
    EMBEDDING = "embedding"
    TORCHSCRIPT = "torchscript"
    GENERATION = "generation"


@dataclass(frozen=True)
class TensorSpec:
    """A declared input or output: Open Inference Protocol name, dtype, per-row dims."""

    name: str
    dtype: str
    dims: tuple[int, ...]


@dataclass(frozen=True)
class GenerationSettings:
    """The `[generation]` table of a generation model: the KV cache and continuous batching."""

    #: Longest prompt + generated tokens, in tokens.
    max_model_len: int
    #: Tokens per KV-cache block.
    block_size: int = 16
    #: KV-cache blocks the worker allocates (the cache holds block_size * this many tokens).
    num_kv_blocks: int = 256
    #: Sequences running at once.
    max_num_seqs: int = 32
    #: Tokens computed per step (decodes plus prefill chunks).
    max_num_batched_tokens: int = 512
    #: KV blocks kept free when admitting a new sequence while others run: headroom for the
    #: running ones to grow before one must be preempted (0: admit while any block is free).
    watermark_blocks: int = 0
    #: Prefix caching: "shared" (a prompt's leading full blocks are computed once and shared
    #: by every request that starts the same way), "per_tenant" (shared only within a tenant,
    #: so no tenant can tell from its time to first token what another one sent), or "off".
    prefix_caching: str = "shared"


PREFIX_CACHING_SCOPES = ("off", "shared", "per_tenant")


@dataclass(frozen=True)
class EmbeddingSettings:
    """The `[embedding]` table of an embedding model: what its embedding APIs may do."""

    #: The model is trained so that its leading dims are an embedding themselves (Matryoshka):
    #: OpenAI's `dimensions` may shorten the output (then re-normalized). Off: `dimensions` is
    #: refused.
    shortenable: bool = False
    #: Inputs longer than the model takes are cut to its longest input instead of refused, on
    #: the APIs that have no per-call choice (OpenAI's /v1/embeddings; TEI's asks per call).
    truncate: bool = False


@dataclass(frozen=True)
class ModelConfig:
    """One model's `config.toml`."""

    name: str
    kind: ModelKind
    #: End-to-end latency objective (p99), ms: what the fleet is batched and provisioned for
    #: (it sets linger, batch size and the autoscaling signal). Not a cap on a caller's deadline.
    slo_p99_ms: int
    max_batch_size: int
    #: Cap on bucket * rows per batch; 0 = no cap.
    max_batch_tokens: int
    max_queue_size: int
    #: Text models: padded length classes in tokens, ascending; the last is the longest input.
    length_buckets: tuple[int, ...]
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    #: Backend-specific preprocessing settings; part of the fingerprint.
    preprocessing: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))
    #: Version labels ("stable", "canary") to version numbers.
    labels: Mapping[str, int] = field(default_factory=lambda: MappingProxyType({}))
    #: Share of requests without a version that each label receives (e.g. canary 0.05,
    #: stable 0.95). Empty: such requests go to "stable", else the newest served version.
    traffic: Mapping[str, float] = field(default_factory=lambda: MappingProxyType({}))
    #: Generation models only.
    generation: GenerationSettings | None = None
    #: Embedding models: what their embedding APIs may do (defaults without the table).
    embedding: EmbeddingSettings = EmbeddingSettings()
    #: The deadline of a request whose caller sent none, ms (for generation: the whole stream).
    default_timeout_ms: int = DEFAULT_TIMEOUT_MS
    #: Opt-in shedding: refuse (RESOURCE_EXHAUSTED) a request predicted to finish past the SLO
    #: even when its caller would wait longer (Triton's queue policy with REJECT). Off: only the
    #: caller's deadline bounds admission.
    shed_past_slo: bool = False

    @property
    def normalizes_embeddings(self) -> bool:
        """Embedding models: whether their outputs are L2-normalized (`preprocessing.normalize`,
        on unless the config turns it off)."""
        return bool(self.preprocessing.get("normalize", True))

    @functools.cached_property
    def output_row_bytes(self) -> int:
        """Bytes of one row's outputs, every declared output's (BYTES values count one)."""
        return sum(math.prod(o.dims) * _DTYPE_BYTES[o.dtype] for o in self.outputs)

    @property
    def slo_s(self) -> float:
        return self.slo_p99_ms / 1000.0

    def timeout_s_for(self, caller_timeout_s: float | None) -> float:
        """A request's deadline, seconds from now: the caller's, else `default_timeout_ms`.
        Never capped by the SLO: the SLO is what the fleet is provisioned for, not a limit on
        a caller who is willing to wait."""
        return self.default_timeout_ms / 1000.0 if caller_timeout_s is None else caller_timeout_s

    def shed_budget_s(self, upstream_s: float) -> float | None:
        """With `shed_past_slo`: seconds a request that has already spent `upstream_s` may
        still take, so that it finishes within the SLO; None when the model does not shed."""
        return self.slo_s - upstream_s if self.shed_past_slo else None


@dataclass(frozen=True)
class ModelVersion:
    """One version directory, resolved to where its weights are."""

    config: ModelConfig
    version: str
    weights_dir: Path


def _tensor_specs(raw: Any, key: str, path: Path) -> tuple[TensorSpec, ...]:
    if not isinstance(raw, Mapping) or not raw:
        raise ModelConfigError(f"{path}: [{key}.<name>] tables are required")
    specs = []
    for name, spec in raw.items():
        dtype = spec.get("dtype")
        dims = spec.get("dims")
        if dtype not in _DTYPES:
            raise ModelConfigError(f"{path}: {key}.{name}.dtype must be one of {sorted(_DTYPES)}")
        # type(d) is int: a TOML bool is an int too (dims = [true] read as 1: review finding).
        if not isinstance(dims, list) or not all(type(d) is int and d > 0 for d in dims):
            raise ModelConfigError(f"{path}: {key}.{name}.dims must be a list of positive ints")
        specs.append(TensorSpec(name=name, dtype=dtype, dims=tuple(dims)))
    return tuple(specs)


def parse_model_config(name: str, path: Path) -> ModelConfig:
    """Parses and validates one `config.toml`; anything wrong with it is ModelConfigError."""
    try:
        raw = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ModelConfigError(f"{path}: {error}") from error
    try:
        return _model_config(name, raw, path)
    except (TypeError, ValueError, AttributeError, ArithmeticError) as error:  # a wrong shape
        # ArithmeticError: TOML's reader takes integers past 64 bits (a weight of 400 digits
        # overflowed isfinite), which escaped the per-model errors and stopped the whole read.
        raise ModelConfigError(f"{path}: {error!r}") from error


#: The settings a model's config.toml may hold: another (a typo) kept its default silently.
_SETTINGS = frozenset({
    "kind", "slo_p99_ms", "max_batch_size", "max_batch_tokens", "max_queue_size",
    "length_buckets", "inputs", "outputs", "preprocessing", "labels", "traffic", "generation",
    "embedding", "default_timeout_ms", "shed_past_slo",
})  # fmt: skip


def _model_config(name: str, raw: dict[str, Any], path: Path) -> ModelConfig:
    if unknown := sorted(set(raw) - _SETTINGS):
        raise ModelConfigError(f"{path}: unknown setting(s) {unknown}; known: {sorted(_SETTINGS)}")
    try:
        kind = ModelKind(_require(raw, "kind", str, path))
    except ValueError as error:
        kinds = [k.value for k in ModelKind]
        raise ModelConfigError(f"{path}: kind must be one of {kinds}") from error
    buckets = tuple(raw.get("length_buckets", ()))
    if kind is ModelKind.EMBEDDING and (
        not buckets
        or not all(isinstance(b, int) and b > 0 for b in buckets)
        or list(buckets) != sorted(set(buckets))
    ):
        raise ModelConfigError(f"{path}: length_buckets must be ascending positive ints")
    generation = _generation_settings(raw, path) if kind is ModelKind.GENERATION else None
    labels = raw.get("labels", {})
    if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in labels.values()):
        raise ModelConfigError(f"{path}: [labels] values must be version numbers")
    if not isinstance(raw.get("preprocessing", {}).get("normalize", True), bool):
        raise ModelConfigError(f"{path}: preprocessing.normalize must be true or false")
    if bad := [label for label in labels if not is_label_name(label)]:
        # The gateway's routing refuses them: it did not start, or stopped re-reading.
        raise ModelConfigError(
            f"{path}: [labels] {bad[0]!r} is not a label (lower case, digits, _ and -, 32 at most)"
        )
    traffic = raw.get("traffic", {})
    if not all(
        label in labels
        and isinstance(w, int | float)
        and not isinstance(w, bool)
        and math.isfinite(w)
        and w >= 0
        for label, w in traffic.items()
    ):
        raise ModelConfigError(f"{path}: [traffic] maps existing labels to finite weights >= 0")
    return ModelConfig(
        name=name,
        kind=kind,
        slo_p99_ms=_positive(_require(raw, "slo_p99_ms", int, path), "slo_p99_ms", path),
        max_batch_size=_positive(
            _require(raw, "max_batch_size", int, path), "max_batch_size", path
        ),
        max_batch_tokens=batch_tokens(raw, buckets, path),
        max_queue_size=_positive(
            _optional(raw, "max_queue_size", int, 1024, path), "max_queue_size", path
        ),
        length_buckets=buckets,
        inputs=_tensor_specs(raw.get("inputs"), "inputs", path),
        outputs=_tensor_specs(raw.get("outputs"), "outputs", path),
        preprocessing=MappingProxyType(dict(raw.get("preprocessing", {}))),
        labels=MappingProxyType(dict(labels)),
        traffic=MappingProxyType({k: float(v) for k, v in traffic.items()}),
        generation=generation,
        embedding=_embedding_settings(raw, path),
        default_timeout_ms=_positive(
            _optional(raw, "default_timeout_ms", int, DEFAULT_TIMEOUT_MS, path),
            "default_timeout_ms",
            path,
        ),
        shed_past_slo=_optional(raw, "shed_past_slo", bool, False, path),
    )


def _generation_settings(raw: dict[str, Any], path: Path) -> GenerationSettings:
    try:
        generation = GenerationSettings(**raw.get("generation", {}))
    except TypeError as error:
        raise ModelConfigError(f"{path}: [generation]: {error}") from error
    sizes = {k: v for k, v in vars(generation).items() if k != "prefix_caching"}
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in sizes.values()):
        raise ModelConfigError(f"{path}: [generation] sizes must be integers")
    if min(v for k, v in sizes.items() if k != "watermark_blocks") <= 0:
        raise ModelConfigError(f"{path}: [generation] sizes must be positive")
    if generation.prefix_caching not in PREFIX_CACHING_SCOPES:
        raise ModelConfigError(
            f"{path}: [generation] prefix_caching must be one of {PREFIX_CACHING_SCOPES},"
            f" got {generation.prefix_caching!r}"
        )
    if not 0 <= generation.watermark_blocks < generation.num_kv_blocks:
        # At num_kv_blocks or more no sequence is admitted beside a running one (review).
        raise ModelConfigError(
            f"{path}: [generation] watermark_blocks must be >= 0 and below num_kv_blocks "
            f"({generation.num_kv_blocks}), got {generation.watermark_blocks}"
        )
    if min(generation.num_kv_blocks * generation.block_size, generation.max_model_len) < 2:
        raise ModelConfigError(f"{path}: [generation] KV cache and context hold 2 tokens or more")
    return generation


def _embedding_settings(raw: dict[str, Any], path: Path) -> EmbeddingSettings:
    table = raw.get("embedding", {})
    if not isinstance(table, dict):
        raise ModelConfigError(f"{path}: [embedding] must be a table")
    unknown = sorted(set(table) - {"shortenable", "truncate"})
    if unknown:
        raise ModelConfigError(f"{path}: [embedding] has unknown keys {unknown}")
    if table and raw.get("kind") != ModelKind.EMBEDDING.value:
        raise ModelConfigError(f"{path}: [embedding] is for embedding models only")
    return EmbeddingSettings(
        shortenable=_optional(table, "shortenable", bool, False, path),
        truncate=_optional(table, "truncate", bool, False, path),
    )


def _weights_dir(version_dir: Path) -> Path:
    spec_path = version_dir / "version.toml"
    if not spec_path.exists():
        return version_dir
    try:
        weights = tomllib.loads(spec_path.read_text(encoding="utf-8")).get("weights", "")
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as error:
        raise ModelConfigError(f"{spec_path}: {error}") from error
    if not isinstance(weights, str) or not weights:
        raise ModelConfigError(f"{spec_path}: 'weights' must be a non-empty string")
    if weights.startswith("package:"):
        module_name = weights.removeprefix("package:")
        try:
            module = importlib.import_module(module_name)
        except ImportError as error:
            raise ModelConfigError(
                f"{spec_path}: weights package {module_name!r} is not installed"
            ) from error
        except Exception as error:  # its import failed otherwise: this model's error alone
            raise ModelConfigError(
                f"{spec_path}: weights package {module_name!r} failed to import: {error!r}"
            ) from error
        try:
            return Path(module.get_model_path())
        except Exception as error:  # no get_model_path, or it failed
            raise ModelConfigError(
                f"{spec_path}: weights package {module_name!r} gave no model path: {error!r}"
            ) from error
    path = Path(weights)
    return path if path.is_absolute() else (version_dir / path).resolve()


def load_repository(
    root: Path, *, on_error: Callable[[str, ModelConfigError], None] | None = None
) -> list[ModelVersion]:
    """Every version of every model under `root`, ordered by model then version number. A
    model that does not read raises ModelConfigError, or, with `on_error`, is reported to it
    (with its directory's name) and left out."""
    if not root.is_dir():
        raise ModelConfigError(f"{root}: model repository directory does not exist")
    try:
        model_dirs = sorted(p for p in root.iterdir() if p.is_dir())
    except OSError as error:  # unreadable: a directory of another user's, a volume gone
        raise ModelConfigError(f"{root}: {error.strerror or error}") from error
    versions: list[ModelVersion] = []
    for model_dir in model_dirs:
        try:
            versions.extend(_model_versions(model_dir))
        except ModelConfigError as error:
            if on_error is None:
                raise
            on_error(model_dir.name, error)
    return versions


def _model_versions(model_dir: Path) -> list[ModelVersion]:
    if not _NAME_RE.match(model_dir.name):
        raise ModelConfigError(f"{model_dir}: model names are [a-z0-9][a-z0-9_.-]*")
    config = parse_model_config(model_dir.name, model_dir / "config.toml")
    try:
        # isdecimal and ASCII: "²" is a digit int() does not read.
        found = [p for p in model_dir.iterdir() if p.name.isascii() and p.name.isdecimal()]
        numbered = sorted((p for p in found if p.is_dir()), key=lambda p: int(p.name))
    except OSError as error:
        raise ModelConfigError(f"{model_dir}: {error}") from error
    if not numbered:
        raise ModelConfigError(f"{model_dir}: no version directories (1/, 2/, ...)")
    by_number: dict[int, Path] = {}
    for version_dir in numbered:
        if (same := by_number.setdefault(int(version_dir.name), version_dir)) is not version_dir:
            # 1/ and 01/ would load as two copies of version 1, workers and gateways each one.
            raise ModelConfigError(
                f"{model_dir}: {same.name}/ and {version_dir.name}/ are both version "
                f"{int(version_dir.name)}"
            )
    return [
        ModelVersion(config=config, version=str(number), weights_dir=_weights_dir(version_dir))
        for number, version_dir in by_number.items()
    ]


def select_models(versions: list[ModelVersion], names: tuple[str, ...]) -> list[ModelVersion]:
    """The versions of the models in `names` (a worker's model pool); all of them when `names`
    is empty. Raises ModelConfigError naming any model the repository does not have."""
    if not names:
        return versions
    missing = sorted(set(names) - {v.config.name for v in versions})
    if missing:
        raise ModelConfigError(f"models not in the repository: {', '.join(missing)}")
    return [v for v in versions if v.config.name in names]
