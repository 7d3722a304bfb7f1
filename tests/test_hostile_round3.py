"""Round 3 of the hostile user (issue 26's closing demand): inputs beyond the issue's list,
each compared with plain PyTorch where a value is computed, each error checked for naming
what was wrong and the fix."""
from __future__ import annotations

import contextlib
import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline_lib import Pipe, SumCount
from pipeline_lib.grad_clip import clip_grad_norm_


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 4))


def _stepped_pair() -> tuple[Pipe, nn.Sequential]:
    """A Pipe after one step and the plain model after the same batch's backward."""
    model = _mlp()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    pipe = Pipe(model, balance=[2, 1], chunks=4)
    pipe.step(x, y, F.mse_loss)
    F.mse_loss(plain(x), y).backward()
    return pipe, plain


# -- grad_clip -------------------------------------------------------------------------

@pytest.mark.parametrize("given", ["generator", "list", "tensor"])
def test_clip_takes_parameters_as_pytorch_does(given):
    """`torch.nn.utils.clip_grad_norm_(model.parameters(), ...)` is the habit; ours raised
    AttributeError ('generator' has no attribute 'parameters')."""
    pipe, plain = _stepped_pair()
    params = {"generator": pipe.parameters(), "list": list(pipe.parameters()),
              "tensor": next(pipe.parameters())}[given]
    want = {"generator": plain.parameters(), "list": list(plain.parameters()),
            "tensor": next(plain.parameters())}[given]
    got = clip_grad_norm_(params, 0.1)
    assert got.item() == pytest.approx(torch.nn.utils.clip_grad_norm_(want, 0.1).item())
    for p, q in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_clip_takes_norm_type_as_a_string_as_pytorch_does():
    pipe, plain = _stepped_pair()
    got = clip_grad_norm_(pipe, "0.05", "inf")
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05, "inf")
    assert got.item() == pytest.approx(want.item())
    for p, q in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


@pytest.mark.parametrize("args, match", [
    ((None, 1.0), "takes a Pipe.*got NoneType"),
    (("pipe", "half"), "max_norm must be a number"),
    (("pipe", True), "max_norm must be a number"),
    (("pipe", 1.0, "two"), "norm_type must be a number"),
])
def test_clip_names_a_wrong_argument(args, match):
    pipe, _ = _stepped_pair()
    args = tuple(pipe if a == "pipe" else a for a in args)
    with pytest.raises(TypeError, match=match):
        clip_grad_norm_(*args)


def test_clip_can_refuse_a_nonfinite_norm_leaving_the_gradients():
    pipe, _ = _stepped_pair()
    first = next(pipe.parameters())
    first.grad[0, 0] = math.inf
    before = [p.grad.clone() for p in pipe.parameters()]
    with pytest.raises(RuntimeError, match="norm of the gradients is inf.*left as they were"):
        clip_grad_norm_(pipe, 1.0, error_if_nonfinite=True)
    for p, b in zip(pipe.parameters(), before):
        torch.testing.assert_close(p.grad, b)


# -- python -m pipeline_lib.lm.train's arguments -----------------------------------------

@pytest.mark.parametrize("flags, message", [
    # each was accepted and trained wrongly or failed minutes later
    (["--clip", "nan"], "--clip: must be a number at least 0, not 'nan'"),
    (["--lr", "-1"], "--lr: must be a number above 0, not '-1'"),   # gradient ascent
    (["--lr", "nan"], "--lr: must be a number above 0"),
    (["--lr-floor", "-1"], "--lr-floor: must be a number at least 0 and at most 1"),
    (["--lr-floor", "nan"], "--lr-floor: must be a number at least 0 and at most 1"),
    (["--peak-tflops", "0"], "--peak-tflops: must be a number above 0"),   # MFU left out
    (["--timeout", "0"], "--timeout: must be a number above 0"),
    (["--synthetic", "0"], "--synthetic: must be a whole number of at least 1"),
    (["--preset", "huge"], "--preset: invalid choice: 'huge'"),
    (["--batch", "16", "--microbatches", "100"], "use --batch >= 100 (--dp x --microbatches)"),
    (["--batch", "4", "--dp", "8", "--microbatches", "1"], "use --batch >= 8"),
    (["--save-every", "5"], "--save-every 5 saves nowhere without --save DIR"),
])
def test_train_refuses_values_that_train_wrongly_before_starting(flags, message, capsys):
    from pipeline_lib.lm import train
    with pytest.raises(SystemExit):
        train._parse_args(flags)
    assert message in capsys.readouterr().err


