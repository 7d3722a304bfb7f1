"""The CUDA paths that no CPU run reaches: copies between GPUs on side streams, random
streams per GPU, several GPUs in one `Pipe`, NCCL between processes, and the tutorial's
1.4-billion-parameter model.

Each test skips, with a one-line reason, where CUDA or enough GPUs are missing; on a GPU
machine ``make gpu-check`` runs them and reports (bench/gpu_check.py).
"""
from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import gpu_worker as worker
from pipeline_lib import Pipe
from pipeline_lib.devices import side_stream, transfer
from pipeline_lib.distributed.launch import torchrun
from pipeline_lib.lm.model import transformer_lm
from pipeline_lib.rng import microbatch_rng, owned_rng

GPUS = torch.cuda.device_count()
REPO = Path(__file__).resolve().parent.parent
SLEEP = 50_000_000   # GPU clock cycles (tens of ms): holds a stream up while others run
TUTORIAL_VOCAB = 28_782   # WikiText-2's, as in the tutorial: ~1.4 billion parameters


def needs_gpus(n: int) -> pytest.MarkDecorator:
    return pytest.mark.skipif(GPUS < n, reason=f"needs {n} CUDA GPU(s), found {GPUS}")


def gpu(k: int) -> torch.device:
    return torch.device("cuda", k)


@needs_gpus(2)
def test_a_copy_between_gpus_keeps_its_memory_while_it_is_read():
    """The caching allocator reuses a freed block at once on the stream that allocated
    it. Each half holds up the stream that reads a tensor, frees the tensor, and makes
    the next allocation on its allocating stream write at once: without `transfer`'s
    ``record_stream`` calls, that write lands in the block before the read."""
    n = 1 << 22   # sums of up to 3n stay exact in float32
    for _ in range(10):
        # the copy: allocated on GPU 1's side stream, read on its held-up compute stream
        with torch.cuda.device(1):
            torch.cuda._sleep(SLEEP)
        y = transfer(torch.full((n,), 1.0, device=gpu(0)), gpu(1))
        total = y.sum()
        del y
        transfer(torch.full((n,), 2.0, device=gpu(0)), gpu(1))
        assert total.item() == n
        # the source: allocated on GPU 0's compute stream, read on its held-up side stream
        with torch.cuda.stream(side_stream(gpu(0))):
            torch.cuda._sleep(SLEEP)
        x = torch.full((n,), 3.0, device=gpu(0))
        y = transfer(x, gpu(1))
        del x
        torch.full((n,), 4.0, device=gpu(0))
        assert y.sum().item() == 3 * n


@needs_gpus(1)
def test_gpu_draws_replay_per_stream_from_any_thread():
    """Fused CUDA dropout and ``torch.rand`` take no generator (the locked swap), bernoulli_
    takes one; all replay, match `owned_rng`, and "cuda" means the current GPU."""
    x = torch.randn(256, 256, device=gpu(0))

    def draws() -> list[torch.Tensor]:
        return [F.dropout(x, 0.5), torch.rand(64, device="cuda"),
                torch.empty(64, device=gpu(0)).bernoulli_(0.3), F.dropout(x.cpu(), 0.5)]

    expected = {}
    for seed in range(4):
        with owned_rng(seed, gpu(0)):
            expected[seed] = draws()
    assert not torch.equal(expected[0][0], expected[1][0])
    for device in ("cuda", gpu(0)):
        with microbatch_rng(0, device):
            assert all(torch.equal(a, b) for a, b in zip(draws(), expected[0]))
    results: dict[int, list[torch.Tensor]] = {}

    def work(seed: int) -> None:
        with microbatch_rng(seed, gpu(0)):
            results[seed] = draws()

    threads = [threading.Thread(target=work, args=(seed,)) for seed in expected]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for seed, want in expected.items():
        assert all(torch.equal(a, b) for a, b in zip(results[seed], want))


def reference_step(dropout: float = 0.0) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss and gradients of the tiny model trained on one GPU, unpipelined."""
    model = worker.tiny_lm(dropout).to(gpu(0))
    inputs, target = (t.to(gpu(0)) for t in worker.batch())
    loss = worker.token_loss(model(inputs), target)
    loss.backward()
    return loss.detach().cpu(), [p.grad.cpu() for p in model.parameters()]


def assert_trained_alike(loss, model, expected_loss, expected_grads) -> None:
    torch.testing.assert_close(loss.detach().cpu(), expected_loss, rtol=1e-4, atol=1e-5)
    for (name, p), g in zip(model.named_parameters(), expected_grads):
        torch.testing.assert_close(p.grad.cpu(), g, rtol=1e-4, atol=1e-5, msg=name)


def spread(layers: int, stages: int) -> list[int]:
    """``layers`` over ``stages`` as evenly as it goes."""
    return [layers // stages + (s < layers % stages) for s in range(stages)]


@needs_gpus(2)
@pytest.mark.parametrize("run", ["forward", "gpipe", "1f1b", "interleaved_1f1b"])
def test_pipe_on_several_gpus_trains_like_one_gpu(run):
    """One stage per GPU (two per GPU for interleaved 1F1B), up to 4 GPUs; "forward" is
    the classic ``pipe(x)`` with autograd's backward and checkpointing."""
    n = min(GPUS, 4)
    stages = 2 * n if run == "interleaved_1f1b" else n
    model = worker.tiny_lm()
    pipe = Pipe(model, chunks=2 * n, checkpoint="except_last",
                balance=spread(len(model), stages), devices=[gpu(s % n) for s in range(stages)])
    inputs, target = worker.batch()
    if run == "forward":
        loss = worker.token_loss(pipe(inputs.to(gpu(0))), target.to(gpu(n - 1)))
        loss.backward()
    else:
        loss = pipe.step(inputs, target, worker.token_loss, run)
    assert_trained_alike(loss, model, *reference_step())


