import itertools
import random
from fractions import Fraction

import numpy as np
import pytest
import torch
from torch import nn

from pipeline_lib import Pipe
from pipeline_lib.partition import (
    balance_by_memory,
    balance_by_params,
    balance_by_time,
    check_balance,
    group_layers,
    layer_memory,
    layer_params,
    layer_times,
    optimal_split,
    stage_costs,
)


def all_balances(layers: int, stages: int):
    """Every way to cut ``layers`` into ``stages`` non-empty runs, in lexicographic order."""
    for cuts in itertools.combinations(range(1, layers), stages - 1):
        bounds = (0, *cuts, layers)
        yield [b - a for a, b in zip(bounds, bounds[1:])]


def exact_bottleneck(costs, balance) -> Fraction:
    bounds = list(itertools.accumulate(balance, initial=0))
    return max(sum(map(Fraction, costs[a:b])) for a, b in zip(bounds, bounds[1:]))


def random_costs(rng: random.Random, layers: int) -> list:
    kind = rng.choice(["small ints", "quarters", "floats", "decimal floats"])
    if kind == "small ints":  # lots of zeros and ties
        return [rng.randint(0, 3) for _ in range(layers)]
    if kind == "quarters":  # floats whose sums are exact, so ties are real ties
        return [rng.randint(0, 6) / 4 for _ in range(layers)]
    if kind == "floats":
        return [rng.choice([0.0, rng.random()]) for _ in range(layers)]
    return [rng.choice([0.0, 0.1, 0.2, 0.3, 0.7]) for _ in range(layers)]  # inexact sums


def sums_are_exact(costs) -> bool:
    return all((4 * c) == int(4 * c) for c in costs)


def is_valid(balance, layers, stages) -> bool:
    return (
        type(balance) is list
        and len(balance) == stages
        and all(type(n) is int and n >= 1 for n in balance)
        and sum(balance) == layers
    )


# --------------------------------------------------------------------------- optimal_split


def test_optimal_split_matches_brute_force():
    rng = random.Random(0)
    for _ in range(600):
        layers = rng.randint(1, 9)
        stages = rng.randint(1, min(5, layers))
        costs = random_costs(rng, layers)

        balance = optimal_split(costs, stages)

        assert is_valid(balance, layers, stages), (costs, stages, balance)
        candidates = list(all_balances(layers, stages))
        best = min(exact_bottleneck(costs, b) for b in candidates)
        # Optimal, up to float rounding in the sums.
        assert exact_bottleneck(costs, balance) <= best * (1 + Fraction(1, 10**12))
        if sums_are_exact(costs):
            # Documented tie-break: the lexicographically smallest optimal balance.
            assert exact_bottleneck(costs, balance) == best, (costs, stages, balance)
            first_optimal = next(b for b in candidates if exact_bottleneck(costs, b) == best)
            assert balance == first_optimal, (costs, stages, balance)


def test_optimal_split_examples():
    assert optimal_split([1, 2, 3, 4, 5], 2) == [3, 2]
    assert optimal_split([5, 1, 1, 1, 1, 1], 2) == [1, 5]
    assert optimal_split([7], 1) == [1]
    assert optimal_split([0, 0, 0, 0], 2) == [1, 3]  # all tie: first stage as small as it can
    assert optimal_split([4, 4, 4, 4], 4) == [1, 1, 1, 1]
    assert optimal_split([0.1, 0.2, 0.3], 2) == [2, 1]  # 0.1 + 0.2 > 0.3 in floats too


def test_stage_costs():
    assert stage_costs([1, 2, 3, 4, 5], [3, 2]) == [6.0, 9.0]
    assert stage_costs([0.1] * 10, [10]) == [1.0]  # fsum: exact, no 0.9999999999999999


# --------------------------------------------------------------------------- params


def test_balance_by_params_unequal_layers():
    model = nn.Sequential(
        nn.Linear(10, 10),  # 110
        nn.Linear(10, 100),  # 1100
        nn.ReLU(),  # 0
        nn.Linear(100, 10),  # 1010
        nn.Linear(10, 10),  # 110
    )
    assert layer_params(model) == [110, 1100, 0, 1010, 110]
    assert balance_by_params(model, 2) == [2, 3]  # 1210 | 1120
    assert balance_by_params(model, 3) == [1, 1, 3]  # 110 | 1100 | 1120
    assert balance_by_params(model, 5) == [1, 1, 1, 1, 1]


def test_shared_parameters_counted_once():
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    second.weight = first.weight  # tied weight, separate biases
    assert layer_params(nn.Sequential(first, nn.ReLU(), second)) == [72, 0, 8]


# --------------------------------------------------------------------------- cutting