def test_train_will_not_save_over_another_runs_checkpoint(tmp_path, capsys):
    """The first save of a new run moved `latest` to its own folder and deleted the old
    run's step folder: a learner's hours of training lost without a word."""
    from pipeline_lib import run_state
    from pipeline_lib.lm import train
    (tmp_path / run_state.LATEST).write_text("step-000100")
    with pytest.raises(SystemExit):
        train._parse_args(["--save", str(tmp_path)])
    assert f"--save {tmp_path} already holds another run's checkpoint" in capsys.readouterr().err
    args = train._parse_args(["--save", str(tmp_path), "--resume", str(tmp_path)])
    assert args.save == args.resume   # going on from it, into it, is the way to keep it


# -- run_state: checkpoints the learner owns -------------------------------------------

@pytest.fixture(scope="module")
def mesh(one_rank_mesh):
    return one_rank_mesh


def _trained(mesh, layers: int = 4, width: int = 8, optimizer=torch.optim.AdamW):
    """A one-rank pipeline of ``layers`` Linear layers after one step, its balance and
    optimizer."""
    from pipeline_lib.distributed import DistributedPipe
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)])
    balance = [layers // 2, layers - layers // 2]
    pipe = DistributedPipe(model, mesh, balance, 2, "zb_v")
    opt = optimizer(pipe.parameters(), lr=0.1)
    x = torch.randn(4, width)
    pipe.step(x, x, F.mse_loss)
    opt.step()
    return pipe, balance, opt


@pytest.fixture
def saved(mesh, tmp_path):
    from pipeline_lib import run_state
    run_state.save(tmp_path / "run", 1, *_trained(mesh))
    return tmp_path / "run"


def test_resume_refuses_a_checkpoint_of_a_deeper_model(mesh, saved):
    """A 4-layer checkpoint loaded into a 2-layer model without a word: each rank checked
    only that its own keys were there."""
    from pipeline_lib import run_state
    with pytest.raises(ValueError, match=r"has layers \[2, 3\] and this model only 2.*"
                                         r"another model"):
        run_state.resume(saved, *_trained(mesh, layers=2))


def test_resume_names_another_width_as_another_model(mesh, saved):
    from pipeline_lib import run_state
    with pytest.raises(ValueError, match="does not fit stage 0: it was saved from another"):
        run_state.resume(saved, *_trained(mesh, width=16))


def test_resume_refuses_another_optimizer(mesh, saved):
    """AdamW's settings loaded into SGD: 'momentum' was lost, and SGD.step raised
    KeyError (or, without momentum, ran with AdamW's group settings)."""
    from pipeline_lib import run_state
    sgd = lambda params, lr: torch.optim.SGD(params, lr=lr, momentum=0.9)  # noqa: E731
    with pytest.raises(ValueError, match="holds AdamW's state.*is SGD: resume with AdamW"):
        run_state.resume(saved, *_trained(mesh, optimizer=sgd))


@pytest.mark.parametrize("damage, match", [
    (lambda d: (d / "latest").write_text(""), "names '', which is not a complete step folder"),
    (lambda d: (d / "latest").write_text("step-000099"), "names 'step-000099'"),
    (lambda d: (d / "step-000001" / "stage-1.pt").unlink(), "incomplete: .*stage-1.pt is missing"),
    (lambda d: (d / "step-000001" / "stage-0.pt").write_bytes(b"junk"),
     "stage-0.pt is damaged and cannot be read"),
    (lambda d: (d / "step-000001" / "run.pt").write_bytes(b"junk"),
     "run.pt is damaged and cannot be read"),
])
def test_a_damaged_checkpoint_is_named_file_by_file(mesh, saved, damage, match):
    from pipeline_lib import run_state
    damage(saved)
    with pytest.raises((FileNotFoundError, RuntimeError), match=match):
        run_state.resume(saved, *_trained(mesh))
    with pytest.raises((FileNotFoundError, RuntimeError), match=match):
        run_state.merged_state_dict(saved)


def test_save_deletes_only_its_own_files_of_the_step_it_replaces(mesh, saved):
    """It unlinked every entry of the old step folder (the learner's notes too) and
    raised IsADirectoryError on a subfolder, after the new checkpoint was complete."""
    from pipeline_lib import run_state
    (saved / "step-000001" / "notes.txt").write_text("mine")
    (saved / "step-000001" / "plots").mkdir()
    run_state.save(saved, 2, *_trained(mesh))
    assert (saved / "step-000001" / "notes.txt").read_text() == "mine"
    assert sorted(p.name for p in (saved / "step-000001").iterdir()) == ["notes.txt", "plots"]
    assert run_state.resume(saved, *_trained(mesh)) == 2


@pytest.mark.parametrize("edited", [".", "../elsewhere"])
def test_save_never_deletes_what_an_edited_latest_names(mesh, saved, edited):
    """``latest`` reading ``../elsewhere`` deleted that folder's files and the folder."""
    from pipeline_lib import run_state
    elsewhere = saved.parent / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "run.pt").write_text("someone's")
    (saved / "mine.txt").write_text("mine")
    (saved / "latest").write_text(edited)
    run_state.save(saved, 2, *_trained(mesh))
    assert (elsewhere / "run.pt").read_text() == "someone's"
    assert (saved / "mine.txt").read_text() == "mine"
    assert run_state.resume(saved, *_trained(mesh)) == 2


