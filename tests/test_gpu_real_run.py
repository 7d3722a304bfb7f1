"""A real run's pieces on 2 GPUs: each rank on its own GPU over NCCL, bfloat16 autocast,
global gradient clipping, checkpoints resumed on another layout, and `lm.train` with all of
them. `make gpu-check` runs this file (and test_gpu.py) and prints a pass/fail table; on a
machine with fewer GPUs every test skips, saying why. The same workers run on CPUs over
gloo in test_grad_clip.py, test_mixed_precision.py and test_run_state.py; here they take
their CUDA branches: `launch.rank_device`'s NCCL pin, `grad_clip`'s all-reduce of a GPU
norm, `run_state`'s copies between GPU and disk, `pipeline_eval`'s messages over NCCL,
autocast on "cuda", and layer times measured on a GPU.
"""
from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import dist_train_worker as worker
from dist_worker import MICROBATCHES, batch, tiny_lm, token_loss
from launch_worker import torchrun_worker
from pipeline_lib import Pipe, run_state
from pipeline_lib.distributed.launch import torchrun
from pipeline_lib.grad_clip import clip_grad_norm_
from pipeline_lib.schedules import build

GPUS = torch.cuda.device_count()
pytestmark = [
    pytest.mark.skipif(GPUS < 2, reason=f"needs 2 CUDA GPUs, found {GPUS}"),
    pytest.mark.skipif(not dist.is_nccl_available(), reason="this PyTorch build has no NCCL"),
]
TOLERANCE = dict(rtol=1e-4, atol=1e-6)   # GPU kernels sum in another order than the CPU's


@functools.cache
def launched(*args: str) -> Path:
    """The folder of one 2-GPU launch of the worker (each launch runs once per session)."""
    out = Path(tempfile.mkdtemp(prefix="gpu-run-"))
    torchrun_worker("dist_train_worker.py", 2, *args, "--backend", "default", "--out", str(out))
    return out


def reference(norm: str) -> tuple[float, dict[str, torch.Tensor]]:
    model = tiny_lm()
    token_loss(model(batch()[0]), batch()[1]).backward()
    total = torch.nn.utils.clip_grad_norm_(model.parameters(), worker.CLIP[norm],
                                           worker.NORMS[norm])
    return total.item(), {n: p.grad for n, p in model.named_parameters()}


def test_each_rank_computes_on_its_own_gpu_over_nccl():
    out = launched("--scenario", "clip")
    for r in range(2):
        rank = torch.load(out / f"2x1-1f1b-2-rank{r}.pt")
        assert (rank["backend"], rank["device"], rank["current_gpu"]) == ("nccl", f"cuda:{r}", r)


@pytest.mark.parametrize("mesh", ["2x1", "1x2"])
def test_clipping_on_gpus_equals_one_process(mesh):
    out = launched("--scenario", "clip")
    pp, dp = (int(n) for n in mesh.split("x"))
    for norm in worker.NORMS:
        want_norm, want = reference(norm)
        for name in worker.CLIP_SCHEDULES:
            for d in range(dp):
                got: dict[str, torch.Tensor] = {}
                for r in range(d * pp, (d + 1) * pp):
                    rank = torch.load(out / f"{mesh}-{name}-{norm}-rank{r}.pt")
                    assert rank["norm"] == pytest.approx(want_norm, rel=1e-4), (name, norm)
                    got.update(rank["grads"])
                for n in want:
                    torch.testing.assert_close(got[n], want[n], **TOLERANCE,
                                               msg=f"{mesh} {name} {norm}: {n}")


def test_threaded_pipe_clips_across_two_gpus():
    want_norm, want = reference("2")
    model = tiny_lm()
    pipe = Pipe(model, MICROBATCHES, "never", [4, 4], devices=["cuda:0", "cuda:1"])
    pipe.step(*batch(), token_loss, build("1f1b", 2, MICROBATCHES))
    assert clip_grad_norm_(pipe, worker.CLIP["2"]).item() == pytest.approx(want_norm, rel=1e-4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad.cpu(), want[n], **TOLERANCE, msg=n)


def test_bf16_on_gpus_keeps_weights_float32_and_sends_autocasts_dtype():
    out = launched("--scenario", "clip")
    for model, dtype in (("linear", torch.bfloat16), ("lm", torch.float32)):
        for r in range(2):
            rank = torch.load(out / f"bf16-{model}-rank{r}.pt")
            assert rank["weights"] == rank["grads"] == [str(torch.float32)]
            assert set(rank["sent"]) | set(rank["received"]) == {
                f"activation:{dtype}", f"gradient:{dtype}"}, (model, r)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        want = token_loss(tiny_lm().cuda()(batch()[0].cuda()), batch()[1].cuda()).item()
    assert torch.load(out / "bf16-lm-rank1.pt")["loss"] == pytest.approx(want, rel=5e-3)


@pytest.mark.parametrize("resumed,uninterrupted", [("2x1-to-1x2", "2x1"),
                                                   ("2x1-dropout-to-2x1", "2x1-dropout")])
def test_a_run_resumed_on_gpus_continues(resumed, uninterrupted):
    """Within rounding: CUDA's embedding backward adds with atomics, in any order."""
    out = launched("--scenario", "resume", "--phase", "gpu")
    full = json.loads((out / f"{uninterrupted}.json").read_text())
    got = json.loads((out / f"{resumed}.json").read_text())
    assert got == pytest.approx(full[worker.SAVED_AT:], rel=1e-4)


def test_the_training_program_on_two_gpus(tmp_path):
    """bf16, clipping, balance timed on the GPU, validation over NCCL, save and resume."""
    common = ["--synthetic", "50", "--batch", "8", "--bptt", "16", "--microbatches", "2",
              "--log-every", "1", "--eval-steps", "2", "--timeout", "120"]
    first = torchrun("pipeline_lib.lm.train", ["--pp", "2", "--dtype", "bf16", "--clip", "0.5",
                                               "--steps", "3", "--save", tmp_path, *common],
                     nproc=2, timeout=300)
    assert "by time on cuda:0 of rank 0" in first and "valid loss" in first
    second = torchrun("pipeline_lib.lm.train", ["--pp", "1", "--dp", "2", "--dtype", "bf16",
                                                "--steps", "5", "--resume", tmp_path, *common],
                      nproc=2, timeout=300)
    assert "resumed after step 3" in second
    merged = run_state.merged_state_dict(tmp_path)
    assert all(t.dtype == torch.float32 for t in merged.values() if t.is_floating_point())
