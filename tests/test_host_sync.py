"""`host_sync.HostSyncs` counts each call that would make the host wait for a GPU, names
the line that made it, and leaves torch as it found it."""
from __future__ import annotations

import threading
from typing import Callable
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn

from host_sync import HostSyncs
from pipeline_lib import Pipe
from workloads import VOCAB, padded_batch, token_mean, token_sum

CPU, GPU = torch.device("cpu"), torch.device("cuda", 0)
HERE = "tests/test_host_sync.py"


def test_every_value_read_counts_with_the_line_that_made_it():
    t, scalar = torch.arange(3.0), torch.tensor(2)
    with HostSyncs() as syncs:
        t[0].item(), t.tolist(), t.numpy(), float(t[1]), int(t[1]), bool(t[1])
        range(scalar)
        torch.tensor([1, 2], device="cpu")
    kinds = [c.kind for c in syncs.calls]
    assert kinds == ["Tensor.item", "Tensor.tolist", "Tensor.numpy", "Tensor.__float__",
                     "Tensor.__int__", "Tensor.__bool__", "Tensor.__index__",
                     "torch.tensor(data, device=...)"]
    assert all(c.where.startswith(f"{HERE}:") and c.where.endswith(
        "in test_every_value_read_counts_with_the_line_that_made_it") for c in syncs.calls)
    assert syncs.by_site() == {
        f"{HERE} in test_every_value_read_counts_with_the_line_that_made_it": 8}


def test_what_never_waits_does_not_count():
    t = torch.ones(4)
    with HostSyncs() as syncs:
        u = (t * 2).sum()
        torch.tensor([1.0, 2.0])          # built on the host: no copy to a device
        u.to(torch.float64)
        t.to("cpu").clone()
    assert len(syncs) == 0, str(syncs)


def test_without_stand_ins_only_device_tensors_count():
    with HostSyncs(cpu_stands_for_device=False) as syncs:
        torch.ones(2).tolist(), torch.tensor([1], device="cpu")
    assert len(syncs) == 0


def fake(device: torch.device, pinned: bool = False) -> mock.Mock:
    return mock.Mock(spec=torch.Tensor, device=device, **{"is_pinned.return_value": pinned})


@pytest.mark.parametrize("source, target, non_blocking, kind", [
    (fake(GPU), CPU, True, "copy to the host"),
    (fake(CPU), GPU, True, "copy from pageable memory"),
    (fake(CPU, pinned=True), GPU, False, "blocking copy to a device"),
    (fake(CPU, pinned=True), GPU, True, None),
    (fake(GPU), torch.device("cuda", 1), False, None),
])
def test_copies_count_when_they_wait(source, target, non_blocking, kind):
    syncs = HostSyncs()
    syncs._move(source, target, non_blocking)
    assert [c.kind for c in syncs.calls] == ([kind] if kind else [])


def test_blocking_collectives_count_as_waits(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        with HostSyncs() as syncs:
            dist.all_reduce(torch.ones(2))
            dist.all_reduce(torch.ones(2), async_op=True)   # not waited for: no count
    finally:
        dist.destroy_process_group()
    assert [c.kind for c in syncs.calls] == ["Work.wait"]
    assert syncs.calls[0].where.startswith(HERE)


def test_stage_threads_count_too_and_torch_is_left_as_it_was():
    before = {name: torch.Tensor.__dict__.get(name) for name in ("item", "to", "copy_")}
    with HostSyncs() as syncs:
        thread = threading.Thread(target=lambda: torch.ones(1).item())
        thread.start()
        thread.join()
        with pytest.raises(RuntimeError, match="do not nest"):
            with HostSyncs():
                pass
    assert len(syncs) == 1
    assert {name: torch.Tensor.__dict__.get(name) for name in before} == before
    assert torch.tensor.__module__ != __name__ and torch.Tensor.item is torch._C.TensorBase.item


# -- the executors: nothing per message or per micro-batch --------------------------------

STEADY = {"pipeline_lib/rng.py in new_step_seed": 1,   # a CPU tensor: no device to wait for
          "pipeline_lib/devices.py in read_back": 1}   # the step's one check, at its end


def dropout_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(VOCAB, 8), nn.Linear(8, 8), nn.Dropout(0.1), nn.Tanh(),
                         nn.Linear(8, VOCAB))


def steady_state_syncs(step: Callable[[], object]) -> dict[str, int]:
    """The sites of one step's host syncs, after a first step of the same shapes."""
    step()
    with HostSyncs() as syncs:
        step()
    return syncs.by_site()


@pytest.mark.parametrize("loss", ["mean", "sum and count"])
@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zb_h1", "interleaved_1f1b"])
def test_a_pipe_step_reads_the_device_once_whatever_the_micro_batches(schedule, loss):
    """The last stage's losses are summed on the device and checked with one read at the
    step's end; dropout and checkpointing add nothing; inputs cross no device here."""
    loss_fn = token_mean if loss == "mean" else token_sum
    inputs, target = padded_batch()
    counts = []
    for m in (2, 4):
        balance = [1, 1, 1, 2] if schedule == "interleaved_1f1b" else [2, 3]
        pipe = Pipe(dropout_model(), chunks=m, balance=balance)
        counts.append(steady_state_syncs(lambda: pipe.step(inputs, target, loss_fn, schedule)))
    assert counts[0] == counts[1] == STEADY


def test_a_one_rank_distributed_pipe_step_reads_the_device_once_per_step(tmp_path):
    """A DistributedPipe step without messages (pp = 1): the step's bookkeeping (seed,
    shapes and step number agreed in one all-reduce) and its loss cost the same at any
    number of micro-batches."""
    from pipeline_lib.distributed import DistributedPipe, init_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0,
                            world_size=1)
    try:
        mesh = init_mesh(1)
        inputs, target = padded_batch()
        pipes = [DistributedPipe(dropout_model(), mesh, [5], m, "1f1b") for m in (2, 4)]
        counts = [steady_state_syncs(lambda: pipe.step(inputs, target, token_sum))
                  for pipe in pipes]
    finally:
        dist.destroy_process_group()
    assert counts[0] == counts[1]