def test_a_module_listed_twice_is_refused_everywhere():
    # children() yields a repeated module once, so Pipe(nn.Sequential(lin, lin)) used to
    # compute lin(x) instead of lin(lin(x)), and a balance counted by partition did not fit.
    torch.manual_seed(0)
    lin = nn.Linear(4, 4)
    model = nn.Sequential(lin, nn.ReLU(), lin)
    x = torch.randn(2, 4)
    message = "layers 0 and 2 of the nn.Sequential are the same Linear object"
    for call in (lambda: Pipe(model)(x), lambda: Pipe(model, balance=[2, 1])(x),
                 lambda: group_layers(model, None), lambda: balance_by_params(model, 2),
                 lambda: layer_params(model), lambda: layer_times(model, x),
                 lambda: balance_by_memory(model, x, 2)):
        with pytest.raises(ValueError, match=message) as info:
            call()
        assert "copy.deepcopy(layer)" in str(info.value)
    # Repeats inside one layer are fine: that layer stays whole in one stage.
    inner = nn.Sequential(nn.Sequential(lin, lin), nn.Tanh())
    torch.testing.assert_close(Pipe(inner, chunks=2)(x), inner(x))
    assert layer_params(inner) == [20, 0]


def test_group_layers_cuts_consecutive_layers():
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2), nn.Tanh()]
    stages = group_layers(nn.Sequential(*layers), [1, 3])
    assert [list(stage) for stage in stages] == [layers[:1], layers[1:]]
    assert group_layers(nn.Sequential(*layers), None) == layers


def test_balance_of_numpy_ints_works():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    balance = list(np.array([2, 1]))  # numpy integers, as list(array) gives them
    assert check_balance(balance, 3) == [2, 1] and type(check_balance(balance, 3)[0]) is int
    x = torch.randn(4, 4)
    torch.testing.assert_close(Pipe(model, chunks=2, balance=balance)(x), model(x))
    assert stage_costs([1, 2, 3], (np.int32(1), np.int64(2))) == [1.0, 5.0]


@pytest.mark.parametrize("balance, error, message", [
    ([2, True], TypeError, r"balance\[1\] is True \(bool\): layer counts must be ints"),
    ([1.0, 2], TypeError, r"balance\[0\] is 1.0 \(float\)"),
    ([torch.tensor(1), 2], TypeError, r"\(Tensor\).*\.tolist\(\) converts"),
    (np.array([1, 2]), TypeError, r"must be a list of layer counts.*got ndarray.*tolist"),
    (torch.tensor([1, 2]), TypeError, r"must be a list of layer counts.*got Tensor"),
    ([3, 0], ValueError, r"balance \[3, 0\] has a stage of 0 layers"),
    ([np.int64(1), np.int64(1)], ValueError, r"balance \[1, 1\] sums to 2 but the module has 3"),
])
def test_bad_balance_is_refused_clearly(balance, error, message):
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2))
    for call in (lambda: check_balance(balance, 3), lambda: group_layers(model, balance),
                 lambda: stage_costs([1, 2, 3], balance), lambda: Pipe(model, balance=balance)):
        with pytest.raises(error, match=message):
            call()


# --------------------------------------------------------------------------- time


def test_balance_by_time_isolates_heavy_layer():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.ReLU(), nn.Tanh(), nn.ReLU(), nn.Linear(1024, 1024), nn.ReLU(), nn.Tanh()
    )
    sample = torch.randn(256, 1024)

    # Five repeats: the median then needs three runs of a cheap layer slowed down by
    # other processes before it looks as slow as the Linear (about 20 ms here, several
    # time slices of a busy machine).
    times = layer_times(model, sample, repeats=5)
    assert len(times) == 6 and all(t > 0 for t in times)
    assert times[3] == max(times)

    balance = balance_by_time(model, sample, 3, repeats=5)
    assert is_valid(balance, 6, 3)
    assert balance == [3, 1, 2]  # the big Linear has a stage to itself


def test_layer_times_charges_the_loss_to_the_last_layer():
    """A costly loss (an LM's cross-entropy over its vocabulary) runs on the last stage,
    so with ``loss_fn`` the last layer's time includes it and balance_by_time gives that
    layer a stage of its own. The loss here sleeps 50 ms in forward: a lower bound on
    the measured time that no amount of machine noise can undercut."""
    import time as clock
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 3))
    sample, target = torch.randn(4, 8), torch.tensor([0, 1, 2, 0])
    seen = []

    def slow_loss(output, labels):
        seen.append((tuple(output.shape), labels))
        clock.sleep(0.05)
        return nn.functional.cross_entropy(output, labels)

    times = layer_times(model, sample, repeats=3, loss_fn=slow_loss, target=target)
    assert len(seen) == 1 + 3  # warm-up plus repeats, on the last layer only
    assert all(shape == (4, 3) and torch.equal(labels, target) for shape, labels in seen)
    assert times[-1] >= 0.05 > max(times[:-1])
    assert balance_by_time(model, sample, 2, repeats=3, loss_fn=slow_loss,
                           target=target) == [3, 1]
    with pytest.raises(ValueError, match="give loss_fn and target together"):
        layer_times(model, sample, loss_fn=slow_loss)


