"""DistributedPipe on inputs a careless or hostile user gives it: trained exactly, or
refused on every rank with a message naming what is wrong, never a silent wrong answer or
a hang. Three launches of `dist_robust_worker.py` (4, 4 and 2 processes): one runs every
accepted or refused case that leaves the job running, the others end in a failure.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dist_robust_worker as worker
from pipeline_lib.distributed.pipe import check_no_weight_shared_across_ranks
from pipeline_lib.partition import group_layers
from pipeline_lib.schedules import plan
from test_distributed import failing_run, torchrun

Tensors = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def accepted(tmp_path_factory) -> list[dict]:
    """Every rank's results of the ``accepted`` scenario (one launch, 4 processes)."""
    out = tmp_path_factory.mktemp("accepted")
    done, _ = torchrun(4, "--scenario", "accepted", "--out", str(out),
                       worker="dist_robust_worker.py")
    assert done.returncode == 0, done.stdout + done.stderr
    return [torch.load(out / f"accepted-rank{r}.pt") for r in range(4)]


def unpipelined(model: torch.nn.Sequential, inputs, earlier: float = 0.0
                ) -> tuple[float, Tensors, Tensors]:
    """Loss, gradients (added to ``earlier``) and parameters after one SGD step of the
    whole batch in this process."""
    for p in model.parameters():
        p.grad = torch.full_like(p, earlier) if earlier else None
    _, target = worker.batch()
    loss = worker.token_loss(model(inputs), target)
    loss.backward()
    named = dict(model.named_parameters())
    return (loss.item(), {n: p.grad for n, p in named.items() if p.grad is not None},
            {n: (p if p.grad is None else p - worker.LR * p.grad).detach()
             for n, p in named.items()})


