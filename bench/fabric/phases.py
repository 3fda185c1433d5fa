"""The serving benchmark's phases (bench/fabric/__main__.py runs them in order): one run's
model repositories, texts and report (`prepare`), and each phase that fills the report in:
the raw model, the bare echo, a stack with batching off and on, overload, from ready, the
GPU-speed stand-in and the peer."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import tempfile
from pathlib import Path
from typing import Any

import grpc

from bench.fabric.measure import (
    Progress,
    Settings,
    Target,
    bursty_phases,
    closed_loop,
    measure_rate,
    overload_phases,
    sweep,
    wait_quiet,
)
from bench.fabric.observe import Observer
from bench.fabric.raw import measure_raw, measure_raw_texts
from bench.fabric.stack import (
    start_echo,
    start_stack,
    write_identity_model,
    write_minilm_repository,
)
from bench.fabric.stand_in import CALLERS, measure_stand_in, worker_args
from bench.fabric.targets import (
    MAX_TOKENS,
    MIN_TOKENS,
    PASSAGE_WORDS,
    SHORT_SHARE,
    SHORT_WORDS,
    echo_sender,
    identity_sender,
    make_mixed_texts,
    make_texts,
    predict_sender,
    text_sender,
)
from services.common.model_repository import load_repository
from services.common.procfs import load_average

MODEL = "minilm"


def machine() -> dict[str, Any]:
    return {"cpus": os.cpu_count(), "loadavg_at_start": load_average()}


async def stack_phase(
    name: str,
    repository: Path,
    state_dir: Path,
    log: Progress,
    measure: Any,
    quiet: dict[str, float],
    wait_s: float,
    worker_args: tuple[str, ...],
    quiet_first: bool = True,
    gateway_args: tuple[str, ...] = (),
) -> Any:
    """Starts a stack on `repository`, runs `measure(stack, channel)`, always stops it. Waits
    for the CPU to be quiet first, unless `quiet_first` is False (a measurement from ready)."""
    log(f"[{name}] starting stack (redis, router, worker, gateway) on {repository}")
    stack = await asyncio.to_thread(
        start_stack,
        repository,
        state_dir / name,
        extra_worker_args=worker_args,
        extra_gateway_args=gateway_args,
    )
    log(f"[{name}] stack ready: gateway {stack.gateway_address}, pids {stack.pids()}")
    if quiet_first:
        quiet[name] = await wait_quiet(log, wait_s)
    try:
        async with grpc.aio.insecure_channel(stack.gateway_address) as channel:
            return await measure(stack, channel)
    finally:
        code = await asyncio.to_thread(stack.stop)
        log(f"[{name}] stack stopped (launcher exit {code}); logs in {state_dir / name}")


@dataclasses.dataclass
class Run:
    """One benchmark run's inputs and the report its phases fill in, in order."""

    args: argparse.Namespace
    settings: Settings
    log: Progress
    state_dir: Path
    on_repo: Path
    off_repo: Path
    slo_s: float
    max_batch_size: int
    texts: list[str]
    mixed_texts: list[str]
    #: The client's own bound: well past the SLO, so late answers are seen, not cut off.
    timeout_s: float
    report: dict[str, Any]
    quiet: dict[str, float] = dataclasses.field(default_factory=dict)

    @property
    def raw_best(self) -> float:
        return float(self.report["raw_model"]["best"]["sequences_per_s"])

    async def raw_model(self, bucket: int) -> None:
        settings, log = self.settings, self.log
        log(f"[raw] in-process {MODEL}, {bucket} tokens, no stack running")
        self.quiet["raw"] = await wait_quiet(log, settings.wait_quiet_s)
        self.report["raw_model"] = await measure_raw(self.on_repo, MODEL, bucket, settings, log)
        log(f"[raw mixed] in-process {MODEL} on the mixed-length texts, by bucket")
        self.report["raw_model_mixed"] = await measure_raw_texts(
            self.on_repo, MODEL, self.mixed_texts, settings, log
        )

    async def echo(
        self, payload: bytes, phase: str = "echo", concurrency: int | None = None
    ) -> dict[str, Any]:
        """The bare grpc.aio echo server, closed loop: the overhead baseline (`phase`: its
        name among the phases' quiet checks), at `concurrency` callers (None: the overhead's)."""
        self.quiet[phase] = await wait_quiet(self.log, self.settings.wait_quiet_s)
        echo = await asyncio.to_thread(start_echo, self.state_dir / "echo")
        try:
            address = f"127.0.0.1:{echo.ready['grpc_port']}"
            async with grpc.aio.insecure_channel(address) as channel:
                result: dict[str, Any] = await closed_loop(
                    echo_sender(channel, payload, self.timeout_s),
                    concurrency or self.settings.overhead_concurrency,
                    self.settings.overhead_s,
                    observer=Observer({"echo": echo.ready["pid"]}),
                )
        finally:
            await asyncio.to_thread(echo.stop)
        self.log(f"[overhead] bare grpc.aio echo: {result['ok_per_s']:.0f}/s")
        return result

    async def stack_phase(
        self,
        name: str,
        repository: Path,
        measure: Any,
        quiet_first: bool = True,
        extra_worker_args: tuple[str, ...] = (),
    ) -> Any:
        return await stack_phase(
            name,
            repository,
            self.state_dir,
            self.log,
            measure,
            self.quiet,
            self.settings.wait_quiet_s,
            (*self.args.worker_arg, *extra_worker_args),
            quiet_first,
            tuple(self.args.gateway_arg),
        )

    async def stand_in(self, payload: bytes, bucket: int) -> dict[str, Any]:
        """The GPU-speed stand-in stack (bench/fabric/stand_in.py); returns the bare echo
        measured just before it, the yardstick of its echo-calls: one measured minutes
        earlier, before other phases, drifts with the machine (runs 4 min apart measured it
        at 5,102 and 6,042 calls/s), at the tiers' CALLERS, so the unit and what it measures
        share their concurrency (it ran at the overhead's 32: review finding; side by side an
        echo call cost its server the same at 32 and 64, docs/benchmarks.md)."""
        echo_result = await self.echo(payload, "stand_in_echo", concurrency=CALLERS)

        async def measure(stack: Any, channel: grpc.aio.Channel) -> dict[str, Any]:
            return await measure_stand_in(
                stack, channel, model=MODEL, texts=self.texts, settings=self.settings,
                slo_s=self.slo_s, timeout_s=self.timeout_s, bucket=bucket, echo=echo_result,
                log=self.log, flood_rate_per_s=self.args.flood_rate,
            )  # fmt: skip

        self.report["configs"]["stand_in"] = await self.stack_phase(
            "stand_in", self.on_repo, measure, extra_worker_args=worker_args()
        )
        return echo_result

    async def batching_off(self, stack: Any, channel: grpc.aio.Channel) -> dict[str, Any]:
        observer = Observer(stack.pids(), stack.metrics_ports())
        send = predict_sender(channel, MODEL, self.texts, self.timeout_s)
        target = Target("batching_off", send, observer, MODEL)
        raw_points = {
            p["batch_size"]: p["sequences_per_s"] for p in self.report["raw_model"]["points"]
        }
        fallback = 0.5 * raw_points[1]
        config = await sweep(target, self.settings, self.slo_s, self.log, fallback_rate=fallback)
        return {"max_batch_size": 1, **config}

    async def batching_on(
        self, stack: Any, channel: grpc.aio.Channel, echo_result: dict[str, Any], payload: bytes
    ) -> dict[str, Any]:
        """Uniform sweep, mixed-length sweep, bursty arrivals beside Poisson ones below the
        goodput, overload and after it, then the overhead probe."""
        settings, slo_s, log, report = self.settings, self.slo_s, self.log, self.report
        observer = Observer(stack.pids(), stack.metrics_ports())
        send = predict_sender(channel, MODEL, self.texts, self.timeout_s)
        target = Target("batching_on", send, observer, MODEL)
        swept = await sweep(target, settings, slo_s, log, fallback_rate=0.5 * self.raw_best)
        config = {"max_batch_size": self.max_batch_size, **swept}
        mixed_send = predict_sender(channel, MODEL, self.mixed_texts, self.timeout_s)
        mixed = Target("batching_on_mixed", mixed_send, observer, MODEL)
        mixed_best = report["raw_model_mixed"]["best"]["sequences_per_s"]
        report["configs"]["batching_on_mixed"] = await sweep(
            mixed, settings, slo_s, log, fallback_rate=0.3 * mixed_best
        )
        goodput = config["goodput_per_s"]
        report["bursty"] = await bursty_phases(target, goodput, settings, slo_s, log)
        await self.overload(target, goodput)
        log("[overhead] identity model through gateway, router and worker")
        stack_result = await closed_loop(
            identity_sender(channel, self.timeout_s),
            settings.overhead_concurrency,
            settings.overhead_s,
            observer=observer,
            model="identity",
        )
        log(f"[overhead] identity through the stack: {stack_result['ok_per_s']:.0f}/s")
        report["overhead"] = {
            "concurrency": settings.overhead_concurrency,
            "payload_bytes": len(payload),
            "identity_stack": stack_result,
            "echo": echo_result,
        }
        return config

    async def overload(self, target: Target, goodput: float) -> None:
        """Floods at multiples of the batching-on goodput, then normal traffic right after
        them (docs/benchmarks.md: it must be served normally), then the same floods from
        callers that throttle themselves (measure.overload_phases)."""
        floods, after = await overload_phases(target, goodput, self.settings, self.slo_s, self.log)
        self.report["overload"] = floods
        if after is not None:
            self.report["after_overload"] = after

    async def from_ready(self) -> None:
        """A fresh batching-on stack gets open-loop traffic on the mixed texts at half their
        goodput from the moment it reports ready, with no warm-up and no retry (either would
        no longer be from ready): a rollout or a scale-up (docs/benchmarks.md, from cold)."""
        goodput = self.report["configs"].get("batching_on_mixed", {}).get("goodput_per_s")
        if not goodput:
            self.report["from_ready"] = {"skipped": "no mixed-length goodput to take half of"}
            return
        settings = dataclasses.replace(self.settings, warmup_s=0.0)

        async def measure(stack: Any, channel: grpc.aio.Channel) -> dict[str, Any]:
            observer = Observer(stack.pids(), stack.metrics_ports())
            send = predict_sender(channel, MODEL, self.mixed_texts, self.timeout_s)
            target = Target("from_ready", send, observer, MODEL)
            below = settings.loadgen_priority_below_capacity
            result = await measure_rate(
                target, 0.5 * goodput, settings, self.slo_s, self.log, priority=below
            )
            return result.to_dict()

        self.report["from_ready"] = await self.stack_phase(
            "from_ready", self.on_repo, measure, quiet_first=False
        )

    async def peer(self, peer_class: type | None) -> None:
        configs = self.report["configs"]
        if peer_class is None:
            configs["peer"] = {"skipped": "not run (--no-peer)"}
            return
        self.log("[peer] starting Ray Serve (bench/fabric/peer_client.py)")
        async with peer_class() as peer:
            self.log(f"[peer] ready in {peer.startup_s:.0f} s: {peer.settings}")
            self.quiet["peer"] = await wait_quiet(self.log, self.settings.wait_quiet_s)
            observer = Observer({}, children_label="peer")
            send = text_sender(peer, self.texts)
            target = Target("peer", send, observer, None, self.timeout_s)
            config = await sweep(
                target, self.settings, self.slo_s, self.log, fallback_rate=0.3 * self.raw_best
            )
            configs["peer"] = {"settings": peer.settings, **config}


