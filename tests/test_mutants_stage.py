"""stage.py: StageRunners driven by hand, one action at a time, without an executor.

A few lines below play the executor (route activations, gradients and skip tensors between
the runners in the order the simulator gives), so these tests pin what a runner does for
each action: the same loss and gradients as the unpipelined model for every schedule and
checkpoint mode, the input gradients it hands back (shaped like its input, zeros where an
input was unused), split backwards, skip connections, random streams, and its errors.

Written against the mutants `make mutants` found alive (see mutants-equivalent.md).
"""
import pytest
import torch
from torch import nn

from pipeline_lib.checkpoint import is_checkpointing, is_recomputing
from pipeline_lib.loss import SumCount
from pipeline_lib.microbatch import loss_weights, split
from pipeline_lib.partition import group_layers
from pipeline_lib.rng import microbatch_rng, seed_for
from pipeline_lib.schedules import build
from pipeline_lib.skip import pop, skip_routes, skippable, stash
from pipeline_lib.stage import StageRunner, detach, detach_as_leaf
from pipeline_lib.timeline import simulate
from conftest import assert_same_grads

CPU = torch.device("cpu")


def drive(stages, schedule, x, y, loss_fn, checkpoint="never", step_seed=0, routes=()):
    """Run ``schedule`` on one StageRunner per stage; return the loss and the runners."""
    m, n = schedule.microbatches, len(stages)
    micro_x, micro_y = split(x, m), split(y, m)
    runners = [StageRunner(s, stage, CPU, checkpoint, m, step_seed,
                           loss_fn=loss_fn if s == n - 1 else None,
                           loss_weights=loss_weights(micro_y) if s == n - 1 else None,
                           first=s == 0) for s, stage in enumerate(stages)]
    acts, grads, skip_acts, skip_grads = {}, {}, {}, {}
    events = sorted(simulate(schedule).events, key=lambda e: (e.start, e.rank))
    for action in (e.action for e in events):
        s, i, runner = action.stage, action.microbatch, runners[action.stage]
        if action.kind == "F":
            into = {r.key: skip_acts[r.key, i] for r in routes if r.target == s}
            out = runner.forward(i, micro_x[i] if s == 0 else acts.pop((s, i)),
                                 micro_y[i] if s == n - 1 else None, skips=into)
            skip_acts.update({(key, i): t for key, t in runner.take_stashed(i).items()})
            acts[s + 1, i] = out
        elif action.kind == "W":
            runner.backward_weight(i)
        else:
            back = runner.backward if action.kind == "B" else runner.backward_input
            given = {r.key: skip_grads[r.key, i] for r in routes if r.source == s}
            grad_in = back(i, grads.pop((s, i), None), skip_grads=given)
            skip_grads.update({(key, i): g for key, g in runner.take_skip_grads(i).items()})
            if s > 0:
                grads[s - 1, i] = grad_in
            else:
                assert grad_in is None  # the first stage's input is data: no gradient
    return torch.stack([runners[-1].losses[i][0] for i in range(m)]).sum(), runners


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 6), nn.ReLU(),
                         nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3), nn.LogSoftmax(-1))


def data(rows=6):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 5, generator=g), torch.randint(0, 3, (rows,), generator=g)


def cases():
    for name in ("gpipe", "1f1b", "zb_h1", "interleaved_1f1b"):
        for checkpoint in ("always", "except_last", "never"):
            yield name, checkpoint


@pytest.mark.parametrize("name, checkpoint", list(cases()))
def test_runners_train_like_the_unpipelined_model(name, checkpoint):
    x, y = data()
    loss_fn = nn.NLLLoss()
    reference = make_model()
    expected = loss_fn(reference(x), y)
    expected.backward()

    model = make_model()
    interleaved = name == "interleaved_1f1b"
    schedule = build(name, 2 if interleaved else 4, 6 if interleaved else 3)  # in the test
    balance = [2, 2, 2, 2]
    loss, runners = drive(group_layers(model, balance), schedule, x, y, loss_fn, checkpoint)

    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(model, reference)
    for runner in runners:  # every micro-batch's graph, input and target were let go
        assert not (runner.inputs or runner.outputs or runner.targets or runner.pending_weight)


