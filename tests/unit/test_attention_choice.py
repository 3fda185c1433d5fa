"""The attention kernels' choice (pure: the timing is the caller's) and the graphs' buckets."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from services.gpu_worker.generation.attention_backends import CANDIDATES, enabled_now, fastest
from services.gpu_worker.generation.step_graphs import GATHER_BUDGET, StepGraphs, buckets

pytestmark = pytest.mark.unit


def test_the_fastest_set_that_runs_is_chosen_and_every_time_reported() -> None:
    timed = iter([0.004, 0.002, 0.003])
    seen = []

    def time_step() -> float:
        seen.append(enabled_now())
        return next(timed)

    chosen, times = fastest(CANDIDATES, time_step)

    assert chosen == CANDIDATES[1]
    assert times == {c.name: t for c, t in zip(CANDIDATES, (0.004, 0.002, 0.003), strict=True)}
    # Each timing ran with its own set enabled, cuDNN never.
    assert seen == [frozenset(c.name.split("+")) for c in CANDIDATES]


def test_a_later_set_replaces_an_earlier_one_only_when_faster_by_the_margin() -> None:
    # Within 5% of the first set's time: a tie, and the first (broadest) set stays.
    timed = iter([0.0100, 0.0097, 0.0096])
    chosen, _ = fastest(CANDIDATES, lambda: next(timed))
    assert chosen == CANDIDATES[0]
    # Faster by more than the margin: it wins.
    timed = iter([0.0100, 0.0094, 0.0092])
    chosen, _ = fastest(CANDIDATES, lambda: next(timed))
    assert chosen == CANDIDATES[1]


def test_a_set_whose_kernels_refuse_is_left_out_and_none_running_raises() -> None:
    def refuse_fused() -> float:
        if "flash" in enabled_now():
            raise RuntimeError("No available kernel")
        return 0.001 if "efficient" in enabled_now() else 0.0005

    chosen, times = fastest(CANDIDATES, refuse_fused)
    assert chosen == CANDIDATES[2] and set(times) == {"efficient+math", "math"}

    def refuse() -> float:
        raise RuntimeError("No available kernel")

    with pytest.raises(RuntimeError, match="no attention kernel set"):
        fastest(CANDIDATES, refuse)

    def fault() -> float:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    # A fault is no kernel's refusal: it is not hidden by choosing another set.
    with pytest.raises(RuntimeError, match="illegal memory access"):
        fastest(CANDIDATES, fault)


def test_overlapping_steps_leave_the_flags_as_they_were_once_none_runs() -> None:
    # Two models' steps on two threads: A enters, B enters, A leaves, B leaves.
    before = enabled_now()
    first, second = CANDIDATES[2].enabled(), CANDIDATES[1].enabled()
    first.__enter__()
    assert enabled_now() == {"math"}
    second.__enter__()
    assert enabled_now() == {"efficient", "math"}
    first.__exit__(None, None, None)
    assert enabled_now() == {"efficient", "math"}  # B still runs on its own set
    second.__exit__(None, None, None)
    assert enabled_now() == before


@pytest.mark.parametrize(
    ("limit", "expected"),
    [(1, (1,)), (2, (1, 2)), (32, (1, 2, 4, 8, 16, 32)), (24, (1, 2, 4, 8, 16, 24))],
)
def test_graph_buckets_are_powers_of_two_up_to_the_limit(limit: int, expected: tuple) -> None:
    assert buckets(limit) == expected


def test_graphs_of_many_rows_are_captured_only_within_the_gather_budget() -> None:
    runner = SimpleNamespace(block_size=16, num_blocks=1024)
    graphs = StepGraphs(runner, max_num_seqs=32, max_model_len=4096, max_step_tokens=2048)  # type: ignore[arg-type]
    assert graphs.batch_sizes == tuple(2**i for i in range(12))
    assert graphs.widths == tuple(2**i for i in range(9))
    # Decode-only buckets, every width.
    assert all(graphs.holds(rows, 256) for rows in (1, 8, 32))
    # Past them, rows x width x block_size within the budget.
    assert graphs.holds(512, 32) and GATHER_BUDGET == 512 * 32 * 16
    assert not graphs.holds(512, 64) and not graphs.holds(64, 512)
    assert graphs.holds(2048, 8) and not graphs.holds(2048, 16)
    # Without a step's token count, the decode-only buckets alone, for decode-only steps:
    # a step with a prompt, however small, is no graph's.
    decode_only = StepGraphs(runner, 32, 4096)  # type: ignore[arg-type]
    assert decode_only.batch_sizes == (1, 2, 4, 8, 16, 32)
    decodes = [SimpleNamespace(token_ids=(1,), start_position=9, samples=True)] * 3
    assert decode_only.bucket(decodes) == (4, 1)
    prompt = SimpleNamespace(token_ids=(1, 2), start_position=0, samples=True)
    assert decode_only.bucket([*decodes, prompt]) is None
    assert graphs.bucket([*decodes, prompt]) == (8, 1)


def test_a_step_takes_the_smallest_bucket_that_holds_its_tokens_items_and_context() -> None:
    runner = SimpleNamespace(block_size=16, num_blocks=1024)
    graphs = StepGraphs(runner, max_num_seqs=32, max_model_len=1024, max_step_tokens=512)  # type: ignore[arg-type]

    def item(tokens: int, start: int) -> SimpleNamespace:
        return SimpleNamespace(token_ids=(1,) * tokens, start_position=start, samples=True)

    # 3 decodes, the longest at position 40 (41 positions: 3 blocks): 4 rows, 4 blocks.
    assert graphs.bucket([item(1, 5), item(1, 40), item(1, 17)]) == (4, 4)
    # A 100-token prompt beside 31 decodes: 131 rows -> 256; positions up to 100 -> 8 blocks.
    assert graphs.bucket([item(100, 0)] + [item(1, 20)] * 31) == (256, 8)
    # Past the largest bucket of rows, of items, of width, or of the gather budget: none.
    assert graphs.bucket([item(256, 0), item(257, 0)]) is None
    assert graphs.bucket([item(1, 3)] * 33) is None
    assert graphs.bucket([item(1, 1100)]) is None
    assert graphs.bucket([item(300, 500)]) is None  # 512 rows x 64 blocks x 16: past it
    assert graphs.bucket([item(300, 200)]) == (512, 32)  # 512 x 32 x 16: within it
    # Decode-only buckets whatever their width.
    assert graphs.bucket([item(1, 1000)] * 32) == (32, 64)


def test_a_max_num_seqs_off_the_powers_of_two_is_a_bucket_of_its_own() -> None:
    # Decode steps of 33-48 sequences take the 48-row bucket, held at every width; in the
    # 64-row bucket, past max_num_seqs, wide contexts would fall to the gather budget.
    runner = SimpleNamespace(block_size=16, num_blocks=1024)
    graphs = StepGraphs(runner, max_num_seqs=48, max_model_len=4096, max_step_tokens=512)  # type: ignore[arg-type]
    assert graphs.batch_sizes == (1, 2, 4, 8, 16, 32, 48, 64, 128, 256, 512)
    decode = SimpleNamespace(token_ids=(1,), start_position=3000, samples=True)
    assert graphs.bucket([decode] * 40) == (48, 256)
    # With a 30-token prompt, 70 rows: 128 x 256 blocks x 16 is past the budget.
    assert (
        graphs.bucket(
            [decode] * 40 + [SimpleNamespace(token_ids=(1,) * 30, start_position=0, samples=True)]
        )
        is None
    )
