"""`python -m services.sim run SCENARIO [--out DIR]` or `... plan SCENARIO [options]`.

`run` simulates one scenario file and prints its summary table (and writes JSON and CSV with
--out); `plan` searches the fewest workers that meet the scenario's SLO (see planner.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from services.sim.planner import format_plan, plan
from services.sim.report import format_table, write_outputs, write_summary
from services.sim.scenario import load_scenario
from services.sim.shards import run_sharded
from services.sim.simulation import Scenario, run


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m services.sim", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    run_cmd = commands.add_parser("run", help="simulate one scenario file")
    run_cmd.add_argument("scenario", type=Path)
    run_cmd.add_argument("--out", type=Path, help="directory for summary.json and CSV series")
    run_cmd.add_argument("--duration-s", type=float, help="override the scenario's duration")
    run_cmd.add_argument(
        "--shards", type=int, default=1, help="split a fixed fleet over N processes (shards.py)"
    )
    plan_cmd = commands.add_parser("plan", help="fewest workers meeting the scenario's SLO")
    plan_cmd.add_argument("scenario", type=Path)
    plan_cmd.add_argument("--percentile", type=float, default=99.0, choices=(50.0, 90.0, 99.0))
    plan_cmd.add_argument("--headroom", type=float, default=0.2, help="extra load, 0.2 = 20%%")
    plan_cmd.add_argument("--max-workers", type=int, default=512)
    plan_cmd.add_argument("--duration-s", type=float, help="override the scenario's duration")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Runs the command; returns the exit status (2 for a bad scenario file)."""
    args = _parser().parse_args(argv)
    try:
        scenario = load_scenario(args.scenario)
    except (OSError, ValueError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.duration_s is not None:
        scenario = dataclasses.replace(scenario, duration_s=args.duration_s)
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
    answer = plan(
        scenario,
        percentile=args.percentile,
        headroom=args.headroom,
        max_workers=args.max_workers,
    )
    slo_ms = scenario.model.slo_s * 1e3
    print(format_plan(answer, percentile=args.percentile, headroom=args.headroom, slo_ms=slo_ms))
    return 0 if answer.workers is not None else 1


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
