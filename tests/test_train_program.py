"""`python -m pipeline_lib.lm.train`, the torchrun program: bad arguments are refused
before any process waits for another, with the fix in the message, and the timeline it
saves is never left half-written."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest
import torch

from pipeline_lib import run_state
from pipeline_lib.distributed.launch import torchrun
from pipeline_lib.lm import train
from pipeline_lib.lm.loops import evaluate, lm_loss
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.schedules import plan
from pipeline_lib.timeline import Timeline


@pytest.mark.parametrize("flag, fix", [
    ("--microbatches", "1 sends each replica's batch whole, unsplit"),
    ("--log-every", "1 logs every step; a number above --steps logs only the last one"),
    ("--steps", "train for at least one step"),
])
def test_a_count_of_zero_is_refused_with_the_fix(flag, fix, capsys):
    with pytest.raises(SystemExit):
        train.main([flag, "0"])
    err = capsys.readouterr().err
    assert f"argument {flag}" in err      # (--microbatches also names its old --chunks)
    assert f"must be a whole number of at least 1, not '0': {fix}" in err


def test_a_timeline_in_a_missing_folder_is_refused_before_training(tmp_path, capsys):
    target = tmp_path / "missing" / "timeline.json"
    with pytest.raises(SystemExit):
        train.main(["--timeline", str(target)])
    assert (f"--timeline {target}: folder {target.parent} does not exist; create it "
            f"(mkdir -p {target.parent})") in capsys.readouterr().err


def test_a_failed_write_keeps_the_last_good_timeline(tmp_path, monkeypatch):
    target = tmp_path / "timeline.json"
    target.write_text('{"good": true}')

    def disk_full(self: Path, text: str) -> None:
        with open(self, "w") as f:
            f.write(text[:3])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Path, "write_text", disk_full)
    with pytest.raises(OSError, match="No space left"):
        train._write_atomically(target, json.dumps({"new": list(range(1000))}))
    monkeypatch.undo()
    assert json.loads(target.read_text()) == {"good": True}
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.json"]


@pytest.mark.parametrize("schedule,actions", [("1f1b", 2 * 2 * 2),        # F, B; m = 2
                                              ("zb_v", 4 * 2 * 3)])       # F, I, W on 4 stages
def test_two_ranks_train_and_save_the_last_logged_timeline(tmp_path, schedule, actions):
    """On a V schedule the last stage, which has the loss and logs, is on rank 0. Rank 0
    times the layers: the log said the logging rank's device."""
    target = tmp_path / "timeline.json"
    output = torchrun("pipeline_lib.lm.train", [
        "--pp", "2", "--schedule", schedule, "--synthetic", "50", "--steps", "3",
        "--log-every", "2", "--batch", "4", "--bptt", "8", "--microbatches", "2",
        "--timeline", target, "--timeout", "60"], nproc=2, timeout=150)
    assert "(by time on cpu of rank 0)" in output
    assert [line.split()[1] for line in output.splitlines() if line.startswith("step")] \
        == ["2", "3"]
    timeline = Timeline.from_dict(json.loads(target.read_text()))
    assert timeline.ranks == 2 and len(timeline.events) == actions
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.json"]


@pytest.mark.parametrize("flags, message", [
    (["--timeline", "/proc/x/timeline.json"], "folder /proc/x does not exist"),
    (["--timeline", "/proc/timeline.json"], "--timeline /proc/timeline.json: cannot write in /proc"),
    (["--save", "/proc/run"], "--save /proc/run: cannot create the folder"),
    (["--clip", "-1"], "--clip: must be a number at least 0, not '-1': 0 turns clipping off"),
])
def test_paths_and_values_that_cannot_work_are_refused_before_training(flags, message, capsys):
    """Even for root, whom permission bits never stop: /proc takes no new files."""
    with pytest.raises(SystemExit):
        train.main(flags)
    assert message in capsys.readouterr().err


