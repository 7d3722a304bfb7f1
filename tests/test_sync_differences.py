"""The README's two lists of differences, one test per entry, in the README's order.

"Where `pipeline_lib.Pipe` deliberately differs from the old API": each test shows the
old rule on `pipeline_lib.sync.Pipe` and the core's rule on `pipeline_lib.Pipe`.
"Where `pipeline_lib.sync` differs from the old API": each test shows the facade's
behaviour where the old one raised or did otherwise.
"""
import copy

import pytest
import torch
from torch import nn

import pipeline_lib
from pipeline_lib import is_checkpointing
from pipeline_lib.sync import Pipe, balance
from pipeline_lib.sync.batchnorm import DeferredBatchNorm
from pipeline_lib.sync.skip import SkipError, skippable

META, CPU = torch.device("meta"), torch.device("cpu")


def classic(model, *inputs, **kwargs):
    return Pipe(model, **kwargs)(*inputs).local_value()


# -- pipeline_lib.Pipe against the old API ------------------------------------------------

def test_row_stages_from_children():
    a = nn.Linear(1, 1, device="meta")
    b = nn.Sequential(nn.Linear(1, 1), nn.Linear(1, 1)).to("meta")
    c, d = nn.Linear(1, 1), nn.Linear(1, 1)
    model = nn.Sequential(a, b, c, d)
    assert [len(stage) for stage in Pipe(model).partitions] == [3, 1, 1]
    core = pipeline_lib.Pipe(model)
    assert [stage for stage in core.partitions] == [a, b, c, d]
    assert len(pipeline_lib.Pipe(model, balance=[2, 2], devices=[META, CPU]).partitions) == 2


def test_row_a_stage_without_parameters():
    model = nn.Sequential(nn.Linear(1, 1, device="meta"), nn.ReLU())
    assert Pipe(model).devices == [META, CPU]
    assert pipeline_lib.Pipe(model).devices == [META, META]


class Pair(nn.Module):
    def forward(self, a, b):
        return a + b, a * b


class Mix(nn.Module):
    def forward(self, total, product):
        return total - product


def test_row_forward_arguments_and_tuple_outputs():
    a, b = torch.randn(4, 3), torch.randn(4, 3)
    model = nn.Sequential(Pair(), Mix())
    torch.testing.assert_close(classic(model, a, b, chunks=2), a + b - a * b)
    with pytest.raises(TypeError, match="missing 1 required positional argument"):
        pipeline_lib.Pipe(model, chunks=2)((a, b))


class Add(nn.Module):
    def forward(self, x, ws):
        return x + ws[0].sum(0)


class AddRows(nn.Module):
    def forward(self, batch):
        x, ws = batch
        return x + ws[0]


def test_row_what_is_split():
    x, w = torch.randn(6, 3), torch.randn(4, 3)
    torch.testing.assert_close(classic(nn.Sequential(Add()), x, [w], chunks=3),
                               x + w.sum(0))
    torch.testing.assert_close(classic(nn.Sequential(Pair()), torch.ones(3, 1),
                                       torch.ones(6, 1), chunks=3)[1], torch.ones(6, 1))
    y = torch.randn(6, 3)
    torch.testing.assert_close(pipeline_lib.Pipe(nn.Sequential(AddRows()), chunks=3)((x, [y])),
                               x + y)
    with pytest.raises(ValueError, match="disagree on the batch size"):
        pipeline_lib.Pipe(nn.Sequential(AddRows()), chunks=3)((x, [w]))


def test_row_the_output_reference():
    model, x = nn.Sequential(nn.Linear(2, 2)), torch.randn(4, 2)
    rref = Pipe(model, chunks=2)(x)
    assert rref.local_value() is rref.to_here() and hasattr(rref, "backward")
    assert isinstance(pipeline_lib.Pipe(model, chunks=2)(x), torch.Tensor)


