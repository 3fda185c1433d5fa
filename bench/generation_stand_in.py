"""A GPU-speed stand-in for a generation model's steps, on a machine without a GPU.

On a GPU every step of tiny-llama replays a CUDA graph: the host lays the step out and stages
its inputs (`step_graphs`, the host's real work), then the device computes it in about 0.2 ms
(an H200, graphs of 1 to 128 rows: `bench.generation_steps`' device time, 0.16-0.21 ms).
Here each step takes the same host path, then `step_s` asleep (without the GIL and without
burning a core) in place of the device, and returns zero logits of the step's shape. What
bounds tokens/s is then the engine's own Python (scheduling, sampling, detokenizing,
streaming) on this machine's cores, as on a GPU box: it can be measured and trimmed without
one. A GPU box's host may be slower, and it copies and synchronizes where this sleeps: the
H200's ran the engine at 0.41-0.45x of this 2-core machine's pace with the stand-in
(docs/benchmarks.md). Greedy sampling of zero logits picks token 0 every time: a stand-in's
outputs measure speed, never text.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch

from services.gpu_worker.generation.backend import GenerationBackend
from services.gpu_worker.generation.model_runner import ModelRunner
from services.gpu_worker.generation.step_graphs import StepGraphs
from services.gpu_worker.generation.step_inputs import StepItem

#: Device time of one tiny-llama step from its graph on an H200 (2026-12-04, 0.16-0.21 ms).
H200_STEP_S = 0.0002


class StandInSteps(StepGraphs):
    """Steps laid out and staged as for their graphs, then `step_s` asleep."""

    def __init__(
        self,
        runner: ModelRunner,
        *,
        step_s: float,
        max_num_seqs: int,
        max_model_len: int,
        max_step_tokens: int,
    ) -> None:
        super().__init__(runner, max_num_seqs, max_model_len, max_step_tokens)
        self._step_s = step_s
        self._zeros = torch.zeros(max_num_seqs, runner.config.vocab_size)

    def capture(self) -> None:
        """Nothing to capture: every bucket `holds` is served."""

    def replay(self, items: Sequence[StepItem]) -> torch.Tensor | None:
        if (bucket := self.bucket(items)) is None:
            return None
        self._runner.inputs.staging.stage(self.layout(items, *bucket))
        self._runner.launched()
        time.sleep(self._step_s)
        return self._zeros[: sum(1 for item in items if item.samples)]


def install(backend: GenerationBackend, step_s: float) -> None:
    """Serves the warmed-up `backend`'s steps from the stand-in, in the buckets its graphs
    would have."""
    settings = backend.settings
    backend.runner.graphs = StandInSteps(
        backend.runner,
        step_s=step_s,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=backend.max_model_len,
        max_step_tokens=settings.max_num_batched_tokens,
    )
