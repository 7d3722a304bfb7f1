"""The hostile user, round 4 (issue 35): cases around every public entry point that issue
35 touched and their neighbours, each judged against PyTorch on the unpipelined model
where there is a value, and each error for saying what was wrong and how to fix it.

    python tests/hostile_round4.py                 # every case; a table of outcomes
    python tests/hostile_round4.py --only clip     # the cases whose name starts so
    python tests/hostile_round4.py --no-processes  # skip the two-process cases

Outcomes: ``ok`` (the right answer, or the clear error expected), ``WRONG`` (a wrong value
or a bad input accepted), ``UNCLEAR`` (an error that does not say what or how),
``CRASH`` (an error on allowed input), ``HANG`` (over ``LIMIT`` seconds). The cases whose
outcome was not ``ok`` on the code they were written against are tests in
`test_hostile_round4.py`, one per bug. Reusable: run it again on merged code.
"""
from __future__ import annotations

import argparse
import contextlib
import copy
import errno
import json
import math
import os
import pickle
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tools"), str(REPO / "tests")]

from pipeline_lib import NoChunk, Pipe, SumCount, run_state  # noqa: E402
from pipeline_lib.distributed import DistributedPipe, init_mesh  # noqa: E402
from pipeline_lib.grad_clip import clip_grad_norm_  # noqa: E402

LIMIT = 120.0   # seconds a case may take before it counts as a hang


class Wrong(AssertionError):
    """A wrong value, or bad input accepted."""


class Unclear(AssertionError):
    """An error that does not say what was wrong or how to fix it."""


@dataclass
class Case:
    name: str
    expect: str
    run: Callable[[], None]
    processes: bool = False   # runs on two gloo processes (`worker`)


CASES: list[Case] = []


def case(name: str, expect: str, processes: bool = False) -> Callable:
    def register(fn: Callable[[], None]) -> Callable[[], None]:
        CASES.append(Case(name, expect, fn, processes))
        return fn
    return register


# -- helpers -----------------------------------------------------------------------------

def same(got: Any, want: Any, what: str = "value", **tolerance: float) -> None:
    try:
        torch.testing.assert_close(got, want, **tolerance)
    except AssertionError as exc:
        raise Wrong(f"{what}: {str(exc).splitlines()[0]}") from None


def same_grads(a: nn.Module | list, b: nn.Module | list, **tolerance: float) -> None:
    a = list(a.parameters()) if isinstance(a, nn.Module) else a
    b = list(b.parameters()) if isinstance(b, nn.Module) else b
    for k, (p, q) in enumerate(zip(a, b)):
        if (p.grad is None) != (q.grad is None):
            raise Wrong(f"parameter {k}: grad {p.grad is not None} vs {q.grad is not None}")
        if p.grad is not None:
            same(p.grad, q.grad, f"parameter {k}'s grad", **tolerance)


def refused(call: Callable[[], Any], kind: type[BaseException], *words: str) -> str:
    """``call`` raises ``kind`` with every one of ``words`` in its message (and notes)."""
    try:
        call()
    except kind as exc:
        said = " ".join([str(exc), *getattr(exc, "__notes__", [])])
        missing = [w for w in words if w not in said]
        if missing:
            raise Unclear(f"{type(exc).__name__} lacks {missing}: {said[:200]}") from None
        return said
    except BaseException as exc:  # noqa: BLE001
        raise Unclear(f"{type(exc).__name__} instead of {kind.__name__}: {exc}"[:300]) from None
    raise Wrong(f"accepted; expected {kind.__name__} saying {words}")


def mlp(layers: int = 3, width: int = 4, seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(layers)])


def data(rows: int = 8, width: int = 4, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, width, generator=g), torch.randn(rows, width, generator=g)


def sum_count(out: torch.Tensor, target: torch.Tensor) -> SumCount:
    return SumCount(F.mse_loss(out, target, reduction="sum"), target.numel())


def mean_of(loss: Any) -> torch.Tensor:
    return loss.sum / loss.count if isinstance(loss, SumCount) else loss


def input_grad_case(layers: int, loss_fn: Callable, step: Callable[[nn.Sequential, Any,
                    torch.Tensor], None], inputs: Callable[[torch.Tensor], Any] = lambda x: x,
                    **tolerance: float) -> None:
    """``step(model, inputs(x), y)`` gives x and the weights the plain model's gradients."""
    x, y = data()
    plain, plain_x = mlp(layers), x.clone().requires_grad_()
    mean_of(loss_fn(plain(inputs(plain_x)), y)).backward()
    model, leaf = mlp(layers), x.clone().requires_grad_()
    step(model, inputs(leaf), y)
    same(leaf.grad, plain_x.grad, "x.grad", **tolerance)
    same_grads(model, plain, **tolerance)


_MESH: list[Any] = []


def one_rank_mesh() -> Any:
    """A one-process gloo job in this process, made once."""
    if not _MESH:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                world_size=1)
        _MESH.append(init_mesh(1, 1, 30))
    return _MESH[0]


def trained(optimizer: Callable = torch.optim.AdamW, layers: int = 4,
            mesh: Any = None) -> tuple[DistributedPipe, list[int], torch.optim.Optimizer]:
    """A one-rank V pipeline of ``layers`` Linear layers after one step."""
    torch.manual_seed(0)
    balance = [layers // 2, layers - layers // 2]
    pipe = DistributedPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(layers)]),
                           mesh or one_rank_mesh(), balance, 2, "zb_v")
    opt = optimizer(pipe.parameters())
    pipe.step(*data(4), F.mse_loss)
    opt.step()
    return pipe, balance, opt


