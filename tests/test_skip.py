"""Skip connections: same results as the unpipelined model, sent straight to the popping
stage, and mismatched stash/pop pairs rejected when the Pipe is built."""
import threading

import pytest
import torch
from torch import nn

from pipeline_lib import Namespace, Pipe, SkipError, pop, skippable, stash, verify_skips
from pipeline_lib.threaded import Mailbox
from conftest import assert_same_grads
from workloads import PopMul, Stash

SCHEDULES = ["gpipe", "1f1b", "interleaved_1f1b", "zb_h1"]
CHECKPOINTS = ["always", "except_last", "never"]


def make_model() -> nn.Sequential:
    """Two copies of one skip block, nested (0 -> 6 around 3 -> 4), kept apart by
    namespaces."""
    torch.manual_seed(0)
    outer, inner = Namespace("outer"), Namespace("inner")
    return nn.Sequential(Stash().isolate(outer), nn.Linear(4, 4), nn.Tanh(),
                         Stash().isolate(inner), PopMul().isolate(inner), nn.Tanh(),
                         PopMul().isolate(outer), nn.Linear(4, 3))


def by_hand(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    """The same model written out without stash and pop."""
    outer = model[0].linear(x)
    h = model[1](torch.tanh(outer))
    inner = model[3].linear(torch.tanh(h))
    h = torch.tanh(model[4].linear(torch.tanh(inner)) * inner)
    return model[7](model[6].linear(h) * outer)


def data(rows: int = 10):
    g = torch.Generator().manual_seed(1)
    return torch.randn(rows, 4, generator=g), torch.randint(0, 3, (rows,), generator=g)


def test_skippable_layers_run_in_a_plain_sequential():
    x, _ = data()
    model, twin = make_model(), make_model()
    out, expected = model(x), by_hand(twin, x)
    torch.testing.assert_close(out, expected)
    out.sum().backward()
    expected.sum().backward()
    assert_same_grads(model, twin)


# balance -> stages: [5, 3] keeps the inner skip inside stage 0; [3, 3, 2] sends the outer
# one from stage 0 to stage 2, past stage 1; [2, 2, 2, 2] makes both cross.
BALANCES = {"gpipe": [5, 3], "1f1b": [3, 3, 2], "zb_h1": [3, 3, 2],
            "interleaved_1f1b": [2, 2, 2, 2]}


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_step_matches_unpipelined_model(schedule, checkpoint):
    x, y = data()
    loss_fn = nn.CrossEntropyLoss()
    reference = make_model()
    expected = loss_fn(reference(x), y)
    expected.backward()

    model = make_model()
    pipe = Pipe(model, chunks=4, checkpoint=checkpoint, balance=BALANCES[schedule])
    loss = pipe.step(x, y, loss_fn, schedule=schedule)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-5, atol=1e-6)
    assert_same_grads(model, reference)