def test_resuming_from_a_folder_without_a_checkpoint_is_refused(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(["--resume", str(tmp_path)])
    assert f"--resume {tmp_path}: no checkpoint there" in capsys.readouterr().err


def test_balance_is_measured_on_the_training_device_in_its_precision(monkeypatch):
    """Rank 0 times the layers where the job trains, under its autocast, with the loss,
    on a model built there whose random draws leave the run's generator as it was."""
    seen = {}

    def measured(model, sample, stages, **kwargs):
        seen.update(kwargs, autocast=torch.is_autocast_enabled("cpu"), model=model)
        torch.rand(5)   # a dropout mask while timing
        return [1, 1]

    monkeypatch.setattr(train, "balance_by_time", measured)
    monkeypatch.setattr(train.dist, "get_rank", lambda: 0)
    monkeypatch.setattr(train.dist, "broadcast_object_list", lambda answer, src: None)
    device = torch.device("cpu")
    sample = (torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 3, dtype=torch.long))
    build = lambda: torch.nn.Sequential(torch.nn.Linear(3, 3))  # noqa: E731
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    assert train._balance(None, build, sample, 2, "time", device,
                          train._precision("bf16", device)) == ([1, 1], "by time on cpu of rank 0")
    assert torch.equal(torch.rand(3), expected)
    assert seen["device"] == device and seen["loss_fn"] is lm_loss and seen["autocast"]
    assert seen["target"] is sample[1] and isinstance(seen["model"][0], torch.nn.Linear)


def test_each_rank_holds_the_layers_of_its_stages():
    schedule = plan("interleaved_1f1b", 2, 4, 4)   # stages 0, 2 on rank 0; 1, 3 on rank 1
    assert train._layers_on(schedule, [2, 1, 1, 3], 0) == {0, 1, 3}
    assert train._layers_on(schedule, [2, 1, 1, 3], 1) == {2, 4, 5, 6}


def test_the_log_line_counts_tokens_and_model_flops():
    line = train._step_line(7, 2.5, 3e-4, torch.tensor(0.25), tokens=1000, seconds=0.5,
                            parameters=10**6, peak_tflops=0.024, processes=2)
    assert line.startswith("step     7  loss 2.500  lr 3.00e-04  grad norm 0.250  2,000 tokens/s")
    assert line.endswith("MFU 25.0%")   # 6 x 1e6 x 1000 FLOP / 0.5 s over 2 x 24 GFLOP/s


def test_a_run_saved_on_pp2_dp2_in_bf16_resumes_on_pp4_dp1(tmp_path):
    """The issue's commands, tiny: the resumed run goes on from the saved step, and the
    checkpoint loads into the plain model, whose validation loss is the one logged."""
    common = ["--synthetic", "50", "--batch", "8", "--bptt", "8", "--microbatches", "2",
              "--balance", "params", "--log-every", "1", "--eval-steps", "2", "--timeout", "60"]
    torchrun("pipeline_lib.lm.train", ["--pp", "2", "--dp", "2", "--clip", "0.5", "--dtype",
                                       "bf16", "--save", tmp_path, "--steps", "2", *common],
             nproc=4, timeout=200)
    output = torchrun("pipeline_lib.lm.train", ["--pp", "4", "--dp", "1", "--resume", tmp_path,
                                                "--save", tmp_path, "--steps", "3", *common],
                      nproc=4, timeout=200)
    assert "resumed after step 2" in output
    assert [line.split()[1] for line in output.splitlines() if line.startswith("step")] == ["3"]
    valid = next(line for line in output.splitlines() if line.startswith("valid loss"))
    args = train._parse_args(["--steps", "3", *common])
    _, valid_tokens, vocab = train._tokens(args, rank=0)
    model = transformer_lm(vocab, "cpu")
    model.load_state_dict(run_state.merged_state_dict(tmp_path))
    loss, _ = evaluate(model, valid_tokens, 8, max_steps=2)
    assert valid.split()[2] == f"{loss:.3f}"


def test_the_old_chunks_option_still_sets_the_micro_batches_and_says_the_new_name():
    from pipeline_lib.lm.train import _parse_args

    with pytest.warns(FutureWarning, match="--chunks is deprecated.*use --microbatches"):
        assert _parse_args(["--chunks", "2", "--synthetic", "50"]).microbatches == 2
    assert _parse_args(["--microbatches", "3", "--synthetic", "50"]).microbatches == 3
