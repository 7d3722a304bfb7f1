"""partition.py: what the profilers really run, on which device, and what they report.

Written against the mutants `make mutants` found alive (see mutants-equivalent.md): each test
pins a behaviour the older tests left free.
"""
import pytest
import torch
from torch import nn

from pipeline_lib.partition import (
    balance_by_memory,
    balance_by_params,
    balance_by_time,
    group_layers,
    layer_memory,
    layer_params,
    layer_times,
    optimal_split,
)


class Probe(nn.Module):
    """A linear layer that logs, in a list shared by its deep copies, every forward (the
    device of its input and weight, whether the weight's gradient had been reset) and every
    backward (the gradient it was seeded with)."""

    def __init__(self, log: list):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(4, 4))
        self.log = log  # deepcopy keeps the list shared: it copies modules, not this list

    def __deepcopy__(self, memo):
        twin = Probe(self.log)
        twin.weight = nn.Parameter(self.weight.detach().clone())
        return twin

    def forward(self, x):
        self.log.append(("F", x.device.type, self.weight.device.type, self.weight.grad is None))
        return _LogBackward.apply(x @ self.weight, self.log)


class _LogBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, log):
        ctx.log = log
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append(("B", grad.clone()))
        return grad, None


def forwards(log):
    return [entry for entry in log if entry[0] == "F"]


def backwards(log):
    return [entry[1] for entry in log if entry[0] == "B"]


# --------------------------------------------------------------------------- layer_times


@pytest.mark.parametrize("repeats, runs", [(None, 6), (1, 2), (3, 4)])
def test_layer_times_runs_warmup_plus_repeats_forwards_and_backwards(repeats, runs):
    log = []
    model = nn.Sequential(Probe(log), Probe(log))
    x = torch.randn(2, 4)
    kwargs = {} if repeats is None else {"repeats": repeats}   # None: the default, 5

    times = layer_times(model, x, **kwargs)

    assert len(times) == 2 and all(t > 0 for t in times)
    assert len(forwards(log)) == 2 * runs          # one warm-up run, then `repeats` timed
    grads = backwards(log)
    assert len(grads) == 2 * runs                   # each run is a forward *and* a backward
    assert all(torch.equal(g, torch.ones(2, 4)) for g in grads)   # seeded with ones
    # Every run starts from fresh gradients, not from the last run's (zeroed or summed).
    assert all(fresh for *_, fresh in forwards(log))


def test_balance_by_time_passes_repeats_on():
    for kwargs, runs in (({}, 6), ({"repeats": 2}, 3)):
        log = []
        assert balance_by_time(nn.Sequential(Probe(log), Probe(log)), torch.randn(2, 4), 2,
                               **kwargs) == [1, 1]
        assert len(forwards(log)) == 2 * runs


@pytest.mark.parametrize("profile", [
    lambda m, x: layer_times(m, x, repeats=1, device="meta"),
    lambda m, x: balance_by_time(m, x, 2, repeats=1, device="meta"),
    lambda m, x: layer_memory(m, x, device="meta"),
    lambda m, x: balance_by_memory(m, x, 2, device="meta"),
])
def test_profiling_runs_layers_and_sample_on_the_device_asked_for(profile):
    # "meta" stands in for a GPU on a CPU-only machine: a real second device, which the
    # sample (on the CPU) and the layers have to be moved to.
    log = []
    model = nn.Sequential(Probe(log), Probe(log))
    profile(model, torch.randn(2, 4))
    assert forwards(log) and {(x, w) for _, x, w, _ in forwards(log)} == {("meta", "meta")}
    assert model[0].weight.device.type == "cpu"  # the caller's model stays where it was


def test_layer_times_profiles_a_tuple_sample():
    class Mul(nn.Module):
        def forward(self, pair):
            a, b = pair
            return a * b

    log = []
    model = nn.Sequential(Mul(), Probe(log))
    a, b = torch.randn(3, 4, requires_grad=True), torch.randn(3, 4, requires_grad=True)
    times = layer_times(model, (a, b), repeats=1)
    assert len(times) == 2 and all(t > 0 for t in times)
    assert len(forwards(log)) == 2 and len(backwards(log)) == 2
    # Mul saves both of its inputs for the backward: two buffers of 3 x 4 floats.
    assert layer_memory(model, (a, b))[0] == 2 * 3 * 4 * 4


def test_a_layer_whose_output_holds_no_tensor_is_named():
    class Text(nn.Module):
        def forward(self, x):
            return "not a tensor"

    with pytest.raises(TypeError, match="^each layer's output holds no tensor: it must be a "
                                        "Tensor, or tuples, lists or dicts of them; got str$"):
        layer_times(nn.Sequential(nn.ReLU(), Text()), torch.randn(2, 3), repeats=1)
    with pytest.raises(TypeError, match="^sample holds no tensor: .*; got list$"):
        layer_times(nn.Sequential(nn.ReLU()), [1, 2])


