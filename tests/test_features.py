"""The README's feature table: what one executor lacks, it refuses with a message naming
the executor that has it, before any rank waits for another (so these need no process
group: the refusals come before the mesh is used)."""
import pytest
import torch
from torch import nn

from pipeline_lib import DeferredBatchNorm, WithDevice, pop, skippable, stash
from pipeline_lib.distributed.pipe import DistributedPipe


@skippable(stash=["x"])
class Stash(nn.Module):
    def forward(self, x):
        yield stash("x", x)
        return x


@skippable(pop=["x"])
class Pop(nn.Module):
    def forward(self, x):
        skipped = yield pop("x")
        return x + skipped


class NoMesh:
    """Any use of the mesh fails the test: a refusal must come first."""

    def __getattr__(self, name):
        pytest.fail(f"the mesh was used ({name}) before the refusal")


@pytest.mark.parametrize("layers,named", [
    ([nn.Linear(4, 4), DeferredBatchNorm(4, 2)], "layer 1 is a DeferredBatchNorm"),
    ([nn.Linear(4, 4), WithDevice(nn.ReLU(), "cpu")], "layer 1 is a WithDevice(cpu)"),
])
def test_distributed_pipe_refuses_what_only_the_threaded_pipe_runs(layers, named):
    with pytest.raises(NotImplementedError, match="(?i)use Pipe") as refused:
        DistributedPipe(nn.Sequential(*layers), NoMesh(), [1] * len(layers), microbatches=2)
    assert named in str(refused.value)


@pytest.mark.parametrize("balance", [[3], [1, 1, 1]], ids=["within a stage", "across stages"])
def test_skip_connections_are_not_refused(balance):
    """Both executors send skip tensors (across processes too: `test_skip_processes.py`):
    a skip gets as far as the mesh, within a stage or across stages."""
    with pytest.raises(pytest.fail.Exception, match="the mesh was used"):
        DistributedPipe(nn.Sequential(Stash(), nn.Linear(4, 4), Pop()), NoMesh(), balance, 2)


def test_distributed_pipe_has_no_classic_forward_and_names_pipe():
    pipe = object.__new__(DistributedPipe)
    with pytest.raises(TypeError, match=r"pipe\(x\).*threaded Pipe"):
        pipe(torch.randn(2, 4))


def test_the_old_keyword_for_microbatches_still_works_with_a_warning_naming_the_new():
    with pytest.warns(DeprecationWarning, match="microbatches="), \
            pytest.raises(NotImplementedError):
        DistributedPipe(nn.Sequential(nn.Linear(4, 4), DeferredBatchNorm(4, 2)), NoMesh(),
                        [1, 1], chunks=2)


def test_pipe_inside_ddp_with_several_micro_batches_is_refused_naming_the_executors(
        tmp_path):
    """DDP all-reduces a gradient when it is first accumulated; `Pipe`'s backward
    accumulates it once per micro-batch, so DDP would average partial sums. One
    micro-batch, or evaluation without grad, is exact and allowed."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from pipeline_lib import Pipe

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rendezvous'}",
                            rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        layers = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
        x = torch.randn(6, 4)
        with pytest.raises(RuntimeError, match="DistributedPipe.*sync.Pipe"):
            DistributedDataParallel(Pipe(layers, chunks=2, balance=[2, 1]))(x)
        one = DistributedDataParallel(Pipe(layers, chunks=1, balance=[2, 1]))
        one(x).sum().backward()
        expected = [p.grad.clone() for p in layers.parameters()]
        for p in layers.parameters():
            p.grad = None
        layers(x).sum().backward()
        assert all(torch.allclose(e, p.grad) for e, p in zip(expected, layers.parameters()))
        with torch.no_grad():
            DistributedDataParallel(Pipe(layers, chunks=2, balance=[2, 1]))(x)
    finally:
        dist.destroy_process_group()
