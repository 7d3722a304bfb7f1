"""The classic tutorials' and API documentation's `Pipe` code, with only the import
changed, checked against the same model unpipelined.

* Seed 000, "Training Transformer models using Pipeline Parallelism": test_sync.py runs
  its training and evaluation lines (run_tutorial).
* Seed 003, "... using Distributed Data Parallel and Pipeline Parallelism": each process
  wraps its own ``Pipe(..., checkpoint="never")`` in ``DistributedDataParallel`` and
  clips its gradients locally (here 2 CPU processes on gloo instead of 2 × 2 GPUs).
* Seed 004, the Pipe API documentation (PyTorch 2.3): the ``Pipe`` example, the
  ``WithDevice`` example, the skip-connection examples (``@skippable``, ``stash``,
  ``pop``, ``Namespace``/``isolate``, ``verify_skippables``) and
  ``deferred_batch_norm=True``. Their devices (cuda:0, cuda:1) are the CPU here.
"""
import copy

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from conftest import assert_same_grads
from pipeline_lib.sync import Pipe, WithDevice
from pipeline_lib.sync.skip import Namespace, pop, skippable, stash, verify_skippables
from test_sync import BPTT, NTOKENS, batchify, get_batch, tutorial_module_list

# -- seed 003: Pipe inside DistributedDataParallel, one per process -------------------------

WORLD_SIZE, STEPS, LR = 2, 2, 0.5


def rank_data(rank: int) -> torch.Tensor:
    """Each process trains on its own share of the data, as seed 003's did."""
    tokens = torch.randint(NTOKENS, (1200,), generator=torch.Generator().manual_seed(1))
    share = len(tokens) // WORLD_SIZE
    return batchify(tokens[rank * share:(rank + 1) * share], 20)


def ddp_worker(rank: int, init_file: str) -> None:
    from torch.nn.parallel import DistributedDataParallel

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=WORLD_SIZE)
    try:
        module_list = tutorial_module_list()
        plain = copy.deepcopy(nn.Sequential(*module_list))

        # seed 003's lines
        chunks = 8
        model = Pipe(torch.nn.Sequential(*module_list), chunks=chunks, checkpoint="never")
        model = DistributedDataParallel(model)
        criterion = nn.CrossEntropyLoss()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        model.train()
        train_data = rank_data(rank)
        for i in range(0, STEPS * BPTT, BPTT):
            data, targets = get_batch(train_data, i)
            optimizer.zero_grad()
            output = model(data).local_value()
            loss = criterion(output.view(-1, NTOKENS), targets)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()

        # the same steps unpipelined: gradients averaged over the ranks' batches
        plain_optimizer = torch.optim.SGD(plain.parameters(), lr=LR)
        for i in range(0, STEPS * BPTT, BPTT):
            plain_optimizer.zero_grad()
            for r in range(WORLD_SIZE):
                data, targets = get_batch(rank_data(r), i)
                (criterion(plain(data).reshape(-1, NTOKENS), targets) / WORLD_SIZE).backward()
            torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5)
            plain_optimizer.step()
        for (name, p), q in zip(model.module.named_parameters(), plain.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=name)
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not dist.is_available(), reason="this torch build has no torch.distributed")
def test_seed_003_pipe_in_distributed_data_parallel(tmp_path):
    mp.spawn(ddp_worker, args=(str(tmp_path / "init"),), nprocs=WORLD_SIZE, join=True)


# -- seed 004: the API documentation's examples -------------------------------------------

def test_the_pipe_example():
    torch.manual_seed(0)
    fc1 = nn.Linear(16, 8)
    fc2 = nn.Linear(8, 4)
    model = nn.Sequential(fc1, fc2)
    plain = copy.deepcopy(model)
    model = Pipe(model, chunks=8)
    input = torch.rand(16, 16)
    output_rref = model(input)
    output_rref.local_value().sum().backward()
    plain(input).sum().backward()
    assert_same_grads(model, plain)


def test_the_with_device_example():
    torch.manual_seed(0)
    fc1 = nn.Linear(16, 8)
    fc2 = nn.Linear(8, 4)
    dropout = nn.Dropout()
    model = nn.Sequential(fc1, fc2, WithDevice(dropout, "cpu"))
    model = Pipe(model, chunks=8)
    assert list(model) == [fc1, fc2, dropout] and len(model.devices) == 3
    model.eval()
    x = torch.rand(16, 16)
    torch.testing.assert_close(model(x).local_value(), fc2(fc1(x)))


def make_f():
    return nn.Linear(4, 4)


@skippable(stash=["1to3"])
class Layer1(nn.Module):
    def __init__(self):
        super().__init__()
        self.f1 = make_f()

    def forward(self, input):
        yield stash("1to3", input)
        return self.f1(input)


class Layer2(nn.Module):
    def __init__(self):
        super().__init__()
        self.f2 = make_f()

    def forward(self, input):
        return self.f2(input)