def folder() -> Path:
    return Path(tempfile.mkdtemp(prefix="hostile4-"))


def saved() -> Path:
    """A folder holding the checkpoint of `trained` after step 1."""
    where = folder()
    run_state.save(where, 1, *trained())
    return where


# -- 4. input gradients ------------------------------------------------------------------

@case("input: x.grad adds up over two steps", "twice the plain model's x.grad")
def _() -> None:
    x, y = data()
    plain, plain_x = mlp(), x.clone().requires_grad_()
    for _ in range(2):
        F.mse_loss(plain(plain_x), y).backward()
    pipe, leaf = Pipe(mlp(), 4, balance=[1, 2]), x.clone().requires_grad_()
    for _ in range(2):
        pipe.step(leaf, y, sum_count, "zb_h1")
    same(leaf.grad, plain_x.grad, "x.grad")


@case("input: a step that fails leaves x.grad as it was", "x.grad None, weights' None")
def _() -> None:
    x, y = data()
    calls = []

    def failing(out: torch.Tensor, target: torch.Tensor) -> SumCount:
        calls.append(1)
        if len(calls) == 3:
            raise KeyError("boom")
        return sum_count(out, target)

    pipe, leaf = Pipe(mlp(), 4, balance=[1, 2]), x.clone().requires_grad_()
    with contextlib.suppress(KeyError):
        pipe.step(leaf, y, failing, "1f1b")
    if leaf.grad is not None or any(p.grad is not None for p in pipe.parameters()):
        raise Wrong("a failed step left gradients")


@case("input: a one-stage pipe, SumCount", "the plain model's x.grad")
def _() -> None:
    input_grad_case(2, sum_count, lambda m, x, y: Pipe(m, 4, balance=[2]).step(x, y, sum_count))


@case("input: an in-place first layer", "the plain model's gradient of x")
def _() -> None:
    x, y = data()
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 4), nn.Linear(4, 4))
    plain = copy.deepcopy(model)
    plain_x = x.clone().requires_grad_()
    F.mse_loss(plain(plain_x * 1), y).backward()
    leaf = x.clone().requires_grad_()
    Pipe(model, 4, balance=[2, 1]).step(leaf * 1, y, F.mse_loss, "zb_h1")
    same(leaf.grad, plain_x.grad, "x.grad")


@case("input: bf16 autocast", "the plain model's x.grad under autocast (float32)")
def _() -> None:
    def step(m: nn.Sequential, x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            Pipe(m, 4, balance=[1, 2]).step(x, y, F.mse_loss, "1f1b")
    x, y = data()
    plain, plain_x = mlp(), x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = F.mse_loss(plain(plain_x), y)
    loss.backward()
    model, leaf = mlp(), x.clone().requires_grad_()
    step(model, leaf, y)
    if leaf.grad.dtype != plain_x.grad.dtype:
        raise Wrong(f"x.grad is {leaf.grad.dtype}, plain {plain_x.grad.dtype}")
    same(leaf.grad, plain_x.grad, "x.grad", rtol=2e-2, atol=2e-3)


@case("input: the same tensor twice in the inputs", "both uses' gradients added, as plain")
def _() -> None:
    class Both(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0] * pair[1]
    x, y = data()
    torch.manual_seed(0)
    model = nn.Sequential(Both(), nn.Linear(4, 4))
    plain = copy.deepcopy(model)
    plain_x = x.clone().requires_grad_()
    F.mse_loss(plain((plain_x, plain_x)), y).backward()
    leaf = x.clone().requires_grad_()
    Pipe(model, 4, balance=[1, 1]).step((leaf, leaf), y, F.mse_loss)
    same(leaf.grad, plain_x.grad, "x.grad")


@case("input: a tensor the first stage does not use", "no x.grad, as plain")
def _() -> None:
    class First(nn.Module):
        def forward(self, pair: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
            return pair[0]
    x, y = data()
    unused = x.clone().requires_grad_()
    Pipe(nn.Sequential(First(), nn.Linear(4, 4)), 4, balance=[1, 1]).step(
        (x, unused), y, F.mse_loss, "zb_h1")
    if unused.grad is not None:
        raise Wrong("an unused input got a gradient")


@case("input: sync.Pipe's step (the classic class)", "the plain model's x.grad")
def _() -> None:
    from pipeline_lib.sync import Pipe as SyncPipe
    input_grad_case(3, sum_count, lambda m, x, y: SyncPipe(m, chunks=4).step(x, y, sum_count,
                                                                             "1f1b"))


@case("input: token ids (no gradient) still run as given", "weights' grads as plain")
def _() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4))
    plain = copy.deepcopy(model)
    ids, y = torch.randint(0, 10, (8,)), torch.randn(8, 4)
    F.mse_loss(plain(ids), y).backward()
    Pipe(model, 4, balance=[1, 1]).step(ids, y, F.mse_loss, "zb_h1")
    same_grads(model, plain)