def test_save_names_a_file_in_the_way_and_a_bad_step(mesh, tmp_path):
    from pipeline_lib import run_state
    (tmp_path / "afile").write_text("x")
    with pytest.raises(NotADirectoryError, match=f"{tmp_path / 'afile'} is a file, not a folder"):
        run_state.save(tmp_path / "afile", 1, *_trained(mesh))
    with pytest.raises(ValueError, match="whole number >= 0, not -1"):
        run_state.save(tmp_path / "run", -1, *_trained(mesh))


# -- the simulator's validation ----------------------------------------------------------

def test_per_stage_costs_as_a_dict_are_refused_not_read_as_their_keys():
    """``forward={0: 1.0, 1: 2.0}`` has a length, and iterating it gives the keys: stage 1
    cost 1 (its key) where 2 was meant, a silently shorter makespan."""
    from pipeline_lib.schedules import build
    from pipeline_lib.timeline import simulate
    with pytest.raises(TypeError, match="forward must be a number or one number per stage"):
        simulate(build("1f1b", 2, 4), forward={0: 1.0, 1: 2.0})
    with pytest.raises(TypeError, match="weight must be a number or one number per stage"):
        simulate(build("zb_h1", 2, 4), weight={0: 0.5, 1: 0.5})


@pytest.mark.parametrize("placement", [(False, True), (0.0, 1.0)])
def test_a_placement_of_non_int_ranks_is_refused(placement):
    from pipeline_lib.schedules import Schedule, ScheduleError, build, validate
    one_f = build("1f1b", 2, 4)
    with pytest.raises(ScheduleError, match="must give a rank in 0..1 for each of the 2"):
        validate(Schedule("mine", 2, 4, one_f.actions, placement=placement))


@pytest.mark.parametrize("data, match", [
    ({"ranks": 2}, "not a timeline: expected a dict with 'ranks'"),
    ([1, 2], "not a timeline"),
    ({"ranks": 2, "events": [[0, "0F0", 0.0, 1.0]]}, "event 0 .* needs the keys"),
    ({"ranks": 1, "events": [dict(rank=1, stage=0, kind="F", microbatch=0, start=0.0,
                                  end=1.0)]}, r"rank \(below 1\)"),
    ({"ranks": 1, "events": [dict(rank=0, stage=0, kind="X", microbatch=0, start=0.0,
                                  end=1.0)]}, "kind one of F, B, I, W"),
    ({"ranks": 1, "events": [dict(rank=0, stage=0, kind="F", microbatch=0, start=2.0,
                                  end=1.0)]}, "end >= start"),
])
def test_a_timeline_file_that_is_not_one_is_named(data, match):
    """A hand-edited or truncated ``--timeline`` file raised KeyError/TypeError, or (end
    before start) gave a bubble of 0 and negative busy times."""
    from pipeline_lib.timeline import Timeline
    with pytest.raises(ValueError, match=match):
        Timeline.from_dict(data)