class Rows(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(len(x))
        return x


@pytest.mark.parametrize("rows,old,core", [(10, [3, 3, 3, 1], [3, 3, 2, 2]),
                                           (6, [2, 2, 2], [2, 2, 1, 1]),
                                           (2, [1, 1], None)])
def test_row_micro_batch_sizes(rows, old, core):
    x = torch.randn(rows, 2)
    counter = Rows()
    classic(nn.Sequential(counter), x, chunks=4)
    assert counter.seen == old
    counter = Rows()
    if core is None:
        with pytest.raises(ValueError, match="cannot be split into 4 micro-batches"):
            pipeline_lib.Pipe(nn.Sequential(counter), chunks=4)(x)
    else:
        pipeline_lib.Pipe(nn.Sequential(counter), chunks=4)(x)
        assert counter.seen == core


class Count(nn.Module):
    def forward(self, x):
        return x, len(x)


class Flag(nn.Module):
    def forward(self, x):
        return x, "flag"


def test_row_non_tensor_outputs():
    x = torch.randn(5, 2)
    assert classic(nn.Sequential(Count()), x, chunks=3)[1] == [2, 2, 1]
    assert classic(nn.Sequential(Flag()), x, chunks=3)[1] == ["flag"] * 3
    assert pipeline_lib.Pipe(nn.Sequential(Flag()), chunks=3)(x)[1] == "flag"
    with pytest.raises(ValueError, match="cannot tell whether it is a count"):
        pipeline_lib.Pipe(nn.Sequential(Count()), chunks=3)(x)


def test_row_converted_arguments_and_the_empty_model():
    model = nn.Sequential(nn.Linear(1, 1))
    assert Pipe(model, chunks=2.0).chunks == 2
    x = torch.randn(3)
    assert classic(nn.Sequential(), x) is x
    with pytest.raises(ValueError, match="chunks must be a positive integer"):
        pipeline_lib.Pipe(model, chunks=2.0)
    with pytest.raises(ValueError, match="empty"):
        pipeline_lib.Pipe(nn.Sequential())


def test_row_deferred_batch_norm_conversion():
    model = nn.Sequential(nn.BatchNorm1d(3))
    first = Pipe(model, chunks=4, deferred_batch_norm=True)[0]
    assert Pipe(model, chunks=2, deferred_batch_norm=True)[0] is not first
    core_model = nn.Sequential(nn.BatchNorm1d(3))
    core_first = pipeline_lib.Pipe(core_model, chunks=4, deferred_batch_norm=True).partitions[0]
    core_second = pipeline_lib.Pipe(core_model, chunks=2, deferred_batch_norm=True).partitions[0]
    assert core_second is core_first and core_first.chunks == 2
    assert isinstance(first, DeferredBatchNorm)


def test_row_stash_and_pop_of_one_name():
    @skippable(stash=["foo"], pop=["foo"])
    class Both(nn.Module):
        def forward(self, x):
            return x

    with pytest.raises(SkipError, match="both as stashable and as poppable"):
        Pipe(nn.Sequential(Both()))
    with pytest.raises(SkipError, match="cannot both stash and pop"):
        pipeline_lib.skippable(stash=["foo"], pop=["foo"])


def test_row_moving():
    with pytest.raises(TypeError, match="cannot be moved"):
        Pipe(nn.Sequential(nn.Linear(2, 2))).cpu()
    core = pipeline_lib.Pipe(nn.Sequential(nn.Linear(2, 2)))
    assert core.cpu() is core and core.double() is core
    with pytest.raises(TypeError, match="cannot move a Pipe from cpu to meta"):
        core.to("meta")


def test_row_the_input_device():
    model = nn.Sequential(nn.Linear(2, 2, device="meta"))
    with pytest.raises(ValueError, match="first stage's device meta"):
        Pipe(model)(torch.randn(4, 2))
    assert pipeline_lib.Pipe(model, chunks=2)(torch.randn(4, 2)).device == META


def test_row_len_indexing_and_iteration():
    layers = [nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)]
    model = nn.Sequential(nn.Sequential(*layers[:2]), layers[2])
    pipe = Pipe(model)
    assert len(pipe) == 3 and list(pipe) == layers and pipe[1] is layers[1]
    core = pipeline_lib.Pipe(model)
    assert len(core) == 2 and list(core.partitions) == [model[0], model[1]]


def test_row_step():
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    loss = pipeline_lib.Pipe(model, chunks=2).step(torch.randn(4, 2), torch.randn(4, 2),
                                                   nn.MSELoss(), "1f1b")
    assert loss.dim() == 0 and all(p.grad is not None for p in model.parameters())


# -- pipeline_lib.sync against the old API -----------------------------------------------

@pytest.mark.skipif(not torch.distributed.rpc.is_available(),
                    reason="this torch build has no torch.distributed.rpc")
def test_no_rpc_needed_and_the_reference_is_not_an_rpc_rref():
    from torch.distributed import rpc

    assert not rpc.api._is_current_rpc_agent_set()   # the old Pipe raised here
    out = Pipe(nn.Sequential(nn.Linear(2, 2)))(torch.randn(2, 2))
    assert not isinstance(out, rpc.RRef)


def test_an_in_place_layer_after_a_checkpointed_stage_works():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True))
    plain = copy.deepcopy(model)
    x = torch.randn(4, 2)
    classic(model, x, chunks=2, checkpoint="always").sum().backward()
    plain(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, plain[0].weight.grad)


def test_balance_by_time_accepts_gradients_and_leaves_them():
    model = nn.Sequential(nn.Conv2d(3, 3, 1), nn.Conv2d(3, 3, 1))
    sample = torch.rand(1, 3, 8, 8)
    model(sample).norm().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert balance.balance_by_time(2, model, sample, timeout=0, device="cpu") == [1, 1]
    for p, grad in zip(model.parameters(), grads):
        torch.testing.assert_close(p.grad, grad)
    assert not hasattr(balance, "balance_by_size")


class Spy(nn.Module):
    def __init__(self):
        super().__init__()
        self.checkpointed = []

    def forward(self, x):
        self.checkpointed.append(is_checkpointing())
        return x * 1.0


def test_fewer_micro_batches_than_chunks_commit_once_and_leave_the_last_alone():
    torch.manual_seed(0)
    spy, bn = Spy(), nn.BatchNorm1d(3)
    reference = copy.deepcopy(bn)
    pipe = Pipe(nn.Sequential(spy, bn), chunks=4, deferred_batch_norm=True)
    x = torch.randn(6, 3, requires_grad=True)     # torch.chunk: 3 micro-batches
    pipe(x).local_value().sum().backward()
    reference(x)
    assert pipe[1].num_batches_tracked.item() == 1
    torch.testing.assert_close(pipe[1].running_mean, reference.running_mean)
    assert spy.checkpointed[:3] == [True, True, False]


class Doubled(nn.Sequential):
    def forward(self, x):
        return 2 * super().forward(x)


def test_a_sequential_subclass_keeps_its_forward():
    x = torch.randn(4, 2)
    torch.testing.assert_close(classic(nn.Sequential(Doubled(nn.Identity())), x, chunks=2),
                               2 * x)
    plain = Pipe(nn.Sequential(nn.Sequential(nn.Identity(), nn.ReLU())))
    assert len(plain.partitions[0]) == 2