@case("input: DistributedPipe, checkpoint always, zb_v, SumCount", "the plain model's x.grad")
def _() -> None:
    input_grad_case(2, sum_count, lambda m, x, y: DistributedPipe(
        m, one_rank_mesh(), [1, 1], 4, "zb_v", checkpoint="always").step(x, y, sum_count))


@case("input: pipe(x) with x requiring grad, checkpoint always", "the plain model's x.grad")
def _() -> None:
    input_grad_case(3, F.mse_loss, lambda m, x, y: F.mse_loss(
        Pipe(m, 4, "always", balance=[1, 2])(x), y).backward())


@case("input: a view of a leaf", "the leaf's gradient, as plain")
def _() -> None:
    x, y = data()
    base, plain_base = torch.cat([x, x], 1).requires_grad_(), torch.cat([x, x], 1)
    plain_base.requires_grad_()
    plain = mlp()
    F.mse_loss(plain(plain_base[:, :4]), y).backward()
    Pipe(mlp(), 4, balance=[2, 1]).step(base[:, :4], y, F.mse_loss, "zb_h1")
    same(base.grad, plain_base.grad, "base.grad")


def _distributed_input_case(pp: int, dp: int, schedule: str, loss_fn: Callable) -> None:
    """x.grad on the ranks holding stage 0: added up over the replicas, the plain
    model's; on the others, none."""
    from pipeline_lib.schedules import stages_per_rank
    mesh = init_mesh(pp, dp, timeout=60)
    stages = pp * stages_per_rank(schedule)
    x, y = data()
    plain, plain_x = mlp(stages), x.clone().requires_grad_()
    mean_of(loss_fn(plain(plain_x), y)).backward()
    pipe = DistributedPipe(mlp(stages), mesh, [1] * stages, 4, schedule)
    leaf = x.clone().requires_grad_()
    pipe.step(leaf, y, loss_fn)
    if pipe.schedule.rank_of(0) != mesh.pipe_rank:
        if leaf.grad is not None:
            raise Wrong("a rank without stage 0 got x.grad")
        leaf.grad = torch.zeros_like(leaf)
    total = leaf.grad.clone()
    dist.all_reduce(total)   # every rank joins: the others add zeros
    same(total, plain_x.grad, "x.grad added over the ranks")


@case("input: DistributedPipe, ZB-V on 2 ranks (stage 0 and the loss on rank 0), SumCount",
      "rank 0's x.grad the plain model's, rank 1's none", processes=True)
def input_zb_v() -> None:
    _distributed_input_case(2, 1, "zb_v", sum_count)


@case("input: DistributedPipe, 2 replicas, SumCount, interleaved 1F1B",
      "the replicas' x.grad add up to the plain model's", processes=True)
def input_replicas() -> None:
    _distributed_input_case(1, 2, "interleaved_1f1b", sum_count)


# -- 1. sync.Pipe and LocalRRef ----------------------------------------------------------

@case("sync: LocalRRef deep-copies and pickles", "a LocalRRef of an equal value")
def _() -> None:
    from pipeline_lib.sync import Pipe as SyncPipe
    with torch.no_grad():   # a tensor in a graph deep-copies in no case (PyTorch's rule)
        out = SyncPipe(nn.Sequential(nn.Linear(2, 2)), chunks=2)(torch.randn(4, 2))
    for copied in (copy.deepcopy(out), pickle.loads(pickle.dumps(out))):
        same(copied.local_value(), out.local_value())
    if "LocalRRef(Tensor)" != repr(out):
        raise Wrong(f"repr {out!r}")


@case("sync: DDP with gradient_as_bucket_view", "DDP over the plain model's grads",
      processes=True)
def ddp_bucket_view() -> None:
    _ddp_case(dict(gradient_as_bucket_view=True))


@case("sync: DDP static_graph, no_sync accumulation after a first step",
      "the plain DDP's grads",
      processes=True)
def ddp_no_sync() -> None:
    _ddp_case(dict(static_graph=True), accumulate=True)


@case("sync: DDP find_unused_parameters, a non-tensor output", "the plain DDP's grads",
      processes=True)
def ddp_tagged() -> None:
    _ddp_case(dict(find_unused_parameters=True), tagged=True)


@case("sync: DDP find_unused_parameters, one of two outputs used", "the plain DDP's grads",
      processes=True)
def ddp_two_outputs() -> None:
    _ddp_case(dict(find_unused_parameters=True), two_outputs=True)


class _Tagged(nn.Module):
    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, str]:
        return x, "tag"