# --------------------------------------------------------------------------- layer_memory


class TwoBuffers(nn.Module):
    """Saves two different tensors for its backward: both factors of a product."""

    def forward(self, x):
        return x.exp() * x.sin()


def test_layer_memory_counts_both_buffers_a_layer_saves():
    x = torch.randn(5, 8, requires_grad=True)
    one = x.numel() * 4
    # exp saves its output, sin its input (the layer's input), the product both factors:
    # exp(x), sin(x) and x, three different buffers of one activation each.
    assert layer_memory(nn.Sequential(TwoBuffers()), x) == [3 * one]
    assert layer_memory(nn.Sequential(nn.ReLU(), TwoBuffers()), x) == [one, 3 * one]


def test_layer_memory_counts_a_tied_parameter_once():
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    second.weight = first.weight  # tied weight, separate biases
    x = torch.randn(4, 8)
    act = x.numel() * 4  # each Linear saves its input
    weight, bias = 8 * 8 * 4, 8 * 4
    # Parameters cost twice their bytes (the gradient is as big); the tied one is charged to
    # the first layer that uses it only.
    assert layer_memory(nn.Sequential(first, second), x) == [act + 2 * (weight + bias),
                                                            act + 2 * bias]


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize("caller, call", [
    ("a pipeline", lambda m: group_layers(m, None)),
    ("layer_params", lambda m: layer_params(m)),
    ("layer_times", lambda m: layer_times(m, torch.randn(2, 4))),
    ("layer_memory", lambda m: layer_memory(m, torch.randn(2, 4))),
    ("layer_params", lambda m: balance_by_params(m, 1)),  # the check is layer_params'
    ("balance_by_time", lambda m: balance_by_time(m, torch.randn(2, 4), 1)),
    ("balance_by_memory", lambda m: balance_by_memory(m, torch.randn(2, 4), 1)),
])
def test_not_sequential_error_names_the_call_and_both_fixes(caller, call):
    with pytest.raises(TypeError) as info:
        call(nn.Linear(4, 4))
    assert str(info.value) == (
        f"{caller} needs an nn.Sequential, whose top-level layers are the units a pipeline "
        "can cut between; got Linear. If its forward just calls its children in order, use "
        "nn.Sequential(*model.children()); otherwise list the blocks yourself: "
        "nn.Sequential(embed, *blocks, head)")


def test_empty_costs_message_is_exact():
    with pytest.raises(ValueError) as info:
        optimal_split([], 1)
    assert str(info.value) == "costs is empty: give one cost per layer, at least one layer"


# --------------------------------------------------------------------------- optimal_split


@pytest.mark.parametrize("scale", [1.0, 1e-20, 1e20])
def test_optimal_split_does_not_depend_on_the_unit_of_the_costs(scale):
    # Seconds or nanoseconds, bytes or gigabytes: the same balance. Tiny costs must not be
    # lost to rounding, e.g. by adding them to an offset of 1.
    costs = [1, 1, 2, 3, 1, 1]
    assert optimal_split([c * scale for c in costs], 2) == [3, 3]
    assert optimal_split([c * scale for c in costs], 3) == [3, 1, 2]
    assert optimal_split([c * scale for c in [1, 1, 2]], 2) == [2, 1]


# --------------------------------------------------------------------------- the loss


def test_layer_times_charges_the_loss_and_its_backward_to_the_last_layer():
    log, calls = [], []

    def loss_fn(out, target):
        calls.append(target.device.type)
        return ((out - target) ** 2).mean()

    model = nn.Sequential(Probe(log), Probe(log))
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    times = layer_times(model, x, repeats=2, loss_fn=loss_fn, target=y)
    assert len(times) == 2
    assert calls == ["cpu"] * 3                     # last layer only, every run
    grads = backwards(log)
    assert len(grads) == 6
    # The first layer is seeded with ones; the last gets the loss's gradient.
    assert all(torch.equal(g, torch.ones(2, 4)) for g in grads[:3])
    assert not any(torch.equal(g, torch.ones(2, 4)) for g in grads[3:])

    calls.clear()
    assert balance_by_time(model, x, 2, repeats=1, loss_fn=loss_fn, target=y,
                           device="meta") == [1, 1]
    assert calls == ["meta"] * 2                    # the target goes where the layers run


@pytest.mark.parametrize("kwargs", [{"loss_fn": lambda out, t: out.sum()},
                                    {"target": torch.zeros(2, 4)}])
def test_loss_fn_and_target_come_together(kwargs):
    with pytest.raises(ValueError) as info:
        layer_times(nn.Sequential(nn.ReLU()), torch.randn(2, 4), **kwargs)
    assert str(info.value) == ("give loss_fn and target together (the loss of the last "
                               "layer's output against the micro-batch's target), or neither")
