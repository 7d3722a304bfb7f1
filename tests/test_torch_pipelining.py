"""torch.distributed.pipelining on our model: the splits, the schedule conversion, one
torchrun launch checked against `Pipe.step`, and every schedule of ours exported and run by
PyTorch's runtime on 2 and 4 processes."""
import math

import pytest
import torch
from torch.distributed.pipelining import pipeline

from pipeline_lib.distributed.launch import TorchrunError, torchrun
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib import Pipe
from pipeline_lib.schedules import (BUILDERS, ScheduleError, build, gpipe, interleaved_1f1b,
                                    one_f_one_b, validate)
from pipeline_lib.course.workers.torch_pipelining import (main, manual_split, materialize,
                                                            pytorch_schedule, read_csv_run,
                                                            read_run, split_spec,
                                                            write_pipelining_setup)
from pipeline_lib.lm.loops import lm_loss

CONFIG = dict(vocab_size=40, d_model=16, nhead=2, d_hid=32, nlayers=2, dropout=0.0)


def tiny_model():
    torch.manual_seed(0)
    return transformer_lm(**CONFIG)


def test_manual_split_keeps_each_layer_once_under_its_name():
    model = tiny_model()
    stages = [manual_split(model, [1, 2, 1], s) for s in range(3)]
    names = [n for stage in stages for n, _ in stage.named_parameters()]
    assert names == [n for n, _ in model.named_parameters()]
    assert stages[1][0] is model[1] and stages[1][1] is model[2]


@pytest.mark.parametrize("balance, stage", [([2, 2], 2), ([2, 1], 0), ([4, 0], 0)])
def test_manual_split_rejects_bad_requests(balance, stage):
    with pytest.raises(ValueError, match="balance|stage"):
        manual_split(tiny_model(), balance, stage)


@pytest.mark.filterwarnings("ignore:.*LeafSpec.*:FutureWarning")   # inside torch.export
def test_tracer_cuts_where_manual_split_does_and_computes_the_same():
    model = tiny_model()
    inputs = torch.randint(0, CONFIG["vocab_size"], (2, 5))
    assert list(split_spec([1, 2, 1])) == ["1", "3"]
    traced = pipeline(model, mb_args=(inputs,), split_spec=split_spec([1, 2, 1]))
    assert traced.num_stages == 3
    for s in range(3):
        assert ({n for n, _ in traced.get_stage_module(s).named_parameters()}
                == {n for n, _ in manual_split(model, [1, 2, 1], s).named_parameters()})
    torch.testing.assert_close(traced(inputs)[0], model(inputs))


def test_pytorch_gpipe_and_interleaved_orders_equal_ours():
    assert pytorch_schedule("GPipe", 3, 5).actions == gpipe(3, 5).actions
    for p, m, v in [(2, 4, 2), (4, 8, 2), (3, 6, 3)]:
        assert (pytorch_schedule("Interleaved1F1B", p, m, v).actions
                == interleaved_1f1b(p, m, v).actions)


def test_pytorch_1f1b_order_matches_ours_except_possibly_the_last_rank():
    theirs, ours = pytorch_schedule("1F1B", 4, 8), one_f_one_b(4, 8)
    assert theirs.actions[:-1] == ours.actions[:-1]
    if theirs.actions[-1] != ours.actions[-1]:
        with pytest.raises(ScheduleError):
            validate(theirs)


def test_pytorch_schedule_keeps_v_shaped_placement():
    assert pytorch_schedule("ZBVZeroBubble", 2, 4, 2).placement == (0, 1, 1, 0)


def test_a_stage_built_on_meta_and_materialised_computes_as_the_model():
    model = tiny_model()
    with torch.device("meta"):
        shapes_only = transformer_lm(**CONFIG)
    stages = [materialize(manual_split(shapes_only, [2, 2], s), model.state_dict(),
                          CONFIG["d_model"], torch.device("cpu")) for s in range(2)]
    assert not any(p.is_meta for stage in stages for p in stage.parameters())
    assert torch.equal(stages[0][0].pe, model[0].pe)    # not in the checkpoint: recomputed
    ids = torch.randint(0, CONFIG["vocab_size"], (2, 5))
    torch.testing.assert_close(stages[1](stages[0](ids)), model(ids))


