"""I then W gives the full backward's gradients, and W does not redo I's work."""
import pytest
import torch
from torch import nn

from pipeline_lib.split_backward import backward_input


class Counted(torch.autograd.Function):
    """Identity whose backward counts its calls: it sits on the path to the input only."""
    calls = 0

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        Counted.calls += 1
        return grad


class Tied(nn.Module):
    """One weight used twice, once below a node that also leads to the other use."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(torch.relu(self.lin(x))) + x * self.lin.weight.sum()


MODELS = {
    "mlp": (lambda: nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 16),
                                  nn.LayerNorm(16), nn.Linear(16, 8)), (4, 16)),
    "transformer": (lambda: nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0,
                                                       batch_first=True), (2, 5, 16)),
    "tied": (Tied, (3, 8)),
}


def reference(model, x, grad):
    out = model(x)
    return torch.autograd.grad(out, [x, *model.parameters()], grad)


@pytest.mark.parametrize("name", MODELS)
def test_input_then_weight_equals_the_full_backward(name):
    make, shape = MODELS[name]
    torch.manual_seed(0)
    model, x = make(), torch.randn(shape, requires_grad=True)
    grad = torch.randn_like(model(x))
    expected = reference(model, x, grad)

    out = model(x)
    found, weights = backward_input([out], [grad], [x], list(model.parameters()))
    torch.testing.assert_close(found[0], expected[0])
    assert all(p.grad is None for p in model.parameters())    # I leaves the weights alone
    weights.run()
    for p, g in zip(model.parameters(), expected[1:]):
        torch.testing.assert_close(p.grad, g)


def test_weight_pass_does_not_walk_the_input_path_again():
    torch.manual_seed(0)
    first, second = nn.Linear(8, 8), nn.Linear(8, 8)
    x = torch.randn(4, 8, requires_grad=True)
    out = second(Counted.apply(torch.relu(first(x))))
    Counted.calls = 0
    _, weights = backward_input([out], [torch.ones_like(out)], [x],
                                [*first.parameters(), *second.parameters()])
    assert Counted.calls == 1
    weights.run()
    assert Counted.calls == 1, "W recomputed an activation gradient that I had computed"
    assert first.weight.grad is not None and second.weight.grad is not None


def test_without_inputs_weight_pass_is_the_whole_backward_and_an_output_may_repeat():
    """A first stage has no input gradient to compute; a tensor sent on and also stashed
    for a later stage is an output twice, and both its gradients count."""
    torch.manual_seed(0)
    lin, x = nn.Linear(4, 4), torch.randn(3, 4)
    g1, g2 = torch.randn(3, 4), torch.randn(3, 4)
    out = lin(x)
    expected = torch.autograd.grad([out, out], list(lin.parameters()), [g1, g2])
    out = lin(x)
    found, weights = backward_input([out, out], [g1, g2], [], list(lin.parameters()))
    assert found == []
    weights.run()
    for p, g in zip(lin.parameters(), expected):
        torch.testing.assert_close(p.grad, g)


def test_weight_pass_accumulates_through_autograd_so_ddp_hooks_fire():
    lin, x = nn.Linear(4, 4), torch.randn(3, 4, requires_grad=True)
    fired = []
    for p in lin.parameters():
        p.register_post_accumulate_grad_hook(lambda p: fired.append(p))
    out = lin(x)
    _, weights = backward_input([out], [torch.ones_like(out)], [x], list(lin.parameters()))
    assert fired == []
    weights.run()
    assert len(fired) == 2
