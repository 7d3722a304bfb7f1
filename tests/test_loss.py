"""Losses whose normaliser varies by micro-batch: ``loss_fn`` returns SumCount(loss_sum,
count), and the step's gradients are those of (sum over all tokens) / (total tokens)."""
import pytest
import torch
from torch import nn

from pipeline_lib import Pipe, SumCount
from conftest import assert_same_grads
from workloads import PAD, padded_batch, token_mean, token_model, token_sum

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]


def unpipelined() -> tuple[nn.Sequential, torch.Tensor]:
    inputs, target = padded_batch()
    model = token_model()
    loss = token_mean(model(inputs), target)
    loss.backward()
    return model, loss.detach()


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_sum_and_count_give_the_token_weighted_loss_and_gradients(schedule, checkpoint):
    reference, expected = unpipelined()
    model = token_model()
    pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=[1, 1, 1, 1])
    loss = pipe.step(*padded_batch(), token_sum, schedule)
    torch.testing.assert_close(loss, expected)
    assert_same_grads(model, reference)


def test_why_the_pair_exists_a_mean_per_micro_batch_is_not_the_token_mean():
    _, expected = unpipelined()
    pipe = Pipe(token_model(), chunks=4, balance=[2, 2])
    assert abs(pipe.step(*padded_batch(), token_mean).item() - expected.item()) > 1e-3


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_gradients_accumulated_before_the_step_are_not_rescaled(schedule):
    """The step divides only the gradients it added: what was already in .grad (steps
    accumulated without zero_grad) stays as it was."""
    reference, _ = unpipelined()
    model = token_model()
    earlier = [torch.randn_like(p) for p in model.parameters()]
    for p, g in zip(model.parameters(), earlier):
        p.grad = g.clone()
    Pipe(model, chunks=4, balance=[1, 1, 1, 1]).step(*padded_batch(), token_sum, schedule)
    for p, g, q in zip(model.parameters(), earlier, reference.parameters()):
        torch.testing.assert_close(p.grad, g + q.grad)


def test_inconsistent_or_empty_counts_are_refused():
    inputs, target = padded_batch()
    model = token_model()
    pipe = Pipe(model, chunks=2, balance=[2, 2])
    calls = []

    def sometimes_pairs(logits, t):
        calls.append(1)
        return token_sum(logits, t) if len(calls) == 1 else token_mean(logits, t)

    with pytest.raises(TypeError, match="SumCount.* for some micro-batches and a single loss"):
        pipe.step(inputs, target, sometimes_pairs)
    with pytest.raises(ValueError, match="add up to 0.0 .* ignore_index"):
        pipe.step(inputs, torch.full_like(target, PAD), token_sum)
    with pytest.raises(ValueError, match="count must be one number that carries no gradient"):
        pipe.step(inputs, target, lambda out, t: SumCount(token_sum(out, t)[0], torch.ones(2)))
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("schedule", ["1f1b", "zb_h1"])
def test_a_plain_pair_is_refused_it_could_be_loss_and_accuracy(schedule):
    """(loss, accuracy) was read as (loss_sum, count): the step returned the loss divided
    by the accuracy summed over micro-batches."""
    inputs, target = padded_batch()
    model = token_model()
    pipe = Pipe(model, chunks=4, balance=[1, 1, 1, 1])

    def loss_and_accuracy(logits, t):
        hits = (logits.argmax(-1) == t)[t != PAD].float().mean()
        return token_mean(logits, t), hits

    for pair in (loss_and_accuracy, lambda out, t: list(token_sum(out, t))):
        with pytest.raises(TypeError, match=r"returned a (tuple|list) of 2 for micro-batch 0; "
                                            r"return a mean-reduced scalar, or "
                                            r"pipeline_lib.SumCount\(loss_sum, count\)"):
            pipe.step(inputs, target, pair, schedule)
    assert all(p.grad is None for p in model.parameters())


def test_a_bool_count_is_refused_like_a_python_bool():
    inputs, target = padded_batch()
    pipe = Pipe(token_model(), chunks=2, balance=[2, 2])
    for flag in (True, torch.tensor(True)):
        with pytest.raises(TypeError, match="count"):
            pipe.step(inputs, target, lambda out, t: SumCount(token_sum(out, t)[0], flag))
    with pytest.raises(TypeError, match="a bool tensor, a flag rather than a count"):
        pipe.step(inputs, target, lambda out, t: SumCount(token_sum(out, t)[0],
                                                          torch.tensor(True)))


@pytest.mark.parametrize("schedule", ["gpipe", "zb_h1"])
def test_a_mean_over_a_micro_batch_of_padding_only_names_sumcount(schedule):
    """The last micro-batch's targets all ignore_index: its mean is 0/0, the step
    returned NaN (with finite gradients) where the batch's mean is finite."""
    inputs, target = padded_batch()
    target[9:] = PAD
    model = token_model()
    expected = token_mean(model(inputs), target)
    assert torch.isfinite(expected)
    pipe = Pipe(model, chunks=4, balance=[1, 1, 1, 1])
    with pytest.raises(ValueError, match=r"mean of nan for micro-batch 3 although the model's "
                                         r"outputs are finite.*ignore_index.*SumCount"):
        pipe.step(inputs, target, token_mean, schedule)
    assert all(p.grad is None for p in model.parameters())
    torch.testing.assert_close(pipe.step(inputs, target, token_sum, schedule),
                               expected.detach())


def test_a_nan_mean_from_nan_outputs_is_passed_on_as_unpipelined():
    """A model that diverged gives NaN unpipelined too: no error to make up."""
    inputs, target = padded_batch()
    model = token_model()
    with torch.no_grad():
        model[-1].bias.fill_(float("nan"))
    loss = Pipe(model, chunks=2, balance=[2, 2]).step(inputs, target, token_mean)
    assert torch.isnan(loss) and torch.isnan(token_mean(model(inputs), target))


def test_a_count_may_be_any_real_number_but_not_negative_or_nan():
    """numpy's integers were refused as "not a number"; a negative or NaN count was
    reported as a batch of padding only."""
    import numpy as np
    inputs, target = padded_batch()
    reference, expected = unpipelined()
    model = token_model()
    pipe = Pipe(model, chunks=2, balance=[2, 2])
    loss = pipe.step(inputs, target, lambda out, t: SumCount(token_sum(out, t)[0],
                                                             np.int64((t != PAD).sum())))
    torch.testing.assert_close(loss, expected)
    assert_same_grads(model, reference)
    for count in (-3.0, float("nan")):
        with pytest.raises(ValueError, match=f"SumCount's count is {count}; a count is how "
                                             f"many elements"):
            pipe.step(inputs, target, lambda out, t: SumCount(token_sum(out, t)[0], count))