@needs_gpus(2)
def test_dropout_replays_on_every_gpu():
    """Recomputed stages on two GPUs draw the masks of their first pass."""
    grads = []
    for checkpoint in ("never", "always"):
        model = worker.tiny_lm(dropout=0.5)
        torch.manual_seed(123)
        Pipe(model, chunks=4, checkpoint=checkpoint, balance=worker.BALANCE,
             devices=[gpu(0), gpu(1)]).step(*worker.batch(), worker.token_loss, "1f1b")
        grads.append([p.grad.cpu() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@needs_gpus(1)
def test_index_less_cuda_devices_run_a_pipe():
    """``devices=["cuda", "cuda"]`` means the current GPU twice: its stage threads can
    ``set_device`` it, and nothing is copied between its stages."""
    model = worker.tiny_lm()
    pipe = Pipe(model, chunks=4, balance=worker.BALANCE, devices=["cuda", "cuda"])
    assert pipe.devices == [gpu(torch.cuda.current_device())] * 2
    loss = pipe.step(*worker.batch(), worker.token_loss, "1f1b")
    assert_trained_alike(loss, model, *reference_step())


@pytest.mark.skipif(not dist.is_nccl_available(), reason="this PyTorch build has no NCCL")
@needs_gpus(2)
def test_distributed_pipe_over_nccl_trains_like_the_threaded_pipe(tmp_path, monkeypatch):
    """Two processes, one GPU each, talking NCCL (tests/gpu_worker.py): the loss and gradients of unpipelined
    training without dropout; with dropout, those of `Pipe` on the same two GPUs (whose
    masks the processes must draw too)."""
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(
        [str(REPO / "tests"), str(REPO), os.environ.get("PYTHONPATH", "")]))
    torchrun("gpu_worker", ["--out", tmp_path], nproc=2, timeout=300)
    for dropout in worker.DROPOUTS:
        if dropout:
            model = worker.tiny_lm(dropout)
            pipe = Pipe(model, worker.MICROBATCHES, "never", worker.BALANCE, [gpu(0), gpu(1)])
            loss = pipe.step(*worker.batch(), worker.token_loss, "1f1b").cpu()
            names = [n for n, _ in model.named_parameters()]
            expected = dict(zip(names, (p.grad.cpu() for p in model.parameters())))
        else:
            loss, grads = reference_step()
            names = [n for n, _ in worker.tiny_lm().named_parameters()]
            expected = dict(zip(names, grads))
        ranks = [torch.load(tmp_path / f"dropout{dropout}-rank{r}.pt") for r in range(2)]
        assert ranks[0]["loss"] is None
        assert ranks[1]["loss"] == pytest.approx(loss.item(), rel=1e-4)
        got = {**ranks[0]["grads"], **ranks[1]["grads"]}
        assert got.keys() == expected.keys()
        for name, g in got.items():
            torch.testing.assert_close(g, expected[name], rtol=1e-4, atol=1e-5, msg=name)


@needs_gpus(1)
def test_tutorial_preset_steps_on_gpus():
    """The tutorial's model, on two GPUs (or one): `Pipe.step`'s loss is the unpipelined
    forward's and every parameter gets a finite gradient."""
    n = min(GPUS, 2)
    with torch.device("meta"):
        params = sum(p.numel() for p in transformer_lm(TUTORIAL_VOCAB, "tutorial").parameters())
    assert 1.3e9 < params < 1.5e9
    need = 2.5 * 4 * params   # float32 parameters and gradients, activations, workspace
    free = sum(torch.cuda.mem_get_info(k)[0] for k in range(n))
    if free < need:
        pytest.skip(f"needs ~{need / 2**30:.0f} GiB free on {n} GPU(s), found "
                    f"{free / 2**30:.0f} GiB")
    torch.manual_seed(0)
    with torch.device(gpu(0)):
        model = transformer_lm(TUTORIAL_VOCAB, "tutorial", dropout=0.0)
    g = torch.Generator().manual_seed(0)
    inputs, target = (torch.randint(0, TUTORIAL_VOCAB, (8, 35), generator=g) for _ in range(2))
    with torch.no_grad():
        expected = worker.token_loss(model(inputs.to(gpu(0))), target.to(gpu(0))).cpu()
    pipe = Pipe(model, chunks=4, balance=[7, 7], devices=[gpu(0), gpu(n - 1)])
    loss = pipe.step(inputs, target, worker.token_loss, "1f1b")
    torch.testing.assert_close(loss.cpu(), expected, rtol=1e-4, atol=1e-4)
    for name, p in model.named_parameters():
        assert p.grad is not None and torch.isfinite(p.grad).all(), name
