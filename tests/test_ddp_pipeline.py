"""The recorded DDP × pipeline job: its records say what really happened.

One torchrun launch (2 pipeline ranks × 2 replicas, gloo) trains a tiny LM for a few SGD
steps; the tests compare its records with training in this process.
"""
from __future__ import annotations

import pytest
import torch

from pipeline_lib.course.workers.ddp_pipeline import (ReplicaLoss, Setup, last_step_timeline,
                                                        read_records, write_ddp_pipeline_setup)
from pipeline_lib.distributed.launch import torchrun
from pipeline_lib.distributed.mesh import grid_place, grid_rank
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.schedules import build
from pipeline_lib.lm.loops import lm_loss

PP, DP, MICROBATCHES, STEPS, LR = 2, 2, 3, 3, 0.5
MODEL = dict(vocab_size=50, d_model=16, nhead=2, d_hid=32, nlayers=2, dropout=0.0)
SCHEDULE = "gpipe"


def make_setup(**options) -> Setup:
    torch.manual_seed(0)
    model = transformer_lm(**MODEL)
    g = torch.Generator().manual_seed(1)
    # 12 rows: 6 per replica, split into 3 micro-batches of 2
    batches = [tuple(torch.randint(0, MODEL["vocab_size"], (2, 12, 5), generator=g))
               for _ in range(STEPS)]
    return Setup(pp=PP, dp=DP, model_config=MODEL, state_dict=model.state_dict(),
                 balance=[2, 2], microbatches=MICROBATCHES, schedule=SCHEDULE, lr=LR, batches=batches,
                 **options)


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    workdir = tmp_path_factory.mktemp("ddp_pipeline")
    setup = make_setup()
    write_ddp_pipeline_setup(workdir, setup)
    torchrun("pipeline_lib.course.workers.ddp_pipeline", [str(workdir)], nproc=PP * DP, timeout=150)
    return setup, read_records(workdir)


@pytest.fixture(scope="module")
def stage_major_clipped_job(tmp_path_factory):
    """The other rank order, and a clip that bites (0.05, far below the norm)."""
    workdir = tmp_path_factory.mktemp("ddp_pipeline_stage_major")
    setup = make_setup(order="stage-major", clip=0.05)
    write_ddp_pipeline_setup(workdir, setup)
    torchrun("pipeline_lib.course.workers.ddp_pipeline", [str(workdir)], nproc=PP * DP, timeout=150)
    return setup, read_records(workdir)


def single_process(setup: Setup) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = transformer_lm(**setup.model_config)
    model.load_state_dict(setup.state_dict)
    optimizer = torch.optim.SGD(model.parameters(), lr=setup.lr)
    losses = []
    for inputs, targets in setup.batches:
        optimizer.zero_grad()
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        if setup.clip is not None:
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), setup.clip)
            assert norm > setup.clip       # the clip bites: the test would see a slip
        optimizer.step()
        losses.append(loss.item())
    return losses, dict(model.named_parameters())


def test_records_place_each_rank_in_the_mesh(job):
    _, records = job
    for r in records:
        assert (r.replica, r.pipe_rank) == divmod(r.rank, PP)
        assert r.pipeline == [r.replica * PP + p for p in range(PP)]
        assert r.dp_group == [d * PP + r.pipe_rank for d in range(DP)]


def test_stage_major_order_puts_each_ddp_group_on_neighbouring_ranks(stage_major_clipped_job):
    _, records = stage_major_clipped_job
    for r in records:
        assert (r.pipe_rank, r.replica) == divmod(r.rank, DP)
        assert r.pipeline == [p * DP + r.replica for p in range(PP)]
        assert r.dp_group == [p for p in range(r.pipe_rank * DP, (r.pipe_rank + 1) * DP)]


def test_clipped_stage_major_training_equals_one_process_clipped(stage_major_clipped_job):
    """`pipeline_lib.grad_clip` sums the norm over the pipeline's ranks: the clipped run
    equals one process clipping the whole model, in either rank order."""
    setup, records = stage_major_clipped_job
    losses, params = single_process(setup)
    norms = records[0].grad_norms
    assert len(norms) == STEPS and all(r.grad_norms == norms for r in records)  # one norm
    by_place = {(r.replica, r.pipe_rank): r for r in records}
    for replica in range(DP):
        assert by_place[(replica, PP - 1)].losses == pytest.approx(losses, rel=1e-5)
        for pipe_rank in range(PP):
            for name, p in by_place[(replica, pipe_rank)].parameters.items():
                torch.testing.assert_close(p, params[name].detach(), rtol=1e-5, atol=1e-6)


