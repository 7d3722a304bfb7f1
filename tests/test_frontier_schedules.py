"""The frontier schedules (ZB-H2, ZB-V, DualPipeV, interleaved zero bubble, looped BFS,
interleaved 1F1B for any m) compute what unpipelined training computes: in processes
(`DistributedPipe`), in every checkpoint mode, with uneven micro-batches, V-shaped
placement included; with dropout, trees and token-count losses in threads. (The threaded
equivalence for every schedule, checkpoint mode and m is `test_pipe`'s.)"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

import dist_frontier_worker as worker
from conftest import assert_same_grads
from workloads import data, make_model, padded_batch, token_mean, token_model, token_sum, tree_batch, tree_model
from pipeline_lib import Pipe
from pipeline_lib.schedules import zb_v

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", worker.FRONTIER)
def test_dropout_masks_do_not_depend_on_the_schedule(name):
    """Masks depend on (step, stage, micro-batch) only: recomputed under any order of
    actions, they equal GPipe's without recomputation."""
    x, y = data(12)
    loss_fn = nn.CrossEntropyLoss()

    def grads(checkpoint: str, schedule: str) -> list[torch.Tensor]:
        model = make_model(dropout=0.5)
        torch.manual_seed(123)
        Pipe(model, chunks=4, checkpoint=checkpoint, balance=[2, 2, 2, 3]).step(
            x, y, loss_fn, schedule)
        return [p.grad for p in model.parameters()]

    for a, b in zip(grads("never", "gpipe"), grads("always", name)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("name", worker.FRONTIER)
def test_trees_between_stages_and_token_count_losses(name):
    """Dicts and lists between stages, and a (loss_sum, count) loss over padded rows
    whose micro-batches hold different numbers of real tokens: one stage per layer, so
    the V-shaped schedules turn on rank 1 and end on rank 0."""
    inputs, y = tree_batch()
    reference = tree_model()
    nn.functional.cross_entropy(reference(inputs), y).backward()
    model = tree_model()
    Pipe(model, chunks=4, balance=[1, 1, 1, 1]).step(inputs, y, nn.CrossEntropyLoss(), name)
    assert_same_grads(model, reference)

    inputs, target = padded_batch()
    reference = token_model()
    expected = token_mean(reference(inputs), target)
    expected.backward()
    model = token_model()
    loss = Pipe(model, chunks=4, balance=[1, 1, 1, 1]).step(inputs, target, token_sum, name)
    torch.testing.assert_close(loss, expected.detach())
    assert_same_grads(model, reference)


def test_v_shape_keeps_both_chunks_of_a_rank_on_its_device():
    """Rank 0 holds stages 0 and 3 of a 4-stage V: Pipe refuses them on two devices."""
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(4)])
    pipe = Pipe(model, chunks=2, devices=["cpu", "meta", "meta", "meta"])
    with pytest.raises(ValueError, match="ZB-V runs stage 3 on rank 0, so it must be on "
                                         "device cpu, not meta"):
        pipe._schedule(zb_v(2, 2), 2)


# -- processes ---------------------------------------------------------------------------

LAUNCH_TIMEOUT = 300


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(processes)`` -> the folder of the run with that many processes (one
    torchrun each, on first use)."""
    folders: dict[int, Path] = {}

    def folder(processes: int) -> Path:
        if processes not in folders:
            out = tmp_path_factory.mktemp(f"frontier{processes}")
            meshes = "2x1" if processes == 2 else "4x1,2x2"
            command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                       "--nproc_per_node", str(processes),
                       str(REPO / "tests" / "dist_frontier_worker.py"),
                       "--meshes", meshes, "--out", str(out)]
            env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
            process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                       text=True, env=env, cwd=REPO, start_new_session=True)
            try:
                stdout, stderr = process.communicate(timeout=LAUNCH_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                stdout, stderr = process.communicate()
                pytest.fail(f"torchrun hung for {LAUNCH_TIMEOUT} s:\n{stdout}{stderr}")
            assert process.returncode == 0, stdout + stderr
            folders[processes] = out
        return folders[processes]
    return folder


PROCESS_CASES = [(mesh, *case) for mesh in ("2x1", "4x1", "2x2") for case in worker.cases(mesh)]


@pytest.mark.parametrize("mesh,name,checkpoint,chunks,workload", PROCESS_CASES)
def test_processes_match_unpipelined_loss_and_gradients(launched, mesh, name, checkpoint,
                                                        chunks, workload):
    """Every replica ends with the whole batch's loss and gradients: for token counts,
    the mean over every real token of the global batch."""
    pp, dp = (int(n) for n in mesh.split("x"))
    if workload == "lm":
        model, (inputs, target), loss_fn = (worker.base.tiny_lm(), worker.base.batch(),
                                            worker.base.token_loss)
    else:
        model, (inputs, target), loss_fn = token_model(), padded_batch(), token_mean
    expected = loss_fn(model(inputs), target)
    expected.backward()
    reference = {n: p.grad for n, p in model.named_parameters()}

    folder = launched(pp * dp)
    ranks = [torch.load(folder / f"{worker.tag(mesh, name, checkpoint, chunks, workload)}"
                                 f"-rank{r}.pt") for r in range(pp * dp)]
    for d in range(dp):
        replica = ranks[d * pp:(d + 1) * pp]
        losses = [r["loss"] for r in replica]
        holder = 0 if name in ("zb_v", "dualpipe_v") else pp - 1   # the last stage's rank
        assert losses[holder] == pytest.approx(expected.item(), rel=1e-5)
        assert all(loss is None for k, loss in enumerate(losses) if k != holder)
        grads = {n: g for r in replica for n, g in r["grads"].items()}
        assert sorted(grads) == sorted(reference)
        assert sum(len(r["grads"]) for r in replica) == len(reference)   # each once
        for n, g in grads.items():
            torch.testing.assert_close(g, reference[n], rtol=1e-5, atol=1e-7, msg=n)


def test_gantt_draws_each_stage_of_a_v_on_the_rank_that_holds_it():
    import matplotlib
    matplotlib.use("Agg")
    from matplotlib.figure import Figure
    from pipeline_lib.timeline import simulate
    from pipeline_lib.viz.plot import gantt

    schedule = zb_v(2, 2)
    ax = gantt(simulate(schedule, forward=0.5, backward=1.0), ax=Figure((30, 3)).subplots())
    stage_labels = [t for t in ax.texts if t.get_text().startswith("s")]
    assert {t.get_text() for t in stage_labels} == {"s0", "s1", "s2", "s3"}
    for t in stage_labels:   # written under the micro-batch, on the row of its rank
        assert t.get_position()[1] - 0.25 == schedule.rank_of(int(t.get_text()[1:]))
