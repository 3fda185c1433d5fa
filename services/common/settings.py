"""Settings tables: each tier declares its settings once, as rows of `Setting`; the command line
and its environment fallbacks are generated from the table.

Precedence, highest first: the flag, the environment variable `<TIER>_<NAME>` (for example
`WORKER_GRPC_PORT`), the table's default. `--help` lists every setting with its unit, variable
and default. A malformed value, from a flag or the environment, exits with status 2 and a
message naming it; so does a value the config dataclasses reject.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, TypeVar

from services.common.event_loop import EVENT_LOOPS, parse_event_loop

C = TypeVar("C")

#: Placeholder of a value in usage lines, by unit or else by type.
_METAVARS: dict[Any, str] = {
    "s": "SECONDS",
    "ms": "MS",
    "port": "PORT",
    int: "INT",
    float: "NUMBER",
    str: "TEXT",
    Path: "PATH",
}
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


@dataclass(frozen=True)
class Setting:
    """One setting: a flag with an environment fallback and a default."""

    #: Key of the parsed value (snake_case); also names the flag and the variable by default.
    name: str
    #: Parses the flag's or variable's text: int, float, str, Path, bool or a str -> value
    #: callable that raises ValueError. bool settings get `--x/--no-x`.
    type: Callable[[str], Any]
    #: Value when neither the flag nor the variable is given; None means "unset".
    default: Any
    #: What the setting does, for `--help` (one sentence).
    doc: str
    #: Unit of the value ("s", "ms", "port"...), shown in `--help`; "" for none.
    unit: str = ""
    #: Command-line flag; "" means `--<name with dashes>`.
    flag: str = ""
    #: Full environment variable name; "" means `<TIER>_<NAME>`. Set only to keep a name that
    #: deployments already use.
    env: str = ""
    #: Where the value goes in the tier's config: a field name, or `nested.field` for a field
    #: of a nested config dataclass; "" means the top-level field called `name`.
    field: str = ""
    #: Factor applied to a numeric value on its way into the config (0.001 puts a setting in
    #: ms into a field in seconds).
    scale: float = 1.0


@dataclass(frozen=True)
class SettingsTable:
    """A tier's settings and the program they configure."""

    #: Program name shown in usage lines (`python -m services.<tier>`).
    prog: str
    description: str
    #: `<TIER>` of the environment variables: GATEWAY, ROUTER, WORKER.
    env_prefix: str
    settings: tuple[Setting, ...]

    def flag(self, setting: Setting) -> str:
        return setting.flag or "--" + setting.name.replace("_", "-")

    def env_var(self, setting: Setting) -> str:
        return setting.env or f"{self.env_prefix}_{setting.name.upper()}"

    def env_vars(self) -> tuple[str, ...]:
        return tuple(self.env_var(s) for s in self.settings)


def listener_settings(defaults: Any) -> tuple[Setting, ...]:
    """The settings every tier has: listen address, ports, ready file, drain grace, logging
    (into the config's `logging: LogConfig` field) and the event loop (its `event_loop`);
    defaults read from the tier's config class (its `grpc_port`, `metrics_port`,
    `drain_grace_s`)."""
    grpc_port, metrics_port = defaults.grpc_port, defaults.metrics_port
    drain_grace_s = defaults.drain_grace_s
    return (
        Setting(
            "drain_grace_s",
            parse_seconds,
            drain_grace_s,
            "time in-flight work may take to finish after SIGTERM",
            "s",
        ),
        Setting("host", str, "127.0.0.1", "interface the gRPC and metrics listeners bind"),
        Setting("grpc_port", int, grpc_port, "gRPC port; 0 picks a free one", "port"),
        Setting(
            "metrics_port",
            int,
            metrics_port,
            "Prometheus /metrics port; 0 picks a free one",
            "port",
        ),
        Setting(
            "ready_file",
            Path,
            None,
            "once ready, write the bound ports here as JSON {grpc_port, metrics_port}",
        ),
        # Checked by services.common.logs.LogConfig, the tier config's `logging` field.
        Setting(
            "log_level", str, "info", "lowest level logged: debug, info, warning or error",
            field="logging.level",
        ),
        Setting(
            "log_format", str, "json",
            "log lines as json (one object per line, with trace and request ids) or text",
            field="logging.format",
        ),
        Setting(
            "event_loop", parse_event_loop, EVENT_LOOPS[0],
            "the process's event loop: uvloop (libuv's, about a tenth less CPU a call) or "
            "asyncio (the standard library's); services.common.event_loop",
        ),
    )  # fmt: skip


def parse_bool(text: str) -> bool:
    """1/true/yes/on or 0/false/no/off, any case."""
    value = text.strip().lower()
    if value in _TRUE or value in _FALSE:
        return value in _TRUE
    raise ValueError(f"expected one of {sorted(_TRUE | _FALSE)}")


def parse_seconds(text: str) -> float:
    """A duration: a finite number of seconds, at least 0."""
    value = float(text)
    if not (math.isfinite(value) and value >= 0):
        raise ValueError(f"expected a finite number of seconds >= 0, got {text!r}")
    return value


def parse_weights(text: str) -> dict[str, float]:
    """`name=weight,name=weight` (for example `search=3,batch=0.5`); "" is no weights."""
    weights: dict[str, float] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, sep, weight = item.partition("=")
        if not (sep and name.strip()):
            raise ValueError(f"{item!r} is not name=weight")
        value = float(weight)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"weight of {name.strip()!r} must be a positive number")
        weights[name.strip()] = value
    return weights


