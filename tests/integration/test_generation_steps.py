"""One generation step's inputs, attention kernels and (on a GPU) CUDA graphs.

The runner packs a step's rows decodes first and returns logits only for the items that
sample; its attention runs on the kernel set it chose, never cuDNN attention. The CUDA tests
run where a GPU is (the device script runs them); on a CPU they are skipped, not passed.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from prometheus_client import CollectorRegistry
from torch.overrides import TorchFunctionMode

from services.common import metric_names as names
from services.common.model_repository import load_repository
from services.gpu_worker.generation.attention_backends import CANDIDATES, enabled_now
from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.generation.metrics import GenerationMetrics
from services.gpu_worker.generation.model_runner import ModelRunner, SequenceBatchItem
from services.gpu_worker.generation.step_inputs import paged_rows, paged_step
from services.gpu_worker.generation.tiny_llama import create_tiny_llama

pytestmark = pytest.mark.integration

BLOCK_SIZE = 4
NUM_BLOCKS = 8 * 24  # eight sequences of up to 96 positions
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return create_tiny_llama(tmp_path_factory.mktemp("steps") / "tiny-llama", seed=3)


def make_runner(model_dir: Path, device: str = "cpu") -> ModelRunner:
    return ModelRunner(
        model_dir,
        device=torch.device(device),
        dtype=torch.float32,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
    )


class Sequences:
    """Test-side sequences with disjoint block tables, prompt i of length `lengths[i]`."""

    def __init__(self, lengths: list[int]) -> None:
        self.tokens = [[1 + (7 * i + 3 * j) % 250 for j in range(n)] for i, n in enumerate(lengths)]
        self.cached = [0] * len(lengths)
        self.tables: list[tuple[int, ...]] = []
        block = 0
        for _ in lengths:
            self.tables.append(tuple(range(block, block + 24)))  # room for 96 positions
            block += 24

    def prefill(
        self, i: int, upto: int | None = None, *, samples: bool = True
    ) -> SequenceBatchItem:
        end = len(self.tokens[i]) if upto is None else upto
        item = SequenceBatchItem(
            tuple(self.tokens[i][self.cached[i] : end]), self.cached[i], self.tables[i], samples
        )
        self.cached[i] = end
        return item

    def decode(self, i: int, token: int) -> SequenceBatchItem:
        self.tokens[i].append(token)
        item = SequenceBatchItem((token,), self.cached[i], self.tables[i])
        self.cached[i] += 1
        return item


@pytest.mark.parametrize(
    ("device", "tolerance"), [("cpu", 1e-5), pytest.param("cuda", 1e-3, marks=needs_cuda)]
)
def test_a_step_returns_logits_only_for_the_items_that_sample(
    model_dir: Path, device: str, tolerance: float
) -> None:
    # One runner takes a step mixing, in this order, a prompt's middle chunk (which samples
    # nothing), a decode, a whole prompt and another decode; the other runs each item in a
    # step of its own. The rows come back for the sampling items only, in the items' order
    # (on CUDA within a tolerance: other shapes, other kernels).
    mixed, alone = make_runner(model_dir, device), make_runner(model_dir, device)
    first, second = Sequences([5, 9, 12, 7]), Sequences([5, 9, 12, 7])
    for runner, seqs in ((mixed, first), (alone, second)):
        runner.execute([seqs.prefill(0), seqs.prefill(1)])
    step = [first.prefill(2, upto=6, samples=False), first.decode(0, 42)]
    step += [first.prefill(3), first.decode(1, 17)]
    expected = [
        alone.execute([item])
        for item in (
            second.prefill(2, upto=6, samples=False),
            second.decode(0, 42),
            second.prefill(3),
            second.decode(1, 17),
        )
    ]

    logits = mixed.execute(step)

    assert [e.shape[0] for e in expected] == [0, 1, 1, 1]
    assert logits.shape == (3, mixed.config.vocab_size)
    torch.testing.assert_close(logits, torch.cat(expected), atol=tolerance, rtol=tolerance)
    # The rest of the prompt then continues from the chunk's keys and values.
    torch.testing.assert_close(
        mixed.execute([first.prefill(2)]),
        alone.execute([second.prefill(2)]),
        atol=tolerance,
        rtol=tolerance,
    )


def test_a_step_laid_out_as_paged_rows_gives_the_eager_logits(model_dir: Path) -> None:
    # What a captured graph computes, run eagerly here: every token a row attending through
    # its sequence's cached blocks, padded to a bucket of rows and width. The same logits as
    # the eager layout (prompts attending to their own keys, decodes through the cache), for
    # a step mixing a whole prompt, a middle chunk that samples nothing, a later chunk with
    # cached context and decodes; and the padding rows touched no sequence's blocks.
    eager, paged = make_runner(model_dir), make_runner(model_dir)
    first, second = Sequences([5, 9, 12, 7, 20]), Sequences([5, 9, 12, 7, 20])
    for runner, seqs in ((eager, first), (paged, second)):
        runner.execute([seqs.prefill(0), seqs.prefill(1), seqs.prefill(4, upto=6)])

    def step(seqs: Sequences) -> list[SequenceBatchItem]:
        return [
            seqs.prefill(2, upto=6, samples=False),
            seqs.decode(0, 42),
            seqs.prefill(3),
            seqs.prefill(4),  # positions 6-19 after 6 cached
            seqs.decode(1, 17),
        ]

    expected = eager.execute(step(first))
    layout = {"rows": 64, "width": 8, "num_seqs": 6, "block_size": BLOCK_SIZE}
    values = paged_rows(step(second), **layout, pad_block=paged.pad_block)
    with torch.inference_mode():
        logits = paged.forward(paged_step(torch.tensor(values), **layout))

    assert expected.shape[0] == 4
    torch.testing.assert_close(logits[:4], expected, atol=1e-5, rtol=1e-5)
    # The next step of every sequence (the chunked prompt finished) agrees too.
    torch.testing.assert_close(
        paged.execute([second.prefill(2), *(second.decode(i, 5) for i in (0, 1, 3, 4))]),
        eager.execute([first.prefill(2), *(first.decode(i, 5) for i in (0, 1, 3, 4))]),
        atol=1e-5,
        rtol=1e-5,
    )


class SdpaKernels(TorchFunctionMode):
    """Records, at each scaled_dot_product_attention call, which kernels torch's flags enable."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[frozenset[str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if func is F.scaled_dot_product_attention:
            self.seen.append(enabled_now())
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("choice", CANDIDATES, ids=lambda c: c.name)
def test_attention_runs_on_the_chosen_kernels_and_never_cudnn(model_dir: Path, choice) -> None:
    runner = make_runner(model_dir)
    runner.attention = choice
    seqs = Sequences([6, 11])
    kernels = SdpaKernels()
    before = enabled_now()
    with kernels:
        runner.execute([seqs.prefill(0), seqs.prefill(1, upto=5)])
        runner.execute([seqs.decode(0, 9), seqs.prefill(1)])

    # Two layers: per layer one prompt, then one decode call and one later chunk.
    assert len(kernels.seen) == 2 * 2 + 2 * 2
    expected = frozenset(choice.name.split("+"))
    assert set(kernels.seen) == {expected}
    assert "cudnn" not in expected
    # Outside a step the flags are back as they were.
    assert enabled_now() == before


