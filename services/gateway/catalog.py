"""What the gateway knows about models: configs and tokenizers from its model repository, and
which versions the fleet serves now (from the router, refreshed in the background).

Resolving a request's model picks the version (number, label, or weighted default), checks a
ready worker serves it, and that the workers' tokenizer is the one this gateway would use.
Labels and traffic weights are the repository's until Redis says otherwise
(services.common.model_routing, applied by routing_sync).
"""

from __future__ import annotations

import itertools
import logging
import random
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidInput, NotFound, ServingError, Unavailable
from services.common.model_repository import ModelConfig, ModelKind, ModelVersion
from services.common.model_routing import ModelRouting
from services.common.sparse_log import SparseLog
from services.common.telemetry import Retirement
from services.common.text import TextEncoder
from services.gateway.triton_info import WorkerTimes
from services.pb.inference.v1 import worker_pb2 as pb

log = logging.getLogger(__name__)
_sparse = SparseLog(log)

_NAME_RE = re.compile(r"^[a-z0-9][a-z0-9_.-]{0,63}$")
_LABEL_RE = re.compile(r"^[a-z][a-z0-9_-]{0,31}$")
#: A name past the repository's pattern is a model not found up to this length (and shaped
#: as a name: `_is_name_shaped`); longer, blank, a path or with control characters, malformed.
_MAX_UNKNOWN_NAME_CHARS = 256


def _is_name_shaped(name: str) -> bool:
    """Whether a name past the repository's pattern may still be a model's name elsewhere
    (`BAAI/bge-small`): printable, no space, and no path (`../x`, `/etc`, `a\\b`)."""
    return (
        name.isprintable()
        and not any(c.isspace() for c in name)
        and ".." not in name
        and not name.startswith(("/", "."))
        and "\\" not in name
    )


#: The longest version a call may name (a number or a label).
MAX_VERSION_SPEC_CHARS = 64


def new_encoder(version: ModelVersion) -> TextEncoder | None:
    """The tokenizer of a text model's version (reads its files: blocking); None for tensor
    models."""
    if version.config.kind in (ModelKind.EMBEDDING, ModelKind.GENERATION):
        return TextEncoder(version.weights_dir, version.config)
    return None


#: What `_encoders.get` answers for a version this gateway has not read (None is a tensor
#: model's encoder).
_UNREAD: Any = object()


@dataclass(frozen=True)
class ResolvedModel:
    config: ModelConfig
    version: str
    #: The fingerprint requests are stamped with (the workers' for this version).
    fingerprint: str
    #: Tokenizer for text models; None for tensor models.
    encoder: TextEncoder | None