@pytest.mark.parametrize("checkpoint", CHECKPOINTS)
@pytest.mark.parametrize("balance", [[5, 3], [3, 3, 2], [2, 2, 2, 2]])
def test_forward_and_autograd_backward_match_unpipelined_model(balance, checkpoint):
    x, y = data()
    reference = make_model()
    expected = reference(x)
    nn.functional.cross_entropy(expected, y).backward()

    model = make_model()
    out = Pipe(model, chunks=3, checkpoint=checkpoint, balance=balance)(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    nn.functional.cross_entropy(out, y).backward()
    assert_same_grads(model, reference)


class MailboxSpy:
    """Records which pipeline thread put and got each skip message."""

    def __init__(self, monkeypatch):
        self.puts, self.gets = {}, {}
        put, get = Mailbox.put, Mailbox.get

        def spy_put(mailbox, key, value):
            self.puts.setdefault(key, []).append(threading.current_thread().name)
            put(mailbox, key, value)

        def spy_get(mailbox, key):
            self.gets.setdefault(key, []).append(threading.current_thread().name)
            return get(mailbox, key)

        monkeypatch.setattr(Mailbox, "put", spy_put)
        monkeypatch.setattr(Mailbox, "get", spy_get)

    def skip_traffic(self, kind: str) -> dict:
        """{micro-batch: (putters, getters)} of the skip messages of ``kind``."""
        return {key[2]: (self.puts[key], self.gets.get(key)) for key in self.puts
                if key[0] == kind}


@pytest.mark.parametrize("run", ["forward", "step"])
def test_skip_goes_straight_to_the_popping_stage(run, monkeypatch):
    spy = MailboxSpy(monkeypatch)
    model = make_model()
    middle_inputs = []
    pipe = Pipe(model, chunks=2, balance=[3, 3, 2])   # outer skip: stage 0 -> stage 2
    pipe.partitions[1].register_forward_pre_hook(lambda _, args: middle_inputs.append(args))
    assert [(r.key[1], r.source, r.target) for r in pipe.skip_routes] == [("skip", 0, 2)]
    x, y = data()
    if run == "forward":
        nn.functional.cross_entropy(pipe(x), y).backward()
    else:
        pipe.step(x, y, nn.CrossEntropyLoss())

    rank0, rank2 = "pipeline-rank0", "pipeline-rank2"
    assert spy.skip_traffic("skip") == {0: ([rank0], [rank2]), 1: ([rank0], [rank2])}
    if run == "step":   # the gradient goes straight back
        assert spy.skip_traffic("skip-grad") == {0: ([rank2], [rank0]),
                                                 1: ([rank2], [rank0])}
    # the middle stage sees only the activation, never the stashed tensor
    assert all(len(args) == 1 and args[0].shape == (5, 4) for args in middle_inputs)


def test_isolated_copies_pair_by_namespace():
    model = make_model()
    layout = verify_skips(model)
    assert sorted(layout.values()) == [(0, 6), (3, 4)]


def layers(*modules):
    return nn.Sequential(*modules)


@skippable(stash=["a", "b"], pop=["c"])
class Many(nn.Module):
    def forward(self, x):
        yield stash("a", x)
        yield stash("b", x)
        c = yield pop("c")
        return x + c


@pytest.mark.parametrize("model,message", [
    (lambda: layers(Stash(), nn.Tanh()),
     r"'skip' is stashed by layer 0 \(Stash\) but never popped"),
    (lambda: layers(nn.Tanh(), PopMul()),
     r"'skip' is popped by layer 1 \(PopMul\) but never stashed"),
    (lambda: layers(PopMul(), Stash()),
     r"'skip' is popped by layer 0 \(PopMul\) before it is stashed by layer 1 \(Stash\)"),
    (lambda: layers(Stash(), Stash(), PopMul()),
     r"'skip' is stashed twice, by layer 0 \(Stash\) and layer 1 \(Stash\); give each "
     r"copy its own namespace: layer.isolate\(Namespace\(\)\)"),
    (lambda: layers(Stash(), PopMul(), PopMul()),
     r"'skip' is popped twice, by layer 1 \(PopMul\) and layer 2 \(PopMul\)"),
    (lambda: layers(nn.Sequential(nn.Tanh(), Stash().isolate(Namespace("block")))),
     r"'skip' in Namespace\('block'\) is stashed by layer 0.1 \(Stash\) but never popped"),
])
def test_mismatched_skips_are_rejected_when_the_pipe_is_built(model, message):
    with pytest.raises(SkipError, match=message):
        Pipe(model(), chunks=2)


def test_every_mismatch_is_reported_at_once():
    with pytest.raises(SkipError) as error:
        verify_skips(layers(Many(), nn.Tanh()))
    lines = str(error.value).splitlines()[1:]
    assert len(lines) == 3 and "'a'" in lines[0] and "'b'" in lines[1] and "'c'" in lines[2]


def test_undeclared_and_malformed_requests_are_clear_errors():
    @skippable(stash=["declared"])
    class Undeclared(nn.Module):
        def forward(self, x):
            yield stash("other", x)
            return x

    with pytest.raises(SkipError, match=r"yielded stash\('other', <tensor>\), but it "
                                        r"declares stash=\['declared'\], pop=\[\]"):
        Undeclared()(torch.zeros(1))
    with pytest.raises(TypeError, match=r"stash\('x', \.\.\.\) needs a tensor, got list"):
        stash("x", [1])
    with pytest.raises(SkipError, match=r"cannot both stash and pop \['x'\]"):
        skippable(stash=["x"], pop=["x"])
    with pytest.raises(SkipError, match=r"cannot isolate \['nope'\]"):
        Stash().isolate(Namespace(), only=["nope"])
    with pytest.raises(SkipError, match=r"pop\('skip'\) found no stashed tensor"):
        nn.Sequential(nn.Tanh(), PopMul())(torch.zeros(2, 4))


def test_isolate_only_some_names():
    ns = Namespace()
    many = Many().isolate(ns, only=["b"])
    assert [many.skip_key(n)[0] is ns for n in ("a", "b", "c")] == [False, True, False]
