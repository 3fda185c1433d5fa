"""When a worker's fronts have all stopped listening for long enough that it must stop serving
(services.gpu_worker.fronts.Silence, on the caller's clock)."""

from __future__ import annotations

import pytest

from services.gpu_worker.fronts import Silence

pytestmark = pytest.mark.unit


def test_lost_once_none_has_listened_for_the_whole_time() -> None:
    silence = Silence(lost_after_s=30.0)
    assert not silence.update(False, now_s=100.0)  # the first time none listens
    assert not silence.update(False, now_s=129.9)
    assert silence.update(False, now_s=130.0)
    assert not silence.update(False, now_s=200.0), "told once"


def test_a_front_listening_between_restarts_starts_the_count_again() -> None:
    silence = Silence(lost_after_s=30.0)
    assert not silence.update(False, now_s=0.0)
    assert not silence.update(True, now_s=20.0)  # one came up a while
    assert not silence.update(False, now_s=25.0)
    assert not silence.update(False, now_s=54.9)
    assert silence.update(False, now_s=55.0)
