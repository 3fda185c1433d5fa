"""Dotted-path overrides of a scenario file's mapping, for the CLI's --set and sweeps:
`parse_setting("batching.max_wait_cap_s=0.005")` reads one from the command line, and
`with_overrides` sets them in a copy of the mapping before it is parsed (scenario.py)."""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Mapping
from typing import Any


def with_overrides(raw: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of `raw` with each dotted path (`batching.max_wait_cap_s`, `duration_s`) set to
    its value; missing tables on the way are created, and a number picks an element of an
    array of tables (`traffic.streams.0.rate_per_s`). `raw` is not changed."""
    out = copy.deepcopy(dict(raw))
    for path, value in overrides.items():
        *tables, key = path.split(".")
        if not key or not all(tables):
            raise ValueError(
                f"--set {path!r}: expected a dotted path such as batching.max_wait_cap_s"
            )
        node: Any = out
        for name in tables:
            if isinstance(node, list) and name.isdigit() and int(name) < len(node):
                node = node[int(name)]
            elif isinstance(node, dict):
                node = node.setdefault(name, {})
            else:
                raise ValueError(f"--set {path!r}: no table {name!r} there")
        if not isinstance(node, dict):
            raise ValueError(f"--set {path!r}: {tables[-1]!r} is not a table")
        node[key] = value
    return out


def parse_setting(text: str) -> tuple[str, list[Any]]:
    """`table.key=V1,V2,...` into the path and its values, each a TOML value (a number, true,
    "text"), or the bare text where it is none (`hpa.metric=backlog`)."""
    path, sep, values = text.partition("=")
    if not sep or not path.strip() or not values.strip():
        raise ValueError(f"--set {text!r}: expected table.key=VALUE[,VALUE...]")
    try:
        parsed = tomllib.loads(f"v = [{values}]")["v"]
    except tomllib.TOMLDecodeError:
        parsed = [v.strip() for v in values.split(",")]
    return path.strip(), list(parsed)
