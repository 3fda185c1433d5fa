"""A canary rollout that fails while stepping sends the canary's traffic back (a real Redis, real
metrics endpoints over HTTP, the real controller and CLI), the last step's stable baseline, and
routing records that cannot be read."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis.exceptions
from prometheus_client import CollectorRegistry

from services.common.model_repository import load_repository
from services.common.model_routing import ModelRouting, routing_key
from services.common.registry_schema import connect
from services.rollout.__main__ import ABORTED, cancel_once, main
from services.rollout.controller import (
    CanaryRollout,
    RolloutAborted,
    RolloutMetrics,
    RoutingChanged,
)
from services.rollout.health import Snapshot
from services.rollout.policy import Decision, Plan
from services.rollout.routing_store import RoutingStore
from tests.integration.test_rollout_kubernetes import no_wait
from tests.support.models import tiny_llama_version, write_versioned_affine_model
from tests.support.processes import REPO_ROOT
from tests.support.redis import RedisServer, start_redis
from tests.support.waiting import eventually

pytestmark = pytest.mark.integration

STABLE = ModelRouting({"stable": 1}, {"stable": 1.0})


class MetricsEndpoint:
    """A worker's /metrics over HTTP: both versions of `affine` answer 100 more calls, all OK,
    at each scrape; it stops answering (its socket closed) after `lives_for` scrapes."""

    def __init__(self, lives_for: int | None = None) -> None:
        self.scrapes = 0
        self._lives_for = lives_for
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                endpoint.scrapes += 1
                n = 100 * endpoint.scrapes
                body = "".join(
                    f'inference_worker_requests_total{{model="affine",version="{v}",code="OK"}}'
                    f" {n}\n"
                    for v in (1, 2)
                ).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)
                if endpoint._lives_for is not None and endpoint.scrapes >= endpoint._lives_for:
                    threading.Thread(target=endpoint.close, daemon=True).start()

            def log_message(self, *args: object) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}/metrics"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def repository(tmp_path: Path) -> Path:
    repository = tmp_path / "repo"
    write_versioned_affine_model(repository, "affine", versions=(1, 2))
    return repository


@pytest.fixture
def endpoint() -> Iterator[MetricsEndpoint]:
    endpoint = MetricsEndpoint()
    yield endpoint
    endpoint.close()


async def routing_in_redis(redis_server: RedisServer, repository: Path) -> ModelRouting:
    client = connect(redis_server.url, timeout_s=5.0)
    try:
        return await RoutingStore(client, "fabric", load_repository(repository)).routing("affine")
    finally:
        await client.aclose()


async def set_stable(redis_server: RedisServer, repository: Path) -> None:
    client = connect(redis_server.url, timeout_s=5.0)
    try:
        store = RoutingStore(client, "fabric", load_repository(repository))
        await store.change("affine", lambda _: STABLE)
    finally:
        await client.aclose()


def canary_args(redis_server: RedisServer, repository: Path, *args: str) -> list[str]:
    return ["--redis-url", redis_server.url, "--model-repository", str(repository),
            "canary", "affine", "--version", "2", "--steps", "50,100", "--min-requests", "10",
            *args]  # fmt: skip


async def test_a_metrics_endpoint_gone_mid_step_aborts_with_the_canary_share_back_to_zero(
    redis_server: RedisServer, repository: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    await set_stable(redis_server, repository)
    dying = MetricsEndpoint(lives_for=3)  # the step's first scrape and two checks
    try:
        status = await asyncio.to_thread(
            main,
            canary_args(redis_server, repository, "--metrics-url", dying.url, "--hold-s", "60",
                        "--check-period-s", "0.1"),
        )  # fmt: skip
    finally:
        dying.close()

    assert status == ABORTED
    assert dying.scrapes == 3
    # URLError, or ConnectionResetError when the endpoint closed mid-answer.
    assert "affine: rollout aborted: " in capsys.readouterr().err
    routing = await routing_in_redis(redis_server, repository)
    assert routing.traffic == {"stable": 100.0, "canary": 0.0}
    assert routing.labels == {"stable": 1, "canary": 2}


@pytest.mark.parametrize(
    "signum", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT], ids=["TERM", "HUP", "INT"]
)
async def test_a_signal_mid_step_aborts_with_the_canary_share_back_to_zero(
    redis_server: RedisServer, repository: Path, endpoint: MetricsEndpoint, signum: int
) -> None:
    """SIGTERM (a deleted Job) and SIGHUP (the terminal closed: an SSH session lost, which
    killed the controller before, the canary left serving its share) abort the rollout."""
    await set_stable(redis_server, repository)
    command = [sys.executable, "-m", "services.rollout",
               *canary_args(redis_server, repository, "--metrics-url", endpoint.url,
                            "--hold-s", "600", "--check-period-s", "0.1")]  # fmt: skip
    process = subprocess.Popen(
        command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:

        async def stepping() -> bool:
            routing = await routing_in_redis(redis_server, repository)
            return routing.traffic.get("canary") == 50.0 and endpoint.scrapes >= 2

        await eventually(stepping, timeout_s=30.0, message="the canary's first step runs")
        os.kill(process.pid, signum)
        _, err = process.communicate(timeout=30)
    finally:
        if process.poll() is None:
            process.kill()
            process.communicate()

    assert process.returncode == ABORTED, err.decode()
    routing = await routing_in_redis(redis_server, repository)
    assert routing.traffic == {"stable": 100.0, "canary": 0.0}


def two_steps(stable_calls: Sequence[float], stable_errors: Sequence[float]) -> object:
    """A scrape of one endpoint over a 50% step then a 100% step (two scrapes each): the canary
    fails 1.5% of its 1,000 calls a step; stable serves `stable_calls[i]` calls in step i, of
    which `stable_errors[i]` fail."""
    scrapes: list[int] = []

    async def scrape(urls: Sequence[str]) -> Snapshot:
        step, taken = divmod(len(scrapes), 2)
        scrapes.append(1)
        done = [float(s < step) + float(s == step) * taken for s in range(2)]
        canary = {"code:OK": sum(985.0 * d for d in done),
                  "code:INTERNAL": sum(15.0 * d for d in done)}  # fmt: skip
        stable_failed = sum(e * d for e, d in zip(stable_errors, done, strict=True))
        stable_ok = sum(c * d for c, d in zip(stable_calls, done, strict=True)) - stable_failed
        return [{"1": {"code:OK": stable_ok, "code:INTERNAL": stable_failed}, "2": canary}]

    return scrape


async def two_step_rollout(
    redis_server: RedisServer, repository: Path, scrape: object, urls: tuple[str, ...]
) -> Decision:
    """A rollout of affine's version 2 at 50% then 100%, judged from `scrape`, to its end."""
    await set_stable(redis_server, repository)
    client = connect(redis_server.url, timeout_s=5.0)
    try:
        store = RoutingStore(client, "fabric", load_repository(repository))
        rollout = CanaryRollout(
            store,
            "affine",
            2,
            Plan(steps=(50.0, 100.0), hold_s=1.0, min_requests=100),
            scrape=scrape,  # type: ignore[arg-type]
            metrics=RolloutMetrics(CollectorRegistry()),
            metrics_urls=urls,
            check_period_s=1.0,
            sleep=no_wait,
        )
        return await rollout.run()
    finally:
        await client.aclose()


