"""Which items of a failed generation step run again (step_executor.rerun_split)."""

from __future__ import annotations

import pytest

from services.gpu_worker.generation.sequence import ScheduledSequence
from services.gpu_worker.generation.step_executor import rerun_plan, rerun_split

pytestmark = pytest.mark.unit


def item(seq_id: int, start: int, num_tokens: int) -> ScheduledSequence:
    return ScheduledSequence(seq_id, tuple(range(num_tokens)), start, (0, 1), samples=True)


def test_a_preempted_sequence_recomputing_runs_again_and_a_new_prompt_fails() -> None:
    """A failed step of a decode (1), a new prompt's chunk (2) and the recompute of a
    preempted sequence (3: its prompt and tokens again, from position 0, as a prompt's chunk
    reads). 3 has sent tokens, which no tier may replay: it runs again with the decode; only
    the new prompt fails. Before, 3 was failed as a prompt."""
    decode, prompt, recompute = item(1, 20, 1), item(2, 0, 12), item(3, 0, 30)
    sent = {1, 3}
    again, failed = rerun_split([decode, prompt, recompute], lambda i: i.seq_id in sent)
    assert (again, failed) == ([decode, recompute], [prompt])
    # A new prompt's one token left after a prefix-cache hit reads as a decode (a position
    # past 0, one token), but its sequence has sent nothing: it fails with the new prompts.
    hit = item(4, 16, 1)
    assert rerun_split([decode, hit], lambda i: i.seq_id in sent) == ([decode], [hit])
    assert rerun_plan([decode, hit], lambda i: i.seq_id in sent) == ([hit], [[decode]])


def test_the_rerun_plan_blames_new_prompts_then_recomputes_and_keeps_decodes_last() -> None:
    """A review of the first form: with decodes and a recompute and no new prompt, nothing
    was failed, so nothing was rerun and every stream failed (before, the decodes ran again).
    Now, with new prompts they fail and the rest runs again, then the decodes alone; with
    none, the recomputes fail and the decodes run again; one kind alone fails whole."""
    decode, prompt, recompute = item(1, 20, 1), item(2, 0, 12), item(3, 0, 30)
    sent = {1, 3}.__contains__

    def plan(*items: ScheduledSequence) -> object:
        return rerun_plan(list(items), lambda i: sent(i.seq_id))

    assert plan(decode, prompt, recompute) == ([prompt], [[decode, recompute], [decode]])
    assert plan(decode, recompute) == ([recompute], [[decode]])
    assert plan(decode, prompt) == ([prompt], [[decode]])
    assert plan(recompute, prompt) == ([prompt], [[recompute]])
    assert plan(decode, item(3, 9, 1)) is None  # decodes only
    assert plan(prompt, item(5, 0, 3)) is None  # new prompts only
    assert plan(recompute) is None