def test_training_equals_one_process_on_the_global_batch(job):
    setup, records = job
    losses, params = single_process(setup)
    for replica in range(DP):
        last = records[replica * PP + PP - 1]
        assert last.losses == pytest.approx(losses, rel=1e-5)
        stages = records[replica * PP:(replica + 1) * PP]
        names = [n for r in stages for n in r.parameters]
        assert sorted(names) == sorted(params)            # every parameter, once
        for r in stages:
            for name, p in r.parameters.items():
                torch.testing.assert_close(p, params[name].detach(), rtol=1e-5, atol=1e-6)
    assert all(r.losses == [] and r.replica_losses == [] for r in records if r.pipe_rank < PP - 1)


def test_replicas_stay_identical_and_their_losses_average_to_the_global_one(job):
    _, records = job
    for pipe_rank in range(PP):
        first, second = records[pipe_rank], records[PP + pipe_rank]
        assert all(torch.equal(p, second.parameters[n]) for n, p in first.parameters.items())
    last = [records[d * PP + PP - 1] for d in range(DP)]
    assert last[0].replica_losses != last[1].replica_losses   # they saw different rows
    for step in range(STEPS):
        mean = sum(r.replica_losses[step] for r in last) / DP
        assert mean == pytest.approx(last[0].losses[step], rel=1e-5)


def test_gradients_are_all_reduced_once_per_step_during_the_last_backward(job):
    _, records = job
    schedule = build(SCHEDULE, PP, MICROBATCHES)
    for r in records:
        last_backward = [a for a in schedule.actions[r.pipe_rank] if a.kind == "B"][-1]
        assert [a.step for a in r.all_reduces] == list(range(STEPS))   # one bucket each
        assert {a.action for a in r.all_reduces} == {str(last_backward)}


def test_last_step_timeline_puts_every_rank_on_one_axis(job):
    _, records = job
    timeline, syncs = last_step_timeline(records)
    programs = build(SCHEDULE, PP, MICROBATCHES).actions
    assert timeline.ranks == PP * DP
    assert len(timeline.events) == sum(len(programs[r % PP]) for r in range(PP * DP))
    assert min(e.start for e in timeline.events) == 0.0
    assert len(syncs) == PP * DP
    assert sorted(sync.rank for sync in syncs) == list(range(PP * DP))
    for sync in syncs:
        assert 0.0 < sync.time < timeline.makespan
        assert sync.step == STEPS - 1


def test_replica_loss_is_token_weighted():
    torch.manual_seed(0)
    logits, targets = torch.randn(5, 4, 7), torch.randint(0, 7, (5, 4))
    loss_fn = ReplicaLoss()
    for rows in (slice(0, 3), slice(3, 5)):   # micro-batches of 3 and 2 rows
        loss_fn(logits[rows], targets[rows])
    assert loss_fn.take() == pytest.approx(lm_loss(logits, targets).item(), rel=1e-6)
    assert loss_fn.parts == []


def test_missing_records_name_the_command_to_run(tmp_path):
    for rank in range(PP * DP):   # an earlier job's records: a new setup removes them
        (tmp_path / f"rank{rank}.pt").write_bytes(b"stale")
    write_ddp_pipeline_setup(tmp_path, make_setup())
    with pytest.raises(FileNotFoundError, match="torchrun --nproc-per-node 4 -m "
                                                "pipeline_lib.course.workers.ddp_pipeline"):
        read_records(tmp_path)


def test_grid_rank_numbers_the_grid_in_either_order():
    assert [grid_rank("replica-major", 4, 2, d, p) for d in range(2) for p in range(4)] == \
        list(range(8))
    assert [[grid_rank("stage-major", 4, 2, d, p) for p in range(4)] for d in range(2)] == \
        [[0, 2, 4, 6], [1, 3, 5, 7]]
    for order in ("replica-major", "stage-major"):
        assert [grid_rank(order, 4, 2, *grid_place(order, 4, 2, r)) for r in range(8)] == \
            list(range(8))
    with pytest.raises(ValueError, match="unknown rank order 'pipe'"):
        grid_rank("pipe", 2, 2, 0, 0)
