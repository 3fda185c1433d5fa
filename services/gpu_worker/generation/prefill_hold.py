"""When to let waiting prompts into a step, where a step with a prompt costs far more than one
without (pure: the engine passes `now_s`).

On a GPU a step replays a CUDA graph (`step_graphs`), where one holds it: for tiny-llama on an
H200 a decode step of 32 sequences 0.37 ms, where a step run eagerly costs 1.5-2.8 ms whatever
its size, all launches. Steps with prompts replay graphs too, up to the largest bucket; a
larger one (or, with `--decode-only-graphs` in the benchmarks, every one) runs eagerly. If
such steps are dear, admitting each prompt the moment it arrives (or a seat frees) makes
nearly every step an eager one. Holding prompts back while sequences decode, for at most the
extra cost of one step with a prompt since the last one, lets the prompts that arrive in that
window share one such step: at most half the engine's time goes to the extra cost, and a
prompt's first token comes at most that extra cost later (milliseconds, against time-to-first-
token objectives of hundreds). With nothing decoding there is nothing to overlap: prompts are
admitted at once. Where both kinds of step cost alike (a CPU, graphs off, prompts' steps
replayed) the hold is next to zero.
"""

from __future__ import annotations

#: Weight of each new step in the moving averages of step costs.
_ALPHA = 0.1


class PrefillHold:
    """Moving averages of step costs with and without prompts, and the admission rule."""

    def __init__(self) -> None:
        #: Mean seconds of a step with a prompt chunk (None: none seen yet).
        self.mixed_s: float | None = None
        #: Mean seconds of a decode-only step (None: none seen yet).
        self.decode_s: float | None = None
        #: When the last step with a prompt ended (None: never).
        self._last_mixed_end_s: float | None = None

    @property
    def hold_s(self) -> float:
        """How long after a step with a prompt the next may start: its extra cost over a
        decode-only step (zero until both kinds were measured)."""
        if self.mixed_s is None or self.decode_s is None:
            return 0.0
        return max(0.0, self.mixed_s - self.decode_s)

    def record(self, *, has_prompt: bool, seconds: float, end_s: float) -> None:
        """A step that ended at `end_s` after `seconds`, with a prompt chunk or not."""
        if has_prompt:
            self.mixed_s = (
                seconds
                if self.mixed_s is None
                else self.mixed_s + _ALPHA * (seconds - self.mixed_s)
            )
            self._last_mixed_end_s = end_s
        else:
            self.decode_s = (
                seconds
                if self.decode_s is None
                else self.decode_s + _ALPHA * (seconds - self.decode_s)
            )

    def admits(self, now_s: float, *, num_running: int) -> bool:
        """Whether the step planned at `now_s` may admit waiting prompts."""
        if num_running == 0 or self._last_mixed_end_s is None:
            return True
        return now_s - self._last_mixed_end_s >= self.hold_s