def test_profiling_leaves_model_and_sample_untouched():
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4)).eval()
    sample = torch.randn(8, 4, requires_grad=True)
    layer_times(model, sample, repeats=1)
    layer_memory(model, sample)
    assert all(p.grad is None for p in model.parameters())
    assert sample.grad is None
    assert not model.training
    assert model[1].num_batches_tracked.item() == 0


@pytest.mark.parametrize("container", [tuple, list, lambda pair: dict(enumerate(pair))])
def test_nested_activations(container):
    class Split(nn.Module):
        def forward(self, x):
            return container((x[:, :2], x[:, 2:]))

    class Join(nn.Module):
        def forward(self, pair):
            return torch.cat([pair[0], pair[1]], dim=1).relu()

    model = nn.Sequential(nn.Linear(4, 4), Split(), Join())
    assert len(layer_times(model, torch.randn(3, 4), repeats=1)) == 3
    assert is_valid(balance_by_memory(model, torch.randn(3, 4), 2), 3, 2)
    # Join's ReLU saves its output, 3 x 4 floats, whatever container brought its input.
    assert layer_memory(model, torch.randn(3, 4))[2] == 3 * 4 * 4


# --------------------------------------------------------------------------- memory


class Widen(nn.Module):
    """Saves four times as much for backward as a plain ReLU."""

    def forward(self, x):
        return torch.cat([x, x, x, x], dim=1).relu()


class Square(nn.Module):
    def forward(self, x):
        return x * x  # saves x twice: one storage


def test_layer_memory_counts_saved_activations():
    sample = torch.randn(8, 16, requires_grad=True)
    act = sample.numel() * 4  # float32 bytes of one activation
    model = nn.Sequential(nn.Identity(), nn.ReLU(), Square(), Widen())
    assert layer_memory(model, sample) == [0, act, act, 4 * act]


def test_layer_memory_counts_params_and_grads():
    sample = torch.randn(8, 32)
    linear = nn.Linear(32, 32)
    param_bytes = (32 * 32 + 32) * 4
    # Linear saves its input for the weight gradient; the saved weight is not an activation.
    assert layer_memory(nn.Sequential(linear), sample) == [sample.numel() * 4 + 2 * param_bytes]
    linear.requires_grad_(False)  # frozen: no grad, and nothing saved for backward
    assert layer_memory(nn.Sequential(linear), sample) == [param_bytes]


def test_balance_by_memory_gives_heavy_layer_its_own_stage():
    model = nn.Sequential(nn.ReLU(), nn.ReLU(), nn.ReLU(), Widen())
    sample = torch.randn(8, 16, requires_grad=True)
    balance = balance_by_memory(model, sample, 2)
    assert is_valid(balance, 4, 2)
    assert balance == [3, 1]


# --------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "costs, stages, error, message",
    [
        ([], 1, ValueError, "costs is empty"),
        ([1, -2, 3], 2, ValueError, "costs[1] is -2: costs must be non-negative"),
        ([1, float("nan")], 1, ValueError, "must be a finite number"),
        ([1, 2, 3], 0, ValueError, "stages must be at least 1, got 0"),
        ([1, 2, 3], 4, ValueError, "cannot split 3 layers into 4 stages"),
        ([1, 2, 3], 2.0, TypeError, "stages must be an int"),
    ],
)
def test_optimal_split_bad_input(costs, stages, error, message):
    with pytest.raises(error) as info:
        optimal_split(costs, stages)
    assert message in str(info.value)


def test_not_sequential_says_how_to_wrap():
    model = nn.Linear(4, 4)
    for call in (
        lambda: balance_by_params(model, 1),
        lambda: balance_by_time(model, torch.randn(2, 4), 1),
        lambda: balance_by_memory(model, torch.randn(2, 4), 1),
    ):
        with pytest.raises(TypeError) as info:
            call()
        message = str(info.value)
        assert "needs an nn.Sequential" in message and "got Linear" in message
        assert "nn.Sequential(*model.children())" in message


def test_more_stages_than_layers_fails_before_profiling():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        balance_by_time(model, torch.randn(2, 4), 3)
    with pytest.raises(ValueError, match="cannot split 2 layers into 3 stages"):
        balance_by_params(model, 3)


def test_bad_profiling_arguments():
    model = nn.Sequential(nn.ReLU())
    with pytest.raises(ValueError, match="empty nn.Sequential"):
        balance_by_params(nn.Sequential(), 1)
    with pytest.raises(ValueError, match="repeats must be an int of at least 1"):
        layer_times(model, torch.randn(2), repeats=0)
    with pytest.raises(TypeError, match="sample holds no tensor: it must be a Tensor, or"):
        layer_memory(model, [1, 2])