def _help(table: SettingsTable, setting: Setting) -> str:
    default = setting.default
    if isinstance(default, bool):
        shown = "on" if default else "off"
    elif default is None or default == "" or default == {}:
        shown = "unset"
    else:
        shown = str(default)
    unit = f"{setting.unit}; " if setting.unit else ""
    text = f"{setting.doc} ({unit}env {table.env_var(setting)}; default {shown})"
    return text.replace("%", "%%")  # argparse %-formats help text


def _from_env(setting: Setting, raw: str) -> Any:
    if raw == "" and setting.default is None:
        return None
    if setting.type is bool:
        return parse_bool(raw)
    return _parse(setting)(raw)


def _parse(setting: Setting) -> Callable[[str], Any]:
    """What reads the setting's text. A plain float is taken finite (NaN passes every `< 0`
    check and then compares false everywhere; inf never comes), and at least 0 as a duration
    (unit s or ms)."""
    if setting.type is not float:
        return setting.type
    return parse_seconds if setting.unit in ("s", "ms") else parse_finite


def parse_finite(text: str) -> float:
    """A finite number."""
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"expected a finite number, got {text!r}")
    return value


def build_parser(table: SettingsTable, environ: Mapping[str, str]) -> argparse.ArgumentParser:
    """The tier's parser, its defaults already taken from `environ` where set. A malformed
    variable exits here with status 2."""
    parser = argparse.ArgumentParser(prog=table.prog, description=table.description)
    defaults: dict[str, Any] = {}
    for setting in table.settings:
        flag, help_text = table.flag(setting), _help(table, setting)
        if setting.type is bool:
            action = argparse.BooleanOptionalAction
            parser.add_argument(flag, dest=setting.name, action=action, help=help_text)
        else:
            metavar = _METAVARS.get(setting.unit) or _METAVARS.get(setting.type, "VALUE")
            parser.add_argument(
                flag, dest=setting.name, type=_parse(setting), metavar=metavar, help=help_text
            )
        variable = table.env_var(setting)
        raw = environ.get(variable)
        if raw is None:
            defaults[setting.name] = setting.default
            continue
        try:
            defaults[setting.name] = _from_env(setting, raw)
        except ValueError as error:
            parser.error(f"environment variable {variable}={raw!r} is invalid: {error}")
    # Defaults go in after the arguments: argparse would otherwise print the environment's
    # value as each bool's default, which --help already states from the table.
    parser.set_defaults(**defaults)
    return parser


def config_builder(config_class: type[C], table: SettingsTable) -> Callable[[Mapping[str, Any]], C]:
    """Builds `config_class` (a dataclass) from the values `table` parsed, each placed where its
    setting's `field` says; nested config dataclasses are built from their fields' defaults'
    types. A ValueError from a config's validation propagates."""

    def build(values: Mapping[str, Any]) -> C:
        top: dict[str, Any] = {}
        nested: dict[str, dict[str, Any]] = {}
        for setting in table.settings:
            value = values[setting.name]
            if setting.scale != 1.0 and value is not None:
                value = value * setting.scale
            head, _, rest = (setting.field or setting.name).partition(".")
            if rest:
                nested.setdefault(head, {})[rest] = value
            else:
                top[head] = value
        # C is any config dataclass; typeshed's DataclassInstance bound is private to it.
        fields = {f.name: f for f in dataclasses.fields(config_class)}  # type: ignore[arg-type]
        for name, kwargs in nested.items():
            factory = fields[name].default_factory
            if not callable(factory):
                raise TypeError(f"{config_class.__name__}.{name} needs a default_factory")
            top[name] = dataclasses.replace(factory(), **kwargs)
        return config_class(**top)

    return build


def read_config(
    table: SettingsTable,
    build: Callable[[Mapping[str, Any]], C],
    argv: list[str] | None = None,
    environ: Mapping[str, str] | None = None,
) -> C:
    """Parses `argv` (None: sys.argv) with `environ` (None: os.environ) as fallback and builds
    the tier's config from the values by name. A value `build` rejects with ValueError exits
    with status 2, as a malformed flag does."""
    environ = os.environ if environ is None else environ
    parser = build_parser(table, environ)
    values = vars(parser.parse_args(argv))
    try:
        return build(values)
    except ValueError as error:
        parser.error(str(error))


class StartupError(ValueError):
    """A setting that parsed but cannot be used once the process starts: a file it names is
    missing, unreadable or malformed where the tier first reads it (a pod's paths are not
    read when its config is parsed). Under `ConfigParser.startup_errors` the process exits
    with status 2 and the message, as for a malformed flag, not with a traceback."""


def unusable_file(what: str, path: Path, error: Exception) -> StartupError:
    """The StartupError for the file `path` (`what` it holds) that failed with `error`."""
    reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    reason = reason.removeprefix(f"{path}: ")  # the file's own errors may name it first
    return StartupError(f"{what} {path} cannot be used: {reason}")


def unusable_port(what: str, port: int, error: OSError) -> StartupError:
    """The StartupError for `port` (`what` it serves) that could not be bound."""
    return StartupError(f"{what} {port} cannot be used: {error.strerror or error}")


@dataclass(frozen=True)
class ConfigParser(Generic[C]):
    """A tier's `parse_config`: its table and how its config is built from the values."""

    table: SettingsTable
    build: Callable[[Mapping[str, Any]], C]

    @contextlib.contextmanager
    def startup_errors(self) -> Iterator[None]:
        """Around a tier's run: a StartupError exits with status 2 and its message on
        stderr, named as the parser names the program."""
        try:
            yield
        except StartupError as error:
            sys.stderr.write(f"{self.table.prog}: error: {error}\n")
            raise SystemExit(2) from None

    def __call__(
        self, argv: list[str] | None = None, environ: Mapping[str, str] | None = None
    ) -> C:
        """The config from `argv` (None: sys.argv) and `environ` (None: os.environ); a bad
        setting exits with status 2."""
        return read_config(self.table, self.build, argv, environ)