def test_the_last_stage_returns_each_microbatch_share_of_the_loss_detached():
    x, y = data(rows=5)  # uneven: 3 + 2 rows
    loss_fn = nn.NLLLoss()
    model = make_model()
    loss, runners = drive([model], build("gpipe", 1, 2), x, y, loss_fn)
    last = runners[0]
    parts = [loss_fn(model(xi), yi) for xi, yi in zip(split(x, 2), split(y, 2))]
    for i, (part, weight) in enumerate(zip(parts, [3 / 5, 2 / 5])):
        value, count, _ = last.losses[i]
        torch.testing.assert_close(value, (part * weight).detach())
        assert not value.requires_grad and count is None  # a mean: weighted, no count
    torch.testing.assert_close(loss, loss_fn(model(x), y).detach())


def test_split_backward_gives_the_input_gradient_first_and_the_weights_at_w():
    torch.manual_seed(0)
    first, second = nn.Linear(3, 3), nn.Linear(3, 2)
    x = torch.randn(4, 3)
    runner = StageRunner(1, second, CPU, "never", 1, 0, loss_fn=lambda out, t: out.sum(),
                         loss_weights=[1.0])
    h = first(x).detach()
    assert runner.forward(0, h, None).requires_grad is False   # what goes on is detached
    grad_h = runner.backward_input(0)
    assert second.weight.grad is None  # I leaves the weights to W
    torch.testing.assert_close(grad_h, torch.ones(4, 2) @ second.weight.detach())
    runner.backward_weight(0)
    torch.testing.assert_close(second.weight.grad, torch.ones(2, 4) @ h)
    torch.testing.assert_close(second.bias.grad, torch.full((2,), 4.0))


def test_frozen_stage_passes_input_gradients_and_its_w_does_nothing():
    lin = nn.Linear(3, 3).requires_grad_(False)
    runner = StageRunner(1, lin, CPU, "never", 1, 0)
    x = torch.randn(2, 3)
    runner.forward(0, x)
    grad = torch.randn(2, 3)
    torch.testing.assert_close(runner.backward_input(0, grad), grad @ lin.weight)
    runner.backward_weight(0)  # no parameter wants a gradient: nothing to do, no error
    assert lin.weight.grad is None


class Pair(nn.Module):
    """Sends on a float activation and an integer tensor (token ids) beside it."""

    def forward(self, x):
        return x * 2, torch.arange(x.size(0))


class UseFirst(nn.Module):
    """Uses only the float half of its input pair and ignores the ids."""

    def forward(self, pair):
        h, ids = pair
        assert not ids.requires_grad and not ids.is_floating_point()
        return h.sum(1)


class UseNeither(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, pair):
        return self.scale * torch.ones(pair[0].size(0))


@pytest.mark.parametrize("method", ["backward", "backward_input"])
def test_input_gradient_is_shaped_like_a_tuple_input(method):
    runner = StageRunner(1, UseFirst(), CPU, "never", 1, 0)
    h = torch.randn(3, 4)
    runner.forward(0, (h, torch.arange(3)))
    grad_in = getattr(runner, method)(0, torch.ones(3))
    assert isinstance(grad_in, tuple) and len(grad_in) == 2
    torch.testing.assert_close(grad_in[0], torch.ones(3, 4))
    assert grad_in[1] is None  # integer tensors take no gradient

    # An input the stage does not use gets None: no gradient flows back through it.
    runner = StageRunner(1, UseNeither(), CPU, "never", 1, 0)
    runner.forward(0, (h, torch.arange(3)))
    assert getattr(runner, method)(0, torch.ones(3)) == (None, None)


class FloatPair(nn.Module):
    """Sends on two float activations, both of which the next stage uses."""

    def forward(self, x):
        return x * 2, x.tanh()


class UseBoth(nn.Module):
    def forward(self, pair):
        return (pair[0] * pair[1]).sum(1)


@pytest.mark.parametrize("layers", [
    pytest.param(lambda: (FloatPair(), UseBoth()), id="float-pair"),
    pytest.param(lambda: (Pair(), UseFirst()), id="ids-beside-floats"),
])
def test_tuple_activations_cross_stages_and_train_like_the_model(layers):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), *layers())
    x, y = torch.randn(4, 4), torch.randn(4)
    loss_fn = nn.MSELoss()
    expected = loss_fn(model(x), y)
    expected.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    for name in ("1f1b", "zb_h1"):
        model.zero_grad()
        loss, _ = drive(group_layers(model, [1, 1, 1]), build(name, 3, 2), x, y, loss_fn,
                        checkpoint="always")
        torch.testing.assert_close(loss, expected.detach())
        for p, g in zip(model.parameters(), grads):
            torch.testing.assert_close(p.grad, g)


