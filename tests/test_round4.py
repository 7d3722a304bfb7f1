"""Issue 35: no silent wrong answer, round 3 of the hostile user's findings, each checked
against what PyTorch computes on the unpipelined model where there is a value, and each
error for naming what was wrong and the fix. Input gradients have their own file
(`test_input_grads.py`); the checks that need two processes run in one torchrun launch
(`dist_round4_worker.py`, the ``two_ranks`` fixture)."""
from __future__ import annotations

import copy
import errno
import math
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from launch_worker import torchrun_worker
from pipeline_lib import Pipe, SumCount, run_state
from pipeline_lib.grad_clip import clip_grad_norm_


def sum_count(out: torch.Tensor, target: torch.Tensor) -> SumCount:
    return SumCount(F.mse_loss(out, target, reduction="sum"), target.numel())


# -- 7. pipe(x) from another thread during a step --------------------------------------

def test_a_backward_of_pipe_x_during_a_sum_count_step_is_not_scaled_by_its_count():
    """pipe(x)'s backward, run from another thread while a SumCount step ran, added into
    the .grad the step had set aside, and the step divided it by its count (32): the
    weights got 1/32 of that gradient. Now it waits for the step: exact, however the
    threads are timed (here the step's loss takes its time, once the other has begun)."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    plain = copy.deepcopy(layers)
    x, y, other = torch.randn(8, 4), torch.randn(8, 4), torch.randn(8, 4)
    (F.mse_loss(plain(x), y) + plain(other).sum()).backward()
    pipe = Pipe(layers, chunks=4, balance=[2, 1], checkpoint="never")
    started = threading.Event()

    def slow_loss(out: torch.Tensor, target: torch.Tensor) -> SumCount:
        started.set()
        time.sleep(0.05)
        return sum_count(out, target)

    def elsewhere() -> None:
        started.wait(10)
        pipe(other).sum().backward()

    thread = threading.Thread(target=elsewhere)
    thread.start()
    pipe.step(x, y, slow_loss)
    thread.join()
    for p, q in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)



def test_a_backward_of_pipe_x_inside_the_steps_loss_fn_neither_hangs_nor_is_scaled():
    """Its stage backwards run on a step's thread (on a GPU, on the device's autograd
    thread, which the step's own backwards need): waiting there for the step to end
    would never end. Its gradients are held and added, unscaled, when the step ends."""
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    plain = copy.deepcopy(layers)
    aside, x, y = torch.randn(4, 4), torch.randn(4, 4), torch.randn(4, 4)
    (plain(aside).sum() + F.mse_loss(plain(x), y, reduction="sum") / y.numel()).backward()
    pipe = Pipe(layers, chunks=2, balance=[2, 1])
    pending = [pipe(aside).sum()]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> SumCount:
        if pending:
            pending.pop().backward()
        return sum_count(out, target)

    stepping = threading.Thread(target=pipe.step, args=(x, y, loss_fn, "1f1b"), daemon=True)
    stepping.start()
    stepping.join(60)
    assert not stepping.is_alive(), "the step hangs"
    for p, q in zip(pipe.parameters(), plain.parameters()):
        torch.testing.assert_close(p.grad, q.grad)

# -- two processes: one torchrun launch for all of them --------------------------------

@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> list[dict]:
    """What each rank of `dist_round4_worker.py` recorded (see its docstring)."""
    out = tmp_path_factory.mktemp("round4")
    torchrun_worker("dist_round4_worker.py", 2, "--out", str(out))
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]


@pytest.mark.parametrize("chunks", [1, 3])
@pytest.mark.parametrize("flag", ["static_graph", "find_unused_parameters"])
def test_sync_pipe_inside_ddp_takes_its_flags_as_the_plain_model_does(two_ranks, flag, chunks):
    """1. static_graph=True never averaged the gradients (each process kept its own);
    find_unused_parameters=True raised 'Expected to mark a variable ready only once'.
    Both were hidden from DDP by the LocalRRef around the output."""
    for rank in two_ranks:
        for step in range(2):
            got, want = rank["ddp"][f"{flag}-{chunks}-{step}"]
            assert len(got) == len(want) == 4   # the spare parameter gets none, as there
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w)
    for g, h in zip(two_ranks[0]["ddp"][f"{flag}-{chunks}-1"][0],
                    two_ranks[1]["ddp"][f"{flag}-{chunks}-1"][0]):
        torch.testing.assert_close(g, h)   # averaged: the same on both processes


@pytest.mark.parametrize("norm", [2.0, math.inf])
@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_clipping_finds_a_nonfinite_gradient_on_another_pipeline_rank(two_ranks, bad, norm):
    """2. A NaN gradient on pipeline rank 1 passed the inf-norm as finite (0.381 on both
    ranks: gloo's maximum drops NaN), and rank 1 kept its NaN. Now every rank finds
    PyTorch's norm, and with error_if_nonfinite every rank raises, gradients untouched."""
    for rank in two_ranks:
        found = rank["clip"][f"{bad}-{norm}"]
        assert found["want_raised"] is not None
        assert found["raised"] is not None and "gradients is" in found["raised"]
        assert found["kept"]
        assert str(found["total"]) == str(found["want"])   # nan == nan, inf == inf


def test_ranks_given_other_target_values_are_refused_naming_them(two_ranks):
    """9. The fingerprint compared shapes only: other targets on one rank trained."""
    for rank in two_ranks:
        assert "rank 1 is at step 1" in rank["agree"]["error"]
        assert "target values other than rank 0's" in rank["agree"]["error"]
        assert "input values" not in rank["agree"]["error"]


def test_ranks_given_another_flag_in_their_inputs_are_refused(two_ranks):
    """Hostile round 4: a string in the inputs (a mode flag) differing on one rank trained
    without a word: only tensors were fingerprinted."""
    for rank in two_ranks:
        assert "rank 1 is at step 1 with inputs (float32[6, 4], str)" in rank["agree"]["flag"]
        assert "input values other than rank 0's" in rank["agree"]["flag"]


def test_distributed_pipe_gives_the_input_its_gradient_where_stage_0_runs(two_ranks):
    """4. The unpipelined model's x.grad: on the rank holding stage 0 (SumCount, 1F1B);
    with two replicas, each replica's rows on its own rank (ZB-H1's split backward)."""
    pipeline = [rank["input"]["2x1-1f1b-sumcount"] for rank in two_ranks]
    torch.testing.assert_close(pipeline[0]["got"], pipeline[0]["want"])
    assert pipeline[1]["got"] is None
    replicas = [rank["input"]["1x2-zb_h1-mean"] for rank in two_ranks]
    torch.testing.assert_close(replicas[0]["got"] + replicas[1]["got"], replicas[0]["want"])
    assert not replicas[0]["got"][3:].any() and not replicas[1]["got"][:3].any()


def test_resume_keeps_each_ranks_optimizer_settings_and_restores_its_state(two_ranks):
    """5. Every rank got rank 0's lr and weight decay, and ranks with other numbers of
    parameter groups could not resume at all."""
    assert two_ranks[0]["optimizer"]["settings"] == [(0.01, 0.0)]
    assert two_ranks[1]["optimizer"]["settings"] == [(0.002, 0.5), (0.003, 0.1)]
    for rank in two_ranks:
        assert rank["optimizer"]["resumed_at"] == 1 and rank["optimizer"]["restored"]


def test_an_optimizer_holding_a_parameter_outside_the_pipe_is_refused(two_ranks):
    """5. Its state was dropped at save, and the resume failed with KeyError."""
    for rank in two_ranks:   # a save is refused on every rank, naming rank 1's
        assert "rank 1: the optimizer holds 1 parameter(s) that are not the pipe's" \
            in rank["optimizer"]["save_outside"]
    assert two_ranks[0]["optimizer"]["resume_outside"] is None
    assert "cannot be restored" in two_ranks[1]["optimizer"]["resume_outside"]


def test_a_nan_weight_is_never_saved_over_the_last_good_checkpoint(two_ranks):
    """3. A diverged run's save deleted the good checkpoint for one all NaN."""
    for rank in two_ranks:
        assert "rank 1: the weights or optimizer state after step 3 hold NaN or inf " \
               "values (2.weight)" in rank["optimizer"]["save_nan"]
        assert rank["optimizer"]["latest"] == "step-000001"
        assert rank["optimizer"]["folders"] == ["latest", "step-000001"]


def test_clipping_on_one_rank_only_says_so_when_its_wait_ends(two_ranks):
    """10. The error was gloo's receive timeout alone, not a word of clipping."""
    error = two_ranks[0]["one-rank-clip"]["error"]
    assert "Timed out" in error
    assert "clip_grad_norm_ all-reduced the gradient norm over the pipeline's ranks [0, 1]" \
        in error and "every one of them must call" in error


# -- 3 and 10. lm.train: a run that diverges, --steps beyond the data, --seed ----------

def short_run(*flags: str) -> subprocess.CompletedProcess:
    """`lm.train` on one process and a training split of 3 batches (`train_short_data`)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "1", str(Path(__file__).parent / "train_short_data.py"),
               "--pp", "1", "--batch", "2", "--bptt", "4", "--microbatches", "1",
               "--balance", "params", "--log-every", "1", "--eval-every", "0",
               "--eval-steps", "1", "--timeout", "60", *flags]
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=200)


def test_a_diverging_run_stops_naming_the_step_and_keeps_the_good_checkpoint(tmp_path):
    """3. `--resume D --save D --lr 1e30` exited 0 logging `loss nan`, deleted the good
    checkpoint and saved one all NaN. 10. `--steps 5` on 3 batches trained 3 steps without
    a word (and a resume then said "raise --steps"): it goes round the data again."""
    first = short_run("--steps", "5", "--save", str(tmp_path))
    said = first.stdout + first.stderr
    assert first.returncode == 0, said
    assert "--steps 5 goes 1.67 times over the training data's 3 batches" in said
    assert [line.split()[1] for line in first.stdout.splitlines()
            if line.startswith("step")] == ["1", "2", "3", "4", "5"]
    good = run_state.merged_state_dict(tmp_path)
    second = short_run("--steps", "9", "--resume", str(tmp_path), "--save", str(tmp_path),
                       "--lr", "1e30", "--warmup", "0")
    assert second.returncode != 0
    said = second.stdout + second.stderr
    assert re.search(r"step +6  loss \d", said)   # its update makes the next loss inf
    assert "step 7: the loss and the gradient norm are NaN or inf: the run has diverged" \
        in said and f"the newest checkpoint, {tmp_path / 'step-000005'}, is kept" in said
    assert (tmp_path / run_state.LATEST).read_text() == "step-000005"
    kept = run_state.merged_state_dict(tmp_path)
    assert all(torch.equal(kept[k], good[k]) for k in good)


def test_a_nonfinite_step_is_found_on_every_rank_then_skipped_or_stopped(one_rank_mesh,
                                                                         capsys):
    """What the run checks once per step: the loss (on the last stage's ranks) and the
    gradient norm (read from the gradients when --clip is 0), all-reduced."""
    from pipeline_lib.lm import train
    pipe, _, _ = _trained(one_rank_mesh)
    finite = torch.tensor(1.0)
    assert train._nonfinite(finite, None, pipe) is None
    assert train._nonfinite(None, finite, pipe) is None   # a rank without the loss
    assert train._nonfinite(torch.tensor(math.nan), finite, pipe) == "the loss is NaN or inf"
    next(pipe.parameters()).grad[0, 0] = math.inf
    assert train._nonfinite(finite, None, pipe) == "the gradient norm is NaN or inf"
    args = train._parse_args(["--skip-nonfinite", "1"])
    train._stop_or_skip(7, "the loss is NaN or inf", 1, args, logs=True)
    assert "step     7  skipped: the loss is NaN or inf (1 of at most 1 skipped)" \
        in capsys.readouterr().out
    with pytest.raises(RuntimeError, match=r"step 8: the loss is NaN or inf: the run has "
                                           r"diverged .*\(1 such step\(s\) skipped so far, "
                                           r"--skip-nonfinite 1\); start again"):
        train._stop_or_skip(8, "the loss is NaN or inf", 2, args, logs=True)


def test_a_seed_torch_cannot_take_is_refused_naming_seed(capsys):
    """10. --seed 2**64 failed after start-up in torch.manual_seed, without naming it."""
    from pipeline_lib.lm import train
    with pytest.raises(SystemExit):
        train._parse_args(["--seed", str(2**64)])
    assert "argument --seed: must be a whole number from 0 to 18446744073709551614" \
        in capsys.readouterr().err
    seed = train._parse_args(["--seed", str(2**64 - 2)]).seed
    torch.manual_seed(seed)
    torch.Generator().manual_seed(seed + 1)   # the validation data's


# -- 10. grad_clip and run_state ----------------------------------------------------------

def test_clip_takes_foreach_as_pytorch_does():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4))
    pipe = Pipe(copy.deepcopy(plain), chunks=2, balance=[2, 1])
    x, y = torch.randn(4, 4), torch.randn(4, 4)
    pipe.step(x, y, F.mse_loss)
    F.mse_loss(plain(x), y).backward()
    for foreach in (True, False, None):
        got = clip_grad_norm_(pipe, 0.01, foreach=foreach)
        want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01, foreach=foreach)
        torch.testing.assert_close(got, want)
        for p, q in zip(pipe.parameters(), plain.parameters()):
            torch.testing.assert_close(p.grad, q.grad)


def _trained(mesh, step: int = 1):
    from pipeline_lib.distributed import DistributedPipe
    torch.manual_seed(0)
    pipe = DistributedPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)]), mesh,
                           [1, 1], 2, "zb_v")
    optimizer = torch.optim.AdamW(pipe.parameters())
    pipe.step(torch.randn(4, 4), torch.randn(4, 4), F.mse_loss)
    optimizer.step()
    return pipe, [1, 1], optimizer


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full to fill a disk")
def test_a_full_disk_during_a_save_is_named_and_the_last_checkpoint_kept(
        one_rank_mesh, tmp_path, monkeypatch):
    """10. It said "enforce fail at inline_container.cc ... unexpected pos", no path, no
    "disk full". The fake: torch.save writes into /dev/full, a disk that is always full."""
    run_state.save(tmp_path, 1, *_trained(one_rank_mesh))
    real_save = torch.save

    def onto_a_full_disk(obj, f, *args, **kwargs):
        with open("/dev/full", "wb") as full:
            real_save(obj, full, *args, **kwargs)

    monkeypatch.setattr(torch, "save", onto_a_full_disk)
    with pytest.raises(OSError, match=r"no space left to save .*step-000002/stage-0.pt \(the "
                                      r"disk is full or over quota: .* MiB free there\); free "
                                      r"some space .* is unchanged") as raised:
        run_state.save(tmp_path, 2, *_trained(one_rank_mesh))
    assert raised.value.errno == errno.ENOSPC
    monkeypatch.undo()
    assert (tmp_path / run_state.LATEST).read_text() == "step-000001"
    assert not list(tmp_path.rglob("*.part"))
    assert run_state.resume(tmp_path, *_trained(one_rank_mesh)) == 1


def test_what_a_killed_save_left_goes_at_the_next_save(one_rank_mesh, tmp_path):
    """10. Temporary files and step folders that `latest` never named stayed for ever;
    a learner's own file in one stays still."""
    run_state.save(tmp_path, 1, *_trained(one_rank_mesh))
    dead = tmp_path / "step-000007"
    dead.mkdir()
    (dead / ".stage-0.pt.4242.part").write_bytes(b"half")
    (dead / "stage-1.pt").write_bytes(b"whole but alone")
    (dead / "notes.txt").write_text("mine")
    (tmp_path / "step-000001" / ".run.pt.4242.part").write_bytes(b"half")
    run_state.save(tmp_path, 2, *_trained(one_rank_mesh))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-000002",
                                                          "step-000007"]
    assert [p.name for p in dead.iterdir()] == ["notes.txt"]
    assert not list(tmp_path.rglob("*.part"))


# -- 8. make lab -----------------------------------------------------------------------

def _lab():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))
    try:
        import lab
    finally:
        sys.path.pop(0)
    return lab


