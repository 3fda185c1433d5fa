"""What admitting a bundle into a standing queue costs the worker's event loop, per row.

    python -m bench.admission_pass [--passes 200] [--rounds 5]

A flooded worker's lane holds a standing queue (600 rows of three tenants, batches of 64, 2 ms
plus 0.1 ms a row by the latency model, the executor busy for 10 ms more), and each bundle of
64 one-row slices fits only in part: about 28 rows meet their limit, the rest do not. The pass
admits rows until the first refusal (the rest of a bundle like it meets that refusal again:
slice_admission.Refusals). Two ways to bound the pass, alternated in one run, `--rounds`
times each:

- `whole pass`: the pass's bound covers a row only when the whole bundle fits, which a
  standing queue's never does, so every row takes its own forecasts (`Batcher.add`);
- `step`: the bound also covers each row by the drain of what is queued with it, kept as a
  running sum (forecast.Step); only the row that does not fit takes its forecasts.

Both make the same decisions (tests/unit/test_pass_bound.py); this reports microseconds of
CPU per admitted row, the pass's bound and its one refusal included, each round's median.
Method: docs/benchmarks.md (the worker under a flood).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from services.gpu_worker.admission import Admitted
from services.gpu_worker.batching.forecast import PassBound
from services.gpu_worker.batching.latency_model import LatencyModel
from services.gpu_worker.batching.policy import Batcher
from services.gpu_worker.batching.types import BatcherConfig, BatchKey, QueuedItem

KEY = BatchKey(model="minilm", version="1", fingerprint="f", bucket=16)
QUEUED, BUNDLE, EXECUTOR_FREE_S = 600, 64, 0.01


def standing_lane() -> Batcher:
    """A lane whose queue stands: QUEUED rows of three tenants, each allowing 5 s."""
    latency = LatencyModel(default_s=0.01)
    for size in (1, 8, 64):
        latency.observe(KEY, size, 0.002 + 0.0001 * size)
    config = BatcherConfig(
        max_batch_size=64,
        max_queue_size=2000,
        slo_s=0.25,
        upstream_budget_s=0.02,
        safety_margin_s=0.005,
        max_wait_cap_s=0.005,
    )
    batcher = Batcher(config, latency)
    for item_id in range(QUEUED):
        batcher.add(row(item_id, f"t{item_id % 3}", 5.0), 0.0, executor_free_s=EXECUTOR_FREE_S)
    return batcher


def row(item_id: int, tenant: str, deadline_s: float) -> QueuedItem:
    return QueuedItem(
        item_id=item_id,
        key=KEY,
        tenant=tenant,
        num_tokens=16,
        arrival_s=0.0,
        deadline_s=deadline_s,
        finish_by_s=None,
        priority=1,
        weight=1.0,
    )


def one_pass(batcher: Batcher, deadline_s: float, *, step: bool) -> tuple[float, int]:
    """CPU seconds of one pass (its bound, its admitted rows, its first refusal) and the rows
    it admitted."""
    rows = [row(10_000 + i, "t1", deadline_s) for i in range(BUNDLE)]
    started = time.process_time()
    bound = batcher.pass_bound({KEY: BUNDLE}, 0.0, EXECUTOR_FREE_S)
    if not step:  # the same bound, with nothing to step by
        bound = PassBound(bound.finish_s, bound.earliest_limit_s)
    admitted = 0
    for item in rows:
        if not isinstance(batcher.add(item, 0.0, executor_free_s=EXECUTOR_FREE_S, bound=bound),
                          Admitted):  # fmt: skip
            break
        admitted += 1
    return time.process_time() - started, admitted


def round_us(passes: int, *, step: bool) -> tuple[float, float]:
    """Microseconds of CPU per admitted row over `passes` passes, each into its own standing
    queue (deadlines varied a little, so the rows that fit vary), and rows admitted a pass."""
    spent_s, admitted = 0.0, 0
    for index in range(passes):
        batcher = standing_lane()
        seconds, count = one_pass(batcher, 0.097 + 0.0002 * (index % 10), step=step)
        spent_s, admitted = spent_s + seconds, admitted + count
    return spent_s / max(admitted, 1) * 1e6, admitted / passes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--passes", type=int, default=200, help="passes per round")
    parser.add_argument("--rounds", type=int, default=5, help="rounds of each, alternated")
    args = parser.parse_args()
    results: dict[str, list[float]] = {"whole pass": [], "step": []}
    rows_per_pass = 0.0
    for _ in range(args.rounds):
        for name in results:
            us, rows_per_pass = round_us(args.passes, step=name == "step")
            results[name].append(us)
    report = {
        "rows_admitted_per_pass": rows_per_pass,
        **{f"{name} us/row": round(statistics.median(us), 2) for name, us in results.items()},
        "ratio": round(
            statistics.median(results["step"]) / statistics.median(results["whole pass"]), 3
        ),
    }
    print(json.dumps(report))


if __name__ == "__main__":
    main()