@skippable(pop=["1to3"])
class Layer3(nn.Module):
    def __init__(self):
        super().__init__()
        self.f3 = make_f()

    def forward(self, input):
        skip_1to3 = yield pop("1to3")
        return self.f3(input) + skip_1to3


@skippable(stash=["alice", "bob"], pop=["carol"])
class StashStashPop(nn.Module):
    def forward(self, input):
        yield stash("alice", 2 * input)
        yield stash("bob", 3 * input)
        carol = yield pop("carol")
        return input + carol


@skippable(stash=["carol"])
class StashCarol(nn.Module):
    def forward(self, input):
        yield stash("carol", input.sin())
        return input


@skippable(pop=["alice", "bob"])
class PopBoth(nn.Module):
    def forward(self, input):
        alice = yield pop("alice")
        bob = yield pop("bob")
        return input * alice - bob


@pytest.mark.parametrize("example", ["1to3", "several-names", "isolated"])
def test_the_skip_connection_examples(example):
    torch.manual_seed(0)
    if example == "1to3":
        model = nn.Sequential(Layer1(), Layer2(), Layer3())
    elif example == "several-names":
        model = nn.Sequential(StashCarol(), StashStashPop(), Layer2(), PopBoth())
    else:
        ns1, ns2 = Namespace(), Namespace()
        model = nn.Sequential(Layer1().isolate(ns1), Layer1().isolate(ns2), Layer2(),
                              Layer3().isolate(ns2), Layer3().isolate(ns1))
    plain = copy.deepcopy(model)
    x = torch.randn(8, 4)
    out = Pipe(model, chunks=4)(x).local_value()
    expected = plain(x)
    torch.testing.assert_close(out, expected)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(model, plain)


def test_verify_skippables_without_a_pipe():
    verify_skippables(nn.Sequential(Layer1(), Layer2(), Layer3()))
    with pytest.raises(TypeError, match="never popped"):
        verify_skippables(nn.Sequential(Layer1(), Layer2()))
    with pytest.raises(TypeError, match="never stashed"):
        verify_skippables(nn.Sequential(Layer2(), Layer3()))


@pytest.mark.parametrize("checkpoint", ["never", "always", "except_last"])
def test_deferred_batch_norm(checkpoint):
    """The documented promise: running statistics as one BatchNorm over the mini-batch
    (and, as the old test_deferred_batch_norm_params checked, the same gradients as
    BatchNorm over each micro-batch, one chunk being the whole batch there)."""
    torch.manual_seed(0)
    bn = nn.BatchNorm2d(3)
    pipe = Pipe(nn.Sequential(copy.deepcopy(bn)), chunks=2, checkpoint=checkpoint,
                deferred_batch_norm=True)
    x = torch.rand(4, 3, 10, 10)
    out = pipe(x).local_value()
    torch.testing.assert_close(out, torch.cat([bn(part) for part in x.chunk(2)]))
    fresh = nn.BatchNorm2d(3)
    fresh(x)
    torch.testing.assert_close(pipe[0].running_mean, fresh.running_mean)
    torch.testing.assert_close(pipe[0].running_var, fresh.running_var)


@pytest.fixture
def one_process_group(tmp_path):
    """A gloo group of this process alone: enough for DistributedDataParallel to run."""
    if not dist.is_available():
        pytest.skip("this torch build has no torch.distributed")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'init'}", rank=0,
                            world_size=1)
    yield
    dist.destroy_process_group()


def test_inside_distributed_data_parallel_skips_and_non_tensors_still_work(one_process_group):
    """The one-graph forward DDP gets: skip connections across stages, and a non-tensor
    output that comes back once per micro-batch; gradients as the plain model's."""
    from torch.nn.parallel import DistributedDataParallel

    torch.manual_seed(0)
    layers = nn.Sequential(Layer1(), Layer2(), Layer3(), Tagged())
    plain = copy.deepcopy(layers)
    x = torch.randn(8, 4)
    out, tags = DistributedDataParallel(Pipe(layers, chunks=4, checkpoint="never"))(x) \
        .local_value()
    expected, _ = plain(x)
    torch.testing.assert_close(out, expected)
    assert tags == ["tag"] * 4
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_same_grads(layers, plain)


class Tagged(nn.Module):
    def forward(self, x):
        return x, "tag"


def test_a_checkpointing_pipe_inside_distributed_data_parallel_is_refused(one_process_group):
    """The classic documentation allowed DDP around a Pipe only with checkpoint='never';
    with checkpointing, DDP would all-reduce partial gradients, so it is refused."""
    from torch.nn.parallel import DistributedDataParallel

    model = DistributedDataParallel(Pipe(nn.Sequential(nn.Linear(2, 2)), chunks=2))
    with pytest.raises(ValueError, match="must be built with checkpoint='never'"):
        model(torch.randn(4, 2))
    model.eval()                          # nothing is checkpointed in eval mode
    model(torch.randn(4, 2))