def test_warm_up_reports_the_kernels_and_no_graphs_on_a_cpu(
    model_dir: Path, tmp_path: Path
) -> None:
    repository = Path(__file__).resolve().parents[2] / "models"
    version = next(v for v in load_repository(repository) if v.config.name == "tiny-llama")
    registry = CollectorRegistry()
    backend = GenerationBackend(version, torch.device("cpu"), GenerationMetrics(registry))
    backend.warm_up()
    labels = {"model": "tiny-llama", "version": version.version}
    assert backend.runner.attention == CANDIDATES[0]
    assert backend.runner.graphs is None
    assert registry.get_sample_value(names.GENERATION_CUDA_GRAPHS, labels) == 0.0
    chosen = {**labels, "backends": CANDIDATES[0].name}
    assert registry.get_sample_value(names.GENERATION_ATTENTION_BACKENDS, chosen) == 1.0


@needs_cuda
def test_on_cuda_the_kernel_choice_is_measured_and_excludes_cudnn(model_dir: Path) -> None:
    runner = make_runner(model_dir, "cuda")
    seqs = Sequences([40] * 5)
    runner.execute([seqs.prefill(i) for i in range(4)])
    times = runner.choose_attention([[seqs.decode(i, 5) for i in range(4)], [seqs.prefill(4)]])
    assert set(times) <= {c.name for c in CANDIDATES} and runner.attention.name in times
    assert "cudnn" not in runner.attention.name


