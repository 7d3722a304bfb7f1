"""`grad_clip.clip_grad_norm_` clips a pipelined model as `torch.nn.utils.clip_grad_norm_`
clips the unpipelined one: the whole model's norm, over every stage (and, with DDP, after
the replicas' average), in both executors and on every schedule, V schedules included."""
from __future__ import annotations

import math

import pytest
import torch

import dist_train_worker as worker
from dist_worker import MICROBATCHES, batch, tiny_lm, token_loss
from launch_worker import clip_and_bf16_run
from pipeline_lib import Pipe
from pipeline_lib.grad_clip import clip_grad_norm_
from pipeline_lib.schedules import build, stages_per_rank


def reference(norm: str) -> tuple[float, dict[str, torch.Tensor]]:
    """One process on the global batch, clipped by PyTorch."""
    model = tiny_lm()
    inputs, target = batch()
    token_loss(model(inputs), target).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), worker.CLIP[norm],
                                           worker.NORMS[norm])
    assert total > worker.CLIP[norm]   # clipping is active, or the test proves nothing
    return total.item(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("norm", sorted(worker.NORMS))
@pytest.mark.parametrize("name", worker.CLIP_SCHEDULES)
def test_threaded_pipe_clips_the_whole_model(name, norm):
    want_norm, want = reference(norm)
    model = tiny_lm()
    ranks = 2
    stages = ranks * stages_per_rank(name)
    pipe = Pipe(model, MICROBATCHES, "never", worker.even_balance(len(model), stages))
    pipe.step(*batch(), token_loss, build(name, ranks, MICROBATCHES))
    total = clip_grad_norm_(pipe, worker.CLIP[norm], worker.NORMS[norm])
    assert total.item() == pytest.approx(want_norm, rel=1e-5)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=1e-5, atol=1e-7, msg=n)


@pytest.fixture(scope="module")
def clipped():
    return clip_and_bf16_run()


@pytest.mark.parametrize("mesh", ["4x1", "2x2"])
def test_distributed_pipe_clips_the_whole_model_on_every_schedule(clipped, mesh):
    """Each rank's norm is the whole model's, and its clipped gradients are PyTorch's."""
    pp, dp = (int(n) for n in mesh.split("x"))
    for norm in worker.NORMS:
        want_norm, want = reference(norm)
        for name in worker.CLIP_SCHEDULES:
            ranks = [torch.load(clipped / f"{mesh}-{name}-{norm}-rank{r}.pt")
                     for r in range(pp * dp)]
            for d in range(dp):
                got: dict[str, torch.Tensor] = {}
                for rank in ranks[d * pp:(d + 1) * pp]:
                    assert rank["norm"] == pytest.approx(want_norm, rel=1e-5), (name, norm)
                    got.update(rank["grads"])
                assert got.keys() == want.keys()
                for n in want:
                    torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7,
                                               msg=f"{name}, {norm}-norm, replica {d}: {n}")


def test_bad_arguments_are_refused_with_the_fix():
    pipe = Pipe(tiny_lm(), MICROBATCHES, "never", [4, 4])
    with pytest.raises(ValueError, match="max_norm must be positive.*0.5"):
        clip_grad_norm_(pipe, 0.0)
    with pytest.raises(ValueError, match="norm_type must be at least 1 or math.inf"):
        clip_grad_norm_(pipe, 1.0, 0.5)
    assert clip_grad_norm_(pipe, 1.0, math.inf).item() == 0.0   # no gradients yet