def check_replicas(ranks: list[dict], pp: int, expected: tuple[float, Tensors, Tensors]):
    """Every replica has the whole batch's loss (on one rank), each gradient once, and the
    parameters after the SGD step of one process training on the whole batch."""
    loss, grads, params = expected
    for replica in range(len(ranks) // pp):
        mine = ranks[replica * pp:(replica + 1) * pp]
        losses = [r["loss"] for r in mine if r["loss"] is not None]   # the last stage's rank
        assert losses == pytest.approx([loss], rel=1e-5)
        assert sum(len(r["grads"]) for r in mine) == len(grads)
        for r in mine:
            for n, g in r["grads"].items():
                torch.testing.assert_close(g, grads[n], rtol=1e-5, atol=1e-6, msg=n)
            for n, p in r["params"].items():
                torch.testing.assert_close(p, params[n], rtol=1e-5, atol=1e-6, msg=n)


def case(ranks: list[dict], mesh: str, name: str) -> list[dict]:
    pp, dp = (int(n) for n in mesh.split("x"))
    return [r[f"{mesh}-{name}"] for r in ranks[:pp * dp]]


@pytest.mark.parametrize("mesh", ["2x2", "4x1"])
def test_weight_tied_between_stages_of_one_rank_trains_exactly(accepted, mesh):
    """ZB-V holds the first and the last stage on rank 0, so tied embedding and output
    weights are one parameter there: its gradient sums both stages' shares (with the
    gradients already in .grad added once), and the optimizer steps it once."""
    pp = int(mesh[0])
    ranks = case(accepted, mesh, "tied")
    expected = unpipelined(worker.tied_lm(2 * pp), worker.batch()[0], worker.EARLIER)
    assert "0.weight" in ranks[0]["grads"] and "0.weight" not in ranks[1]["grads"]
    check_replicas(ranks, pp, expected)


@pytest.mark.parametrize("name,shared", [("tied-across", "0.weight = 3.weight"),
                                         ("storage-across", "0.weight = 3.weight")])
def test_weight_shared_by_stages_on_different_ranks_is_refused(accepted, name, shared):
    for r in case(accepted, "2x2", name):
        assert r["error"].startswith(
            f"a weight is shared by stages on different ranks of 1F1B: {shared} is used by "
            f"stage 0 on pipe rank 0, stage 1 on pipe rank 1. Each process would hold its "
            f"own copy")
        assert "Use the threaded Pipe" in r["error"] and "untie the weights" in r["error"]


@pytest.mark.parametrize("mesh", ["2x2", "4x1"])
def test_nochunk_input_reaches_every_micro_batch_whole(accepted, mesh):
    pp = int(mesh[0])
    ids, _ = worker.batch()
    model = worker.masked_lm(4 if pp == 2 else pp)
    check_replicas(case(accepted, mesh, "nochunk"), pp,
                   unpipelined(model, {"ids": ids, "mask": worker.mask()}))


def test_frozen_parameter_the_forward_never_uses_trains_with_replicas(accepted):
    """What the error about an unused parameter advises (freeze it) works."""
    ranks = case(accepted, "2x2", "frozen")
    expected = unpipelined(worker.spare_lm(frozen=True), worker.batch()[0])
    assert "1.spare" not in expected[1]
    check_replicas(ranks, 2, expected)


def test_ranks_given_batches_of_different_shapes_all_raise_naming_them(accepted):
    for r in case(accepted, "2x2", "rows"):
        assert r["error"].startswith(
            "the ranks were given different batches or are at different steps: rank 0 is "
            "at step 1 with inputs (int64[10, 6]) and target (int64[10, 6]); rank 3 is at "
            "step 1 with inputs (int64[12, 6]) and target (int64[12, 6]). Every rank must "
            "call step the same number of times with the same global batch")


def test_ranks_at_different_steps_all_raise_naming_them(accepted):
    for r in case(accepted, "2x2", "steps"):
        assert ("rank 0 is at step 2 with inputs (int64[10, 6]) and target "
                "(int64[10, 6]); rank 3 is at step 1 with inputs") in r["error"]


def failed(tmp_path: Path, scenario: str, nproc: int) -> tuple[str, list[dict]]:
    """The output of a launch that must fail, and what each rank saved before raising.
    (torchrun looks every 2 s, so that every rank notices the failure before it is
    stopped.)"""
    output = failing_run(nproc, "--scenario", scenario, "--out", str(tmp_path),
                         worker="dist_robust_worker.py", flags=("--monitor-interval=2",))
    return output, [torch.load(tmp_path / f"{scenario}-rank{r}.pt") for r in range(nproc)]


def test_unused_parameter_with_replicas_is_named_before_any_optimizer_step(tmp_path):
    """DDP all-reduces a stage's gradients when every parameter's is ready in its last
    backward: a parameter the forward never uses must be named at once, not leave its
    replicas' gradients apart (and the next step fail asking for find_unused_parameters)."""
    output, ranks = failed(tmp_path, "unused", 4)
    assert ("RuntimeError: parameters ['1.spare'] of stage 0 got no gradient in the "
            "stage's last backward of the step") in output
    assert "freeze them (p.requires_grad_(False)) before building DistributedPipe" in output
    assert "optimizer step" not in output
    assert all(r["step"] == 0 and r["grads_as_before"] for r in ranks)
    for holder in (0, 2):   # the ranks holding stage 0 raise it; the others lose them
        assert ranks[holder]["error"].startswith("RuntimeError: parameters ['1.spare']")


def test_failed_step_leaves_grad_as_it_was_on_every_rank(tmp_path):
    """Rank 1 raises in its third forward of the second step (whose messages travel into
    receives posted early), after both ranks added gradients to .grad: both raise (rank 0
    once rank 1 is gone), and both have .grad as before that step."""
    output, ranks = failed(tmp_path, "raise", 2)
    assert "rank 1 failed: RuntimeError: boom: injected failure" in output
    assert ranks[1]["error"] == "RuntimeError: boom: injected failure"
    assert ranks[0]["error"].startswith("RankLost: rank 1 lost")
    assert all(r["step"] == 1 and r["grads_as_before"] for r in ranks)


# -- in-process: the parts that need no second process ---------------------------------

def test_frozen_weight_shared_across_ranks_is_accepted():
    """A frozen weight gets no gradient and no optimizer step: the copies stay equal."""
    model = worker.tied_lm(4)
    model[0].weight.requires_grad_(False)
    stages = group_layers(model, [2, 2])
    check_no_weight_shared_across_ranks(model, stages, plan("1f1b", 2, 2, 4))
    model[0].weight.requires_grad_(True)
    with pytest.raises(ValueError, match="0.weight = 3.weight is used by stage 0 on pipe "
                                         "rank 0, stage 1 on pipe rank 1"):
        check_no_weight_shared_across_ranks(model, stages, plan("1f1b", 2, 2, 4))
