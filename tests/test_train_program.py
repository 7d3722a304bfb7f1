"""`python -m pipeline_lib.lm.train`, the torchrun program: bad arguments are refused
before any process waits for another, with the fix in the message, and the timeline it
saves is never left half-written."""
from __future__ import annotations

import errno
import json
from pathlib import Path

import pytest

from pipeline_lib.distributed.launch import torchrun
from pipeline_lib.lm import train
from pipeline_lib.timeline import Timeline


@pytest.mark.parametrize("flag, fix", [
    ("--chunks", "1 sends each replica's batch whole, unsplit"),
    ("--log-every", "1 logs every step; a number above --steps logs only the last one"),
    ("--steps", "train for at least one step"),
])
def test_a_count_of_zero_is_refused_with_the_fix(flag, fix, capsys):
    with pytest.raises(SystemExit):
        train.main([flag, "0"])
    assert f"argument {flag}: must be a whole number of at least 1, not '0': {fix}" \
        in capsys.readouterr().err


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
    """On a V schedule the last stage, which has the loss and logs, is on rank 0."""
    target = tmp_path / "timeline.json"
    output = torchrun("pipeline_lib.lm.train", [
        "--pp", "2", "--schedule", schedule, "--synthetic", "50", "--steps", "3",
        "--log-every", "2", "--batch", "4", "--bptt", "8", "--chunks", "2",
        "--balance", "params", "--timeline", target, "--timeout", "60"], nproc=2, timeout=150)
    assert [line.split()[1] for line in output.splitlines() if line.startswith("step")] \
        == ["2", "3"]
    timeline = Timeline.from_dict(json.loads(target.read_text()))
    assert timeline.ranks == 2 and len(timeline.events) == actions
    assert [p.name for p in tmp_path.iterdir()] == ["timeline.json"]
