"""`python -m services.sim run|plan|sweep SCENARIO [options]`.

`run` simulates one scenario file and prints its summary table (and writes JSON and CSV with
--out); `plan` searches the fewest workers that meet the scenario's SLO and counts the gateways
(see planner.py); `sweep` runs it once per value of `--set table.key=V1,V2,...` and marks the
best (see sweep.py). `--set table.key=VALUE` overrides one setting of the file in any command.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from collections.abc import Callable
from pathlib import Path

from services.sim.generation_run import GenerationScenario, run_generation
from services.sim.plan_text import format_plan
from services.sim.planner import plan
from services.sim.report import (
    format_generation_table,
    format_table,
    write_generation_outputs,
    write_outputs,
    write_summary,
)
from services.sim.scenario import load_scenario
from services.sim.scenario_overrides import parse_setting
from services.sim.shards import run_sharded
from services.sim.simulation import Scenario, run
from services.sim.sweep import format_sweep, sweep


def _number(low: float, *, is_open: bool) -> Callable[[str], float]:
    """An argparse type: a finite number above `low` (`is_open`) or at least it."""

    def parse(text: str) -> float:
        value = float(text)
        if not math.isfinite(value) or value < low or (is_open and value == low):
            raise argparse.ArgumentTypeError(
                f"{text}: a finite number {'>' if is_open else '>='} {low:g}"
            )
        return value

    return parse


_POSITIVE = _number(0.0, is_open=True)
_AT_LEAST_0 = _number(0.0, is_open=False)


def _count(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text}: at least 1")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.sim", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_cmd = commands.add_parser("run", help="simulate one scenario file")
    run_cmd.add_argument("scenario", type=Path)
    run_cmd.add_argument("--out", type=Path, help="directory for summary.json and CSV series")
    run_cmd.add_argument("--duration-s", type=_POSITIVE, help="override the scenario's duration")
    run_cmd.add_argument(
        "--shards", type=_count, default=1, help="split a fixed fleet over N processes (shards.py)"
    )
    plan_cmd = commands.add_parser("plan", help="fewest workers meeting the scenario's SLO")
    plan_cmd.add_argument("scenario", type=Path)
    plan_cmd.add_argument("--percentile", type=float, default=99.0, choices=(50.0, 90.0, 99.0))
    plan_cmd.add_argument(
        "--headroom", type=_AT_LEAST_0, default=0.2, help="extra load, 0.2 = 20%%"
    )
    plan_cmd.add_argument("--max-workers", type=_count, default=512)
    plan_cmd.add_argument("--duration-s", type=_POSITIVE, help="override the scenario's duration")
    plan_cmd.add_argument(
        "--gateway-rps", type=_POSITIVE, help="requests/s one gateway serves (fleet.gateway_rps)"
    )
    sweep_cmd = commands.add_parser("sweep", help="one run per value of --set, the best marked")
    sweep_cmd.add_argument("scenario", type=Path)
    sweep_cmd.add_argument("--duration-s", type=_POSITIVE, help="override the scenario's duration")
    for command in (run_cmd, plan_cmd, sweep_cmd):
        command.add_argument(
            "--set",
            action="append",
            default=[],
            metavar="TABLE.KEY=VALUE[,VALUE...]",
            help="override a setting of the file (several values: sweep only); repeatable",
        )
    return parser


def _settings(texts: list[str], *, is_sweep: bool) -> dict[str, list[object]]:
    settings = dict(parse_setting(text) for text in texts)
    if not is_sweep and any(len(values) != 1 for values in settings.values()):
        raise ValueError("--set takes one value here; several values are for `sweep`")
    if is_sweep and not settings:
        raise ValueError("sweep needs --set table.key=V1,V2,...")
    return settings


def _sweep(args: argparse.Namespace, settings: dict[str, list[object]]) -> int:
    try:
        rows = sweep(args.scenario, settings, duration_s=args.duration_s)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_sweep(rows))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for a bad scenario file)."""
    args = _parser().parse_args(argv)
    try:
        settings = _settings(args.set, is_sweep=args.command == "sweep")
        if args.command == "sweep":
            return _sweep(args, settings)
        scenario = load_scenario(args.scenario, {k: v[0] for k, v in settings.items()})
        if args.duration_s is not None:  # checked again against the scenario's warm-up
            scenario = dataclasses.replace(scenario, duration_s=args.duration_s)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if isinstance(scenario, GenerationScenario):
        return _run_generation(args, scenario)
    if args.command == "run" and args.shards > 1:
        return _run_sharded(scenario, args.shards, args.out)
    if args.command == "run":
        result = run(scenario)
        print(format_table(result.summary))
        if args.out is not None:
            paths = write_outputs(result, args.out)
            print(f"wrote {', '.join(str(p) for p in paths)}")
            if not any(p.suffix == ".png" for p in paths):
                print("no PNG plots: matplotlib is not installed (pip install -e '.[bench]')")
        return 0
    try:
        answer = plan(
            scenario,
            percentile=args.percentile,
            headroom=args.headroom,
            max_workers=args.max_workers,
            gateway_rps=args.gateway_rps,
        )
    except ValueError as error:  # what the scenario cannot be planned for, said
        print(f"error: {error}", file=sys.stderr)
        return 2
    slo_ms = scenario.model.slo_s * 1e3
    print(format_plan(answer, percentile=args.percentile, headroom=args.headroom, slo_ms=slo_ms))
    return 0 if answer.workers is not None else 1


def _run_generation(args: argparse.Namespace, scenario: GenerationScenario) -> int:
    if args.command != "run" or args.shards > 1:
        print("error: generation scenarios only `run`, unsharded", file=sys.stderr)
        return 2
    result = run_generation(scenario)
    print(format_generation_table(result.summary))
    if args.out is not None:
        paths = write_generation_outputs(result, args.out)
        print(f"wrote {', '.join(str(p) for p in paths)}")
    return 0


def _run_sharded(scenario: Scenario, num_shards: int, out_dir: Path | None) -> int:
    try:
        summary = run_sharded(scenario, num_shards)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(format_table(summary))
    if out_dir is not None:
        path = write_summary(summary, out_dir)
        print(f"wrote {path} (sharded runs write no time series)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