def test_boundary_helpers():
    x, ids = torch.randn(2, requires_grad=True), torch.arange(2)
    leaf = detach_as_leaf(x * 2)
    assert leaf.is_leaf and leaf.requires_grad
    a, b, flag = detach_as_leaf((x * 2, ids, "flag"))
    assert a.is_leaf and a.requires_grad and not b.requires_grad and flag == "flag"
    out = detach((x * 2, (x * 3,), 5))
    assert not out[0].requires_grad and out[0].grad_fn is None
    assert not out[1][0].requires_grad and out[2] == 5
    assert detach("flag") == "flag"


# --------------------------------------------------------------------------- checkpointing


class Flags(nn.Module):
    """Logs, per forward, whether it is the checkpointed forward or the recomputation."""

    def __init__(self, log):
        super().__init__()
        self.log, self.lin = log, nn.Linear(3, 3)

    def forward(self, x):
        self.log.append((is_checkpointing(), is_recomputing(), torch.is_grad_enabled()))
        return self.lin(x)


@pytest.mark.parametrize("checkpoint, expected", [
    ("always", [(True, False, False), (True, False, False),
                (False, True, True), (False, True, True)]),
    ("except_last", [(True, False, False), (False, False, True), (False, True, True)]),
    ("never", [(False, False, True), (False, False, True)]),
])
def test_checkpointed_microbatches_run_without_graph_then_recompute(checkpoint, expected):
    log = []
    runner = StageRunner(1, Flags(log), CPU, checkpoint, 2, 0)
    for i in range(2):
        runner.forward(i, torch.randn(2, 3))
    kept = {0, 1} - {i for i in range(2)
                     if expected[i][0]}  # graphs kept only for the unchecked ones
    assert set(runner.outputs) == kept
    for i in range(2):
        runner.backward(i, torch.ones(2, 3))
    assert log == expected


# --------------------------------------------------------------------------- random streams


def test_each_microbatch_draws_from_its_own_stream_and_replays_it():
    dropout = nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.5))
    x = torch.randn(4, 8)
    for checkpoint in ("never", "always"):
        runner = StageRunner(2, dropout, CPU, checkpoint, 2, step_seed=7)
        outs = [runner.forward(i, x) for i in range(2)]
        for i, out in enumerate(outs):
            with microbatch_rng(seed_for(7, 2, i), CPU):
                torch.testing.assert_close(out, dropout(x))
        grads = [runner.backward(i, torch.ones(4, 8)) for i in range(2)]
        # the recomputed forward drew the same mask: dropped units pass no gradient
        for out, grad in zip(outs, grads):
            assert torch.equal(out == 0, (grad.abs().sum(0, keepdim=True) == 0).expand_as(out)
                               | (out == 0))


# --------------------------------------------------------------------------- skips


@skippable(stash=["skip"])
class Save(nn.Module):
    def forward(self, x):
        yield stash("skip", x)
        return x


@skippable(pop=["skip"])
class Add(nn.Module):
    def forward(self, x):
        skip = yield pop("skip")
        return x + skip


def skip_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 4), Save(), nn.Tanh(), nn.Linear(4, 4), Add(),
                         nn.Linear(4, 2))


