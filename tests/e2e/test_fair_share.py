"""Fair share and priority classes on the worker, end to end: tenant weights from the gateway's
keys file split contended compute, on one model and across models; `batch` traffic fills what
`interactive` leaves. The whole stack as separate processes, three real TorchScript models.

Asserted as counted compute and calls: the favoured tenant gets far more compute than the
other, nobody starves, interactive calls are never refused beside batch traffic. The figures
(the split's ratio against the weights' 3.0, interactive p99 beside batch against alone, batch's
share of what interactive leaves) are `python -m bench.fabric.fair_share`'s, which runs the same
scenarios (bench/fabric/fair_share.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import grpc
import pytest

from bench.fabric.fair_share import (
    SPLITS,
    keys_toml,
    priorities,
    weighted_split,
    write_repository,
)
from tests.support.stack import Stack, start_stack
from tests.support.waiting import eventually

pytestmark = pytest.mark.e2e

#: The weighted split's window: once each tenant has had SETTLE_COMPUTE_S of compute (both
#: queues are full), the worker's next WINDOW_COMPUTE_S of compute is counted per tenant.
#: The ledger charges each batch's real compute, so a batch that another process stalled is
#: charged to its tenant whole, and the other is then served alone until it catches up (3x the
#: stall for a stalled bronze batch): the likely cause when a 3 s window in a full-suite run
#: saw bronze get nothing at all. Over 6 s, a stall of up to about 2 s on bronze's side or 3 s on
#: gold's leaves both assertions true; the split stays exact over time.
SETTLE_COMPUTE_S, WINDOW_COMPUTE_S = 0.5, 6.0
#: Weights are 3:1; an even split would be 1:1. The favoured tenant must get more than this
#: multiple of the other's compute: a wide margin below the weights, well above an even split.
#: The ratio itself is the benchmark's figure: 2.7-3.0 on a quiet machine; 2.44 on one model
#: (5.5 across models) with other processes keeping the 2 cores' load average at 10, where the
#: starved tiers let the favoured tenant's queue run dry now and then.
MIN_FAVOURED_MULTIPLE = 1.5
#: Seconds of interactive traffic beside batch traffic (the duration is the scenario).
PRIORITY_WINDOW_S = 4.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("fair-share")
    keys_path = tmp / "api-keys.toml"
    keys_path.write_text(keys_toml())
    repository = write_repository(tmp / "repo")
    stack = start_stack(
        tmp, model_repository=repository, extra_gateway_args=(f"--api-keys-file={keys_path}",)
    )
    yield stack
    assert stack.stop() == 0, stack.stop_report()


async def wait(condition: Callable[[], bool], timeout_s: float, message: str) -> None:
    await eventually(condition, timeout_s=timeout_s, interval_s=0.1, message=message)


@pytest.mark.parametrize("models", list(SPLITS.values()), ids=list(SPLITS))
async def test_weights_3_to_1_favour_the_heavier_tenant_and_starve_nobody(
    stack: Stack, models: tuple[str, str]
) -> None:
    """Closed-loop callers of many-row calls for `gold` (weight 3) and `bronze` (weight 1), on
    one model and on two of different cost (bench.fabric.fair_share.weighted_split): over a
    window of a fixed amount of the worker's compute, gold got more than MIN_FAVOURED_MULTIPLE
    x bronze's compute, bronze got some (not starved), and both tenants' calls were answered."""
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        split = await weighted_split(
            channel,
            stack.workers[0].metrics_port,
            models,
            settle_compute_s=SETTLE_COMPUTE_S,
            window_compute_s=WINDOW_COMPUTE_S,
            wait=wait,
        )
    served = split.served_s
    calls = {
        tenant: (len(outcomes.latencies_s), dict(Counter(e.name for e in outcomes.errors)))
        for tenant, outcomes in (("gold", split.gold), ("bronze", split.bronze))
    }
    summary = f"compute seconds in the window: {served}; (OK calls, errors) over the run: {calls}"
    print(summary)
    assert served["bronze"] > 0, f"bronze was starved: {summary}"
    assert served["gold"] > MIN_FAVOURED_MULTIPLE * served["bronze"], summary
    assert split.gold.latencies_s and split.bronze.latencies_s, summary


async def test_batch_traffic_fills_what_interactive_leaves_and_refuses_no_interactive_call(
    stack: Stack,
) -> None:
    """Two interactive callers beside 32 `batch` callers, one model: no interactive call is
    refused or fails, and batch traffic is served beside it, not starved: batch calls are
    answered between the first interactive answer and the last. How many depends on the
    machine: on a CPU each row costs its own compute, so while interactive rows keep arriving a
    batch of `batch` rows is held to about one row's compute (close_rule.URGENT_RECENT_S);
    with another test loading the cores, 42 batch calls against 58 interactive ones in one
    full-suite run (most answered once the interactive callers stopped), many more on an idle
    machine."""
    async with grpc.aio.insecure_channel(stack.gateway.address) as channel:
        run = await priorities(channel, window_s=PRIORITY_WINDOW_S, pairs=1, baselines=False)
    online, filler = run.online_beside, run.filler_beside
    first_online_s = min(online.answered_s, default=0.0)
    last_online_s = max(online.answered_s, default=0.0)
    beside = sum(1 for t in filler.answered_s if first_online_s < t < last_online_s)
    counts = (
        f"interactive {len(online.latencies_s)} OK, batch {len(filler.latencies_s)} OK "
        f"({beside} between the first and the last interactive answer), batch errors "
        f"{dict(Counter(e.name for e in filler.errors))}"
    )
    print(counts)
    assert online.latencies_s, counts
    assert online.errors == [], (counts, online.errors)
    assert beside >= 1, counts
