"""Placing stages (WithDevice) and handing shared tensors to every micro-batch (NoChunk)."""
import copy

import pytest
import torch
from torch import nn

from pipeline_lib import NoChunk, Pipe, WithDevice

META, CPU = torch.device("meta"), torch.device("cpu")


def test_with_device_places_a_parameterless_stage_and_those_after_it():
    # "meta" stands for a second device here: placement only, nothing runs on it
    model = nn.Sequential(nn.Linear(2, 2), WithDevice(nn.ReLU(), "meta"), nn.Tanh(),
                          WithDevice(nn.Linear(2, 2), "cpu"))
    pipe = Pipe(model)
    assert pipe.devices == [CPU, META, META, CPU]


def test_with_device_moves_a_layer_with_parameters():
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh(), WithDevice(nn.Linear(2, 2), "meta"))
    pipe = Pipe(model, balance=[2, 1])
    assert pipe.devices == [CPU, META]
    assert model[2].module.weight.device == META


def test_with_device_conflicts_are_clear_errors():
    model = nn.Sequential(nn.Linear(2, 2), WithDevice(nn.ReLU(), "meta"))
    with pytest.raises(ValueError, match=r"stage 1 holds a layer pinned by WithDevice to "
                                         r"meta, but devices\[1\] is cpu"):
        Pipe(model, devices=["cpu", "cpu"])
    two_pins = nn.Sequential(WithDevice(nn.ReLU(), "meta"), WithDevice(nn.Tanh(), "cpu"))
    with pytest.raises(ValueError, match=r"pinned by WithDevice to different devices "
                                         r"\['cpu', 'meta'\]"):
        Pipe(two_pins, balance=[2])


def test_with_device_is_transparent():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 2))
    wrapped = copy.deepcopy(model)
    wrapped[1] = WithDevice(wrapped[1], "cpu")
    x = torch.randn(6, 3)
    torch.testing.assert_close(Pipe(wrapped, chunks=3)(x), model(x))


class Masked(nn.Module):
    """Multiplies by a feature mask shared by all rows; records the masks it was given."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(4, 4)
        self.masks_seen = []

    def forward(self, inputs):
        x, mask = inputs
        self.masks_seen.append(mask)
        return self.linear(x) * mask, mask


class DropMask(nn.Module):
    def forward(self, inputs):
        return inputs[0]


def make_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Masked(), Masked(), DropMask(), nn.Linear(4, 3))


@pytest.mark.parametrize("run", ["forward", "step"])
def test_nochunk_gives_the_whole_tensor_to_every_micro_batch(run):
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(10, 4, generator=g), torch.randint(0, 3, (10,), generator=g)
    mask = torch.tensor([1.0, 0.0, 1.0, 0.5])   # 4 entries: not split over the 10 rows
    reference = make_model()
    expected = nn.functional.cross_entropy(reference((x, mask)), y)
    expected.backward()

    model = make_model()
    pipe = Pipe(model, chunks=5, checkpoint="never", balance=[1, 1, 2])
    if run == "forward":
        loss = nn.functional.cross_entropy(pipe((x, NoChunk(mask))), y)
        loss.backward()
    else:
        loss = pipe.step((x, NoChunk(mask)), y, nn.CrossEntropyLoss())
    torch.testing.assert_close(loss.detach(), expected.detach())
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad)
    for layer in model[:2]:
        assert len(layer.masks_seen) == 5
        assert all(torch.equal(seen, mask) for seen in layer.masks_seen)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        pipe((x, mask))   # unwrapped, the mask would be split like the batch
