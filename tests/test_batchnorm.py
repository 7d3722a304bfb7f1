"""Deferred BatchNorm: after a pipelined step, running statistics equal full-batch ones."""
import copy

import pytest
import torch
from torch import nn

from pipeline_lib import DeferredBatchNorm, Pipe, is_recomputing
from pipeline_lib.microbatch import split

CHECKPOINTS = ["always", "except_last", "never"]


def make_model() -> nn.Sequential:
    """Two BatchNorms: 2-D input, then 3-D input with cumulative averaging (momentum None)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6, momentum=0.3), nn.Tanh(),
                         nn.Unflatten(1, (2, 3)), nn.BatchNorm1d(2, momentum=None),
                         nn.Flatten(), nn.Linear(6, 3))


def data(rows: int = 10):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(rows, 5, generator=g) * 3 + 2     # far from BatchNorm's initial stats
    return x, torch.randint(0, 3, (rows,), generator=g)


def record_inputs(model: nn.Sequential) -> dict[int, list[torch.Tensor]]:
    """What each BatchNorm really saw, micro-batch by micro-batch (replays left out)."""
    seen = {}
    for k, layer in enumerate(model):
        if isinstance(layer, nn.modules.batchnorm._BatchNorm):
            seen[k] = []
            layer.register_forward_pre_hook(
                lambda _, args, k=k: None if is_recomputing() else seen[k].append(args[0]))
    return seen


def assert_full_batch_stats(model, initial, seen, steps):
    """Each BatchNorm's statistics are those of a plain BatchNorm given, ``steps`` times,
    all its micro-batches at once."""
    for k, inputs in seen.items():
        plain = copy.deepcopy(initial[k]).train()
        for chunk in torch.chunk(torch.cat(inputs).detach(), steps):
            plain(chunk)
        bn = model[k]
        torch.testing.assert_close(bn.running_mean, plain.running_mean, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(bn.running_var, plain.running_var, rtol=1e-5, atol=1e-6)
        assert bn.num_batches_tracked.item() == plain.num_batches_tracked.item() == steps


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("chunks", [1, 3, 4])
def test_step_updates_running_stats_once_per_mini_batch(chunks, checkpoint):
    x, y = data()
    model = make_model()
    initial = copy.deepcopy(model)
    pipe = Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=[3, 4],
                deferred_batch_norm=True)
    seen = record_inputs(model)
    for _ in range(2):   # two steps: momentum compounds, num_batches_tracked counts
        pipe.step(x, y, nn.CrossEntropyLoss(), schedule="1f1b")
    assert all(len(inputs) == 2 * chunks for inputs in seen.values())
    assert_full_batch_stats(model, initial, seen, steps=2)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("chunks", [2, 5])
def test_forward_and_backward_update_running_stats_once(chunks, checkpoint):
    x, y = data()
    model = make_model()
    initial = copy.deepcopy(model)
    pipe = Pipe(model, chunks=chunks, checkpoint=checkpoint, balance=[2, 5],
                deferred_batch_norm=True)
    seen = record_inputs(model)
    for _ in range(2):
        out = pipe(x)
        nn.functional.cross_entropy(out, y).backward()   # recomputes checkpointed stages
    assert_full_batch_stats(model, initial, seen, steps=2)

    # the first BatchNorm's input does not depend on micro-batching: its statistics are
    # those of the unpipelined model; outputs are normalised per micro-batch, as always
    reference = copy.deepcopy(initial)
    expected = torch.cat([reference(part) for part in split(x, chunks)])
    full_batch = copy.deepcopy(initial)
    full_batch(x)
    full_batch(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[1].running_mean, full_batch[1].running_mean)
    torch.testing.assert_close(model[1].running_var, full_batch[1].running_var)


def test_without_deferral_running_stats_follow_micro_batches():
    """Why the option exists: plain BatchNorm takes one momentum step per micro-batch,
    drifting from the full-batch statistics."""
    x, y = data()
    chunks = 4
    full_batch = make_model()
    full_batch(x)
    model = make_model()
    Pipe(model, chunks=chunks, checkpoint="never", balance=[3, 4]).step(
        x, y, nn.CrossEntropyLoss())
    assert model[1].num_batches_tracked.item() == chunks
    assert not torch.allclose(model[1].running_mean, full_batch[1].running_mean, rtol=1e-3)
    assert not torch.allclose(model[1].running_var, full_batch[1].running_var, rtol=1e-3)


def running_stats(model: nn.Sequential) -> list[torch.Tensor]:
    return [buffer.clone() for layer in model
            if isinstance(layer, nn.modules.batchnorm._BatchNorm)
            for buffer in (layer.running_mean, layer.running_var, layer.num_batches_tracked)]


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1"])
def test_a_replay_leaves_plain_batchnorm_statistics_alone(schedule, checkpoint):
    """Plain BatchNorm took one more momentum step for each recomputed micro-batch: 7 per
    4-micro-batch step under except_last, 8 under always, instead of 4."""
    x, y = data()
    expected = make_model()
    Pipe(expected, chunks=4, checkpoint="never", balance=[3, 4]).step(
        x, y, nn.CrossEntropyLoss(), schedule)
    model = make_model()
    pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=[3, 4])
    pipe.step(x, y, nn.CrossEntropyLoss(), schedule)
    for got, want in zip(running_stats(model), running_stats(expected)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    assert model[1].num_batches_tracked.item() == 4
    nn.functional.cross_entropy(pipe(x), y).backward()     # pipe(x) replays in autograd
    expected_pipe = Pipe(expected, chunks=4, checkpoint="never", balance=[3, 4])
    nn.functional.cross_entropy(expected_pipe(x), y).backward()
    for got, want in zip(running_stats(model), running_stats(expected)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_conversion_keeps_parameters_state_and_eval_behaviour():
    x, y = data()
    model = make_model()
    weight, state_keys = model[1].weight, set(model.state_dict())
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)   # built before the Pipe
    pipe = Pipe(model, chunks=2, balance=[3, 4], deferred_batch_norm=True)
    assert isinstance(model[1], DeferredBatchNorm) and isinstance(model[4], DeferredBatchNorm)
    assert model[1].weight is weight and set(model.state_dict()) == state_keys
    pipe.step(x, y, nn.CrossEntropyLoss())
    optimizer.step()   # the optimizer still updates the BatchNorm weight the Pipe uses

    plain = make_model()
    plain.load_state_dict(model.state_dict())
    pipe.eval()
    plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), plain(x))
    assert not torch.equal(model[1].weight, make_model()[1].weight)


class FailOnCall(nn.Module):
    def __init__(self, call: int):
        super().__init__()
        self.call, self.calls = call, 0

    def forward(self, x):
        self.calls += 1
        if self.calls == self.call:
            raise RuntimeError("injected failure")
        return x


def as_plain(bn: DeferredBatchNorm) -> nn.BatchNorm1d:
    """A plain BatchNorm in ``bn``'s current state."""
    plain = nn.BatchNorm1d(bn.num_features, momentum=bn.momentum)
    plain.load_state_dict(bn.state_dict())
    return plain


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_failed_step_does_not_shift_the_next_steps_commits(checkpoint):
    """The old code kept the failed step's micro-batches: the next step committed after
    its first few micro-batches, and every later commit fell at the wrong boundary."""
    x, y = data()
    model = nn.Sequential(*make_model(), FailOnCall(2))   # fails on micro-batch 1
    pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=[3, 5],
                deferred_batch_norm=True)
    with pytest.raises(RuntimeError, match="injected failure"):
        pipe.step(x, y, nn.CrossEntropyLoss(), schedule="gpipe")
    plain = {k: as_plain(model[k]) for k in (1, 4)}   # where the failed step left them
    seen = record_inputs(model)
    for _ in range(2):
        pipe.step(x, y, nn.CrossEntropyLoss(), schedule="gpipe")
    for k, inputs in seen.items():
        for chunk in torch.chunk(torch.cat(inputs).detach(), 2):
            plain[k](chunk)
        torch.testing.assert_close(model[k].running_mean, plain[k].running_mean)
        torch.testing.assert_close(model[k].running_var, plain[k].running_var)
        assert model[k].num_batches_tracked.item() == plain[k].num_batches_tracked.item()