def test_worker_rejects_a_malformed_mesh_before_starting(tmp_path, capsys):
    (tmp_path / "setup.pt").write_bytes(b"")       # never read: the arguments fail first
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--mesh", "2by2"])
    assert "write PPxDP, e.g. 2x2" in capsys.readouterr().err


def test_worker_rejects_unknown_runs_before_starting(tmp_path):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--runs", "zb:manual"])


def test_torchrun_deadline_kills_the_job(tmp_path):
    with pytest.raises(TorchrunError, match="did not finish"):
        torchrun("pipeline_lib.course.workers.torch_pipelining", [tmp_path], timeout=1)


# -- one torchrun job per process count: PyTorch's classes, then our schedules exported ------

# 2 processes: every builder at m = 1 (fewer micro-batches than ranks) and m = 5 (interleaved
# in uneven rounds of 3 and 2; DualPipeV with its overlapped pairs), both CSV formats at 5.
ON_2 = [(name, m, fmt) for name in BUILDERS for m, fmt in
        [(1, "compute_only"), (5, "compute_only"), (5, "compute_comms")]]
# 4 processes: every builder once, at sizes PyTorch's own builders refuse where they have one
ON_4 = [("gpipe", 2, "compute_only"), ("1f1b", 2, "compute_only"),
        ("zb_h1", 6, "compute_only"), ("zb_h2", 9, "compute_only"),
        ("interleaved_1f1b", 9, "compute_comms"), ("interleaved_zero_bubble", 9, "compute_comms"),
        ("looped_bfs", 6, "compute_comms"), ("zb_v", 6, "compute_comms"),
        ("dualpipe_v", 6, "compute_comms")]
NAMED = [("gpipe", "manual"), ("1f1b", "manual")]      # PyTorch's classes, m = 2
WIDER = dict(CONFIG, nlayers=6)                         # 8 layers: 8 stages on 4 ranks