class ModelCatalog:
    def __init__(
        self,
        versions: Sequence[ModelVersion],
        rng: random.Random | None = None,
        *,
        on_error: Callable[[str, Exception], None] | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`on_error`: given, a version whose tokenizer does not read (its files still being
        copied) is left out and passed to it (as `name/version`), the model too if none of its
        versions read; else that raises (a review finding: at a gateway's start it stopped the
        gateway, where the repository's re-reads leave such a version out and read it once it
        does)."""
        self._configs: dict[str, ModelConfig] = {}
        self._encoders: dict[tuple[str, str], TextEncoder | None] = {}
        for version in versions:
            try:
                encoder = new_encoder(version)
            except Exception as error:
                if on_error is None:
                    raise
                on_error(f"{version.config.name}/{version.version}", error)
                continue
            self._configs[version.config.name] = version.config
            self._encoders[(version.config.name, version.version)] = encoder
        self._served: dict[tuple[str, str], pb.ModelVersionInfo] = {}
        self._load_failures: dict[tuple[str, str], list[pb.LoadFailure]] = {}
        self._rng = rng or random.Random()
        self._seeds = {
            name: ModelRouting(dict(c.labels), dict(c.traffic)) for name, c in self._configs.items()
        }
        self._routing = dict(self._seeds)
        #: Per model, `_newest_default`'s answer (None: none), kept until what it reads
        #: changes: without it every call to a model without labels built and sorted lists.
        self._newest_defaults: dict[str, str | None] = {}
        #: What is kept elsewhere per version (metric series, Triton's statistics) is dropped
        #: by these, RETIRED_SERIES_S after this catalog forgot the version.
        self.on_removed: list[Callable[[str, str], None]] = []
        #: Models whose desired state was last read (or written here) as unloaded
        #: (RepositoryControl; none without Redis).
        self.unloaded: frozenset[str] = frozenset()
        self._retirement = Retirement(self._removed, clock)

    def _removed(self, model: str, version: str) -> None:
        for remove in self.on_removed:
            remove(model, version)

    def routing(self, name: str) -> ModelRouting:
        """The model's labels and traffic weights in force (KeyError for an unknown model)."""
        return self._routing[name]

    def set_routing(self, name: str, routing: ModelRouting | None) -> bool:
        """Applies a runtime routing for `name` (None: back to the repository's seed) if it is
        newer than the one in force; True if it changed anything. Raises ValueError for an
        unknown model or a label naming a version not in this gateway's repository."""
        if name not in self._configs:
            raise ValueError(f"model {name!r} is not in this gateway's repository")
        current = self._routing[name]
        if routing is None:
            if current.revision == 0:
                return False
            self._routing[name] = self._seeds[name]
            self._newest_defaults.clear()
            return True
        if routing.revision <= current.revision:
            return False
        routing.check_versions({int(v) for (n, v) in self._encoders if n == name})
        self._routing[name] = routing
        self._newest_defaults.clear()
        return True

    def update_served(
        self,
        versions: Sequence[pb.ModelVersionInfo],
        load_failures: Sequence[pb.LoadFailure] = (),
    ) -> None:
        """Replaces the fleet view (what the router says live workers serve, and which
        versions they failed to load)."""
        self._served = {(v.model_name, v.model_version): v for v in versions}
        self._newest_defaults.clear()
        failures: dict[tuple[str, str], list[pb.LoadFailure]] = {}
        for failure in load_failures:
            failures.setdefault((failure.model_name, failure.model_version), []).append(failure)
        self._load_failures = failures

    def ready_versions(self) -> dict[str, int]:
        """Per model of this gateway's repository, how many of its versions a ready live
        worker serves (by the fleet view) that this gateway has read too: calls to a version
        it has not read fail here."""
        counts = dict.fromkeys(self._configs, 0)
        for key, served in self._served.items():
            if key[0] in counts and served.is_ready and key in self._encoders:
                counts[key[0]] += 1
        return counts

    def load_failures(self, name: str, version: str) -> list[pb.LoadFailure]:
        """The live workers' failures to load one version (empty if none failed)."""
        return self._load_failures.get((name, version), [])

    def worker_times(self, name: str, version: str) -> WorkerTimes:
        """The live workers' cumulative batcher figures for one version (zeros if unserved)."""
        served = self._served.get((name, version))
        if served is None:
            return WorkerTimes()
        totals = served.totals
        return WorkerTimes(
            executions=totals.executions,
            queue_s=totals.queue_ns / 1e9,
            rows=totals.rows,
            compute_s=totals.compute_ns / 1e9,
        )

    def tightest_slo_s(self) -> float | None:
        """The tightest SLO of the fixed-cost models (not generation), seconds; None if none."""
        return min((c.slo_s for c in self._configs.values() if c.generation is None), default=None)

    def model_names(self) -> list[str]:
        return sorted(self._configs)

    def label_for(self, name: str) -> str:
        """A bounded metric label: names outside the repository count as "other"."""
        return name if name in self._configs else "other"

    def config(self, name: str) -> ModelConfig:
        if not _NAME_RE.match(name):
            if 0 < len(name) <= _MAX_UNKNOWN_NAME_CHARS and _is_name_shaped(name):
                # A name no repository holds (`BAAI/bge-small`, `Qwen2.5-7B`) is a model not
                # found: OpenAI's clients fall back on a 404, not on a 400 (review finding).
                raise NotFound(
                    f"model {name!r} not found (model names are lowercase letters, digits and _.-)"
                )
            raise InvalidInput(f"model name {name!r} is not a valid model name")
        config = self._configs.get(name)
        if config is None:
            raise NotFound(f"model {name!r} not found")
        return config

    def has_version(self, name: str, version: str) -> bool:
        """Whether this gateway knows `name`/`version` (read from its repository)."""
        return (name, version) in self._encoders

    def add_version(self, version: ModelVersion, encoder: TextEncoder | None) -> None:
        """Knows a version added to the repository since start (hot load; `encoder` from
        `new_encoder`, built off the event loop). A model new to the catalog starts from its
        config's routing; a known model keeps its config and routing."""
        name = version.config.name
        if name not in self._configs:
            self._configs[name] = version.config
            config = version.config
            self._seeds[name] = ModelRouting(dict(config.labels), dict(config.traffic))
            self._routing[name] = self._seeds[name]
        self._encoders[(name, version.version)] = encoder
        self._newest_defaults.clear()
        self._retirement.revive(name, version.version)

    def forget_versions(self, on_disk: set[tuple[str, str]]) -> list[str]:
        """Forgets the versions (and their tokenizers) gone from the repository (`on_disk`:
        every `(name, version)` it holds now) that nothing here needs any more: no live worker
        serves them, ready or not, and no label names them (the labels in force; the config's
        only while the model is still in the repository). A model left without versions is
        forgotten too (NOT_FOUND from then on). Returns the versions as `name/version`.
        Without this, each version a rollout retired stayed here for good."""
        needed = set(self._served)
        present = {name for name, _ in on_disk}
        for name, routing in self._routing.items():
            if name in present or routing.revision > 0:
                needed.update((name, str(v)) for v in routing.labels.values())
        gone = [key for key in self._encoders if key not in on_disk and key not in needed]
        for key in gone:
            del self._encoders[key]
            self._retirement.retire(*key)
        kept = {name for name, _ in self._encoders}
        for name in [n for n in self._configs if n not in kept]:
            del self._configs[name], self._seeds[name], self._routing[name]
        self._newest_defaults.clear()
        return [f"{name}/{version}" for name, version in gone]

    def serves_gone(self, on_disk: set[tuple[str, str]]) -> bool:
        """Whether a live worker serves a version this gateway holds that is gone from the
        repository (`on_disk`): kept by `forget_versions` until no worker does."""
        return any(key in self._encoders and key not in on_disk for key in self._served)

    def is_current(self, name: str, version: str, fingerprint: str) -> bool:
        """Whether a live worker serves `name`/`version` with `fingerprint`, and this gateway
        still knows the version: what is kept per version elsewhere (a bundle tokenizer, a
        bundle key's state) is worth keeping."""
        served = self._served.get((name, version))
        return (
            served is not None
            and served.fingerprint == fingerprint
            and (name, version) in self._encoders
        )

    def repository_versions(self, name: str) -> list[str]:
        """The versions of `name` in this gateway's repository, in version order."""
        return sorted((v for n, v in self._encoders if n == name), key=int)

    def served_versions(self, name: str) -> list[pb.ModelVersionInfo]:
        """The versions of `name` a ready live worker serves that this gateway has read too,
        with the workers' tokenizer: those its calls can run on (`_is_default_ready`). One
        only the fleet serves (loaded a moment ago, its tokenizer not read here, or not the
        workers') was listed and called ready, and a call naming it failed (review finding)."""
        return [
            v for v in self.fleet_versions(name) if self._is_default_ready(name, v.model_version)
        ]

    def fleet_versions(self, name: str) -> list[pb.ModelVersionInfo]:
        """The versions of `name` a ready live worker serves, read here or not (the fleet's
        state: the repository's index and loads)."""
        served = [v for (n, _), v in self._served.items() if n == name and v.is_ready]
        return sorted(served, key=lambda v: int(v.model_version))

    def _default_version(self, config: ModelConfig, sticky_key: str | None) -> str:
        """The weighted label's version, else stable's, else another weighted label's, else
        the newest served: a labelled version no ready worker serves (a canary that failed to
        load everywhere) passes its share on down that list rather than fail it (review
        finding), but never to a version a label holds at weight 0 (a canary held back)."""
        name, routing = config.name, self._routing[config.name]
        label = routing.weighted_label(name, sticky_key, self._rng)
        weighted = (label for label, weight in routing.traffic.items() if weight > 0)
        for chosen in itertools.chain((label, "stable"), weighted):
            if chosen is not None and chosen in routing.labels:
                version = str(routing.labels[chosen])
                if self._is_default_ready(name, version):  # a dict lookup per call, no list
                    return version
        if name in self._newest_defaults:
            newest = self._newest_defaults[name]
        else:
            newest = self._newest_defaults[name] = self._newest_default(name, routing)
        if newest is None:
            raise self._not_served(name, f"model {name!r}")
        return newest

    def _not_served(self, name: str, what: str) -> ServingError:
        """Why no ready worker serves `what` (of model `name`): unloaded on purpose, NOT_FOUND
        (it was UNAVAILABLE, which clients retry and jobs wait 30 minutes on); else
        UNAVAILABLE."""
        if name in self.unloaded:
            return NotFound(f"model {name!r} is unloaded (RepositoryModelUnload)")
        return Unavailable(f"no ready worker serves {what}")

    def _newest_default(self, name: str, routing: ModelRouting) -> str | None:
        """The newest version served that may be a default: ready, read here, and not held
        back by a label at weight 0; None if there is none."""
        held = {str(v) for label, v in routing.labels.items() if routing.traffic.get(label) == 0}
        served = [
            v.model_version
            for v in self.served_versions(name)
            if self._is_default_ready(name, v.model_version) and v.model_version not in held
        ]
        return served[-1] if served else None

    def _is_default_ready(self, name: str, version: str) -> bool:
        """Whether a ready worker serves `version`, this gateway has read it, and with the
        workers' tokenizer: one not read here yet (loaded a moment ago), or whose tokenizer
        here differs (a re-staged version, a stale volume), is not a default, resolving it
        would fail (its share of calls was refused while stable served: review finding)."""
        served = self._served.get((name, version))
        encoder = self._encoders.get((name, version), _UNREAD)
        if served is None or not served.is_ready or encoder is _UNREAD:
            return False
        return encoder is None or encoder.fingerprint == served.tokenizer_fingerprint

    def version_of(self, name: str, version_spec: str) -> str:
        """The version a number or label names now, whether served or not; NOT_FOUND for one
        this gateway's repository lacks or a label not set, INVALID_ARGUMENT for neither."""
        spec = version_spec.strip()
        if len(spec) > MAX_VERSION_SPEC_CHARS:  # echoed in errors; int() refuses 4,301 digits
            raise InvalidInput(f"version {spec[:16]!r}... is longer than {MAX_VERSION_SPEC_CHARS}")
        if spec.isascii() and spec.isdecimal():  # not str.isdigit: superscripts are digits
            version = str(int(spec))
        elif _LABEL_RE.match(spec):
            labels = self._routing[self.config(name).name].labels
            if spec not in labels:
                raise NotFound(f"model {name!r} has no version label {spec!r}")
            version = str(labels[spec])
        else:
            raise InvalidInput(f"model version {version_spec!r} is neither a number nor a label")
        return self._known(name, version)

    def _known(self, name: str, version: str) -> str:
        """`version`, when this gateway's repository has it; NOT_FOUND otherwise."""
        if (name, version) not in self._encoders:
            raise NotFound(f"model {name!r} version {version} not found")
        return version

    def resolve(
        self, name: str, version_spec: str, *, sticky_key: str | None = None
    ) -> ResolvedModel:
        """The version a request for `version_spec` (number, label, or "" for the weighted
        default; the same `sticky_key` gets the same default while weights stand) runs on."""
        config = self.config(name)
        if version_spec.strip():
            version = self.version_of(name, version_spec)
        else:
            version = self._known(name, self._default_version(config, sticky_key))
        served = self._served.get((name, version))
        if served is None or not served.is_ready:
            raise self._not_served(name, f"{name}/{version}")
        encoder = self._encoders[(name, version)]
        if encoder is not None and encoder.fingerprint != served.tokenizer_fingerprint:
            _sparse.error(  # every call of the version meets it, as long as the rollout lasts
                (name, version), "tokenizer mismatch for %s/%s: gateway %s, workers %s",
                name, version, encoder.fingerprint, served.tokenizer_fingerprint,
            )  # fmt: skip
            raise Unavailable(
                f"this gateway's tokenizer for {name}/{version} differs from the workers'"
            )
        return ResolvedModel(config, version, served.fingerprint, encoder)
