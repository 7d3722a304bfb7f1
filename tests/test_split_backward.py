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


class SharedAround(nn.Module):
    """``c.weight = a.weight`` with ``b`` between: W of the shared weight walks through
    b's node, which W of b's weight also needs."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.c.weight = self.a.weight

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


class Albert(nn.Module):
    """One block applied twice (ALBERT): every weight is used around the others."""

    def __init__(self):
        super().__init__()
        self.block = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))

    def forward(self, x):
        return self.block(self.block(x) + x)


@pytest.mark.parametrize("make", [SharedAround, Albert])
def test_a_weight_used_around_another_weighted_layer(make):
    """Crashed with "backward through the graph a second time": W of one group freed a
    node that another group's W walks through."""
    torch.manual_seed(0)
    model, x = make(), torch.randn(3, 8, requires_grad=True)
    grad = torch.randn(3, 8)
    expected = reference(model, x, grad)
    found, weights = backward_input([model(x)], [grad], [x], list(model.parameters()))
    torch.testing.assert_close(found[0], expected[0])
    weights.run()
    for p, g in zip(model.parameters(), expected[1:]):
        torch.testing.assert_close(p.grad, g)


def random_graph(seed: int):
    """A random small stage: a few weights (some used twice or not at all) and a few
    operations mixing inputs, activations and weights; returns ``run(inputs, weights)``
    giving its outputs (one may repeat, one may not depend on the inputs, one may be a
    weight itself), and how many inputs and weights it takes."""
    g = torch.Generator().manual_seed(seed)

    def pick(n: int) -> int:
        return int(torch.randint(n, (), generator=g))

    n_inputs, n_weights, n_ops = 1 + pick(2), 1 + pick(4), 2 + pick(7)
    ops = []
    for k in range(n_ops):
        ops.append((pick(6), pick(n_inputs + k), pick(n_inputs + k), pick(n_weights)))
    n_outputs = 1 + pick(2)
    outputs = [n_inputs + n_ops - 1] + [pick(n_inputs + n_ops) for _ in range(n_outputs - 1)]
    weight_only = pick(4)                 # 1: an output from a weight alone; 2: a weight

    def run(inputs, weights):
        values = list(inputs)
        for kind, i, j, w in ops:
            a, b, weight = values[i], values[j], weights[w]
            values.append([lambda: a @ weight, lambda: torch.tanh(a) * b,
                           lambda: a + b @ weight, lambda: torch.relu(a @ weight) + b,
                           lambda: a * weight.sum(), lambda: (a @ weight) @ weight][kind]())
        out = [values[k] for k in outputs]
        if weight_only == 1:
            out.append(weights[pick_w] @ weights[pick_w])
        elif weight_only == 2:            # a stage stashing its weight for a later one
            out.append(weights[pick_w])
        return out

    pick_w = pick(n_weights)
    return run, n_inputs, n_weights


@pytest.mark.parametrize("block", range(4))
def test_input_then_weight_equals_the_full_backward_on_random_graphs(block):
    """300 random graphs (75 per block, seeded): I then W gives every input and weight the
    gradient of one plain backward, and never crashes."""
    for seed in range(75 * block, 75 * (block + 1)):
        run, n_inputs, n_weights = random_graph(seed)
        torch.manual_seed(seed)
        inputs = [torch.randn(3, 4, requires_grad=True) for _ in range(n_inputs)]
        weights = [torch.randn(4, 4, requires_grad=True) for _ in range(n_weights)]
        outs = run(inputs, weights)
        grads = [torch.randn_like(o) for o in outs]
        expected = torch.autograd.grad(outs, inputs + weights, grads, allow_unused=True)

        outs = run(inputs, weights)
        found, pending = backward_input(outs, grads, inputs, weights)
        assert all(w.grad is None for w in weights), seed
        pending.run()
        for got, want in zip(found + [w.grad for w in weights], expected):
            if want is None:
                assert got is None or not got.any(), seed
            else:
                torch.testing.assert_close(got, want, msg=lambda m: f"graph {seed}: {m}")


def test_a_weight_that_is_itself_an_output_gets_that_gradient():
    """A stage that stashes a weight it does not use itself for a later stage (a tied
    embedding): the gradient coming back for it was dropped by W, with no error."""
    torch.manual_seed(0)
    lin, x = nn.Linear(4, 4), torch.randn(3, 4, requires_grad=True)
    embedding = nn.Parameter(torch.randn(5, 4))
    g_out, g_embedding = torch.randn(3, 4), torch.randn(5, 4)
    params = [embedding, *lin.parameters()]
    expected = torch.autograd.grad([lin(x), embedding], [x, *params], [g_out, g_embedding])
    found, weights = backward_input([lin(x), embedding], [g_out, g_embedding], [x], params)
    weights.run()
    for got, want in zip(found + [p.grad for p in params], expected):
        torch.testing.assert_close(got, want)


@pytest.mark.parametrize("has_input", [True, False])
def test_a_reentrant_checkpoint_in_a_stage_says_what_to_use(has_input):
    """PyTorch's own message said to call .backward() without inputs. Found by I on the
    input path, or by W (a first stage, whose checkpointed input is a weight)."""
    lin = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True) if has_input else nn.Parameter(torch.randn(3, 4))
    out = torch.utils.checkpoint.checkpoint(lin, x, use_reentrant=True)
    inputs, params = ([x], list(lin.parameters())) if has_input else \
        ([], [x, *lin.parameters()])
    with pytest.raises(RuntimeError, match="use_reentrant=True, whose backward cannot be "
                                           "split.*pass use_reentrant=False"):
        backward_input([out], [torch.ones_like(out)], inputs, params)[1].run()


@pytest.mark.parametrize("schedule", ["zb_h1", "zb_h2", "zb_v", "dualpipe_v",
                                      "interleaved_zero_bubble"])
def test_pipe_with_weights_used_around_other_layers_matches_plain_pytorch(schedule):
    from conftest import assert_same_grads
    from pipeline_lib import Pipe

    def model():
        torch.manual_seed(0)
        return nn.Sequential(SharedAround(), Albert(), SharedAround(), nn.Linear(8, 3))

    torch.manual_seed(1)
    x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
    reference = model()
    expected = nn.functional.cross_entropy(reference(x), y)
    expected.backward()
    pipelined = model()
    loss = Pipe(pipelined, chunks=4, balance=[1, 1, 1, 1]).step(
        x, y, nn.functional.cross_entropy, schedule)
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(pipelined, reference)