@pytest.mark.parametrize("name", ["gpipe", "zb_h1"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_skip_connections_across_stages_train_like_the_model(name, checkpoint):
    x, y = torch.randn(4, 4), torch.randn(4, 2)
    loss_fn = nn.MSELoss()
    reference = skip_model()
    expected = loss_fn(reference(x), y)
    expected.backward()

    model = skip_model()
    balance = [2, 2, 2]  # stashed on stage 0, popped on stage 2: the skip jumps stage 1
    stage_of_layer = [s for s, count in enumerate(balance) for _ in range(count)]
    routes = skip_routes(model, stage_of_layer)
    assert [(r.source, r.target) for r in routes] == [(0, 2)]
    loss, runners = drive(group_layers(model, balance), build(name, 3, 2), x, y, loss_fn,
                          checkpoint, routes=routes)
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(model, reference)
    assert not any(r.skips_in or r.skips_out or r.skip_grads_out for r in runners)


def test_a_stash_whose_gradient_was_not_given_is_named():
    runner = StageRunner(0, nn.Sequential(nn.Linear(4, 4), Save()), CPU, "never", 1, 0,
                         first=True)
    runner.forward(0, torch.randn(2, 4))
    assert set(runner.take_stashed(0)) and runner.take_stashed(0) == {}  # taken once
    with pytest.raises(RuntimeError, match=r"^stage 0: micro-batch 0 stashed 'skip' but "
                                           r"its gradient was not given; pass backward\(\.\.\., "
                                           r"skip_grads=\.\.\.\) what take_skip_grads returned"
                                           r" on the stage that popped it$"):
        runner.backward(0, torch.ones(2, 4))


def test_a_popped_tensor_without_gradient_sends_back_none():
    runner = StageRunner(1, nn.Sequential(Add()), CPU, "never", 1, 0)
    key = Add().skip_key("skip")
    runner.forward(0, torch.randn(2, 4), skips={key: torch.arange(8.0).reshape(2, 4).int()})
    runner.backward(0, torch.ones(2, 4))
    assert runner.take_skip_grads(0) == {key: None}
    assert runner.take_skip_grads(0) == {}


def test_wrong_number_of_gradients_is_refused():
    runner = StageRunner(1, nn.Linear(3, 3), CPU, "never", 1, 0)
    runner.forward(0, torch.randn(2, 3))
    with pytest.raises(RuntimeError, match="^stage 1: got 2 gradients for the 1 leaves of "
                                           "micro-batch 0's output$"):
        runner.backward(0, (torch.ones(2, 3), torch.ones(2, 3)))


# --------------------------------------------------------------------------- what a stage owns


class AddOneInPlace(nn.Module):
    """Changes its input in place, and not idempotently: a replay that saw the already
    changed input would add 2."""

    def forward(self, x):
        return x.add_(1)


@pytest.mark.parametrize("checkpoint", ["never", "always"])
@pytest.mark.parametrize("first", [False, True])
def test_an_in_place_first_layer_computes_what_the_model_computes(checkpoint, first):
    torch.manual_seed(0)
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3)
    expected_out = lin(x + 1)
    expected_out.sum().backward()
    expected_grad = lin.weight.grad.clone()
    lin.zero_grad()

    runner = StageRunner(1, nn.Sequential(AddOneInPlace(), lin), CPU, checkpoint, 1, 0,
                         first=first)
    given = x.clone()
    torch.testing.assert_close(runner.forward(0, given), expected_out.detach())
    grad_in = runner.backward(0, torch.ones(4, 2))
    torch.testing.assert_close(lin.weight.grad, expected_grad)  # the replay saw x, not x + 1
    if not first:
        torch.testing.assert_close(grad_in, torch.ones(4, 2) @ lin.weight.detach())


def test_the_first_stage_uses_its_input_as_given():
    # No detach on the first stage: a caller's tensor that requires grad gets its gradient.
    lin = nn.Linear(3, 2)
    x = torch.randn(4, 3, requires_grad=True)
    runner = StageRunner(0, lin, CPU, "never", 1, 0, first=True)
    runner.forward(0, x)
    assert runner.backward(0, torch.ones(4, 2)) is None
    torch.testing.assert_close(x.grad, torch.ones(4, 2) @ lin.weight.detach())


class WithConstant(nn.Module):
    """Sends a float tensor that depends on nothing (no graph) beside its activation."""

    def forward(self, x):
        return x * 2, torch.ones(x.size(0), 1)


class UsePair(nn.Module):
    def forward(self, pair):
        return pair[0] * pair[1]


@pytest.mark.parametrize("method", ["backward", "backward_input"])
def test_an_output_without_graph_takes_no_gradient(method):
    # The next stage makes every float input a leaf needing grad, so it sends a gradient
    # for the constant too; the constant has no graph to take it.
    runner = StageRunner(1, WithConstant(), CPU, "never", 1, 0)
    x = torch.randn(2, 3)
    h, ones = runner.forward(0, x)
    grad = getattr(runner, method)(0, (torch.ones(2, 3), torch.full((2, 1), 5.0)))
    torch.testing.assert_close(grad, torch.full((2, 3), 2.0))
    assert torch.equal(ones, torch.ones(2, 1))


# --------------------------------------------------------------------------- losses


def test_a_sum_and_count_loss_is_kept_unweighted():
    lin = nn.Linear(3, 1)
    x, y = torch.randn(4, 3), torch.randn(4, 1)

    def loss_fn(out, target):
        return SumCount(((out - target) ** 2).sum(), 4)

    runner = StageRunner(0, lin, CPU, "never", 2, 0, loss_fn=loss_fn,
                         loss_weights=[0.25, 0.75], first=True)
    out = runner.forward(1, x, y)
    value, count, _ = runner.losses[1]
    expected = ((lin(x) - y) ** 2).sum().detach()
    torch.testing.assert_close(value, expected)  # not scaled by 0.75
    torch.testing.assert_close(out, expected)
    assert count == 4


def test_loss_errors_name_the_microbatch():
    lin = nn.Linear(3, 2)
    runner = StageRunner(0, lin, CPU, "never", 2, 0, loss_fn=lambda out, t: out,
                         loss_weights=[0.5, 0.5], first=True)
    with pytest.raises(ValueError, match="^loss_fn returned a tensor of shape \\[4, 2\\] "
                                         "for micro-batch 1, a loss of shape"):
        runner.forward(1, torch.randn(4, 3), None)
    detached = StageRunner(0, lin, CPU, "never", 1, 0, first=True, loss_weights=[1.0],
                           loss_fn=lambda out, t: out.sum().detach())
    with pytest.raises(RuntimeError, match="for micro-batch 0, a loss that does not "
                                           "require grad"):
        detached.forward(0, torch.randn(4, 3), None)


def test_a_second_backward_of_a_microbatch_is_refused():
    runner = StageRunner(2, nn.Linear(3, 3), CPU, "never", 1, 0)
    runner.forward(0, torch.randn(2, 3))
    runner.backward(0, torch.ones(2, 3))
    with pytest.raises(RuntimeError) as info:
        runner.backward(0, torch.ones(2, 3))
    assert str(info.value) == ("stage 2: the backward of micro-batch 0 ran twice, or without "
                               "its forward (a graph from pipe(x) can be backpropagated once: "
                               "no retain_graph)")


# --------------------------------------------------------------------------- skips: edge cases


@skippable(stash=["nothing", "skip"])
class SaveNoneThenTensor(nn.Module):
    def forward(self, x):
        yield stash("nothing", None)
        yield stash("skip", x * 3)
        return x


@pytest.mark.parametrize("method", ["backward", "backward_input"])
def test_a_stashed_none_does_not_hide_the_stashed_tensors_after_it(method):
    stage = nn.Sequential(nn.Linear(2, 2), SaveNoneThenTensor())
    runner = StageRunner(1, stage, CPU, "never", 1, 0)
    x = torch.randn(3, 2)
    runner.forward(0, x)
    keys = {key[1]: key for key in runner.take_stashed(0)}
    assert set(keys) == {"nothing", "skip"}
    skip_grad = torch.ones(3, 2)
    grad = getattr(runner, method)(0, torch.zeros(3, 2),
                                   skip_grads={keys["nothing"]: None, keys["skip"]: skip_grad})
    # only the skip's gradient reaches the input: 3 * (ones @ W)
    torch.testing.assert_close(grad, 3 * skip_grad @ stage[0].weight.detach())


@pytest.mark.parametrize("method", ["backward", "backward_input"])
def test_a_stash_the_popper_did_not_differentiate_sends_nothing_back(method):
    stage = nn.Sequential(nn.Linear(2, 2), Save())
    runner = StageRunner(1, stage, CPU, "never", 1, 0)
    runner.forward(0, torch.randn(3, 2))
    (key,) = runner.take_stashed(0)
    grad = getattr(runner, method)(0, torch.ones(3, 2), skip_grads={key: None})
    torch.testing.assert_close(grad, torch.ones(3, 2) @ stage[0].weight.detach())


@pytest.mark.parametrize("method", ["backward", "backward_input"])
def test_an_integer_tensor_popped_takes_no_gradient(method):
    runner = StageRunner(1, nn.Sequential(nn.Linear(4, 4), Add()), CPU, "never", 1, 0)
    key = Add().skip_key("skip")
    x = torch.randn(2, 4)
    runner.forward(0, x, skips={key: torch.ones(2, 4, dtype=torch.int64)})
    grad = getattr(runner, method)(0, torch.ones(2, 4))
    torch.testing.assert_close(grad, torch.ones(2, 4) @ runner.module[0].weight.detach())
    assert runner.take_skip_grads(0) == {key: None}
