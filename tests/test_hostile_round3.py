"""Round 3 of the hostile user (issue 26's closing demand): inputs beyond the issue's list,
each compared with plain PyTorch where a value is computed, each error checked for naming
what was wrong and the fix."""
from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from pipeline_lib import Pipe
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
    (["--batch", "16", "--chunks", "100"], "use --batch >= 100 (--dp x --chunks)"),
    (["--batch", "4", "--dp", "8", "--chunks", "1"], "use --batch >= 8"),
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
