"""SavedActivations counts what a stage really holds for its backward; PeakTensorMemory
counts every tensor a block allocates, until it is freed."""
import pytest
import torch
from torch import nn

from pipeline_lib import Pipe, simulate
from pipeline_lib.memory import PeakTensorMemory, SavedActivations
from pipeline_lib.schedules import build

HIDDEN, ROWS = 8, 3


def block(activation: type[nn.Module]) -> nn.Sequential:
    return nn.Sequential(nn.Linear(HIDDEN, 4 * HIDDEN), activation(), nn.Linear(4 * HIDDEN, HIDDEN))


def measure(schedule: str, checkpoint: str, stages: int = 3, chunks: int = 4,
            activation: type[nn.Module] = nn.GELU) -> SavedActivations:
    torch.manual_seed(0)
    pipe = Pipe(nn.Sequential(*[block(activation) for _ in range(stages)]), chunks=chunks,
                checkpoint=checkpoint)
    x, y = torch.randn(chunks * ROWS, HIDDEN), torch.randn(chunks * ROWS, HIDDEN)
    with SavedActivations(pipe.partitions) as saved:
        pipe.step(x, y, nn.functional.mse_loss, schedule)
    return saved


# One micro-batch through a GELU block saves the block input (Linear), the GELU input and
# the second Linear's input: 1 + 4 + 4 hidden-widths per row, in float32. The weights,
# which the Linears save too, are not activations.
PER_MICROBATCH = ROWS * 9 * HIDDEN * 4


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_peak_is_the_simulated_in_flight_count_of_microbatches(schedule):
    saved = measure(schedule, "never")
    in_flight = simulate(build(schedule, 3, 4)).peak_in_flight()
    assert saved.peak == [n * PER_MICROBATCH for n in in_flight]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_checkpointing_holds_one_recomputed_microbatch_at_a_time(schedule):
    assert measure(schedule, "always").peak == [PER_MICROBATCH] * 3


def test_a_tensor_saved_by_two_layers_counts_once():
    # ReLU saves its output and the next Linear saves that same tensor as its input.
    saved = measure("gpipe", "never", stages=1, chunks=1, activation=nn.ReLU)
    assert saved.peak == [ROWS * (1 + 4) * HIDDEN * 4]


def test_everything_is_released_and_the_history_ends_at_zero():
    saved = measure("1f1b", "never")
    assert saved.held == [0, 0, 0]
    for stage, history in enumerate(saved.history):
        times = [t for t, _ in history]
        assert times == sorted(times)
        assert history[-1][1] == 0
        assert max(b for _, b in history) == saved.peak[stage]


def test_hooks_are_removed_on_exit_and_a_tracker_is_used_once():
    layer = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), nn.Tanh())
    tracker = SavedActivations([layer])
    with tracker:
        layer(torch.randn(2, HIDDEN)).sum().backward()
        with pytest.raises(RuntimeError, match="measures once"):
            tracker.__enter__()
    peak = tracker.peak
    assert peak[0] > 0
    out = layer(torch.randn(5, HIDDEN))
    assert tracker.held == [0] and tracker.peak == peak
    assert not layer._forward_hooks and not layer._forward_pre_hooks
    out.sum().backward()
    with pytest.raises(RuntimeError, match="measures once"):
        tracker.__enter__()


def test_peak_memory_counts_allocations_until_freed_not_views():
    outside = torch.ones(1000)
    with PeakTensorMemory() as memory:
        a = torch.zeros(1000)          # 4000 bytes
        b = a.view(10, 100)            # a view allocates nothing
        a.add_(1)                      # nor does an in-place op
        c = outside * 2                # 4000 more
        del a, b, c
        d = torch.zeros(500)           # 2000, after both were freed
    assert memory.peak == 8000
    assert memory.current == 2000 == d.nbytes


def test_peak_memory_sees_the_backward():
    weight = torch.ones(1000, requires_grad=True)
    with PeakTensorMemory() as memory:
        (weight * 3).sum().backward()
    assert memory.current >= weight.grad.nbytes