def prepare(args: argparse.Namespace, settings: Settings, log: Progress) -> tuple[Run, int]:
    """Writes the model repositories and texts and starts the report; returns the run and the
    uniform texts' length bucket."""
    state_dir = args.state_dir or Path(tempfile.mkdtemp(prefix="fabric-bench-"))
    state_dir.mkdir(parents=True, exist_ok=True)
    log(f"state (repositories, stack logs): {state_dir}")
    off_repo, on_repo = state_dir / "repo-batching-off", state_dir / "repo-batching-on"
    # The model opts in to shedding past its SLO: the fleet is provisioned for the SLO, and
    # goodput counts answers within it (callers' deadlines stay timeout_s, well past it).
    write_minilm_repository(
        off_repo, max_batch_size=1, length_buckets=settings.length_buckets, shed_past_slo=True
    )
    write_minilm_repository(on_repo, length_buckets=settings.length_buckets, shed_past_slo=True)
    version = next(v for v in load_repository(on_repo) if v.config.name == MODEL)
    config = version.config
    write_identity_model(on_repo, slo_p99_ms=config.slo_p99_ms)
    texts = make_texts(256, settings.seed, version.weights_dir / "tokenizer.json")
    mixed_texts = make_mixed_texts(512, settings.seed)
    bucket = min(b for b in config.length_buckets if b >= MAX_TOKENS)
    report: dict[str, Any] = {
        "settings": dataclasses.asdict(settings),
        "worker_args": list(args.worker_arg),
        "gateway_args": list(args.gateway_arg),
        "flood_rate_per_s": args.flood_rate,
        "machine": machine(),
        "model": {
            "name": MODEL,
            "slo_p99_ms": config.slo_p99_ms,
            "max_batch_size_on": config.max_batch_size,
            "length_buckets": list(config.length_buckets),
            "bucket_tokens": bucket,
            "texts": {"count": len(texts), "tokens": [MIN_TOKENS, MAX_TOKENS]},
            "mixed_texts": {
                "count": len(mixed_texts),
                "short_share": SHORT_SHARE,
                "short_words": list(SHORT_WORDS),
                "passage_words": list(PASSAGE_WORDS),
            },
            "shed_past_slo": True,
        },
        "configs": {},
    }
    run = Run(
        args=args,
        settings=settings,
        log=log,
        state_dir=state_dir,
        on_repo=on_repo,
        off_repo=off_repo,
        slo_s=config.slo_s,
        max_batch_size=config.max_batch_size,
        texts=texts,
        mixed_texts=mixed_texts,
        timeout_s=max(1.0, 4 * config.slo_s),
        report=report,
    )
    report["outside_cpu_share_before_phase"] = run.quiet
    return run, bucket