class _Split(nn.Module):
    """Two outputs, from two layers: the loss uses only the first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.a(x), self.b(x)


def _ddp_case(flags: dict[str, bool], accumulate: bool = False, tagged: bool = False,
              two_outputs: bool = False) -> None:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from pipeline_lib.sync import Pipe as SyncPipe
    rank = dist.get_rank()
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 4), nn.Tanh(),
                           _Split() if two_outputs else nn.Linear(4, 4),
                           *([_Tagged()] if tagged else []))
    plain = copy.deepcopy(layers)
    pipe, ref = (DDP(SyncPipe(layers, chunks=2, checkpoint="never"), **flags),
                 DDP(plain, **flags))
    for step in range(2):
        for model in (pipe, ref):
            model.zero_grad()
            # static_graph records its graph in a first iteration with sync: PyTorch's
            # DDP fails an INTERNAL ASSERT on the plain model too if it begins in no_sync
            xs = [data(4, seed=10 * step + rank + k)[0]
                  for k in range(2 if accumulate and step else 1)]
            for k, x in enumerate(xs):
                context = model.no_sync() if k < len(xs) - 1 else contextlib.nullcontext()
                with context:
                    out = model(x)
                    out = out.local_value() if model is pipe else out
                    out = out[0] if isinstance(out, tuple) else out
                    out.square().mean().backward()
        same_grads(pipe.module, ref.module)


# -- 2. clipping -------------------------------------------------------------------------

def _stepped() -> tuple[Pipe, nn.Sequential]:
    x, y = data()
    pipe, plain = Pipe(mlp(), 4, balance=[1, 2]), mlp()
    pipe.step(x, y, F.mse_loss)
    F.mse_loss(plain(x), y).backward()
    return pipe, plain


@case("clip: max_norm inf changes nothing", "PyTorch's norm, gradients as they were")
def _() -> None:
    pipe, plain = _stepped()
    same(clip_grad_norm_(pipe, math.inf),
         torch.nn.utils.clip_grad_norm_(plain.parameters(), math.inf))
    same_grads(pipe, plain)


@case("clip: no gradient at all", "a norm of 0, as PyTorch")
def _() -> None:
    pipe = Pipe(mlp(), 4, balance=[1, 2])
    same(clip_grad_norm_(pipe, 1.0), torch.nn.utils.clip_grad_norm_(mlp().parameters(), 1.0))


@case("clip: bfloat16 and float32 gradients together", "PyTorch's norm and gradients")
def _() -> None:
    pipe, plain = _stepped()
    for model in (pipe, plain):
        first = next(model.parameters())
        grad = first.grad.bfloat16()
        first.data, first.grad = first.data.bfloat16(), grad
    same(clip_grad_norm_(pipe, 0.1), torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.1))
    same_grads(pipe, plain)


@case("clip: NaN on a threaded Pipe with error_if_nonfinite", "raises, gradients kept")
def _() -> None:
    pipe, _ = _stepped()
    next(pipe.parameters()).grad[0, 0] = math.nan
    before = [p.grad.clone() for p in pipe.parameters()]
    refused(lambda: clip_grad_norm_(pipe, 1.0, math.inf, error_if_nonfinite=True),
            RuntimeError, "nan", "left as they were")
    for p, b in zip(pipe.parameters(), before):
        if not torch.allclose(p.grad, b, equal_nan=True):
            raise Wrong("the gradients changed")


@case("clip: norm_type -inf (PyTorch takes it)", "a clear refusal naming the norms taken")
def _() -> None:
    pipe, _ = _stepped()
    refused(lambda: clip_grad_norm_(pipe, 1.0, -math.inf), ValueError,
            "norm_type must be at least 1 or math.inf")


@case("clip: 1-norm, NaN on pipeline rank 1", "NaN on both ranks, as PyTorch", processes=True)
def clip_one_norm() -> None:
    _clip_case(1.0, {1: math.nan})


@case("clip: inf on rank 0 and NaN on rank 1, inf-norm", "NaN everywhere, both raise",
      processes=True)
def clip_mixed() -> None:
    _clip_case(math.inf, {0: math.inf, 1: math.nan})


@case("clip: a frozen stage on rank 1 (no gradient there)", "PyTorch's norm", processes=True)
def clip_frozen() -> None:
    mesh = init_mesh(2, timeout=60)
    model, x, y = mlp(4), *data()
    for p in model[2:].parameters():
        p.requires_grad_(False)
    plain = copy.deepcopy(model)
    pipe = DistributedPipe(model, mesh, [2, 2], 4)
    pipe.step(x, y, F.mse_loss)
    F.mse_loss(plain(x), y).backward()
    same(clip_grad_norm_(pipe, 0.01), torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.01))


def _clip_case(norm: float, bad: dict[int, float]) -> None:
    mesh = init_mesh(2, timeout=60)
    x, y = data()
    pipe, plain = DistributedPipe(mlp(4), mesh, [2, 2], 4), mlp(4)
    pipe.step(x, y, F.mse_loss)
    F.mse_loss(plain(x), y).backward()
    if mesh.pipe_rank in bad:
        next(pipe.parameters()).grad[0, 0] = bad[mesh.pipe_rank]
    for r, value in bad.items():
        plain[2 * r][0].weight.grad[0, 0] = value
    refused(lambda: clip_grad_norm_(pipe, 0.5, norm, error_if_nonfinite=True), RuntimeError,
            "gradients is")
    got = clip_grad_norm_(pipe, 0.5, norm)
    want = torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.5, norm)
    if str(got.item()) != str(want.item()):
        raise Wrong(f"norm {got.item()}, PyTorch {want.item()}")


# -- 3, 5, 10. run_state ---------------------------------------------------------------

@case("save: step 0 saves and resumes at 0", "resume returns 0")
def _() -> None:
    where = folder()
    run_state.save(where, 0, *trained())
    if run_state.resume(where, *trained()) != 0:
        raise Wrong("not step 0")


@case("save: an infinite exp_avg_sq", "refused, the last checkpoint kept")
def _() -> None:
    where = saved()
    pipe, balance, opt = trained()
    opt.state[next(pipe.parameters())]["exp_avg_sq"][0, 0] = math.inf
    refused(lambda: run_state.save(where, 2, pipe, balance, opt), ValueError,
            "exp_avg_sq", "NaN or inf", "kept")
    if (where / run_state.LATEST).read_text() != "step-000001":
        raise Wrong("latest moved")


@case("save: bfloat16 weights holding inf", "refused")
def _() -> None:
    pipe, balance, opt = trained()
    with torch.no_grad():
        for p in pipe.parameters():
            p.data = p.data.bfloat16()
        next(pipe.parameters())[0, 0] = math.inf
    refused(lambda: run_state.save(folder(), 1, pipe, balance, opt), ValueError, "NaN or inf")


@case("save: BatchNorm's integer buffers", "saved and resumed")
def _() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 4), nn.Linear(4, 4))
    pipe = DistributedPipe(model, one_rank_mesh(), [2, 2], 2, "zb_v")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)
    pipe.step(*data(4), F.mse_loss)
    opt.step()
    where = folder()
    run_state.save(where, 1, pipe, [2, 2], opt)
    if run_state.merged_state_dict(where)["1.num_batches_tracked"].item() != 2:
        raise Wrong("num_batches_tracked")


@case("resume: AdamW saved without amsgrad, resumed with it", "refused, naming the state")
def _() -> None:
    where = saved()
    refused(lambda: run_state.resume(where, *trained(
        lambda p: torch.optim.AdamW(p, amsgrad=True))), ValueError, "max_exp_avg_sq",
        "saved with")


@case("resume: SGD with momentum", "the momentum buffers restored")
def _() -> None:
    sgd = lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)  # noqa: E731
    where = folder()
    pipe, balance, opt = trained(sgd)
    run_state.save(where, 1, pipe, balance, opt)
    fresh, _, fresh_opt = trained(sgd)
    run_state.resume(where, fresh, balance, fresh_opt)
    for p, q in zip(pipe.parameters(), fresh.parameters()):
        same(fresh_opt.state[q]["momentum_buffer"], opt.state[p]["momentum_buffer"])


@case("resume: an optimizer with an extra empty group", "resumes, its groups as built")
def _() -> None:
    where = saved()
    pipe, balance, _ = trained()
    opt = torch.optim.AdamW([{"params": list(pipe.parameters())}, {"params": [], "lr": 1.0}])
    run_state.resume(where, pipe, balance, opt)
    if [g["lr"] for g in opt.param_groups] != [0.001, 1.0]:
        raise Wrong(f"groups {[g['lr'] for g in opt.param_groups]}")


@case("resume: a checkpoint saved with rank 0's groups in run.pt (the old format)",
      "resumes, keeping this optimizer's settings")
def _() -> None:
    where = saved()
    run_file = where / "step-000001" / run_state.RUN
    record = torch.load(run_file)
    torch.save({**record, "groups": [{"lr": 9.0, "weight_decay": 9.0}]}, run_file)
    pipe, balance, opt = trained(lambda p: torch.optim.AdamW(p, lr=0.5))
    run_state.resume(where, pipe, balance, opt)
    if opt.param_groups[0]["lr"] != 0.5:
        raise Wrong("the saved lr came back")


@case("resume: the optimizer before any step (no state saved)", "resumes, state empty")
def _() -> None:
    torch.manual_seed(0)
    pipe = DistributedPipe(nn.Sequential(*[nn.Linear(4, 4) for _ in range(2)]),
                           one_rank_mesh(), [1, 1], 2, "zb_v")
    opt = torch.optim.AdamW(pipe.parameters())
    where = folder()
    run_state.save(where, 0, pipe, [1, 1], opt)
    run_state.resume(where, pipe, [1, 1], opt)
    if opt.state:
        raise Wrong("state appeared")


@case("save: the balance given is not the pipe's", "refused (names would be other layers')")
def _() -> None:
    pipe, _, opt = trained()
    refused(lambda: run_state.save(folder(), 1, pipe, [1, 3], opt), ValueError,
            "balance [1, 3] is not the one this pipe was built with")


@case("save: a file named like a step folder in the folder", "left alone, no crash")
def _() -> None:
    where = saved()
    (where / "step-000009").write_text("a learner's file")
    run_state.save(where, 2, *trained())
    if (where / "step-000009").read_text() != "a learner's file":
        raise Wrong("the file was touched")


@case("save: latest names a folder that is gone (edited)", "saves, and latest moves")
def _() -> None:
    where = saved()
    (where / run_state.LATEST).write_text("step-000007")
    run_state.save(where, 2, *trained())
    if run_state.resume(where, *trained()) != 2:
        raise Wrong("not step 2")


@case("save: a full disk while writing latest", "an OSError naming the file and disk full")
def _() -> None:
    where = saved()
    pipe, balance, opt = trained()
    real_replace = os.replace

    def full(src: Any, dst: Any) -> None:
        if Path(dst).name == run_state.LATEST:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    os.replace = full
    try:
        refused(lambda: run_state.save(where, 2, pipe, balance, opt), OSError,
                "no space left", "latest")
    finally:
        os.replace = real_replace
    if run_state.resume(where, *trained()) != 1:
        raise Wrong("latest moved")


@case("save: optimizer None", "a TypeError naming the optimizer")
def _() -> None:
    pipe, balance, _ = trained()
    refused(lambda: run_state.save(folder(), 1, pipe, balance, None), TypeError,
            "optimizer")


@case("resume: optimizer None", "a TypeError naming the optimizer")
def _() -> None:
    where = saved()
    pipe, balance, _ = trained()
    refused(lambda: run_state.resume(where, pipe, balance, None), TypeError, "optimizer")


@case("save: the ranks' agreement times out (a rank never called save)",
      "the error names save and that every rank must call it")
def _() -> None:
    pipe, balance, opt = trained()
    real = dist.all_reduce

    def timed_out(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("Timed out waiting 2000ms for recv operation to complete")

    dist.all_reduce = timed_out
    try:
        refused(lambda: run_state.save(folder(), 1, pipe, balance, opt), RuntimeError,
                "Timed out", "run_state.save", "each must call save")
    finally:
        dist.all_reduce = real


# -- 3, 10. lm.train ---------------------------------------------------------------------

def _train_args(*flags: str) -> Any:
    from pipeline_lib.lm import train
    return train._parse_args(list(flags))


@case("train: --skip-nonfinite -1", "refused naming the flag")
def _() -> None:
    refused(lambda: _train_args("--skip-nonfinite", "-1"), SystemExit)


@case("train: --skip-nonfinite two", "refused naming the flag")
def _() -> None:
    refused(lambda: _train_args("--skip-nonfinite", "two"), SystemExit)


@case("train: --seed -1", "refused naming the range")
def _() -> None:
    refused(lambda: _train_args("--seed", "-1"), SystemExit)


@case("train: --seed 2**64 - 2, the largest", "accepted, and torch takes it and one more")
def _() -> None:
    seed = _train_args("--seed", str(2**64 - 2)).seed
    torch.manual_seed(seed)
    torch.Generator().manual_seed(seed + 1)


@case("train: a NaN loss on the first step, no --save", "stops naming the step: start again")
def _() -> None:
    from pipeline_lib.lm import train
    args = _train_args()
    refused(lambda: train._stop_or_skip(1, "the loss is NaN or inf", 1, args, False),
            RuntimeError, "step 1:", "start again")


# -- 9. the ranks' batches ---------------------------------------------------------------

def _agree_case(mine: Callable[[int], tuple[Any, torch.Tensor]], refuse: bool,
                *words: str) -> None:
    mesh = init_mesh(2, timeout=60)
    pipe = DistributedPipe(mlp(4), mesh, [2, 2], 2)
    x, y = mine(mesh.rank)
    call = lambda: pipe.step(x, y, F.mse_loss)  # noqa: E731
    if refuse:
        refused(call, ValueError, *words)
    else:
        call()


class _First(nn.Module):
    def forward(self, batch: Any) -> torch.Tensor:
        return batch[0] if isinstance(batch, (tuple, list)) else batch["x"]


@case("agree: NaN in the inputs on both ranks", "trains (the same bits)", processes=True)
def agree_nan() -> None:
    x, y = data()
    x[0, 0] = math.nan
    _agree_case(lambda r: (x, y), False)


@case("agree: a NoChunk mask of other values on rank 1", "refused naming input values",
      processes=True)
def agree_nochunk() -> None:
    def mine(rank: int) -> tuple[Any, torch.Tensor]:
        x, y = data()
        return ({"x": x, "mask": NoChunk(torch.full((4,), float(rank)))}, y)
    mesh = init_mesh(2, timeout=60)
    torch.manual_seed(0)
    pipe = DistributedPipe(nn.Sequential(_First(), nn.Linear(4, 4)), mesh, [1, 1], 2)
    x, y = mine(mesh.rank)
    refused(lambda: pipe.step(x, y, F.mse_loss), ValueError, "input values other than")


@case("agree: int32 ids on one rank, int64 on the other", "refused naming the dtypes",
      processes=True)
def agree_dtype() -> None:
    mesh = init_mesh(2, timeout=60)
    torch.manual_seed(0)
    pipe = DistributedPipe(nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 4)), mesh, [1, 1], 2)
    ids = torch.arange(8) % 10
    ids = ids.int() if mesh.rank else ids
    refused(lambda: pipe.step(ids, torch.randn(8, 4, generator=torch.Generator().manual_seed(0)),
                              F.mse_loss), ValueError, "int32", "int64")


@case("agree: a string flag that differs in the inputs", "refused", processes=True)
def agree_flag() -> None:
    mesh = init_mesh(2, timeout=60)
    torch.manual_seed(0)
    pipe = DistributedPipe(nn.Sequential(_First(), nn.Linear(4, 4)), mesh, [1, 1], 2)
    x, y = data()
    refused(lambda: pipe.step((x, "train" if mesh.rank else "eval"), y, F.mse_loss),
            ValueError, "input values other than")


@case("agree: one rank's batch non-contiguous, same values", "trains", processes=True)
def agree_strides() -> None:
    x, y = data()
    _agree_case(lambda r: (x.t().contiguous().t() if r else x, y), False)


@case("agree: rows in another order on rank 1", "refused", processes=True)
def agree_rows() -> None:
    x, y = data()
    _agree_case(lambda r: (x.flip(0) if r else x, y.flip(0) if r else y), True,
                "input values other than", "target values other than")


# -- 7. threads --------------------------------------------------------------------------

@case("threads: pipe(x) forward (no backward) from another thread during a step",
      "the step's gradients exact")
def _() -> None:
    pipe, plain = Pipe(mlp(), 4, balance=[1, 2]), mlp()
    x, y = data()
    F.mse_loss(plain(x), y).backward()
    done = threading.Event()

    def forward_only() -> None:
        with torch.no_grad():
            while not done.is_set():
                pipe(x)

    thread = threading.Thread(target=forward_only)
    thread.start()
    try:
        pipe.step(x, y, F.mse_loss, "1f1b")
    finally:
        done.set()
        thread.join()
    same_grads(pipe, plain)


@case("threads: two threads' pipe(x) backwards at once (no step)", "both added, as plain")
def _() -> None:
    pipe, plain = Pipe(mlp(), 4, balance=[1, 2]), mlp()
    xs = [data(seed=s)[0] for s in (3, 4)]
    for x in xs:
        plain(x).sum().backward()
    threads = [threading.Thread(target=lambda x=x: pipe(x).sum().backward()) for x in xs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    same_grads(pipe, plain)


@case("threads: a step starting while pipe(x)'s backward runs", "waits; both exact")
def _() -> None:
    entered, release = threading.Event(), threading.Event()

    class Held(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            entered.set()
            release.wait(30)
            return grad

    class Hold(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return Held.apply(x) if torch.is_grad_enabled() and not hold_off else x

    hold_off = False
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    plain = nn.Sequential(copy.deepcopy(first), copy.deepcopy(last))
    pipe = Pipe(nn.Sequential(first, Hold(), last), 4, "never", balance=[2, 1])
    x, y, other = *data(), data(seed=5)[0]
    (plain(other).sum() + F.mse_loss(plain(x), y, reduction="sum") / y.numel()).backward()
    out = pipe(other).sum()
    hold_off = True
    back = threading.Thread(target=out.backward)
    back.start()
    entered.wait(30)
    stepping = threading.Thread(target=pipe.step, args=(x, y, sum_count, "1f1b"))
    stepping.start()
    time.sleep(0.2)
    release.set()
    back.join(30)
    stepping.join(30)
    same_grads(pipe, plain)


def _held_backward_case(model: nn.Sequential, balance: list[int]) -> None:
    """pipe(aside)'s backward inside the step's loss_fn (its weight gradients are held
    during the step): the gradients of both, as the plain model's, no hang."""
    plain = copy.deepcopy(model)
    aside, (x, y) = data(seed=7)[0], data()
    (plain(aside).sum() + F.mse_loss(plain(x), y, reduction="sum") / y.numel()).backward()
    pipe = Pipe(model, 4, "always", balance=balance)
    pending = [pipe(aside).sum()]

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> SumCount:
        if pending:
            pending.pop().backward()
        return sum_count(out, target)

    pipe.step(x, y, loss_fn, "zb_h1")
    same_grads(pipe, plain)