@pytest.mark.parametrize("argv, environ, spelled", [
    (["--LabApp.port=99999"], {}, "--LabApp.port=99999"),
    (["--ServerApp.port", "70000"], {}, "--ServerApp.port"),
    ([], {"JUPYTER_PORT": "99999"}, "JUPYTER_PORT=99999 (in the environment)"),
    ([], {"JUPYTER_PORT": "eighty"}, "JUPYTER_PORT=eighty (in the environment)"),
])
def test_lab_checks_the_port_however_jupyter_is_given_it(argv, environ, spelled, monkeypatch,
                                                         capsys):
    """8. --LabApp.port=99999 (Jupyter moves it to ServerApp) and JUPYTER_PORT=99999 went
    through: Jupyter listened on 34463 and printed :99999."""
    lab = _lab()
    monkeypatch.delenv("JUPYTER_PORT", raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(os, "execv", lambda *args: pytest.fail("Jupyter was started"))
    with pytest.raises(SystemExit):
        lab.main(argv)
    assert f"give the port as --port N (1 to 65535), not {spelled}" in capsys.readouterr().err


def test_lab_passes_a_good_port_in_any_spelling_and_lets_port_override_the_environment(
        monkeypatch):
    lab = _lab()
    started = []
    monkeypatch.setattr(os, "execv", lambda path, cmd: started.append(cmd))
    monkeypatch.setenv("JUPYTER_PORT", "99999")   # --port wins, as Jupyter's own option would
    lab.main(["--port", "9000"])
    monkeypatch.delenv("JUPYTER_PORT")
    lab.main(["--LabApp.port=9001", "--ServerApp.port_retries=0"])
    assert "--port=9000" in started[0]
    assert started[1][-2:] == ["--LabApp.port=9001", "--ServerApp.port_retries=0"]