def exported_setup(folder, ranks, config, runs):
    """``setup.pt`` for a job of ``ranks`` processes, and each of ``runs`` exported to a CSV
    there: what the job starts from, and each CSV's schedule."""
    torch.manual_seed(0)
    model = transformer_lm(**config)
    rows = 2 * math.lcm(2, *(m for _, m, _ in runs))
    inputs, targets = torch.randint(0, config["vocab_size"], (2, rows, 5))
    layers = len(model)
    write_pipelining_setup(folder, config, model, inputs, targets, [layers // 2] * 2,
                           balances=[[layers // s] * s for s in (4, 8) if s <= layers])
    schedules = {}
    for name, m, fmt in runs:
        path = folder / f"{name}-{m}-{fmt}.csv"
        schedules[path] = build(name, ranks, m)
        schedules[path].to_csv(path, format=fmt)
    return model, inputs, targets, schedules


def launch(folder, ranks, csvs, *named):
    """One torchrun job: the ``named`` runs' arguments, then every CSV."""
    torchrun("pipeline_lib.course.workers.torch_pipelining",
             [folder, *named, "--csv", ",".join(map(str, csvs)), "--steps", "1"],
             nproc=ranks, timeout=240)


@pytest.fixture(scope="module")
def on_2(tmp_path_factory):
    """The one 2-process job: PyTorch's GPipe and 1F1B classes, then ON_2's CSVs."""
    folder = tmp_path_factory.mktemp("on_2")
    started = exported_setup(folder, 2, CONFIG, ON_2)
    stale = folder / "gpipe-manual"
    stale.mkdir()
    (stale / "rank2.pt").write_bytes(b"left by an earlier run on 3 processes: not read")
    launch(folder, 2, started[3], "--runs",
           ",".join(f"{schedule}:{split}" for schedule, split in NAMED), "--microbatches", "2")
    return folder, started


def test_pytorch_pipeline_equals_pipe_step(on_2):
    """PyTorch's loss and gradients are ours, and its runtime runs our orders. (The
    tracer split runs in the notebook; launching it here would trace on both ranks.)"""
    folder, (model, inputs, targets, _) = on_2
    for schedule, split in NAMED:
        reference = transformer_lm(**CONFIG)
        reference.load_state_dict(model.state_dict())
        loss = Pipe(reference, chunks=2, checkpoint="never", balance=[2, 2]).step(
            inputs, targets, lm_loss, schedule=schedule)
        run = read_run(folder, schedule, split)
        assert run.loss == pytest.approx(loss.item(), rel=1e-6)
        assert sorted(run.grads) == sorted(n for n, _ in reference.named_parameters())
        for name, param in reference.named_parameters():
            torch.testing.assert_close(run.grads[name], param.grad, rtol=1e-5, atol=1e-7)
        ours = gpipe(2, 2) if schedule == "gpipe" else one_f_one_b(2, 2)
        assert run.executed().actions == ours.actions
        # a 1F1B step sends and receives at once: PyTorch batches them, on gloo too
        assert run.batch_isend_irecv == ([0, 0] if schedule == "gpipe" else [1, 1])
        # the step's wall time spans every action the ranks ran in it
        assert run.step_seconds >= run.timeline.makespan > 0


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_schedule_runs_in_pytorchs_runtime_with_the_unpipelined_gradients(
        request, tmp_path, ranks):
    """Each schedule exported to a CSV (`Schedule.to_csv`) and run by PyTorch's
    `_PipelineScheduleRuntime` in `ranks` gloo processes, its stages cut by our
    `group_layers`: the loss and every gradient are the unpipelined model's, every rank ran
    our order action for action, and none called `batch_isend_irecv`, which has hung on
    gloo (PyTorch's own Schedule1F1B calls it: `test_pytorch_pipeline_equals_pipe_step`)."""
    if ranks == 2:
        folder, (model, inputs, targets, schedules) = request.getfixturevalue("on_2")
    else:
        folder, (model, inputs, targets, schedules) = tmp_path, exported_setup(tmp_path, 4,
                                                                               WIDER, ON_4)
        launch(folder, 4, schedules)
    loss = lm_loss(model(inputs), targets)
    loss.backward()
    for path, schedule in schedules.items():
        run = read_csv_run(folder, path)
        assert run.loss == pytest.approx(loss.item(), rel=1e-5)
        assert sorted(run.grads) == sorted(name for name, _ in model.named_parameters())
        for name, param in model.named_parameters():
            torch.testing.assert_close(run.grads[name], param.grad, rtol=1e-5, atol=1e-7,
                                       msg=lambda m: f"{path.name}, {name}: {m}")
        assert run.executed().actions == schedule.actions, path.name
        assert run.batch_isend_irecv == [0] * ranks, path.name


def test_the_runs_cover_every_builder_and_what_pytorchs_builders_refuse():
    from test_pytorch_export import REFUSED
    for runs, ranks in [(ON_2, 2), (ON_4, 4)]:
        assert {name for name, _, _ in runs} == set(BUILDERS)
    covered = {(name, 2, m) for name, m, _ in ON_2} | {(name, 4, m) for name, m, _ in ON_4}
    assert {(ours, p, m) for _, p, m, _, ours, _ in REFUSED} <= covered


def test_a_new_setup_removes_the_last_jobs_csv_results(tmp_path):
    """A job that failed before a CSV's run leaves the last job's results there: a new
    setup removes them, so that `read_csv_run` says the run is missing."""
    args = (CONFIG, tiny_model(), torch.zeros(2, 5, dtype=torch.long),
            torch.zeros(2, 5, dtype=torch.long), [2, 2])
    write_pipelining_setup(tmp_path, *args)
    (tmp_path / "csv-gpipe").mkdir()
    (tmp_path / "csv-gpipe" / "rank0.pt").write_bytes(b"the last job's")
    write_pipelining_setup(tmp_path, *args)
    with pytest.raises(FileNotFoundError, match="no results"):
        read_csv_run(tmp_path, tmp_path / "gpipe.csv")


def test_worker_refuses_a_bad_csv_before_starting(tmp_path, capsys):
    (tmp_path / "setup.pt").write_bytes(b"")       # never read: the arguments fail first
    (tmp_path / "bad.csv").write_text("0F0,0B0\n1F0,1Q0\n")
    for csv, says in [(tmp_path / "missing.csv", "no schedule CSV"),
                      (tmp_path / "bad.csv", "'1Q0' is not an action")]:
        with pytest.raises(SystemExit):
            main([str(tmp_path), "--csv", str(csv)])
        assert says in capsys.readouterr().err