@case("threads: pipe(x)'s backward in loss_fn, skip connections, checkpointing",
      "both exact (the held gradients of the stashed tensors' paths too)")
def _() -> None:
    from pipeline_lib.skip import pop, skippable, stash

    @skippable(stash=["shortcut"])
    class Keep(nn.Linear):
        def forward(self, x: torch.Tensor) -> Any:
            yield stash("shortcut", x * 2)
            return super().forward(x)

    @skippable(pop=["shortcut"])
    class Add(nn.Linear):
        def forward(self, x: torch.Tensor) -> Any:
            shortcut = yield pop("shortcut")
            return super().forward(x) + shortcut

    torch.manual_seed(0)
    _held_backward_case(nn.Sequential(Keep(4, 4), nn.Tanh(), Add(4, 4)), [2, 1])


@case("threads: pipe(x)'s backward in loss_fn, a weight tied across stages",
      "the tied weight's gradient from both stages, once")
def _() -> None:
    torch.manual_seed(0)
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    _held_backward_case(nn.Sequential(first, nn.Tanh(), last), [2, 1])


@case("agree: the fingerprint of odd tensors", "stable, and changed by any one value")
def _() -> None:
    from pipeline_lib.distributed.pipe import _fingerprint
    batch = {"scalar": torch.tensor(3.0), "empty": torch.zeros(4, 0),
             "mask": torch.tensor([True, False, True, True]),
             "half": torch.randn(4, 3).half(), "complex": torch.randn(4, 2, dtype=torch.cfloat),
             "ids": torch.arange(4), "flag": "train", "none": None}
    base = _fingerprint(batch)
    if _fingerprint(copy.deepcopy(batch)) != base:
        raise Wrong("equal batches differ")
    for key, change in [("scalar", lambda t: t + 1), ("mask", lambda t: ~t),
                        ("half", lambda t: t.flip(0)), ("complex", lambda t: t.conj()),
                        ("ids", lambda t: t.roll(1)), ("flag", lambda t: "eval")]:
        if _fingerprint({**batch, key: change(batch[key])}) == base:
            raise Wrong(f"a change of {key} goes unseen")