def test_a_saved_timeline_reads_back_equal():
    import json

    from pipeline_lib.schedules import build
    from pipeline_lib.timeline import Timeline, simulate
    timeline = simulate(build("zb_v", 2, 4))
    again = Timeline.from_dict(json.loads(json.dumps(timeline.to_dict())))
    assert again == timeline


# -- SumCount --------------------------------------------------------------------------

def _sum_loss(count):
    return lambda out, target: SumCount(F.mse_loss(out, target, reduction="sum"), count)


def test_an_infinite_count_is_refused_not_a_loss_of_zero():
    """count = inf passed `count >= 0`: the step returned 0.0 and zeroed the gradients."""
    pipe = Pipe(_mlp(), balance=[2, 1], chunks=4)
    with pytest.raises(ValueError, match="count is inf; .* a finite number >= 0"):
        pipe.step(torch.randn(8, 4), torch.randn(8, 4), _sum_loss(math.inf))
    assert all(p.grad is None for p in pipe.parameters())


def test_a_complex_loss_is_named():
    """It reached autograd: 'grad can be implicitly created only for real scalar outputs'."""
    pipe = Pipe(_mlp(), balance=[2, 1], chunks=4)
    complex_sum = lambda out, target: SumCount(  # noqa: E731
        torch.complex(F.mse_loss(out, target, reduction="sum"), torch.tensor(0.0)), 4)
    with pytest.raises(TypeError, match="a torch.complex64 loss; return a real floating"):
        pipe.step(torch.randn(8, 4), torch.randn(8, 4), complex_sum)


