"""Checkpoints outlive the layout: a run saved on one pipeline goes on, on another, with
the losses of a run that was never interrupted; the merged checkpoint is the plain model's
state dict.

Two launches (`dist_train_worker.py`): 4 processes train and save (pp 4 x dp 1, pp 2 x dp 2,
with and without dropout) and resume on 4 x 1 and 2 x 2; 2 processes resume on 1 x 2 and
2 x 1. Exact (bit for bit) where a step's arithmetic does not depend on the layout: the
same dp, no dropout, or with dropout the same layout (see `run_state`).
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import dist_train_worker as worker
from dist_worker import tiny_lm, token_loss
from launch_worker import torchrun_worker
from pipeline_lib import run_state


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("runs")
    for phase, nproc in (("save", 4), ("resume", 2)):
        torchrun_worker("dist_train_worker.py", nproc, "--scenario", "resume",
                        "--phase", phase, "--out", str(out))
    return out


def losses(out: Path, run: str) -> list[float]:
    return json.loads((out / f"{run}.json").read_text())


@pytest.mark.parametrize("resumed,uninterrupted", [
    ("2x2-to-1x2", "2x2"),                     # pp 2 -> 1
    ("4x1-to-2x1", "4x1"),                     # pp 4 -> 2
    ("2x2-dropout-to-2x2", "2x2-dropout"),     # dropout: the same layout
])
def test_a_resumed_run_continues_exactly(runs, resumed, uninterrupted):
    full = losses(runs, uninterrupted)
    assert len(full) == worker.STEPS and full[0] != full[-1]
    assert losses(runs, resumed) == full[worker.SAVED_AT:]


def test_a_resumed_run_with_other_replicas_continues_within_rounding(runs):
    """pp 2 x dp 2 -> pp 4 x dp 1: the replicas' average is summed in another order."""
    full = losses(runs, "2x2")
    assert losses(runs, "2x2-to-4x1") == pytest.approx(full[worker.SAVED_AT:], rel=1e-5)


def test_the_merged_checkpoint_is_the_plain_models_state_dict(runs):
    """Its keys are the plain model's, and loaded into it, the loss on the next batch is
    the loss the pipelined run computed there."""
    merged = run_state.merged_state_dict(runs / "2x2")
    model = tiny_lm()
    assert merged.keys() == model.state_dict().keys()
    model.load_state_dict(merged)
    model.eval()
    with torch.no_grad():
        loss = token_loss(model(worker.step_batch(worker.SAVED_AT)[0]),
                          worker.step_batch(worker.SAVED_AT)[1])
    assert loss.item() == pytest.approx(losses(runs, "2x2")[worker.SAVED_AT], rel=1e-5)


def test_a_checkpoint_holds_only_complete_steps(runs):
    """`latest` names the one step folder left; no temporary file remains."""
    folder = runs / "2x2"
    assert (folder / "latest").read_text() == f"step-{worker.SAVED_AT:06d}"
    assert sorted(p.name for p in folder.iterdir()) == ["latest", f"step-{worker.SAVED_AT:06d}"]
    assert sorted(p.name for p in (folder / f"step-{worker.SAVED_AT:06d}").iterdir()) == \
        ["run.pt", "stage-0.pt", "stage-1.pt"]


def test_a_folder_without_a_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="holds no checkpoint.*--save"):
        run_state.merged_state_dict(tmp_path)