@case("threads: deepcopy and torch.save of a Pipe after steps", "a Pipe that steps")
def _() -> None:
    import io
    pipe = Pipe(mlp(), 4, balance=[1, 2])
    pipe.step(*data(), F.mse_loss)
    buffer = io.BytesIO()
    torch.save(pipe, buffer)
    buffer.seek(0)
    for other in (copy.deepcopy(pipe), torch.load(buffer, weights_only=False)):
        other.step(*data(), F.mse_loss)


@case("threads: a Pipe unpickled from before the step's bookkeeping", "steps")
def _() -> None:
    pipe = Pipe(mlp(), 4, balance=[1, 2])
    state = dict(pipe.__dict__)
    for name in ("_held", "_backwards"):
        state.pop(name, None)
    old = Pipe.__new__(Pipe)
    old.__setstate__(state)
    old.step(*data(), F.mse_loss)


# -- 8. make lab -------------------------------------------------------------------------

def _lab(argv: list[str], environ: dict[str, str] | None = None) -> list[str] | str:
    """The command lab.py would run, or the error it printed."""
    import io

    import lab
    started: list[list[str]] = []
    saved_env, saved_execv = dict(os.environ), os.execv
    os.environ.pop("JUPYTER_PORT", None)
    os.environ.update(environ or {})
    os.execv = lambda path, cmd: started.append(cmd)  # type: ignore[assignment]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            lab.main(argv)
    except SystemExit:
        return err.getvalue()
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
        os.execv = saved_execv
    return started[0]