def test_sum_count_of_numpy_and_tensor_counts_equals_pytorch():
    import numpy as np
    x, y = torch.randn(8, 4), torch.randn(8, 4)
    plain = _mlp()
    F.mse_loss(plain(x), y).backward()
    for count in (np.int64(8), torch.tensor(8.0), torch.tensor(8, dtype=torch.int16)):
        pipe = Pipe(_mlp(), balance=[2, 1], chunks=4)
        loss = pipe.step(x, y, _sum_loss(count))   # 8 elements per micro-batch
        assert loss.item() == pytest.approx(F.mse_loss(plain(x), y).item(), rel=1e-6)
        for p, q in zip(pipe.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


# -- tools/student.py: the learner's folder ----------------------------------------------

def test_make_student_keeps_whatever_the_learner_has_under_a_notebooks_name(tmp_path, capsys):
    """A folder, a file in another encoding, a link to nowhere: each stopped `make student`
    with a traceback (IsADirectoryError, UnicodeDecodeError) before the rest were written,
    or (the link) was replaced."""
    import sys
    from pathlib import Path
    tools = Path(__file__).resolve().parents[1] / "tools"
    sys.path.insert(0, str(tools))
    try:
        from student import main as make_student
    finally:
        sys.path.remove(str(tools))
    names = sorted(p.name for p in (tools.parent / "notebooks").glob("*.ipynb"))
    (tmp_path / names[0]).mkdir()
    (tmp_path / names[1]).write_bytes(b"\xff\xfe not utf-8")
    (tmp_path / names[2]).symlink_to(tmp_path / "nowhere")
    assert make_student([str(tmp_path)]) == 0
    out = capsys.readouterr().out
    for name in names[:3]:
        assert f"kept {tmp_path / name}" in out
    assert (tmp_path / names[0]).is_dir() and (tmp_path / names[2]).is_symlink()
    assert (tmp_path / names[1]).read_bytes() == b"\xff\xfe not utf-8"
    assert all((tmp_path / name).is_file() for name in names[3:])


def test_a_second_run_cannot_claim_a_folder_another_run_saves_into(tmp_path):
    """Two runs saving into one folder each deleted the other's step folder when it moved
    `latest`; `lm.train` now claims its --save folder on rank 0 for the whole run."""
    from pipeline_lib import run_state
    with run_state.claimed(tmp_path):
        with pytest.raises(RuntimeError, match="another run is saving into .*another --save"):
            with run_state.claimed(tmp_path):
                pass
    with run_state.claimed(tmp_path):   # released when the first run ended
        pass


def test_lm_train_claims_its_save_folder(tmp_path, monkeypatch):
    """The claim is taken before the model is built: a second run fails at once."""
    from pipeline_lib import run_state
    from pipeline_lib.lm import train
    monkeypatch.setattr(train, "process_group", lambda timeout: contextlib.nullcontext())
    monkeypatch.setattr(train, "init_mesh", lambda *args, **kwargs: _Rank0())
    monkeypatch.setattr(train, "_tokens", lambda *args: pytest.fail("the claim came late"))
    with run_state.claimed(tmp_path):
        with pytest.raises(RuntimeError, match="another run is saving into"):
            train.main(["--save", str(tmp_path), "--synthetic", "10"])


class _Rank0:
    rank = 0


# -- lm.loops ----------------------------------------------------------------------------

def _tiny_lm() -> nn.Sequential:
    from pipeline_lib.lm.model import transformer_lm
    torch.manual_seed(0)
    return transformer_lm(20, d_model=16, nhead=2, d_hid=16, nlayers=1, dropout=0.0)


@pytest.mark.parametrize("clip", [0, -1.0, math.nan, True])
def test_make_step_refuses_a_clip_that_stops_or_reverses_training(clip):
    """clip=0 scaled every gradient to 0 (the weights never moved); clip=-1 flipped their
    sign (gradient ascent); both without a word."""
    from pipeline_lib.lm.loops import make_step
    model = _tiny_lm()
    with pytest.raises(ValueError, match="clip must be a max norm > 0 .* or None"):
        make_step(model, torch.optim.SGD(model.parameters(), lr=0.1), clip)


@pytest.mark.parametrize("bptt", [0, -1])
def test_the_loops_refuse_a_bptt_below_one(bptt):
    """0 raised 'range() arg 3 must not be zero'; -1 trained on nothing and evaluate
    returned (nan, nan) as if the model were a non-final pipeline rank."""
    from pipeline_lib.lm.loops import evaluate, train_epoch
    model, source = _tiny_lm(), torch.randint(0, 20, (4, 30))
    with pytest.raises(ValueError, match="bptt must be a whole number >= 1"):
        evaluate(model, source, bptt)
    with pytest.raises(ValueError, match="bptt must be a whole number >= 1"):
        train_epoch(model, source, bptt, torch.optim.SGD(model.parameters(), lr=0.1))


def test_fit_on_a_source_with_no_batch_says_so():
    """fit divided by the number of steps, 0: ZeroDivisionError."""
    from pipeline_lib.lm.loops import fit
    source = torch.randint(0, 20, (4, 30))
    with pytest.raises(ValueError, match=r"source \(4, 1\) holds no batch.*n >= 2"):
        fit(_tiny_lm(), source[:, :1], source, bptt=5, progress=False)


# -- a script that ends right after a step ---------------------------------------------

def test_no_stage_thread_outlives_a_step():
    """Right after `step` returns, no stage thread runs (19 of 20 steps left one alive):
    the cause of the abort at exit, checked in-process, without timing luck."""
    import threading
    pipe = Pipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(4)]), balance=[1] * 4,
                chunks=4)
    for _ in range(10):
        pipe.step(torch.randn(8, 4), torch.randn(8, 4), F.mse_loss)
        assert not [t.name for t in threading.enumerate()
                    if t.name.startswith("pipeline-rank")]


# -- tools/lab.py ------------------------------------------------------------------------

@pytest.mark.parametrize("spelling", ["--ServerApp.port=99999", "--NotebookApp.port=99999"])
def test_lab_checks_the_port_in_jupyters_own_spelling_too(spelling, monkeypatch, capsys):
    """Passed through unchecked, 99999 wrapped to 34463: the printed URL served nothing."""
    import os
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    try:
        import lab
    finally:
        sys.path.pop(0)
    monkeypatch.setattr(os, "execv", lambda *args: pytest.fail("Jupyter was started"))
    with pytest.raises(SystemExit):
        lab.main([spelling])
    assert f"give the port as --port N (1 to 65535), not {spelling}" in capsys.readouterr().err
