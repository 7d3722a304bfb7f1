"""The speed decomposition's factors multiply back to what was measured."""
import math

import pytest

from pipeline_lib.schedules import gpipe
from pipeline_lib.course.speed import Speed, ideal_speedup
from pipeline_lib.timeline import simulate


def test_ideal_is_fill_and_drain_only():
    assert ideal_speedup(1, 8) == 1
    assert ideal_speedup(4, 1) == 1
    assert ideal_speedup(2, 4) == pytest.approx(8 / 5)


def test_net_is_micro_batching_times_ideal_times_efficiency():
    s = Speed(devices=2, microbatches=4, whole=1.0, accumulated=1.25, step=0.9)
    assert s.micro_batching == pytest.approx(0.8)
    assert s.speedup == pytest.approx(1.25 / 0.9)
    assert s.net == pytest.approx(s.micro_batching * s.ideal * s.efficiency)


@pytest.mark.parametrize("stretch,overhead", [(1.0, 1.0), (1.3, 1.1)])
def test_losses_multiply_to_one_over_efficiency(stretch, overhead):
    """A simulated GPipe step whose actions ran ``stretch`` times slower than alone and
    whose wall time exceeds its actions' span by ``overhead``."""
    p, m, f = 2, 4, 0.01
    timeline = simulate(gpipe(p, m), forward=f * stretch, backward=2 * f * stretch)
    accumulated = m * 3 * f * p                         # every action, one after another
    s = Speed(p, m, whole=accumulated, accumulated=accumulated,
              step=timeline.makespan * overhead, busy=sum(timeline.busy()),
              span=timeline.makespan)
    losses = s.losses()
    assert losses["the bubble beyond fill and drain"] == pytest.approx(1)   # GPipe's own
    assert losses["the stretch (actions slower than alone)"] == pytest.approx(stretch)
    assert losses["the overhead outside the actions"] == pytest.approx(overhead)
    assert s.efficiency * math.prod(losses.values()) == pytest.approx(1)
    if stretch > 1:
        assert "the stretch" in s.verdict()
    else:
        assert s.efficiency == pytest.approx(1) and "largest loss" not in s.verdict()


def test_an_unequal_split_passes_its_own_ideal():
    s = Speed(2, 4, whole=1.0, accumulated=1.0, step=1.0, ideal=1.25)
    assert s.efficiency == pytest.approx(0.8)


def test_bad_times_are_refused_and_losses_need_a_timeline():
    with pytest.raises(ValueError, match="times must be positive"):
        Speed(2, 4, whole=0.0, accumulated=1.0, step=1.0)
    with pytest.raises(ValueError, match="needs the pipelined step's busy= and span="):
        Speed(2, 4, whole=1.0, accumulated=1.0, step=1.0).losses()


def test_a_pipeline_above_its_ideal_is_explained_by_its_stretch():
    s = Speed(2, 4, whole=1.0, accumulated=1.0, step=0.5, busy=0.6, span=0.5)
    assert s.efficiency > 1.05
    assert "above the ideal" in s.verdict() and "0.60x" in s.verdict()