@case("lab: --ServerApp.port=0 (any free port)", "passed to Jupyter")
def _() -> None:
    if not isinstance(_lab(["--ServerApp.port=0"]), list):
        raise Wrong("refused")


@case("lab: --ServerApp.port=-1", "refused naming the range")
def _() -> None:
    said = _lab(["--ServerApp.port=-1"])
    if not isinstance(said, str) or "1 to 65535" not in said:
        raise Unclear(str(said))


@case("lab: JUPYTER_PORT empty", "refused naming JUPYTER_PORT")
def _() -> None:
    said = _lab([], {"JUPYTER_PORT": ""})
    if not isinstance(said, str) or "JUPYTER_PORT" not in said:
        raise Unclear(str(said))


@case("lab: --port 9000 with --ServerApp.port=99999", "refused (Jupyter's option wins)")
def _() -> None:
    said = _lab(["--port", "9000", "--ServerApp.port=99999"])
    if not isinstance(said, str) or "--ServerApp.port=99999" not in said:
        raise Wrong(str(said))


@case("lab: --ServerApp.port_retries=0", "passed (not a port)")
def _() -> None:
    if not isinstance(_lab(["--ServerApp.port_retries=0"]), list):
        raise Wrong("refused")


# -- running them ------------------------------------------------------------------------

