"""DataParallel's primitives on CPU "devices" and a 2-process DistributedDataParallel run:
both must train exactly like one model on the whole batch."""
import copy

import pytest
import torch
from torch import nn

from pipeline_lib.course.data_parallel import (data_parallel_step, parallel_apply, parallel_gather,
                                        reduce_gradients, replicate, scatter)
from pipeline_lib.course.workers.data_parallel import read_ddp_replicas, write_ddp_setup
from pipeline_lib.distributed.launch import torchrun
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.lm.loops import lm_loss

CONFIG = dict(vocab_size=40, d_model=16, nhead=2, d_hid=32, nlayers=2, dropout=0.0)
CPUS = ["cpu", "cpu"]


def tiny_model():
    torch.manual_seed(0)
    return transformer_lm(**CONFIG)


def test_scatter_splits_like_torch_chunk():
    rows = torch.arange(5)
    assert [s.tolist() for s in scatter(rows, ["cpu"] * 4)] == [[0, 1], [2, 3], [4]]
    with pytest.raises(ValueError, match="dim 0"):
        scatter(torch.tensor(1.0), CPUS)


def test_replicas_are_independent_copies():
    model = nn.Linear(3, 2)
    replicas = replicate(model, CPUS)
    assert all(r is not model and torch.equal(r.weight, model.weight) for r in replicas)
    with torch.no_grad():
        replicas[0].weight.add_(1)
    assert not torch.equal(replicas[0].weight, model.weight)


def test_four_primitives_compute_the_module_output():
    model, inputs = tiny_model(), torch.randint(0, 40, (5, 6))
    outputs = parallel_apply(replicate(model, CPUS), scatter(inputs, CPUS))
    torch.testing.assert_close(parallel_gather(outputs, "cpu"), model(inputs))


def test_parallel_apply_names_the_failing_replica():
    modules = [nn.Linear(3, 2), nn.Linear(4, 2)]
    with pytest.raises(RuntimeError, match="replica 1"):
        parallel_apply(modules, [torch.ones(1, 3), torch.ones(1, 3)])


@pytest.mark.parametrize("rows, devices", [(4, 2), (5, 2), (5, 3)])
def test_data_parallel_step_gradients_equal_one_model(rows, devices):
    model, reference = tiny_model(), tiny_model()
    inputs, targets = torch.randint(0, 40, (2, rows, 6))
    loss = data_parallel_step(model, inputs, targets, lm_loss, ["cpu"] * devices)
    expected = lm_loss(reference(inputs), targets)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach())
    for p, q in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-7)


def test_reduce_gradients_adds_to_existing_gradients():
    model = nn.Linear(2, 1)
    model.weight.grad = torch.ones_like(model.weight)
    replicas = replicate(model, CPUS)
    for r in replicas:
        r.weight.grad = torch.full_like(r.weight, 2.0)
        r.bias.grad = None
    reduce_gradients(replicas, model)
    assert torch.equal(model.weight.grad, torch.full_like(model.weight, 5.0))
    assert model.bias.grad is None


def fake_results(folder, ranks, world_size):
    """Files as the processes of a run of ``world_size`` save them, for ``ranks``."""
    for rank in ranks:
        torch.save({"world_size": world_size,
                    "value": {"state_dict": {}, "losses": [float(rank)]}},
                   folder / f"ddp_rank{rank}.pt")


def test_replicas_are_read_in_rank_order_not_name_order(tmp_path):
    fake_results(tmp_path, range(12), 12)
    assert [r.losses for r in read_ddp_replicas(tmp_path)] == [[r] for r in range(12)]


def test_a_run_that_did_not_finish_is_refused(tmp_path):
    fake_results(tmp_path, [0, 2], 3)
    with pytest.raises(FileNotFoundError, match=r"ranks \[0, 2\], not of ranks 0 to 2 of "
                                                r"one run: the last run did not finish"):
        read_ddp_replicas(tmp_path)


def test_a_new_setup_removes_the_last_jobs_results(tmp_path):
    fake_results(tmp_path, range(2), 2)
    write_ddp_setup(tmp_path, CONFIG, tiny_model(), [], lr=0.5)
    with pytest.raises(FileNotFoundError, match="no results in .*: run `torchrun "
                                                "--nproc-per-node 2 -m pipeline_lib"):
        read_ddp_replicas(tmp_path)


def test_ddp_replicas_stay_identical_and_equal_one_process(tmp_path):
    model = tiny_model()
    batches = [tuple(torch.randint(0, 40, (2, 4, 6))) for _ in range(2)]
    write_ddp_setup(tmp_path, CONFIG, model, batches, lr=0.5)
    fake_results(tmp_path, [2], 3)   # left by an earlier run on 3 processes: not read
    torchrun("pipeline_lib.course.workers.data_parallel", [tmp_path], nproc=2, timeout=120)
    first, second = read_ddp_replicas(tmp_path)
    for name, value in first.state_dict.items():
        assert torch.equal(value, second.state_dict[name]), name

    reference = copy.deepcopy(model)
    optimizer = torch.optim.SGD(reference.parameters(), lr=0.5)
    losses = []
    for inputs, targets in batches:
        optimizer.zero_grad()
        loss = lm_loss(reference(inputs), targets)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    mean_of_slices = [(a + b) / 2 for a, b in zip(first.losses, second.losses)]
    assert losses == pytest.approx(mean_of_slices)
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(first.state_dict[name], value, rtol=1e-5, atol=1e-6)
    name = "0.tokens.weight"
    assert not torch.equal(first.state_dict[name], model.state_dict()[name])   # it trained