@needs_cuda
def test_on_cuda_graph_replays_give_the_eager_logits(model_dir: Path) -> None:
    eager, graphed = make_runner(model_dir, "cuda"), make_runner(model_dir, "cuda")
    captured = graphed.capture_graphs(max_num_seqs=8, max_model_len=96, max_step_tokens=32)
    graphs = graphed.graphs
    # Rows up to the step's 32 tokens; widths up to the engine's 96 positions (24 blocks),
    # not the checkpoint's 512.
    assert graphs is not None and graphs.batch_sizes == (1, 2, 4, 8, 16, 32)
    assert graphs.widths == (1, 2, 4, 8, 16, 24)
    assert captured == graphs.count == len(graphs.batch_sizes) * len(graphs.widths)
    lengths = [3, 17, 30, 9, 50, 5, 22, 8]
    first, second = Sequences(lengths), Sequences(lengths)
    for runner, seqs in ((eager, first), (graphed, second)):
        runner.execute([seqs.prefill(i) for i in range(6)])
    # Batches of 1, 3 (padded to 4) and 6 (padded to 8), contexts over several widths.
    for count in (1, 3, 6, 6, 3, 1):
        expected = eager.execute([first.decode(i, 11 + i) for i in range(count)])
        replayed = graphs.replay([second.decode(i, 11 + i) for i in range(count)])
        assert replayed is not None
        torch.testing.assert_close(replayed, expected, atol=2e-3, rtol=2e-3)
    # Through execute, with an item that does not sample: a graph runs it, its row left out.
    step_a = [first.decode(i, 30 + i) for i in range(3)]
    step_b = [second.decode(i, 30 + i) for i in range(3)]
    step_b[1] = dataclasses.replace(step_b[1], samples=False)
    replayed = graphed.num_replayed_steps
    logits = graphed.execute(step_b)
    assert graphed.num_replayed_steps == replayed + 1
    torch.testing.assert_close(logits, eager.execute(step_a)[[0, 2]], atol=2e-3, rtol=2e-3)
    # Steps with prompts replay too, their tokens rows like decodes: a whole prompt, a decode
    # and a chunk that samples nothing (22 + 1 + 4 rows, padded to 32), then the rest of that
    # prompt with a decode.
    for step_a, step_b in (
        (
            [first.prefill(6), first.decode(0, 3), first.prefill(7, upto=4, samples=False)],
            [second.prefill(6), second.decode(0, 3), second.prefill(7, upto=4, samples=False)],
        ),
        ([first.prefill(7), first.decode(6, 9)], [second.prefill(7), second.decode(6, 9)]),
    ):
        replayed = graphed.num_replayed_steps
        logits = graphed.execute(step_b)
        assert graphed.num_replayed_steps == replayed + 1
        torch.testing.assert_close(logits, eager.execute(step_a), atol=2e-3, rtol=2e-3)
    # More tokens than the largest bucket: replay declines it (before touching anything),
    # and execute runs it eagerly, to the same numbers. The decodes after every step above
    # agree: no padding row wrote to a sequence's blocks.
    long_a, long_b = Sequences([40]), Sequences([40])  # blocks 0-23: sequence 0's, now over
    item_a, item_b = long_a.prefill(0), long_b.prefill(0)
    assert graphs.replay([item_b]) is None
    eager_steps = graphed.num_eager_steps
    torch.testing.assert_close(
        graphed.execute([item_b]), eager.execute([item_a]), atol=2e-3, rtol=2e-3
    )
    assert graphed.num_eager_steps == eager_steps + 1
    torch.testing.assert_close(
        graphed.execute([second.decode(i, 4) for i in range(1, 8)]),
        eager.execute([first.decode(i, 4) for i in range(1, 8)]),
        atol=2e-3,
        rtol=2e-3,
    )