def run_case(c: Case) -> tuple[str, str]:
    """(outcome, detail) of one case, in a thread of its own so that a hang is seen."""
    result: list[tuple[str, str]] = []

    def body() -> None:
        try:
            c.run()
            result.append(("ok", ""))
        except Wrong as exc:
            result.append(("WRONG", str(exc)))
        except Unclear as exc:
            result.append(("UNCLEAR", str(exc)))
        except BaseException as exc:  # noqa: BLE001
            result.append(("CRASH", f"{type(exc).__name__}: {exc}"[:300]))

    thread = threading.Thread(target=body, daemon=True)
    thread.start()
    thread.join(LIMIT)
    return result[0] if result else ("HANG", f"over {LIMIT:g} s")


def worker(out: Path, only: str) -> None:
    """One rank of the two-process cases (torchrun sets the environment)."""
    from pipeline_lib.distributed.job import process_group
    torch.set_num_threads(1)
    with process_group(backend="gloo", timeout=60):
        found = {}
        for c in CASES:
            if c.processes and c.name.startswith(only):
                found[c.name] = run_case(c)
                dist.barrier()
        (out / f"rank{dist.get_rank()}.json").write_text(json.dumps(found))


def two_process_outcomes(only: str) -> dict[str, tuple[str, str]]:
    """Each two-process case's outcome: the worse of the two ranks'."""
    out = Path(tempfile.mkdtemp(prefix="hostile4-ranks-"))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc_per_node", "2", __file__, "--worker", str(out), "--only", only]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=900)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    if len(ranks) != 2:
        tail = (done.stdout + done.stderr)[-1500:]
        return {c.name: ("CRASH", f"the launch failed: {tail}") for c in CASES if c.processes
                and c.name.startswith(only)}
    order = ["ok", "UNCLEAR", "WRONG", "CRASH", "HANG"]
    return {name: max((tuple(r[name]) for r in ranks), key=lambda o: order.index(o[0]))
            for name in ranks[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default="", help="cases whose name starts so")
    parser.add_argument("--no-processes", action="store_true")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.only)
        return
    outcomes = {c.name: run_case(c) for c in CASES
                if not c.processes and c.name.startswith(args.only)}
    if not args.no_processes and any(c.processes and c.name.startswith(args.only)
                                     for c in CASES):
        outcomes.update(two_process_outcomes(args.only))
    print("| case | expected | outcome |\n|---|---|---|")
    for c in CASES:
        if c.name in outcomes:
            outcome, detail = outcomes[c.name]
            print(f"| {c.name} | {c.expect} | {outcome}{': ' + detail if detail else ''} |")
    counts = {o: sum(1 for v, _ in outcomes.values() if v == o) for o, _ in outcomes.values()}
    print(f"\n{len(outcomes)} cases: " + ", ".join(f"{n} {o}" for o, n in sorted(counts.items())))


if __name__ == "__main__":
    main()