async def test_the_last_step_judges_the_canary_against_stable_in_the_step_before(
    redis_server: RedisServer, repository: Path
) -> None:
    # At 100% stable serves nothing: judged against that, a canary failing 1.5% of its calls
    # was rolled back although stable failed 2% of its own a step before.
    scrape = two_steps((1000.0, 0.0), (20.0, 0.0))
    decision = await two_step_rollout(redis_server, repository, scrape, ("http://unused",))
    assert decision is Decision.PROMOTE


async def test_an_endpoint_given_twice_is_scraped_once(
    redis_server: RedisServer, repository: Path
) -> None:
    """A `--metrics-url` given twice (or also one of a pool's pods) counted its worker's calls
    twice, halving the `--min-requests` it takes to judge (review finding)."""
    scraped: list[tuple[str, ...]] = []
    steps = two_steps((1000.0, 0.0), (20.0, 0.0))

    async def recorded(urls: Sequence[str]) -> Snapshot:
        scraped.append(tuple(urls))
        return await steps(urls)  # type: ignore[operator]

    urls = ("http://a", "http://a")
    assert await two_step_rollout(redis_server, repository, recorded, urls) is Decision.PROMOTE
    assert scraped and set(scraped) == {("http://a",)}


def test_a_check_period_of_zero_is_refused(
    redis_server: RedisServer, repository: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    status = main(canary_args(redis_server, repository, "--metrics-url", "http://unused",
                              "--check-period-s", "0"))  # fmt: skip

    assert status == 2
    assert "the check period must be > 0 seconds" in capsys.readouterr().err


def test_a_model_that_does_not_read_fails_only_a_command_naming_it(
    redis_server: RedisServer, repository: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model being copied in (or with a typo) failed every command: moving traffic off a
    bad canary of another model was refused (review finding)."""
    (repository / "broken").mkdir()
    (repository / "broken" / "config.toml").write_text("kind = 3\n")
    common = ["--redis-url", redis_server.url, "--model-repository", str(repository), "routing"]
    assert main([*common, "set", "affine", "--label", "stable=1"]) == 0
    assert 'affine: {"labels": {"stable": 1}' in capsys.readouterr().out
    assert main([*common, "set", "broken", "--label", "stable=1"]) == 2
    assert "broken/config.toml" in capsys.readouterr().err


@pytest.mark.parametrize("dry_run", [(), ("--dry-run",)], ids=["run", "dry-run"])
def test_an_unknown_model_is_refused_with_status_2(
    redis_server: RedisServer, repository: Path, capsys: pytest.CaptureFixture[str],
    dry_run: tuple[str, ...],
) -> None:  # fmt: skip
    status = main(["--redis-url", redis_server.url, "--model-repository", str(repository),
                   "canary", "nosuch", "--version", "2", "--metrics-url", "http://unused",
                   *dry_run])  # fmt: skip

    assert status == 2
    assert "model 'nosuch' is not in the model repository" in capsys.readouterr().err


async def test_an_unreadable_record_fails_only_its_model_and_reset_rewrites_it(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    repository = tmp_path / "repo"
    write_versioned_affine_model(repository, "affine", versions=(1, 2))
    write_versioned_affine_model(repository, "other", versions=(1,))
    client = connect(redis_server.url, timeout_s=5.0)
    try:
        store = RoutingStore(client, "fabric", load_repository(repository))
        for _ in range(7):
            await store.change("affine", lambda _: STABLE)
        # Edited by hand: a label naming no whole version, its revision still readable.
        await client.hset(routing_key("fabric"), "affine",
                          '{"revision": 7, "labels": {"stable": 1.5}, "traffic": {}}')  # fmt: skip

        shown = await store.show()
        changed = await store.change("other", lambda _: ModelRouting({"stable": 1}))
        with pytest.raises(ValueError, match="'affine': its stored routing cannot be read"):
            await store.change("affine", lambda _: STABLE)
        assert await store.reset("affine")
        rewritten = await store.routing("affine")
        await client.hset(routing_key("fabric"), "affine", "not json")
        with pytest.raises(ValueError, match="its revision cannot be read"):
            await store.reset("affine")
    finally:
        await client.aclose()

    assert "affine" not in shown and "other" in shown
    assert changed.labels == {"stable": 1}
    # Past the revision gateways hold: they apply the rewrite.
    assert rewritten.revision > 7
    assert rewritten.labels == {}


def healthy_scrape(then: Callable[[int], Awaitable[None]]) -> Callable[..., Awaitable[Snapshot]]:
    """Snapshots of both versions serving 1,000 more calls each, all OK, at every scrape; after
    the n-th scrape (from 1), `then(n)` runs."""
    scrapes = [0]

    async def scrape(urls: Sequence[str]) -> Snapshot:
        scrapes[0] += 1
        calls = {"code:OK": 1000.0 * scrapes[0]}
        await then(scrapes[0])
        return [{"1": dict(calls), "2": dict(calls)}]

    return scrape


def rollout_of(store: RoutingStore, scrape: Callable[..., Awaitable[Snapshot]]) -> CanaryRollout:
    return CanaryRollout(
        store,
        "affine",
        2,
        Plan(steps=(50.0, 100.0), hold_s=1.0, min_requests=100),
        scrape=scrape,
        metrics=RolloutMetrics(CollectorRegistry()),
        metrics_urls=("http://unused",),
        check_period_s=1.0,
        sleep=no_wait,
    )


async def aborted_rollout(
    client: Any, repository: Path, then: Callable[[int], Awaitable[None]]
) -> tuple[RolloutAborted, ModelRouting]:
    """A rollout from stable whose scrapes run `then` (healthy_scrape), which must abort it:
    its error, and the routing in force after it."""
    store = RoutingStore(client, "fabric", load_repository(repository))
    await store.change("affine", lambda _: STABLE)
    with pytest.raises(RolloutAborted) as aborted:
        await rollout_of(store, healthy_scrape(then)).run()
    return aborted.value, await store.routing("affine")


async def test_an_abort_sets_the_share_back_once_redis_is_back_from_an_outage(
    tmp_path: Path, repository: Path
) -> None:
    """A rollout failing while Redis is away (RELIABILITY.md: stopped for 30 s) tried once to
    set the canary's share back, and gave up at once: once Redis was back, every gateway sent
    the canary its share, judged by nobody (review finding). It now tries again until Redis
    answers (here, stopped 3 s), and the share is back to 0."""
    redis = start_redis(tmp_path, appendonly=True)  # an outage, not an empty restart
    restarting: list[threading.Thread] = []

    async def outage_then_fail(n: int) -> None:
        if n == 2:  # the first step's check: Redis stops, the endpoint fails
            await asyncio.to_thread(redis.stop)
            # Bound, never listening, until the restart: connections are refused as in an
            # outage, and no other process (another xdist worker's server on port 0) can take
            # the port meanwhile (Redis comes back on the same one). SO_REUSEADDR, not
            # processes.reserve_port's SO_REUSEPORT: the stopped Redis's connections linger in
            # TIME_WAIT on the port, which only SO_REUSEADDR binds past.
            held = socket.socket()
            held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                held.bind(("127.0.0.1", redis.port))
            except OSError:  # taken in the moment since the stop: Redis's restart says so
                held.close()

            def restart() -> None:
                held.close()
                redis.restart()

            back = threading.Timer(3.0, restart)
            back.start()
            restarting.append(back)
            raise ConnectionError("worker metrics endpoint gone")

    client = connect(redis.url, timeout_s=1.0)
    try:
        aborted, routing = await aborted_rollout(client, repository, outage_then_fail)
    finally:
        for thread in restarting:
            thread.join()
        await client.aclose()
        redis.stop()
    assert "share set back to 0" in str(aborted), aborted
    assert routing.traffic == {"stable": 100.0, "canary": 0.0}


async def test_a_routing_changed_by_another_writer_stops_the_rollout_and_is_left_as_it_is(
    redis_server: RedisServer, repository: Path
) -> None:
    """An operator's `routing set` mid-rollout (every call back to stable, the canary label
    gone) was overwritten at the next step, and the rollout went on to promote (review
    finding). The rollout now stops at its next write, aborted, and leaves the operator's
    routing as it is."""
    client = connect(redis_server.url, timeout_s=5.0)
    operator = connect(redis_server.url, timeout_s=5.0)
    set_by_hand: list[ModelRouting] = []

    async def operator_sets(n: int) -> None:
        if n == 2:  # during the first step
            other = RoutingStore(operator, "fabric", load_repository(repository))
            await other.change("affine", lambda _: STABLE)
            set_by_hand.append(await other.routing("affine"))

    try:
        aborted, routing = await aborted_rollout(client, repository, operator_sets)
    finally:
        await client.aclose()
        await operator.aclose()
    assert isinstance(aborted.__cause__, RoutingChanged)
    assert "NOT set back to 0" in str(aborted)
    assert routing == set_by_hand[0]


async def test_other_labels_keep_their_weights_through_steps_promotion_and_abort(
    redis_server: RedisServer, repository: Path
) -> None:
    """A rollout wrote `{stable: 100 - p, canary: p}` at each step and `{stable: 1}` at the
    promotion: `{stable: 90, beta: 10}` lost beta, whose callers all went to stable and the
    canary (review finding). The canary now takes its share of what stable takes; beta keeps
    10 through the steps, the promotion and an abort."""
    split = ModelRouting({"stable": 1, "beta": 1}, {"stable": 90.0, "beta": 10.0})
    client = connect(redis_server.url, timeout_s=5.0)
    store = RoutingStore(client, "fabric", load_repository(repository))
    seen: list[dict[str, float]] = []

    async def record(n: int) -> None:
        seen.append(dict((await store.routing("affine")).traffic))

    async def fail_in_second_step(n: int) -> None:
        if n == 3:
            raise ConnectionError("worker metrics endpoint gone")

    try:
        await store.change("affine", lambda _: split)
        assert await rollout_of(store, healthy_scrape(record)).run() is Decision.PROMOTE
        promoted = await store.routing("affine")
        await store.change("affine", lambda _: split)
        with pytest.raises(RolloutAborted):
            await rollout_of(store, healthy_scrape(fail_in_second_step)).run()
        aborted = await store.routing("affine")
    finally:
        await client.aclose()
    assert seen[0] == {"stable": 45.0, "canary": 45.0, "beta": 10.0}  # the 50% step
    assert seen[-1] == {"stable": 0.0, "canary": 90.0, "beta": 10.0}  # the 100% step
    assert (promoted.labels, promoted.traffic) == (
        {"stable": 2, "beta": 1},
        {"stable": 90.0, "beta": 10.0},
    )
    assert aborted.traffic == {"stable": 90.0, "canary": 0.0, "beta": 10.0}


async def test_a_rollout_from_a_stable_that_takes_no_traffic_beside_others_is_refused(
    redis_server: RedisServer, repository: Path
) -> None:
    """Its share of stable's nothing would judge the canary on no calls."""
    client = connect(redis_server.url, timeout_s=5.0)
    store = RoutingStore(client, "fabric", load_repository(repository))
    idle = ModelRouting({"stable": 1, "beta": 1}, {"stable": 0.0, "beta": 10.0})
    try:
        await store.change("affine", lambda _: idle)
        with pytest.raises(ValueError, match="stable takes no traffic"):
            await rollout_of(store, healthy_scrape(no_wait)).run()
        after = await store.routing("affine")
    finally:
        await client.aclose()
    assert (after.labels, after.traffic) == (idle.labels, idle.traffic)


async def test_revisions_grow_past_those_gateways_hold_after_redis_restarts_empty(
    redis_server: RedisServer, repository: Path
) -> None:
    """Revisions counted from the record's: after Redis restarted empty the next record was
    revision 1, which a gateway holding 7 ignored, and every record after it up to 7 (review
    finding). A revision is now the time in milliseconds, or one more than the record's."""
    client = connect(redis_server.url, timeout_s=5.0)
    try:
        store = RoutingStore(client, "fabric", load_repository(repository))
        for _ in range(3):
            held = await store.change("affine", lambda _: STABLE)
        await asyncio.to_thread(redis_server.restart)
        after = await store.change("affine", lambda _: STABLE)
        again = await store.change("affine", lambda _: STABLE)
    finally:
        await client.aclose()
    assert after.revision > held.revision
    assert again.revision > after.revision


def test_a_generation_model_is_refused_a_canary_with_status_2(
    tmp_path: Path, redis_server: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing judges a generation model's canary (its streams report no per-version request
    counts or row latencies): it served its share unjudged for every hold, then was rolled
    back (review finding). It is refused before anything changes."""
    repository = tmp_path / "repo"
    tiny_llama_version(repository, "2")
    status = main(["--redis-url", redis_server.url, "--model-repository", str(repository),
                   "canary", "tiny-llama", "--version", "2",
                   "--metrics-url", "http://unused"])  # fmt: skip
    assert status == 2
    assert "generates text" in capsys.readouterr().err


class ReplyLost(RoutingStore):
    """A real store whose `lose_at`-th change (from 1) is written, and its reply lost (Redis
    failing right after): ConnectionError."""

    def __init__(self, *args: Any, lose_at: int) -> None:
        super().__init__(*args)
        self._changes, self._lose_at = 0, lose_at

    async def change(self, *args: Any, **kwargs: Any) -> ModelRouting:
        written = await super().change(*args, **kwargs)
        self._changes += 1
        if self._changes == self._lose_at:
            raise redis.exceptions.ConnectionError("reply lost")
        return written


async def test_an_abort_after_a_write_whose_reply_was_lost_still_sets_the_share_back(
    redis_server: RedisServer, repository: Path
) -> None:
    """The step to 100% written but its reply lost: the record's revision is not the one the
    rollout knows, yet it is the rollout's own write (its labels and weights), not another
    writer's: the abort sets the share back to 0 rather than leave the canary at 100%."""
    client = connect(redis_server.url, timeout_s=5.0)
    try:
        store = ReplyLost(client, "fabric", load_repository(repository), lose_at=3)
        await store.change("affine", lambda _: STABLE)  # change 1; the steps: 2 and 3
        with pytest.raises(RolloutAborted) as aborted:
            await rollout_of(store, healthy_scrape(no_wait_then)).run()
        routing = await store.routing("affine")
    finally:
        await client.aclose()
    assert "share set back to 0" in str(aborted.value), aborted.value
    assert routing.traffic == {"stable": 100.0, "canary": 0.0}


async def no_wait_then(_: int) -> None:
    pass


async def test_a_promotion_whose_reply_was_lost_is_written_again_not_aborted(
    redis_server: RedisServer, repository: Path
) -> None:
    """The promotion written but its reply lost: it is tried again (the same record: the
    rollout's own write), and the rollout promotes. Before, the abort that followed set the
    canary's share to 0 on the promoted record: `stable` named the canary's version, with a
    `canary` label at 0, its pool released (review finding)."""
    client = connect(redis_server.url, timeout_s=5.0)
    try:
        store = ReplyLost(client, "fabric", load_repository(repository), lose_at=4)
        await store.change("affine", lambda _: STABLE)  # change 1; steps 2 and 3; promotion 4
        decision = await rollout_of(store, healthy_scrape(no_wait_then)).run()
        routing = await store.routing("affine")
    finally:
        await client.aclose()
    assert decision is Decision.PROMOTE
    assert (routing.labels, routing.traffic) == ({"stable": 2}, {"stable": 1.0})


def test_redis_unreachable_or_a_canary_already_stable_is_refused_with_status_2(
    redis_server: RedisServer, repository: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Nothing ran: status 2, not 1 (rolled back), and no traceback (review finding)."""
    unreachable = canary_args(redis_server, repository, "--metrics-url", "http://unused")
    unreachable[1] = "redis://127.0.0.1:1"
    assert main(unreachable) == 2
    assert "ConnectionError" in capsys.readouterr().err
    asyncio.run(set_stable(redis_server, repository))
    itself = canary_args(redis_server, repository, "--metrics-url", "http://unused")
    itself[itself.index("--version") + 1] = "1"
    assert main(itself) == 2
    assert "version 1 is already stable" in capsys.readouterr().err


async def test_a_label_held_at_weight_zero_keeps_its_entry_through_the_promotion(
    redis_server: RedisServer, repository: Path
) -> None:
    """`{stable: 1, beta: 0}`: beta's version held out of the default traffic. The promotion
    wrote `{stable: 1}`, dropping beta's entry, so its version could become a default again
    (review finding); it keeps it at 0."""
    held = ModelRouting({"stable": 1, "beta": 1}, {"stable": 1.0, "beta": 0.0})
    client = connect(redis_server.url, timeout_s=5.0)
    store = RoutingStore(client, "fabric", load_repository(repository))
    try:
        await store.change("affine", lambda _: held)
        assert await rollout_of(store, healthy_scrape(no_wait_then)).run() is Decision.PROMOTE
        promoted = await store.routing("affine")
    finally:
        await client.aclose()
    assert (promoted.labels, promoted.traffic) == (
        {"stable": 2, "beta": 1},
        {"stable": 1.0, "beta": 0.0},
    )


async def test_only_the_first_signal_cancels_the_rollout_so_its_abort_runs_whole() -> None:
    """The first signal cancels the rollout, which aborts (its canary's share set back); a
    second one (SIGTERM again, ^C) used to cancel that abort half done, the canary left at its
    share (review finding). The signal handler cancels once."""
    aborting = asyncio.Event()

    async def rollout() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            aborting.set()
            await asyncio.sleep(0.2)  # the abort's writes, which a second cancel cut short
            return "aborted whole"
        return "not cancelled"

    task = asyncio.create_task(rollout())
    await asyncio.sleep(0)
    handle = cancel_once(task)
    handle("SIGTERM")
    await aborting.wait()
    handle("SIGINT")
    assert await task == "aborted whole"


class ChangedFirst(RoutingStore):
    """A real store on which another writer changes the routing just before the rollout's
    first write (while its pool was prepared, say)."""

    def __init__(self, *args: Any, other: ModelRouting) -> None:
        super().__init__(*args)
        self._other: ModelRouting | None = other

    async def change(self, *args: Any, **kwargs: Any) -> ModelRouting:
        if self._other is not None:
            other, self._other = self._other, None
            await super().change(args[0], lambda _: other)
        return await super().change(*args, **kwargs)


async def test_a_rollout_takes_over_no_canary_and_no_change_made_since_it_read(
    redis_server: RedisServer, repository: Path
) -> None:
    """A canary already taking traffic (another rollout's, running or killed) is refused, and
    a routing another writer changed between the rollout's read and its first write stops
    it, that routing left as it is: both were taken over silently (review finding)."""
    client = connect(redis_server.url, timeout_s=5.0)
    try:
        running = ModelRouting({"stable": 1, "canary": 2}, {"stable": 90.0, "canary": 10.0})
        store = RoutingStore(client, "fabric", load_repository(repository))
        await store.change("affine", lambda _: running)
        with pytest.raises(ValueError, match="a canary already takes traffic") as refused:
            await rollout_of(store, healthy_scrape(no_wait_then)).run()
        # The recovery it names gives the share back; `routing reset` would also undo the
        # promotions since (back to the repository's labels: review finding).
        assert "--traffic stable=100" in str(refused.value), refused.value
        assert "not `routing reset`" in str(refused.value), refused.value
        await store.change("affine", lambda _: STABLE)
        operators = ModelRouting({"stable": 1}, {"stable": 1.0})
        changed = ChangedFirst(client, "fabric", load_repository(repository), other=operators)
        pool = ReleasedPool()
        rollout = dataclasses.replace(rollout_of(changed, healthy_scrape(no_wait_then)), pool=pool)
        with pytest.raises(RolloutAborted, match="changed by another writer"):
            await rollout.run()
        routing = await store.routing("affine")
    finally:
        await client.aclose()
    assert (routing.labels, routing.traffic) == (operators.labels, operators.traffic)
    assert pool.released, "nothing of the rollout's was written: its pool serves nothing"


class ReleasedPool:
    """A canary pool that is ready at once (no endpoint of its own) and says if released."""

    released = False

    async def prepare(self) -> tuple[str, ...]:
        return ()

    async def release(self) -> None:
        self.released = True


class Unwritable(RoutingStore):
    """A real store whose changes fail (ConnectionError: Redis away) while `is_away`; the
    first such failure sets `failed`."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.is_away = False
        self.failed = asyncio.Event()

    async def change(self, *args: Any, **kwargs: Any) -> ModelRouting:
        if self.is_away:
            self.failed.set()
            raise redis.exceptions.ConnectionError("Redis away")
        return await super().change(*args, **kwargs)


async def test_a_signal_during_an_abort_already_under_way_lets_it_send_the_traffic_back(
    redis_server: RedisServer, repository: Path
) -> None:
    """A step fails while Redis is away, and the abort tries again to set the canary's share
    back; the first signal (SIGTERM, ^C) then cancelled that abort half done, the canary left
    at its 50%, judged by nobody: `cancel_once` guards only an abort the signal itself began
    (rollout review). The abort runs whole, and the rollout then stops cancelled."""
    client = connect(redis_server.url, timeout_s=5.0)
    try:
        store = Unwritable(client, "fabric", load_repository(repository))
        await store.change("affine", lambda _: STABLE)

        async def away_then_fail(n: int) -> None:
            if n == 2:  # the first step's check
                store.is_away = True
                raise ConnectionError("worker metrics endpoint gone")

        pool = ReleasedPool()
        rollout = dataclasses.replace(rollout_of(store, healthy_scrape(away_then_fail)), pool=pool)
        running = asyncio.create_task(rollout.run())
        await asyncio.wait_for(store.failed.wait(), timeout=10.0)
        assert (await store.routing("affine")).traffic == {"stable": 50.0, "canary": 50.0}
        cancel_once(running)("SIGTERM")
        await asyncio.sleep(0.1)
        store.is_away = False  # Redis back while the abort tries again
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, timeout=30.0)
        routing = await store.routing("affine")
    finally:
        await client.aclose()
    assert routing.traffic == {"stable": 100.0, "canary": 0.0}
    assert pool.released


class PromotionReplyLost(ReplyLost):
    """ReplyLost whose lost reply sets `lost`."""

    def __init__(self, *args: Any, lose_at: int) -> None:
        super().__init__(*args, lose_at=lose_at)
        self.lost = asyncio.Event()

    async def change(self, *args: Any, **kwargs: Any) -> ModelRouting:
        try:
            return await super().change(*args, **kwargs)
        except redis.exceptions.ConnectionError:
            self.lost.set()
            raise


async def test_a_signal_after_the_promotion_was_written_leaves_it_promoted_and_its_pool_up(
    redis_server: RedisServer, repository: Path
) -> None:
    """The promotion written, its reply lost, and a signal while it is tried again: the abort
    took the promoted record for its own last write (the same weights), wrote the canary's
    share to 0 on it (`stable` and `canary` both the new version) and released the canary's
    pool, the only one serving the new stable version (rollout review). The promoted record
    and the pool are left as they are."""
    client = connect(redis_server.url, timeout_s=5.0)
    try:
        store = PromotionReplyLost(client, "fabric", load_repository(repository), lose_at=4)
        await store.change("affine", lambda _: STABLE)  # change 1; steps 2 and 3; promotion 4
        pool = ReleasedPool()
        rollout = dataclasses.replace(rollout_of(store, healthy_scrape(no_wait_then)), pool=pool)
        running = asyncio.create_task(rollout.run())
        await asyncio.wait_for(store.lost.wait(), timeout=10.0)
        cancel_once(running)("SIGTERM")  # during the 0.5 s before it is tried again
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(running, timeout=30.0)
        routing = await store.routing("affine")
    finally:
        await client.aclose()
    assert (routing.labels, routing.traffic) == ({"stable": 2}, {"stable": 1.0})
    assert not pool.released
